"""Moments: streaming == one-shot, merge == one pass, stability, state round trip; the
float32 products of float32 activations against the all-float64 ones."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tangentlens.core.errors import CorruptFileError, UsageError
from tangentlens.core.stats import (
    Moments,
    batch_statistics,
    gram_dtype,
    in_float32_range,
    state_dtype,
    unit_scale,
)


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.reshape(-1, x.shape[-1]).double()
    mu = x.mean(0)
    c = x - mu
    return mu, c.T @ c / x.shape[0]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 60),
    d=st.integers(1, 6),
    cuts=st.lists(st.integers(0, 60), max_size=6),
    seed=st.integers(0, 2**16),
)
def test_streaming_equals_one_shot(n, d, cuts, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) * 3 + 5
    bounds = sorted({0, n, *[c % (n + 1) for c in cuts]})
    m = Moments()
    for a, b in itertools.pairwise(bounds):
        m.update(x[a:b])
    one = Moments().update(x)
    assert m.count == one.count == n
    torch.testing.assert_close(m.mean, one.mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.covariance(), one.covariance(), rtol=1e-10, atol=1e-12)
    _, cov = _reference(x)
    torch.testing.assert_close(m.covariance(), cov, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m.gram, x.double().T @ x.double(), rtol=1e-10, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(shards=st.lists(st.integers(0, 20), min_size=1, max_size=6), seed=st.integers(0, 999))
def test_merge_equals_single_pass(shards, seed):
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(s, 4, generator=gen, dtype=torch.float64) + 10 for s in shards]
    pieces = [Moments(d=4).update(p) for p in parts]
    merged = Moments.merged(pieces)
    assert all(m.count == len(p) for m, p in zip(pieces, parts, strict=True))  # untouched
    whole = Moments(d=4).update(torch.cat(parts))
    assert merged.count == whole.count
    if whole.count:
        torch.testing.assert_close(merged.mean, whole.mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            merged.second_moment(), whole.second_moment(), rtol=1e-10, atol=1e-12
        )


@settings(max_examples=40, deadline=None)
@given(
    shards=st.lists(st.integers(1, 30), min_size=2, max_size=6),
    d=st.integers(1, 5),
    seed=st.integers(0, 999),
    offset=st.sampled_from([0.0, 10.0, 1e3]),
)
def test_remove_gives_the_moments_of_the_rest(shards, d, seed, offset):
    gen = torch.Generator().manual_seed(seed)
    parts = [
        torch.randn(s, d, generator=gen, dtype=torch.float64) * (i + 1) + offset
        for i, s in enumerate(shards)
    ]
    total = Moments()
    for p in parts:
        total.merge(Moments().update(p))
    for i, p in enumerate(parts):
        rest = total - Moments().update(p)
        direct = Moments().update(torch.cat(parts[:i] + parts[i + 1 :]))
        assert rest.count == direct.count
        scale = float(total.second_moment().diagonal().max())  # rounding is relative to it
        torch.testing.assert_close(rest.mean, direct.mean, rtol=1e-9, atol=1e-9 * scale**0.5)
        torch.testing.assert_close(
            rest.covariance(), direct.covariance(), rtol=1e-7, atol=1e-8 * scale
        )
    before = total.covariance().clone()
    assert total.copy().remove(Moments()).count == total.count  # removing nothing
    torch.testing.assert_close(total.covariance(), before)  # ``-`` leaves ``total`` alone
    everything = total.copy().remove(total)
    assert everything.count == 0 and everything.d == d


def test_remove_rejects_what_is_not_a_sub_stream():
    m = Moments().update(torch.randn(50, 3, dtype=torch.float64))
    with pytest.raises(UsageError, match="sub-stream"):
        m.remove(Moments().update(torch.randn(60, 3)))  # more vectors than there are
    with pytest.raises(UsageError, match="sub-stream"):
        m.remove(Moments().update(torch.randn(10, 3, dtype=torch.float64) * 100))
    with pytest.raises(UsageError, match="sub-stream"):
        m.remove(Moments().update(torch.randn(10, 4)))
    with pytest.raises(TypeError, match="Moments"):
        m.remove(3)


def test_stable_for_large_mean():
    """Mean 1e4, std 1: covariance within 1e-9 relative of a two-pass float64 reference."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20_000, 8, generator=gen, dtype=torch.float64) + 1e4
    m = Moments()
    for chunk in x.split(333):
        m.update(chunk)
    _, ref = _reference(x)
    rel = ((m.covariance() - ref).norm() / ref.norm()).item()
    assert rel < 1e-9
    naive = (x.T @ x / x.shape[0]) - torch.outer(x.mean(0), x.mean(0))
    assert ((naive - ref).norm() / ref.norm()).item() > rel  # the naive formula is worse


def test_float16_input_accumulates_in_float64():
    x = torch.randn(64, 5).half()
    m = Moments().update(x)
    assert m.mean.dtype == torch.float64
    torch.testing.assert_close(m.mean, x.double().mean(0))


