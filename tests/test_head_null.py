"""The attention probe's per-head null: batched frames equal one frame at a time, the
p-value's floor and lattice, its calibration under a planted null, and the switches
(``head_null=0``, too few frames for a z)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from torch import Tensor

from tangentlens.core.decompose import AttentionParams, ScoreSplit, keep_blocks, keep_mask
from tangentlens.core.errors import UsageError
from tangentlens.core.subspace import TangentBasis
from tangentlens.core.uncertainty import two_sided_p_value
from tangentlens.hooks.sites import Site
from tangentlens.probes import attention_stats
from tangentlens.probes.attention import STATISTICS, AttentionProbe
from tangentlens.probes.attention_stats import (
    MIN_Z_FRAMES,
    AttentionAccumulator,
    _Block,
    frame_plan,
)
from tangentlens.probes.base import Observation

SITE = Site(0, "attn_in")
pytestmark = pytest.mark.usefixtures("one_thread")


def _rope(q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary position embedding on (batch, head, pos, e): linear in q and in k."""
    half = q.shape[-1] // 2
    freq = 1.0 / 100.0 ** (torch.arange(half, dtype=torch.float64) / half)
    angle = positions[:, None, :, None].to(torch.float64) * freq
    cos, sin = angle.cos().to(q.dtype), angle.sin().to(q.dtype)

    def rotate(t: Tensor) -> Tensor:
        a, b = t[..., :half], t[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    return rotate(q), rotate(k)


def _params(
    d: int, *, heads: int = 4, kv: int = 2, e: int = 8, seed: int = 0, **kw
) -> AttentionParams:
    """Random weights of O(1) scores; GQA, biases and rotary unless ``kw`` says otherwise."""
    gen = torch.Generator().manual_seed(seed)
    w = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    base = {"b_Q": 0.3 * w(heads, e), "b_K": 0.3 * w(kv, e), "rotary": _rope, "causal": True}
    return AttentionParams(
        W_Q=w(heads, d, e) / d**0.5, W_K=w(kv, d, e) / d**0.5, scale=e**-0.5, **(base | kw)
    )


def _frame(d: int, k: int, seed: int) -> TangentBasis:
    gen = torch.Generator().manual_seed(seed)
    return TangentBasis(torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=torch.float64)).Q)


