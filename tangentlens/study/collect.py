"""A study's collection pass: the probe set, then per checkpoint one forward and
backward over it that leaves only sufficient statistics (a *part* file).

The pass depends on no basis, so a killed study resumes at the first missing part and
finished checkpoints are never redone; with ``world_size=N`` each process takes a
contiguous share of the probe batches and the statistics are all-reduced. It takes a
loaded checkpoint (`collect_part`), so the caller can use the same load for the heads.

A part holds the `state_dict` of each probe that collected it, built on its sites
alone (`tangentlens.probes.base.MomentProbe`: basis-free), as ``{probe}/{key}``, the
probes' sites in its metadata, and ``sample/{hook}``, ``sample_sequence`` and ``embed``.
The analysis loads those states back into the same probes and computes their rows with
their own `compute`, against the bases fitted from the early parts: a study's statistics
are a probe session's, checkpoint by checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm.auto import tqdm

from ..core.digests import config_digest, source_digest, tensor_hash
from ..core.errors import CorruptFileError, UsageError
from ..core.files import CONTENT_KEY, check_safetensors, load_tensors, save_tensors
from ..core.stats import Moments
from ..data import corpus
from ..hooks.base import Backend, get_backend
from ..hooks.families import is_causal
from ..hooks.sites import INPUT_KINDS, WRITE_KINDS, Site
from ..models.batches import check_tokens
from ..models.loading import quiet_transformers
from ..probes.activation import FixedSample
from ..probes.base import MomentProbe
from ..probes.distributed import all_reduce_session, check_parent, shard
from ..probes.driver import lm_loss, masked_positions, mlm_loss, run
from ..probes.gradient import GradientProbe
from ..probes.residual import ResidualProbe
from ..probes.weight_gradient import WeightGradientProbe
from .config import StudyConfig, open_series, threads

__all__ = [
    "PART_KEY",
    "PROBE_FILE",
    "Part",
    "collect",
    "collect_part",
    "load_checkpoint",
    "load_part",
    "load_probe_set",
    "part_path",
    "probe_set",
    "save_part",
    "stale_parts",
]

PROBE_FILE = "probe_set.safetensors"
PART_KEY = "tangentlens_study_part"
# the settings a probe set, and a part beyond its probe set, are functions of
_PROBE_SET_KEYS = ("checkpoints", "corpus", "encoding", "max_chars", "seq_len", "probe_fraction")
_PART_KEYS = ("backend", "sites", "writes", "n_groups", "batch_size", "reservoir", "seed")
_PART_META = {"step": int, "weights_hash": str, "n_layers": int, "d_model": int, "n_groups": int}


def _probe_set_digest(cfg: StudyConfig, lines: list[str] | None = None) -> str:
    """The settings a probe set is cut with and the text it is cut from (``lines``, read
    here when not given): a corpus edited in place under the same path makes another."""
    if lines is None:
        lines = corpus.load_lines(cfg.corpus, cfg.max_chars, cfg.encoding)
    settings = {k: getattr(cfg, k) for k in (*_PROBE_SET_KEYS, "seed", "n_sequences")}
    text = corpus.text_sha256(lines)
    return config_digest({**settings, "text_sha256": text, "code": source_digest()})


def _part_digest(cfg: StudyConfig, tokens: Tensor) -> str:
    settings = {k: getattr(cfg, k) for k in _PART_KEYS}
    tokens_hash = tensor_hash({"tokens": tokens})
    # the code: a part collected by another tangentlens (other tensor names, another
    # statistic) is recomputed, never read into this one's probes or mixed with its parts
    return config_digest({**settings, "tokens": tokens_hash, "code": source_digest()})


def probe_set(cfg: StudyConfig, series: Any, out: Path) -> tuple[Tensor, Tensor]:
    """Probe tokens ``(n_sequences, seq_len)`` and corpus counts ``(vocab,)``; saved once,
    reused only when it was made with these settings (else made again: never trusted)."""
    path = out / PROBE_FILE
    lines = corpus.load_lines(cfg.corpus, cfg.max_chars, cfg.encoding)
    if path.is_file():
        found = load_probe_set(path, cfg, lines)
        if found is not None:
            return found
        path.unlink()
    tokenizer = series.load_tokenizer(0)  # its weights are not needed to cut the blocks
    ids = corpus.encoded(tokenizer, lines)
    data = corpus.token_batches(
        tokenizer,
        cfg.corpus,
        ids=ids,
        seq_len=cfg.seq_len,
        probe_fraction=cfg.probe_fraction,
        seed=cfg.seed,
    )
    if data.probe.shape[0] < cfg.n_sequences:
        raise UsageError(
            f"the corpus gives {data.probe.shape[0]} held-out blocks of {cfg.seq_len} tokens, "
            f"fewer than n_sequences={cfg.n_sequences}; use a larger corpus or fewer sequences."
        )
    tokens = data.probe[: cfg.n_sequences].clone()
    counts = torch.bincount(ids, minlength=corpus.vocab_size(tokenizer))
    meta = {
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
        "corpus": cfg.corpus,
        "digest": _probe_set_digest(cfg, lines),
    }
    save_tensors(path, {"tokens": tokens, "counts": counts}, {"probe_set": json.dumps(meta)})
    return tokens, counts


def load_probe_set(
    path: Path, cfg: StudyConfig, lines: list[str] | None = None
) -> tuple[Tensor, Tensor] | None:
    """A saved probe set, checked whole (int64 token blocks of the configured shape, ids
    inside the counted vocabulary, tensors matching their content hash); None when other
    settings or another text made it (``lines``: the corpus, read here when not given), or
    it carries no content hash (it cannot be verified: made again). Damage is a
    `CorruptFileError`."""
    if CONTENT_KEY not in (check_safetensors(path).get("__metadata__") or {}):
        return None
    tensors, header = load_tensors(path, verified=True)
    try:
        meta = json.loads(header["probe_set"])
        tokens, counts = tensors["tokens"], tensors["counts"]
        if tokens.dtype != torch.long or counts.dtype != torch.long:
            raise ValueError(f"tokens {tokens.dtype} and counts {counts.dtype}, not int64")
        if tokens.ndim != 2 or counts.ndim != 1 or tokens.numel() == 0:
            raise ValueError(f"tokens {list(tokens.shape)}, counts {list(counts.shape)}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= counts.numel():
            raise ValueError(f"token ids outside the vocabulary [0, {counts.numel()})")
    except (KeyError, ValueError, TypeError) as err:
        raise CorruptFileError(
            f"{path} is a damaged probe set ({err}); delete it and rerun the study."
        ) from err
    if meta.get("digest") != _probe_set_digest(cfg, lines):
        return None
    if tuple(tokens.shape) != (cfg.n_sequences, cfg.seq_len):
        raise CorruptFileError(
            f"{path} holds {list(tokens.shape)} tokens where its settings make "
            f"{[cfg.n_sequences, cfg.seq_len]}; delete it and rerun the study."
        )
    return tokens, counts


def stale_parts(cfg: StudyConfig, series: Any, out: Path, tokens: Tensor) -> list[int]:
    """Indices of the checkpoints whose part must be computed: missing, made with other
    settings, another probe set or another tangentlens source, without a content hash
    (unverifiable), or from other weights than the checkpoint records now (retrained in
    place). Such parts are deleted
    here: a part is reused only when verified, and recomputing it is the fix."""
    digest = _part_digest(cfg, tokens)
    todo = []
    for i, ckpt in enumerate(series):
        path = part_path(out, ckpt.step)
        if path.is_dir():
            raise CorruptFileError(
                f"{path} is a folder where a study part belongs; delete it to recompute."
            )
        if path.is_file():
            meta = check_safetensors(path).get("__metadata__") or {}
            try:
                made = json.loads(meta[PART_KEY])
                made_by = made.get("collect")
            except (KeyError, ValueError, AttributeError) as err:
                raise CorruptFileError(
                    f"{path} is not a readable study part ({type(err).__name__}: {err}); "
                    "delete it and rerun the study."
                ) from err
            weights = ckpt.metadata.get("weights_hash")
            fresh = not weights or made.get("weights_hash") in (None, weights)
            if made_by == digest and CONTENT_KEY in meta and fresh:
                continue
            path.unlink()
        todo.append(i)
    return todo


def check_parts_match(series: Any, parts: dict[int, Any]) -> None:
    """A part must come from the weights its checkpoint records (`stale_parts` recomputes
    a part of other weights first, so a mismatch left here is a checkpoint whose recorded
    weights hash does not fit its own weights)."""
    for c in series:
        expected = c.metadata.get("weights_hash")
        if expected and parts[c.step].meta["weights_hash"] != expected:
            raise CorruptFileError(
                f"{c.source} holds other weights than the weights_hash its metadata records "
                f"(parts/step{c.step}.safetensors was computed from the weights as they are); "
                "restore that checkpoint, or retrain it so its metadata is written again."
            )


def part_path(out: Path, step: int) -> Path:
    return out / "parts" / f"step{step}.safetensors"


def _study_sites(kinds: tuple[str, ...], n_layers: int) -> list[Site]:
    """Residual sites, each residual-stream tensor once: ``resid_post`` of layer l is
    ``resid_pre`` of layer l + 1, so it is kept only where that one is not measured."""
    sites = []
    for layer in range(n_layers):
        for kind in kinds:
            if kind == "resid_post" and "resid_pre" in kinds and layer + 1 < n_layers:
                continue
            sites.append(Site(layer, kind))
    return sites


def _probes(
    sites: list[Site],
    writes: list[Site],
    inputs: list[Site],
    cfg: StudyConfig | None,
    backend: Backend | None,
    *,
    n_groups: int | None = None,
    d_model: int | None = None,
) -> list[MomentProbe]:
    """The probes a part holds, built on their sites alone (basis-free: Q_T is fitted from
    the early parts later), with the study's options for `MomentProbe.compute`: the
    gradient probe at the residual sites (the gradients' and activations' `Moments` per
    group), the residual probe at the block writes, the weight-gradient probe at the
    inputs of linear maps (S and the inputs' `Moments` per group). Without ``cfg``
    (a part read on its own), the probes' default options and ``n_groups``."""
    groups = cfg.n_groups if cfg is not None else n_groups
    options: dict[str, Any] = {"n_groups": groups}
    if cfg is not None:
        options |= {"n_controls": cfg.n_controls, "seed": cfg.seed}
    zeta = {"zeta": cfg.zeta} if cfg is not None else {}
    probes: list[MomentProbe] = [GradientProbe(sites, **zeta, **options)]
    if writes:
        probes.append(ResidualProbe(writes, n_groups=groups))
    if inputs:
        probes.append(WeightGradientProbe(inputs, backend, d_model=d_model, **options))
    return probes


def load_checkpoint(cfg: StudyConfig, series: Any, i: int) -> Any:
    """Checkpoint ``i`` loaded (and hashed) for the study's backend."""
    with quiet_transformers():
        return series.load(i, backend=cfg.backend)


def collect_part(
    cfg: StudyConfig, loaded: Any, tokens: Tensor, rank: int, world_size: int
) -> tuple[dict[str, Tensor], dict[str, Any]] | None:
    """One loaded checkpoint's pass over this rank's share of the probe set, reduced over
    ranks. Returns the part (tensors, metadata) on rank 0, None elsewhere."""
    start = time.perf_counter()
    ckpt = loaded.checkpoint
    model = loaded.backend_model
    backend = get_backend(model)
    d, n_layers = backend.d_model, backend.n_layers
    cfg.check_ranks(d)
    check_tokens(
        loaded.model,
        tokens,
        source=ckpt.source,
        fix="the tokenizer does not fit the model; save the model's own tokenizer with the "
        "checkpoints",
        what="the probe set (StudyConfig.seq_len, --seq-len)",
    )
    available = set(backend.sites())
    sites = [s for s in _study_sites(cfg.sites, n_layers) if s in available]
    writes = (
        [Site(layer, k) for layer in range(n_layers) for k in WRITE_KINDS] if cfg.writes else []
    )
    writes = [s for s in writes if s in available]
    batches = list(enumerate(tokens.split(cfg.batch_size)))  # (global batch index, batch)
    mine = shard(batches, rank, world_size)
    sample = FixedSample(cfg.reservoir, cfg.seed, tokens.shape, sites, d)
    nll = torch.zeros(1, dtype=torch.float64)
    n_predicted = torch.zeros(1, dtype=torch.float64)
    # decoders: the summed next-token loss; encoders: the summed masked-token loss
    objective = lm_loss if is_causal(loaded.model) else mlm_loss
    inputs = [
        Site(layer, kind)
        for layer in range(n_layers)
        for kind in INPUT_KINDS
        if cfg.weight_gradient and Site(layer, kind) in available
    ]
    probes = _probes(sites, writes, inputs, cfg, backend)

    def feed() -> Iterator[Tensor]:
        for j, batch in mine:
            sample.start = j * cfg.batch_size
            yield batch

    def loss(m: Any, batch: Any) -> Tensor:
        value = objective(m, batch)
        nll.add_(float(value.detach()))
        if objective is mlm_loss:
            n_predicted.add_(int(masked_positions(m, batch).sum()))
        else:
            n_predicted.add_(batch.shape[0] * (batch.shape[1] - 1))
        return value

    handles = [backend.add_forward_hook(s, sample.hook(s)) for s in sample.buffers]
    try:
        session = run(
            model,
            feed(),
            None,
            probes,
            loss=loss,
            progress=False,
            group_of=lambda p: mine[p][0],  # group = global batch index mod G
        )
    finally:
        for handle in handles:
            handle.remove()
    if world_size > 1:
        all_reduce_session(session)
        for buffer in sample.buffers.values():
            dist.all_reduce(buffer)  # each row is filled on exactly one rank
        dist.all_reduce(nll)
        dist.all_reduce(n_predicted)
    if rank != 0:
        return None
    tensors = {
        f"{p.name}/{key}": t for p in session.probes.values() for key, t in p.state_dict().items()
    }
    for site, buffer in sample.buffers.items():
        tensors[f"sample/{site.hook_name}"] = buffer
    tensors["sample_sequence"] = sample.seq.clone()
    tensors["embed"] = loaded.model.get_input_embeddings().weight.detach().float()
    meta = {
        "step": ckpt.step,
        "collect": _part_digest(cfg, tokens),
        "weights_hash": loaded.weights_hash,
        "probe_loss": float(nll) / float(n_predicted),
        "objective": "next-token" if objective is lm_loss else "masked-token",
        "train_loss": ckpt.metadata.get("loss"),
        "eval_loss": ckpt.metadata.get("eval_loss"),
        "n_layers": n_layers,
        "d_model": d,
        "n_groups": cfg.n_groups,
        "probes": {p.name: [site.hook_name for site in p.sites] for p in probes},
        "seconds": time.perf_counter() - start,
        "world_size": world_size,
    }
    return tensors, meta


def collect(
    cfg: StudyConfig,
    series: Any,
    todo: list[int],
    out: Path,
    tokens: Tensor,
    rank: int,
    world_size: int,
    progress: bool,
) -> None:
    """The parts of ``todo`` (one load each), for the processes of a data-parallel run."""
    bar = tqdm(todo, desc="study: checkpoints", disable=not progress or rank != 0)
    for i in bar:
        bar.set_postfix(step=series[i].step)
        part = collect_part(cfg, load_checkpoint(cfg, series, i), tokens, rank, world_size)
        if part is not None:
            check_parent()  # a worker whose parent is gone writes nothing
            save_part(out, part)


def save_part(out: Path, part: tuple[dict[str, Tensor], dict[str, Any]]) -> None:
    tensors, meta = part
    save_tensors(part_path(out, meta["step"]), tensors, {PART_KEY: json.dumps(meta)})


def collect_worker(
    rank: int, world_size: int, config: dict[str, Any], out: str, todo: list[int], progress: bool
) -> None:
    # a worker collects and never plans a probe; a probe the parent registered is unknown
    # in this spawned process, so the config is made here without the probe pass's probes
    cfg = StudyConfig.from_dict({**config, "probes": ()})
    n_threads = cfg.num_threads or max(1, (os.cpu_count() or 1) // world_size)
    series = open_series(cfg.checkpoints)
    path = Path(out) / PROBE_FILE
    found = load_probe_set(path, cfg)  # the parent made and checked it
    if found is None:
        raise CorruptFileError(
            f"{path} changed during the study, or the tangentlens source did (the workers "
            "read another than the study that started them); rerun the study."
        )
    with threads(n_threads):
        tokens, _ = found
        collect(cfg, series, todo, Path(out), tokens, rank, world_size, progress)


@dataclass
class Part:
    """One checkpoint's statistics: the probes that collected them (``gradient`` at the
    residual sites, ``weight`` at the inputs of linear maps or None), ``residual``: the
    residual probe over the residual sites and the block writes (its state at the
    residual sites is the gradient probe's activation `Moments`, collected once), the
    TwoNN token sample with its sequence index, the embedding. ``acts``/``grads`` (merged)
    and ``*_groups`` (per group of sequences) are views of those states."""

    gradient: GradientProbe
    residual: ResidualProbe
    weight: WeightGradientProbe | None
    samples: dict[Site, Tensor]
    sample_sequence: Tensor | None
    embed: Tensor
    meta: dict[str, Any]
    act_groups: dict[Site, list[Moments]] = field(init=False)
    grad_groups: dict[Site, list[Moments]] = field(init=False)
    acts: dict[Site, Moments] = field(init=False)
    grads: dict[Site, Moments] = field(init=False)

    def __post_init__(self) -> None:
        sites, inputs = self.gradient.sites, self.weight.sites if self.weight else []
        self.grad_groups = {s: self.gradient.group_moments(s) for s in sites}
        self.act_groups = {s: self.gradient.group_moments(s, "act") for s in sites}
        self.act_groups |= {s: self.weight.activation_groups(s) for s in inputs if self.weight}
        writes = [s for s in self.residual.sites if s not in self.act_groups]
        self.act_groups |= {s: self.residual.group_moments(s) for s in writes}
        self.acts = {s: Moments.merged(g) for s, g in self.act_groups.items()}
        self.grads = {s: Moments.merged(g) for s, g in self.grad_groups.items()}

    @property
    def wgrad_groups(self) -> dict[Site, list[Tensor]]:
        """S = Σ G Gᵀ per group at each input site."""
        return {s: self.weight.group_matrices(s) for s in self.weight.sites} if self.weight else {}


def load_part(path: Path, cfg: StudyConfig | None = None) -> Part:
    """Read a part file into its probes (with ``cfg``'s options for `compute`, else the
    probes' defaults); anything missing or malformed is a `CorruptFileError`."""
    tensors, header = load_tensors(path, verified=True)
    if PART_KEY not in header:
        raise CorruptFileError(f"{path} is not a study part; delete it and rerun the study.")
    try:
        meta = json.loads(header[PART_KEY])
        for key, kind in _PART_META.items():
            if not isinstance(meta[key], kind) or isinstance(meta[key], bool):
                raise TypeError(f"{key} is {meta[key]!r}, not {kind.__name__}")
        d = meta["d_model"]
        if f"step{meta['step']}.safetensors" != path.name:
            raise ValueError(f"it holds step {meta['step']}")
        n_groups = meta["n_groups"]
        if cfg is not None and n_groups != cfg.n_groups:
            raise ValueError(f"{n_groups} groups where the study has {cfg.n_groups}")
        sites = {name: [Site.parse(h) for h in hooks] for name, hooks in meta["probes"].items()}
        gradient = GradientProbe.name
        writes = sites.get(ResidualProbe.name, [])
        inputs = sites.get(WeightGradientProbe.name, [])
        probes = _probes(sites[gradient], writes, inputs, cfg, None, n_groups=n_groups, d_model=d)
        state: dict[str, dict[str, Tensor]] = {p.name: {} for p in probes}
        samples = {}
        for name, t in tensors.items():
            match name.split("/", 1):
                case [probe, key] if probe in state:
                    state[probe][key] = t
                case ["sample", hook]:
                    samples[Site.parse(hook)] = t
                case ["embed"] | ["sample_sequence"]:
                    pass
                case _:
                    raise ValueError(f"an unknown tensor {name!r}")
        for probe in probes:
            probe.load_state_dict(state[probe.name])
        # the residual sites' activations are the gradient probe's: one state, read twice
        residual = ResidualProbe(sites[gradient] + writes, n_groups=n_groups)
        shared = {k: t for k, t in state[gradient].items() if k.startswith("act/")}
        residual.load_state_dict(shared | state.get(ResidualProbe.name, {}))
        embed = tensors["embed"]
        for name in ("embed", *(f"sample/{s.hook_name}" for s in samples)):
            if tensors[name].is_floating_point() and not bool(torch.isfinite(tensors[name]).all()):
                raise ValueError(f"{name} holds NaN or Inf: the file is damaged")
        weight = probes[-1] if inputs else None
        sequence = tensors.get("sample_sequence")
        part = Part(probes[0], residual, weight, samples, sequence, embed, meta)  # type: ignore[arg-type]
        widths = [m.d for m in [*part.acts.values(), *part.grads.values()] if m.count]
        widths += [t.shape[-1] for t in [*samples.values(), embed]]
        widths += [t.shape[-1] for g in part.wgrad_groups.values() for t in g]
        if embed.ndim != 2 or any(n != d for n in widths):
            raise ValueError(f"statistics of another width than d_model={d}")
        return part
    except (KeyError, ValueError, TypeError, IndexError, CorruptFileError, UsageError) as err:
        raise CorruptFileError(
            f"{path} is a damaged study part ({type(err).__name__}: {err}); delete it and "
            "rerun the study (finished checkpoints are kept)."
        ) from err
