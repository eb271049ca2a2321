"""A study's collection pass: the probe set, then per checkpoint one forward and
backward over it that leaves only sufficient statistics (a *part* file).

The pass depends on no basis, so a killed study resumes at the first missing part and
finished checkpoints are never redone; with ``world_size=N`` each process takes a
contiguous share of the probe batches and the statistics are all-reduced.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from tqdm.auto import tqdm

from .. import corpus
from ..distributed import all_reduce_session, shard
from ..errors import CorruptFileError, UsageError
from ..files import load_tensors, save_tensors
from ..hooks.base import get_backend
from ..hooks.sites import WRITE_KINDS, Site
from ..models import quiet_transformers
from ..probes.driver import lm_loss, run
from ..stats import Moments
from ..subspace import TangentBasis
from .config import StudyConfig, open_series, threads

__all__ = ["PART_KEY", "PROBE_FILE", "Part", "collect", "load_part", "part_path", "probe_set"]

PROBE_FILE = "probe_set.safetensors"
PART_KEY = "tangentlens_study_part"


def probe_set(cfg: StudyConfig, series: Any, out: Path) -> tuple[Tensor, Tensor]:
    """Probe tokens ``(n_sequences, seq_len)`` and corpus counts ``(vocab,)``; saved once."""
    path = out / PROBE_FILE
    if path.is_file():
        tensors, _ = load_tensors(path)
        return tensors["tokens"], tensors["counts"]
    tokenizer = series.load(0).tokenizer
    ids = corpus.encode(tokenizer, corpus.load_lines(cfg.corpus, cfg.max_chars))
    data = corpus.token_batches(
        tokenizer,
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
    meta = {"seq_len": cfg.seq_len, "seed": cfg.seed, "corpus": cfg.corpus}
    save_tensors(path, {"tokens": tokens, "counts": counts}, {"probe_set": json.dumps(meta)})
    return tokens, counts


class _TokenSample:
    """Activations of a fixed, seeded set of probe tokens (uniform without replacement),
    for TwoNN. Unlike a streaming reservoir it does not depend on how the tokens are split
    across batches or processes: each row is written by the one pass that holds its token."""

    def __init__(self, cfg: StudyConfig, shape: tuple[int, int], sites: list[Site], d: int):
        n_seq, seq_len = shape
        size = min(cfg.reservoir, n_seq * seq_len)
        rng = np.random.default_rng(cfg.seed)
        flat = torch.as_tensor(np.sort(rng.choice(n_seq * seq_len, size=size, replace=False)))
        self.seq, self.pos = flat // seq_len, flat % seq_len
        self.buffers = {s: torch.zeros(size, d) for s in sites} if size else {}
        self.start = 0  # first probe sequence of the batch being run

    def hook(self, site: Site) -> Any:
        buffer = self.buffers[site]

        def fn(x: Tensor) -> None:
            sel = (self.seq >= self.start) & (self.seq < self.start + x.shape[0])
            if bool(sel.any()):
                rows = x.detach()[self.seq[sel] - self.start, self.pos[sel]]
                buffer[sel] = rows.to("cpu", torch.float32)

        return fn


def check_parts_match(series: Any, parts: dict[int, Any]) -> None:
    """A resumed part must come from the weights the checkpoint holds now (checked where
    the checkpoint records its weights hash, as the trainer's do)."""
    for c in series:
        expected = c.metadata.get("weights_hash")
        if expected and parts[c.step].meta["weights_hash"] != expected:
            raise UsageError(
                f"parts/step{c.step}.safetensors was computed from other weights than "
                f"{c.source} holds now (retrained?); use a new output folder."
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


def _collect_one(
    cfg: StudyConfig, series: Any, i: int, tokens: Tensor, rank: int, world_size: int
) -> tuple[dict[str, Tensor], dict[str, Any]] | None:
    """One checkpoint's pass over this rank's share of the probe set, reduced over ranks.
    Returns the part (tensors, metadata) on rank 0, None elsewhere."""
    start = time.perf_counter()
    with quiet_transformers():
        loaded = series.load(i, backend=cfg.backend)
    model = loaded.backend_model
    backend = get_backend(model)
    d, n_layers = backend.d_model, backend.n_layers
    cfg.check_ranks(d)
    n_ctx = getattr(loaded.model.config, "max_position_embeddings", None)
    if n_ctx is not None and tokens.shape[1] > n_ctx:
        raise UsageError(
            f"seq_len={tokens.shape[1]} exceeds the model's {n_ctx} positions; lower seq_len."
        )
    available = set(backend.sites())
    sites = [s for s in _study_sites(cfg.sites, n_layers) if s in available]
    writes = (
        [Site(layer, k) for layer in range(n_layers) for k in WRITE_KINDS] if cfg.writes else []
    )
    writes = [s for s in writes if s in available]
    # The pass is basis-free; the session plans its gradient probe from a basis per site.
    placeholder = TangentBasis(torch.eye(d, dtype=torch.float64)[:, :1])
    chunks = tokens.split(cfg.batch_size)
    batches = [(j * cfg.batch_size, batch) for j, batch in enumerate(chunks)]
    mine = shard(batches, rank, world_size)
    sample = _TokenSample(cfg, tokens.shape, sites, d)
    nll = torch.zeros(1, dtype=torch.float64)

    def feed() -> Iterator[Tensor]:
        for first, batch in mine:
            sample.start = first
            yield batch

    def loss(m: Any, batch: Any) -> Tensor:
        value = lm_loss(m, batch)
        nll.add_(float(value.detach()))
        return value

    handles = [backend.add_forward_hook(s, sample.hook(s)) for s in sample.buffers]
    try:
        session = run(
            model,
            feed(),
            {s: placeholder for s in sites + writes},
            ("gradient", "activation"),
            loss=loss,
            progress=False,
            n_controls=1,
        )
    finally:
        for handle in handles:
            handle.remove()
    if world_size > 1:
        all_reduce_session(session)
        for buffer in sample.buffers.values():
            dist.all_reduce(buffer)  # each row is filled on exactly one rank
        dist.all_reduce(nll)
    if rank != 0:
        return None
    acts = {s: session.activation.moments[s] for s in sites + writes}
    grads = {s: m for s, m in session.gradient.moments().items() if s in sites}
    tensors: dict[str, Tensor] = {}
    for prefix, group in (("act", acts), ("grad", grads)):
        for site, m in group.items():
            for key, t in m.state_dict().items():
                tensors[f"{prefix}/{site.hook_name}/{key}"] = t
    for site, buffer in sample.buffers.items():
        tensors[f"sample/{site.hook_name}"] = buffer
    tensors["embed"] = loaded.model.get_input_embeddings().weight.detach().float()
    ckpt = series[i]
    meta = {
        "step": ckpt.step,
        "weights_hash": loaded.weights_hash,
        "probe_loss": float(nll) / (tokens.shape[0] * (tokens.shape[1] - 1)),
        "train_loss": ckpt.metadata.get("loss"),
        "eval_loss": ckpt.metadata.get("eval_loss"),
        "n_layers": n_layers,
        "d_model": d,
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
    bar = tqdm(todo, desc="study: checkpoints", disable=not progress or rank != 0)
    for i in bar:
        bar.set_postfix(step=series[i].step)
        part = _collect_one(cfg, series, i, tokens, rank, world_size)
        if part is not None:
            tensors, meta = part
            save_tensors(part_path(out, series[i].step), tensors, {PART_KEY: json.dumps(meta)})


def collect_worker(
    rank: int, world_size: int, config: dict[str, Any], out: str, todo: list[int], progress: bool
) -> None:
    cfg = StudyConfig.from_dict(config)
    n_threads = cfg.num_threads or max(1, (os.cpu_count() or 1) // world_size)
    series = open_series(cfg.checkpoints)
    with threads(n_threads):
        tokens, _ = probe_set(cfg, series, Path(out))
        collect(cfg, series, todo, Path(out), tokens, rank, world_size, progress)


@dataclass
class Part:
    acts: dict[Site, Moments]
    grads: dict[Site, Moments]
    samples: dict[Site, Tensor]
    embed: Tensor
    meta: dict[str, Any]


def load_part(path: Path) -> Part:
    tensors, header = load_tensors(path)
    if PART_KEY not in header:
        raise CorruptFileError(f"{path} is not a study part; delete it and rerun the study.")
    groups: dict[str, dict[Site, dict[str, Tensor]]] = {"act": {}, "grad": {}}
    samples = {}
    for name, t in tensors.items():
        kind, _, rest = name.partition("/")
        if kind in groups:
            hook, _, key = rest.rpartition("/")
            groups[kind].setdefault(Site.parse(hook), {})[key] = t
        elif kind == "sample":
            samples[Site.parse(rest)] = t
    acts, grads = (
        {s: Moments().load_state_dict(st) for s, st in groups[g].items()} for g in ("act", "grad")
    )
    return Part(acts, grads, samples, tensors["embed"], json.loads(header[PART_KEY]))