def _input(d: int, batch: int, pos: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """An anisotropic input (so frames differ) and a padding mask, left and right."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0.5, -0.5, d, dtype=torch.float64)
    x = torch.randn(batch, pos, d, generator=gen, dtype=torch.float64) * scales
    mask = torch.ones(batch, pos, dtype=torch.int64)
    mask[0, :3] = 0
    mask[-1, pos - 4 :] = 0
    return x, mask


def _loop(probe: AttentionProbe, x: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The null frame by frame: each frame's float32 terms from its own product, into an
    accumulator of its own; statistic → (frames, heads)."""
    params = probe.layers[SITE][1]
    split = ScoreSplit(x, params)
    rule = {"causal": params.causal, "window": params.window}
    keep = keep_mask((x.shape[0], 1, x.shape[1], x.shape[1]), **rule, attention_mask=mask)
    out = []
    for frame in probe.null_bases[SITE]:
        acc, parts = AttentionAccumulator(), split.parts([frame], dtype=torch.float32)
        for rows, keys in keep_blocks(x.shape[1], **rule):
            block = _Block(split.scores(rows, keys), split.bias(rows, keys), keep[..., rows, keys])
            acc._add(parts.terms(0, rows, keys), block)
        acc._count(keep)
        out.append(acc.results())
    return {stat: torch.stack([o[stat] for o in out]) for stat in STATISTICS}


@pytest.mark.parametrize(
    ("budget", "per_chunk", "chunks", "reuse"),
    [(None, None, 2, True), (None, 7, 1, False), (2_400_000, None, 4, True), (1, None, 7, False)],
)
@pytest.mark.parametrize("window", [None, 9])
def test_batched_frames_equal_one_frame_at_a_time(
    budget, per_chunk, chunks, reuse, window, monkeypatch
) -> None:
    """Every frame's statistics, from one batched product per chunk of frames (the
    default plan; all in one chunk; chunks of two with each block's pattern kept across
    them; one frame a chunk, patterns remade), equal those of the frame's own float32
    product to 1e-6: GQA, biases, rotary, padding on both sides, a causal mask with and
    without a window, and three blocks of query rows."""
    if per_chunk is not None:
        monkeypatch.setattr(attention_stats, "FRAMES_PER_CHUNK", per_chunk)
    if budget is not None:
        monkeypatch.setattr(attention_stats, "FRAME_CHUNK_BYTES", budget)
        monkeypatch.setattr(attention_stats, "PATTERN_BYTES", 2_400_000 if reuse else 1)
    d, n = 24, 7
    params = _params(d, window=window)
    x, mask = _input(d, batch=3, pos=70)
    plan, kept = frame_plan(n, 3, 70, params.n_heads, params.d_head)
    assert (len(plan), kept) == (chunks, reuse)
    probe = AttentionProbe({SITE: (_frame(d, 3, seed=5), params)}, head_null=n, seed=2)
    probe.update(Observation(SITE, x, mask))
    got = probe.state(f"{SITE.hook_name}/null")
    want = _loop(probe, x, mask)
    for stat in STATISTICS:
        assert got.results()[stat].shape == (n, params.n_heads)
        torch.testing.assert_close(got.results()[stat], want[stat], rtol=1e-6, atol=1e-9)


def test_frame_plan_sizes() -> None:
    """Equal chunks within the bounds, at least one frame each; none without frames."""
    assert frame_plan(0, 8, 64, 4, 32) == ([], False)
    chunks, _ = frame_plan(99, 8, 64, 4, 32)
    sizes = [c.stop - c.start for c in chunks]
    assert sum(sizes) == 99 and max(sizes) - min(sizes) <= 1
    assert chunks[0].start == 0 and all(a.stop == b.start for a, b in pairwise(chunks))
    assert max(sizes) <= attention_stats.FRAMES_PER_CHUNK
    # SmolLM2's shape: a frame is about 10 MiB, so the frame count, not the bytes, binds
    big = frame_plan(99, 4, 128, 9, 64)[0]
    assert max(c.stop - c.start for c in big) == attention_stats.FRAMES_PER_CHUNK
    # a frame over the byte bound still gets a chunk of its own
    assert all(c.stop - c.start == 1 for c in frame_plan(3, 64, 4096, 32, 128)[0])


def test_p_value_floor_lattice_and_ties() -> None:
    """(1 + #extreme)/(n + 1): 1/(n + 1) for a value beyond every null value on either
    side, 1 when all are equal, NaN for NaN, and always a multiple of 1/(n + 1)."""
    gen = torch.Generator().manual_seed(3)
    null = torch.randn(99, 5, generator=gen, dtype=torch.float64)
    value = torch.tensor([40.0, -40.0, 0.0, torch.nan, 1.0], dtype=torch.float64)
    p = two_sided_p_value(value, null)
    assert p[0] == p[1] == 1 / 100 and p[2] > 0.5 and p[3].isnan()
    assert torch.allclose(p[~p.isnan()] * 100, (p[~p.isnan()] * 100).round())
    assert two_sided_p_value(torch.zeros(3), torch.zeros(9, 3)).tolist() == [1.0] * 3
    with pytest.raises(UsageError, match="null must be"):
        two_sided_p_value(torch.zeros(3), torch.zeros(9, 4))


@pytest.mark.parametrize("n", [9, 99])
def test_p_value_floor_through_the_probe(n: int) -> None:
    """An input that lies in Q_T: its TT share is far beyond every frame's, so its
    p-value is the floor 1/(n + 1) exactly; every p-value is on the lattice j/(n + 1)
    and none below the floor."""
    d, k = 32, 4
    basis = _frame(d, k, seed=7)
    x = torch.randn(2, 20, k, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    probe = AttentionProbe({SITE: (basis, _params(d, b_Q=None, b_K=None))}, head_null=n)
    probe.update(Observation(SITE, x @ basis.basis_.T, None))
    rows = [r for r in probe.rows() if r["statistic"].endswith("_p_value")]
    p = torch.tensor([r["value"] for r in rows], dtype=torch.float64)
    assert len(rows) == len(STATISTICS) * 4 and bool((p >= 1 / (n + 1)).all())
    assert torch.allclose(p * (n + 1), (p * (n + 1)).round())
    tt = [r["value"] for r in rows if r["statistic"] == "score_share_TT_p_value"]
    assert tt == [1 / (n + 1)] * 4


def test_p_values_are_calibrated_under_a_planted_null() -> None:
    """Q_T itself a uniformly random frame of rank 2 in d = 64, so it is one more draw of
    what the frames are (they lie in its complement: exchangeable with it up to terms of
    order k/d = 1/32). Over 200 such Q_T, 4 heads each (800 p-values a statistic):
    at 0.05 every statistic rejects within 0.03 of 5 % (four standard errors of a
    proportion over 800 independent draws, two if the heads of one Q_T moved together),
    and the p-values of all statistics together are within 0.03 of uniform at every
    level j/100 (their largest gap, as a Kolmogorov–Smirnov distance on the lattice)."""
    d, k, n_rep = 64, 2, 200
    params = _params(d, b_Q=None, b_K=None, rotary=None, kv=4)
    x, mask = _input(d, batch=2, pos=16)
    p = {stat: [] for stat in STATISTICS if stat != "score_share_bias"}  # no bias: always 1
    for rep in range(n_rep):
        probe = AttentionProbe({SITE: (_frame(d, k, 100 + rep), params)}, head_null=99, seed=rep)
        probe.update(Observation(SITE, x, mask))
        for r in probe.rows():
            stat = r["statistic"].removesuffix("_p_value")
            if r["statistic"].endswith("_p_value") and stat in p:
                p[stat].append(r["value"])
    for stat, values in p.items():
        assert len(values) == 4 * n_rep
        assert abs(float((torch.tensor(values) <= 0.05).double().mean()) - 0.05) <= 0.03, stat
    pooled = torch.tensor([v for values in p.values() for v in values], dtype=torch.float64)
    levels = torch.arange(1, 101, dtype=torch.float64) / 100
    cdf = (pooled[:, None] <= levels + 1e-12).double().mean(0)
    assert float((cdf - levels).abs().max()) <= 0.03


def test_switches_and_the_z_threshold() -> None:
    """head_null=0: no null rows at all (the write's closed form included); 1 frame is an
    error naming the fix; below `MIN_Z_FRAMES` frames the null has its mean, spread and
    p-value but no z; from it on, a z too."""
    d = 24
    params = _params(d)
    x, mask = _input(d, batch=2, pos=12)
    w_o = torch.randn(4, 8, d, dtype=torch.float64)
    writes = {0: (Site(0, "resid_mid"), _frame(d, 3, 9), w_o)}
    names = {}
    for n in (0, 5, MIN_Z_FRAMES):
        probe = AttentionProbe({SITE: (_frame(d, 3, 5), params)}, head_null=n, writes=writes)
        probe.update(Observation(SITE, x, mask))
        probe._z_hook(0)(torch.randn(2, 12, 4, 8, dtype=torch.float64))
        names[n] = {r["statistic"] for r in probe.rows()}
    suffixes = ("_null", "_null_std", "_p_value", "_z")
    assert not any(s.endswith(suffixes) for s in names[0])
    assert "write_share" in names[0] and "write_share_z" not in names[0]
    for stat in STATISTICS:
        assert {f"{stat}{s}" for s in suffixes[:3]} <= names[5] and f"{stat}_z" not in names[5]
        assert {f"{stat}{s}" for s in suffixes} <= names[MIN_Z_FRAMES]
    assert "write_share_z" in names[5]  # a closed form: no frames behind it
    with pytest.raises(UsageError, match="head_null=1"):
        AttentionProbe({SITE: (_frame(d, 3, 5), params)}, head_null=1)


def test_framed_state_round_trip_and_merge() -> None:
    """The frames' state merges and round-trips like one basis's; another frame count or
    a plain accumulator is refused."""
    d = 24
    params = _params(d)
    x, mask = _input(d, batch=4, pos=12)
    probes = [AttentionProbe({SITE: (_frame(d, 3, 5), params)}, head_null=6) for _ in range(3)]
    probes[0].update(Observation(SITE, x, mask))
    probes[1].update(Observation(SITE, x[:2], mask[:2]))
    probes[2].update(Observation(SITE, x[2:], mask[2:]))
    merged = probes[1].merge(AttentionProbe({SITE: (_frame(d, 3, 5), params)}, head_null=6))
    merged.load_state_dict(merged.merge(probes[2]).state_dict())
    key = f"{SITE.hook_name}/null"
    for stat, want in probes[0].state(key).results().items():
        torch.testing.assert_close(merged.state(key).results()[stat], want, rtol=1e-9, atol=0)
    with pytest.raises(UsageError, match="frames"):
        AttentionAccumulator(frames=6).merge(AttentionAccumulator(frames=5))
    with pytest.raises(UsageError, match="frames"):
        AttentionAccumulator().merge(probes[0].state(key))


def test_the_null_takes_its_first_sequences_and_compares_like_with_like() -> None:
    """With ``head_null_sequences=2`` over batches of 3 and 2 sequences: the statistics
    are those over all 5 sequences; the null's rows (mean, spread, p-value) and each
    ``_null_sample`` are those of a probe that saw only the first 2, so the p-value
    compares Q_T and the frames on the same sequences; ``head_null_sequences`` says 2.
    Without a bound the sample is the statistic itself."""
    d = 24
    params = _params(d)
    x, mask = _input(d, batch=5, pos=12)

    def rows(budget: int | None, parts: list[slice]) -> dict[tuple[str, int | None], float]:
        probe = AttentionProbe(
            {SITE: (_frame(d, 3, 5), params)}, head_null=9, head_null_sequences=budget, seed=4
        )
        for part in parts:
            probe.update(Observation(SITE, x[part], mask[part]))
        return {(r["statistic"], r["head"]): r["value"] for r in probe.rows()}

    bounded = rows(2, [slice(0, 3), slice(3, 5)])
    first = rows(None, [slice(0, 2)])
    every = rows(None, [slice(0, 5)])
    assert bounded[("head_null_sequences", None)] == 2 and every[("head_null_sequences", None)] == 5
    for (stat, head), value in bounded.items():
        if stat == "head_null_sequences":
            continue
        if stat.endswith("_null_sample"):
            want = first[(stat.removesuffix("_null_sample"), head)]
        elif stat.endswith(("_null", "_null_std", "_p_value")):
            want = first[(stat, head)]
        else:
            want = every[(stat, head)]
        assert value == pytest.approx(want, rel=1e-9, abs=1e-12), (stat, head)
    for (stat, head), value in every.items():
        if stat.endswith("_null_sample"):
            assert value == pytest.approx(every[(stat.removesuffix("_null_sample"), head)])
    with pytest.raises(UsageError, match="head_null_sequences"):
        AttentionProbe({SITE: (_frame(d, 3, 5), params)}, head_null_sequences=0)