def test_mask_drops_positions():
    x = torch.randn(2, 7, 3)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0]]).bool()
    m = Moments().update(x, mask=mask)
    ref = Moments().update(x[mask])
    assert m.count == 8
    torch.testing.assert_close(m.covariance(), ref.covariance())


def test_ddof_and_second_moment():
    x = torch.randn(50, 3, dtype=torch.float64)
    m = Moments().update(x)
    np.testing.assert_allclose(m.covariance(ddof=1).numpy(), np.cov(x.numpy().T), rtol=1e-12)
    torch.testing.assert_close(m.second_moment(), x.T @ x / 50)
    assert m.trace_second_moment() == pytest.approx(float((x * x).sum() / 50), rel=1e-12)


def test_state_dict_round_trip():
    m = Moments().update(torch.randn(30, 4))
    m2 = Moments().load_state_dict(m.state_dict())
    assert m2.count == m.count
    torch.testing.assert_close(m2.covariance(), m.covariance())
    assert Moments().load_state_dict(Moments().state_dict()).count == 0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.update(torch.tensor(1.0)), "shape"),
        (lambda m: m.update(torch.tensor([[1.0, float("nan")]])), "NaN"),
        (lambda m: m.update(torch.ones(2, 3), mask=torch.ones(3).bool()), "mask"),
        (lambda m: m.covariance(), "empty|at least"),
        (lambda m: m.update(torch.ones(2, 3)).update(torch.ones(2, 4)), "d=4"),
        (lambda m: m.merge(3), "Moments"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises((UsageError, TypeError), match=match):
        call(Moments())


@pytest.mark.parametrize(
    "state",
    [
        {"mean": torch.zeros(2)},
        {"count": torch.tensor(3), "mean": torch.zeros(2), "scatter": torch.zeros(3, 3)},
    ],
)
def test_corrupt_state_is_a_corrupt_file_error(state):
    with pytest.raises(CorruptFileError):
        Moments().load_state_dict(state)


def test_all_reduce_without_distributed_is_noop():
    m = Moments().update(torch.randn(5, 2))
    before = m.covariance().clone()
    m.all_reduce_()
    torch.testing.assert_close(m.covariance(), before)


def test_shared_batch_reuses_only_the_same_unchanged_memory():
    from tangentlens.core.stats import SharedBatch

    shared = SharedBatch()
    x = torch.randn(2, 5, 3)
    first = shared(x)
    assert shared(x.view(10, 3).view(2, 5, 3)) is first  # a view of the same memory
    x.add_(1.0)  # an in-place edit bumps the version: recomputed
    again = shared(x)
    assert again is not first
    torch.testing.assert_close(again[1], batch_statistics(x)[1])
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert shared(x, mask) is not again  # another mask, another entry
    m = Moments().add_batch(*shared(x, mask))
    torch.testing.assert_close(m.covariance(), Moments().update(x).covariance())


def _float64_statistics(x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    exact = batch_statistics(x)  # float64 products: the default, and gradients'
    reference = batch_statistics(x.double(), fast=True)  # float64 input: float64 anyway
    torch.testing.assert_close(exact[2], reference[2], rtol=1e-12, atol=0)
    return reference


@pytest.mark.parametrize(
    ("mean", "spread"), [(0.0, 1.0), (1e4, 1.0), (-3e3, 1e-3), (0.0, 1e-25), (0.0, 1e25)]
)
def test_float32_products_within_1e_6_of_float64(mean, spread):
    """float32 activations: the product in float32, about the batch mean, scaled by a power
    of two; covariance and second moment within 1e-6 relative of the all-float64 product,
    also with a large mean (1e4, unit spread) and far outside float32's square range."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-2, 1, 96, dtype=torch.float64)  # a 1000x range of spreads
    x = (torch.randn(2048, 96, generator=gen, dtype=torch.float64) * scales * spread + mean).float()
    assert gram_dtype(x) == torch.float32 and gram_dtype(x.double()) == torch.float64
    fast, ref = Moments(), Moments()
    for chunk in x.split(500):
        fast.add_batch(*batch_statistics(chunk, fast=True))
        ref.add_batch(*_float64_statistics(chunk))
    for a, b in [
        (fast.covariance(), ref.covariance()),
        (fast.second_moment(), ref.second_moment()),
    ]:
        assert ((a - b).norm() / b.norm()).item() < 1e-6
    torch.testing.assert_close(fast.mean, ref.mean, rtol=1e-12, atol=0)


def test_empty_vectors_name_d():
    """Vectors of width 0 get a usage error naming d, not a reshape failure."""
    with pytest.raises(UsageError, match="d ≥ 1"):
        Moments().update(torch.zeros(3, 0))


def test_float32_product_unscaled_in_range_equals_the_scaled_one():
    """Inside float32's range the product is formed unscaled; scaling by a power of two
    (what happens outside it) rounds every sum alike, so the two are equal bit for bit:
    2^50·x takes the scaled path and gives 2^100 times x's scatter exactly."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(300, 24, generator=gen) * torch.logspace(-1, 1, 24) + 3.0
    c = x - x.mean(0)
    assert in_float32_range(c.T @ c) and not in_float32_range((c * 2.0**50).T @ (c * 2.0**50))
    n, mean, scatter = batch_statistics(x, fast=True)
    big = batch_statistics(x * 2.0**50, fast=True)  # squares past 2^100: scaled
    assert big[0] == n and torch.equal(big[1], mean * 2.0**50)
    assert torch.equal(big[2], scatter * 2.0**100)


@pytest.mark.parametrize("peak", [3e-30, 0.75, 1.0, 5e20])
def test_unit_scale_is_the_power_of_two_below_the_peak(peak):
    """2^-e with 2^(e-1) ≤ max|t| < 2^e over all the tensors, the same for a transposed
    view as for its contiguous copy; 1 for zeros."""
    gen = torch.Generator().manual_seed(1)
    a = torch.rand(40, 7, generator=gen) * 0.5 * peak
    a[3, 2] = -peak  # the peak's sign does not matter
    b = torch.rand(5, generator=gen) * 0.1 * peak
    for tensors in [(a,), (a.T,), (a.T.contiguous(),), (b, a.T), (a[:, 1:],)]:
        scale = unit_scale(*tensors)
        top = max(float(t.abs().max()) for t in tensors)
        assert 0.5 <= top * float(scale) < 1, tensors[0].shape
        assert torch.frexp(scale)[0] == 0.5  # a power of two: multiplying by it is exact
    assert torch.equal(unit_scale(a.T), unit_scale(a))
    assert float(unit_scale(torch.zeros(3, 4))) == 1.0


def test_reduced_precision_matmul_keeps_float64():
    """Where float32 matmuls may run in bf16 / TF32 passes, products stay in float64."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert gram_dtype(torch.ones(2, 2)) == torch.float64
    finally:
        torch.set_float32_matmul_precision(before)
    assert gram_dtype(torch.ones(2, 2)) == torch.float32


def test_compact_state_is_float32_and_reads_float64():
    x = torch.randn(300, 6, dtype=torch.float64) * 2 + 7
    full = Moments().update(x)
    compact = Moments(dtype=state_dtype("compact")).update(x)
    assert compact._scatter.dtype == torch.float32 and compact.covariance().dtype == torch.float64
    assert compact.nbytes == 6 * 8 + 36 * 4 and full.nbytes == 6 * 8 + 36 * 8
    torch.testing.assert_close(compact.covariance(), full.covariance(), rtol=1e-6, atol=0)
    again = Moments(dtype=torch.float32).load_state_dict(compact.state_dict())
    assert again.state_dict()["scatter"].dtype == torch.float32
    merged = compact.copy().merge(full)
    assert merged.dtype == torch.float32 and merged.count == 600
    with pytest.raises(UsageError, match="memory must be one of"):
        state_dtype("small")


def test_observations_get_float32_products_only_where_allowed():
    """Float32 batch products only where the session allows them (`fast`: a probe that
    fits a basis); gradients and the activations behind ratios get float64 products."""
    from tangentlens.hooks import Site
    from tangentlens.probes import ActivationProbe, GradientProbe
    from tangentlens.probes.base import Observation

    x = torch.randn(3, 40, 16)
    precise = Observation(Site(0, "resid_pre"), x).statistics()
    fast = Observation(Site(0, "resid_pre"), x, fast=True).statistics()
    reference = batch_statistics(x.double())
    torch.testing.assert_close(precise[2], reference[2], rtol=1e-13, atol=0)
    assert not torch.equal(fast[2], reference[2])  # float32 products: close, not equal
    torch.testing.assert_close(fast[2], reference[2], rtol=1e-5, atol=1e-5)
    assert ActivationProbe.float32_products and not GradientProbe.float32_products


def test_identical_means_the_same_stream_bit_for_bit():
    x = torch.randn(50, 8, dtype=torch.float64)
    a, b = Moments().update(x), Moments().update(x)
    assert a.identical(b) and Moments().identical(Moments())
    assert not a.identical(Moments().update(x[:-1]))
    assert not a.identical(Moments().update(x + 1e-12))


def test_first_batch_and_merge_into_empty_are_taken_bit_for_bit():
    x = torch.randn(50, 8, dtype=torch.float64) * 3 + 1e3
    n, mean, scatter = batch_statistics(x)
    first = Moments().add_batch(n, mean, scatter)
    assert first.count == n and torch.equal(first.mean, mean)
    assert torch.equal(first.covariance(), scatter / n)
    assert Moments().merge(first).identical(first) and (Moments() + first).identical(first)
    compact = Moments(dtype=torch.float32).merge(first)
    assert torch.equal(compact.covariance(), scatter.float().double() / n)
