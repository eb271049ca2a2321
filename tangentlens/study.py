"""The paper's experiment over a checkpoint series: one long results table.

>>> frame = Study(StudyConfig(checkpoints="runs/demo")).run("runs/demo-study")

1. **Probe set.** Fixed held-out token blocks of the corpus (the trainer's probe split
   when ``seed``, ``seq_len`` and ``probe_fraction`` match the training run) and the
   corpus token counts: ``probe_set.safetensors``.
2. **One pass per checkpoint** (forward and backward of the summed next-token loss):
   activation and gradient `Moments` at the residual sites, activation Moments of each
   block's writes, a seeded token sample for TwoNN, the embedding matrix and the probe
   loss: ``parts/step{N}.safetensors``. The pass does not depend on any basis, so a
   killed study resumes at the first missing part and finished checkpoints are not redone.
   With ``world_size=N`` each process takes a contiguous share of the probe batches and
   the statistics are all-reduced (`tangentlens.distributed`).
3. **Analysis** from the parts alone (deterministic): per site one rank-k PCA Q_T of the
   pooled early-window activations (``bases/rank{k}.safetensors``), then per checkpoint
   the energy and isotropy tests (IsoScore* reference: the trace-normalised gradient
   covariance averaged over all checkpoints at that site, scaled to each checkpoint's
   trace), activation shares (the depth profile), intrinsic
   dimension, effective rank, IsoScore, frequency–distance correlations and the tangent
   share of the embedding update. ``results.csv``, ``results.json`` and ``manifest.json``.

Every file is written atomically; the statistics and columns are listed in
``docs/CONTRACTS.md`` ("Study and data-parallel runs").

Embedding space basis: the update split uses the layer-0 ``resid_pre`` Q_T. In a model
without learned positional embeddings (Llama, the model trained here) that site *is*
the embedding output, so Q_T spans the token-weighted early embedding rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .hooks.sites import RESIDUAL_KINDS, WRITE_KINDS, Site
from .io import dataclass_from_dict, load_tensors, save_tensors, tensor_hash, write_json, write_text
from .stats import Moments

__all__ = ["COLUMNS", "Study", "StudyConfig", "load_results", "open_series"]

BACKENDS = ("transformer_lens", "nnsight")
COLUMNS = [
    "checkpoint",
    "step",
    "window",
    "rank",
    "layer",
    "head",
    "site",
    "probe",
    "statistic",
    "value",
    "ci_low",
    "ci_high",
]
CONFIG_FILE = "study_config.json"
PROBE_FILE = "probe_set.safetensors"
PART_KEY = "tangentlens_study_part"
_Z95 = 1.959963984540054
_KD_WARNING = r".*normal controls are not exchangeable.*"


# --------------------------------------------------------------------------- config
@dataclass
class StudyConfig:
    """Everything that determines a study's results (``progress`` aside)."""

    checkpoints: str  # a folder of step{N} checkpoints, or a hub id (owner/name)
    backend: str = "transformer_lens"
    sites: tuple[str, ...] = ("resid_pre", "resid_post")
    writes: bool = True  # attn_out / mlp_out activation Moments for the write ratios
    rank: int | tuple[int, ...] = 16
    window_fraction: float = 0.3
    early: tuple[int, int] | None = None  # inclusive step range; overrides the fraction
    late: tuple[int, int] | None = None
    n_controls: int = 1000
    controls: str = "normal"
    zeta: float = 0.1
    seed: int = 0
    n_sequences: int = 32
    seq_len: int = 64
    batch_size: int = 8
    probe_fraction: float = 0.05
    corpus: str | None = None  # text file, folder of .txt, or None for the KJV
    max_chars: int | None = None
    reservoir: int = 1000  # tokens sampled per site for TwoNN (0: no TwoNN)
    n_permutations: int = 200
    num_threads: int | None = 1  # torch threads (None: leave as is); 1 is exact and fast here
    progress: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoints, str | Path) or not str(self.checkpoints):
            raise ValueError("StudyConfig.checkpoints must name a folder or a hub id.")
        self.checkpoints = str(self.checkpoints)
        if self.backend not in BACKENDS:
            raise ValueError(
                f"StudyConfig.backend must be one of {BACKENDS}; got {self.backend!r}."
            )
        sites = (self.sites,) if isinstance(self.sites, str) else tuple(self.sites)
        bad = [s for s in sites if s not in RESIDUAL_KINDS]
        if bad or not sites:
            raise ValueError(
                f"StudyConfig.sites must be a non-empty subset of {RESIDUAL_KINDS}; got {sites!r}."
            )
        self.sites = tuple(k for k in RESIDUAL_KINDS if k in sites)
        for name in ("early", "late"):
            rng = getattr(self, name)
            if rng is None:
                continue
            if len(rng) != 2 or not all(_is_int(v) for v in rng) or rng[0] > rng[1]:
                raise ValueError(
                    f"StudyConfig.{name} must be an inclusive step range (lo, hi) with lo <= hi; "
                    f"got {rng!r}."
                )
            setattr(self, name, (int(rng[0]), int(rng[1])))
        ranks = [self.rank] if isinstance(self.rank, int) else list(self.rank)
        if not ranks or any(not _is_int(r) or r < 1 for r in ranks):
            raise ValueError(
                f"StudyConfig.rank must be a positive int or a list of them; got {self.rank!r}."
            )
        self.rank = ranks[0] if len(ranks) == 1 else tuple(sorted(set(ranks)))
        positive = ("n_controls", "n_sequences", "seq_len", "batch_size", "n_permutations")
        for name in positive:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"StudyConfig.{name} must be a positive int; got {value!r}.")
        checks = {
            "window_fraction": 0.0 < self.window_fraction <= 0.5,
            "controls": self.controls in ("normal", "uniform"),
            "zeta": 0.0 <= self.zeta <= 1.0,
            "seed": _is_int(self.seed) and self.seed >= 0,
            "seq_len": self.seq_len >= 2,
            "probe_fraction": 0.0 < self.probe_fraction < 1.0,
            "max_chars": self.max_chars is None or (_is_int(self.max_chars) and self.max_chars > 0),
            "reservoir": _is_int(self.reservoir) and (self.reservoir == 0 or self.reservoir >= 3),
            "num_threads": self.num_threads is None
            or (_is_int(self.num_threads) and self.num_threads >= 1),
        }
        hints = {
            "window_fraction": "(0, 0.5]",
            "controls": "'normal' or 'uniform'",
            "zeta": "[0, 1]",
            "seed": "an int >= 0",
            "seq_len": "an int >= 2",
            "probe_fraction": "(0, 1)",
            "max_chars": "None or a positive int",
            "reservoir": "0 (no TwoNN) or an int >= 3",
            "num_threads": "None or a positive int",
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"StudyConfig.{name}={getattr(self, name)!r} is out of range; "
                    f"use {hints[name]}."
                )

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,) if isinstance(self.rank, int) else tuple(self.rank)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sites"] = list(self.sites)
        d["rank"] = self.rank if isinstance(self.rank, int) else list(self.rank)
        for name in ("early", "late"):
            d[name] = None if d[name] is None else list(d[name])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StudyConfig:
        return dataclass_from_dict(cls, d)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def open_series(source: str) -> Any:
    """A `CheckpointSeries` from a local folder, or from hub revisions for an ``owner/name``
    id that is not a local path. Errors of the series (missing folder, no checkpoints,
    mixed shapes) surface unchanged."""
    from .checkpoints import CheckpointSeries
    from .models import is_hub_id

    path = Path(source).expanduser()
    if not path.exists() and is_hub_id(source):
        return CheckpointSeries.from_hub(source)
    return CheckpointSeries.from_folder(path)


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """Torch (and, with threadpoolctl installed, numpy's BLAS) limited to ``n`` threads.

    On a shared machine, OpenMP/BLAS threads that outnumber free cores make small d × d
    algebra tens of times slower; ``n`` fixed also keeps results bit-reproducible.
    """
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with _blas_limits(n):
            yield
    finally:
        torch.set_num_threads(before)


def _blas_limits(n: int) -> Any:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return nullcontext()
    return threadpool_limits(n)


# --------------------------------------------------------------------------- study
class Study:
    """Run a `StudyConfig` into an output folder; see the module docstring."""

    def __init__(self, config: StudyConfig) -> None:
        if not isinstance(config, StudyConfig):
            raise TypeError(f"Study takes a StudyConfig; got {type(config).__name__}.")
        self.config = config

    def run(self, out_dir: str | Path, *, world_size: int = 1, progress: bool | None = None) -> Any:
        """Run (or resume) the study; returns the results table (`COLUMNS`)."""
        cfg = self.config
        progress = cfg.progress if progress is None else progress
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1; got {world_size!r}.")
        start = time.perf_counter()
        out = Path(out_dir)
        series = open_series(cfg.checkpoints)
        windows = series.windows(cfg.window_fraction, early=cfg.early, late=cfg.late)
        _prepare_out_dir(cfg, out)
        with _threads(cfg.num_threads):
            tokens, counts = _probe_set(cfg, series, out)
            todo = [i for i, c in enumerate(series) if not _part_path(out, c.step).is_file()]
            n_batches = len(tokens.split(cfg.batch_size))
            if todo and world_size > 1:
                if n_batches < world_size:
                    raise ValueError(
                        f"the probe set has {n_batches} batches, too few for {world_size} "
                        "processes; raise n_sequences or lower the batch size or world size."
                    )
                from .distributed import launch

                launch(_collect_worker, world_size, cfg.to_dict(), str(out), todo, progress)
            elif todo:
                _collect(cfg, series, todo, out, tokens, 0, 1, progress)
            collect_s = time.perf_counter() - start
            parts = {c.step: _load_part(_part_path(out, c.step)) for c in series}
            _check_parts_match(series, parts)
            frame, info = _analyse(cfg, series, windows, parts, counts, out, progress)
        _write_results(out, frame)
        manifest = {
            **info,
            "config": cfg.to_dict(),
            "world_size": world_size,
            "probe_set": {
                "n_sequences": int(tokens.shape[0]),
                "seq_len": int(tokens.shape[1]),
                "tokens_hash": tensor_hash({"tokens": tokens}),
                "corpus_tokens": int(counts.sum()),
            },
            "timings": {
                **info["timings"],
                "collect_s": collect_s,
                "total_s": time.perf_counter() - start,
                "resumed_checkpoints": len(series) - len(todo),
            },
        }
        write_json(out / "manifest.json", manifest)
        return frame

    @staticmethod
    def load(out_dir: str | Path) -> Any:
        """The results table of a finished study in ``out_dir``."""
        return load_results(Path(out_dir) / "results.csv")


def load_results(path: str | Path) -> Any:
    """Read ``results.csv`` back with the study's dtypes."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; run the study first.")
    optional = ("rank", "layer", "head", "site", "value", "ci_low", "ci_high")
    frame = pd.read_csv(
        path,
        dtype={"checkpoint": str, "window": str, "site": "string", "probe": str, "statistic": str},
        keep_default_na=False,
        na_values={col: [""] for col in optional},
    )
    if list(frame.columns) != COLUMNS:
        raise ValueError(f"{path} is not a study table: columns {list(frame.columns)}.")
    for col in ("rank", "layer", "head"):
        frame[col] = frame[col].astype("Int64")
    for col in ("value", "ci_low", "ci_high"):
        frame[col] = frame[col].astype("float64")
    return frame


def _prepare_out_dir(cfg: StudyConfig, out: Path) -> None:
    path = out / CONFIG_FILE
    mine = {k: v for k, v in cfg.to_dict().items() if k != "progress"}
    if path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is corrupt ({err}); delete it or use another --out.") from err
        saved.pop("progress", None)
        if saved == json.loads(json.dumps(mine)):
            return
        if any((out / "parts").glob("step*.safetensors")):
            diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
            raise ValueError(
                f"{out} holds a study with another configuration (differs in {diff}); "
                "rerun with the same configuration to resume, or choose another output folder."
            )
        # nothing computed yet (e.g. the first run failed a check): start afresh
        (out / PROBE_FILE).unlink(missing_ok=True)
    write_json(path, mine)


# --------------------------------------------------------------------------- probe set
def _probe_set(cfg: StudyConfig, series: Any, out: Path) -> tuple[Tensor, Tensor]:
    """Probe tokens ``(n_sequences, seq_len)`` and corpus counts ``(vocab,)``; saved once."""
    from . import corpus

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
        raise ValueError(
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
        import numpy as np

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


# --------------------------------------------------------------------------- collection
def _check_parts_match(series: Any, parts: dict[int, Any]) -> None:
    """A resumed part must come from the weights the checkpoint holds now (checked where
    the checkpoint records its weights hash, as the trainer's do)."""
    for c in series:
        expected = c.metadata.get("weights_hash")
        if expected and parts[c.step].meta["weights_hash"] != expected:
            raise ValueError(
                f"parts/step{c.step}.safetensors was computed from other weights than "
                f"{c.source} holds now (retrained?); use a new output folder."
            )


def _part_path(out: Path, step: int) -> Path:
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


def _wrap(loaded: Any, backend: str) -> Any:
    """The loaded HF model wrapped for ``backend`` (no second load of the weights)."""
    from .checkpoints import quiet_transformers

    if backend == "nnsight":
        import nnsight

        return nnsight.TransformersModel(
            loaded.model, tokenizer=loaded.tokenizer, task="text-generation"
        )
    from transformer_lens.model_bridge import TransformerBridge

    with quiet_transformers(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = TransformerBridge.boot_transformers(
            loaded.checkpoint.source,
            hf_model=loaded.model,
            tokenizer=loaded.tokenizer,
            revision=loaded.checkpoint.revision,
        )
    return bridge.eval()


def _check_ranks(cfg: StudyConfig, d: int) -> None:
    for k in cfg.ranks:
        limit = d // 2 if cfg.controls == "normal" else d - 1
        if k > limit:
            raise ValueError(
                f"rank {k} is too large for d_model={d}: {cfg.controls} controls need "
                f"rank <= {limit}; lower the rank."
            )


def _collect_one(
    cfg: StudyConfig, series: Any, i: int, tokens: Tensor, rank: int, world_size: int
) -> tuple[dict[str, Tensor], dict[str, Any]] | None:
    """One checkpoint's pass over this rank's share of the probe set, reduced over ranks.
    Returns the part (tensors, metadata) on rank 0, None elsewhere."""
    from .distributed import all_reduce_moments, shard
    from .hooks.base import get_backend
    from .probes.session import lm_loss, run
    from .subspace import TangentBasis

    start = time.perf_counter()
    loaded = series.load(i)
    model = _wrap(loaded, cfg.backend)
    backend = get_backend(model)
    d, n_layers = backend.d_model, backend.n_layers
    _check_ranks(cfg, d)
    n_ctx = getattr(loaded.model.config, "max_position_embeddings", None)
    if n_ctx is not None and tokens.shape[1] > n_ctx:
        raise ValueError(
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
    acts = {s: session.activation.moments[s] for s in sites + writes}
    grads = {s: session.gradient.moments[s] for s in sites}
    if world_size > 1:
        import torch.distributed as dist

        all_reduce_moments(acts, d)
        all_reduce_moments(grads, d)
        for buffer in sample.buffers.values():
            dist.all_reduce(buffer)  # each row is filled on exactly one rank
        dist.all_reduce(nll)
    if rank != 0:
        return None
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


def _collect(
    cfg: StudyConfig,
    series: Any,
    todo: list[int],
    out: Path,
    tokens: Tensor,
    rank: int,
    world_size: int,
    progress: bool,
) -> None:
    from tqdm.auto import tqdm

    bar = tqdm(todo, desc="study: checkpoints", disable=not progress or rank != 0)
    for i in bar:
        bar.set_postfix(step=series[i].step)
        part = _collect_one(cfg, series, i, tokens, rank, world_size)
        if part is not None:
            tensors, meta = part
            save_tensors(_part_path(out, series[i].step), tensors, {PART_KEY: json.dumps(meta)})


def _collect_worker(
    rank: int, world_size: int, config: dict[str, Any], out: str, todo: list[int], progress: bool
) -> None:
    import os

    cfg = StudyConfig.from_dict(config)
    threads = cfg.num_threads or max(1, (os.cpu_count() or 1) // world_size)
    series = open_series(cfg.checkpoints)
    with _threads(threads):
        tokens, _ = _probe_set(cfg, series, Path(out))
        _collect(cfg, series, todo, Path(out), tokens, rank, world_size, progress)


@dataclass
class _Part:
    acts: dict[Site, Moments]
    grads: dict[Site, Moments]
    samples: dict[Site, Tensor]
    embed: Tensor
    meta: dict[str, Any]


def _load_part(path: Path) -> _Part:
    tensors, header = load_tensors(path)
    if PART_KEY not in header:
        raise ValueError(f"{path} is not a study part; delete it and rerun the study.")
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
    return _Part(acts, grads, samples, tensors["embed"], json.loads(header[PART_KEY]))


# --------------------------------------------------------------------------- analysis
def _fisher_ci(r: float, n: int, spearman: bool) -> tuple[float, float]:
    """95 % interval of a correlation by Fisher's z (Fieller's variance for Spearman)."""
    if n <= 3 or not math.isfinite(r) or abs(r) >= 1:
        return math.nan, math.nan
    se = math.sqrt((1.06 if spearman else 1.0) / (n - 3))
    z = math.atanh(r)
    return math.tanh(z - _Z95 * se), math.tanh(z + _Z95 * se)


def _pooled_shape(moments: list[Moments]) -> Tensor:
    """Mean over checkpoints of the trace-normalised gradient covariance C/tr(C): each
    checkpoint weighs the same, whatever its gradient scale."""
    shapes = []
    for m in moments:
        c = m.covariance(ddof=1)
        shapes.append(c / torch.trace(c))
    return torch.stack(shapes).mean(0)


def _merge(moments: list[Moments]) -> Moments:
    out = Moments()
    for m in moments:
        out.merge(m)
    return out


class _Rows:
    """Accumulates table rows of one checkpoint at a time."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.step = 0
        self.window = ""

    def at(self, step: int, window: str) -> _Rows:
        self.step, self.window = step, window
        return self

    def add(
        self,
        probe: str,
        values: Mapping[str, Any],
        *,
        rank: int | None = None,
        site: Site | None = None,
        cis: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        layer = None if site is None else site.layer
        kind = None if site is None else site.kind
        for stat, value in values.items():
            low, high = (cis or {}).get(stat, (math.nan, math.nan))
            value = math.nan if value is None else float(value)
            self.rows.append(
                (f"step{self.step}", self.step, self.window, rank, layer, None, kind, probe, stat,
                 value, low, high)
            )  # fmt: skip

    def frame(self) -> Any:
        import pandas as pd

        frame = pd.DataFrame(self.rows, columns=COLUMNS)
        for col in ("rank", "layer", "head"):
            frame[col] = frame[col].astype("Int64")
        frame["site"] = frame["site"].astype("string")
        return frame


def _fit_bases(
    cfg: StudyConfig,
    series: Any,
    early: list[int],
    parts: dict[int, _Part],
    sites: list[Site],
    out: Path,
) -> dict[int, dict[Site, Any]]:
    """Rank → site → Q_T from the pooled early-window activations; saved as `BasisSet`s."""
    from . import __version__
    from .probes.session import BasisSet
    from .subspace import TangentBasis

    pooled = {s: _merge([parts[t].acts[s] for t in early]) for s in sites}
    provenance = {
        "model": series.name,
        "early_steps": early,
        "weights_hashes": {str(t): parts[t].meta["weights_hash"] for t in early},
        "sites": [s.hook_name for s in sites],
        "seed": cfg.seed,
        "library": f"tangentlens {__version__}",
        "n_tokens": pooled[sites[0]].count,
    }
    bases = {}
    for k in cfg.ranks:
        info = {**provenance, "rank": k}
        bases[k] = {
            s: TangentBasis.fit(pooled[s], k, provenance={"site": s.hook_name, **info})
            for s in sites
        }
        BasisSet(bases[k], provenance=info).save(out / "bases" / f"rank{k}.safetensors")
    return bases


def _site_rows(
    rows: _Rows,
    cfg: StudyConfig,
    part: _Part,
    site: Site,
    bases: dict[int, dict[Site, Any]],
    pooled_shape: Tensor,
) -> None:
    """Activation and gradient statistics at one residual site of one checkpoint."""
    from .metrics import effective_rank, isoscore, participation_ratio, twonn_dimension
    from .significance import tangent_tests

    act, grad = part.acts[site], part.grads[site]
    free = {}
    if site in part.samples:
        free["twonn_dimension"] = twonn_dimension(part.samples[site])
    free |= {
        "effective_rank": effective_rank(act),
        "participation_ratio": participation_ratio(act),
        "isoscore": isoscore(act),
        "mean_sq_norm": act.trace_second_moment(),
        "n_tokens": act.count,
    }
    rows.add("activation", free, site=site)
    grad_free = {
        "grad_isoscore": isoscore(grad),
        "grad_effective_rank": effective_rank(grad),
        "n_tokens": grad.count,
    }
    rows.add("gradient", grad_free, site=site)
    # IsoScore* reference: the pooled gradient covariance, rescaled to this checkpoint's
    # trace (gradient scale falls ~1000x in training; unscaled, the reference would swamp
    # the late checkpoints' own covariance).
    reference = pooled_shape * torch.trace(grad.covariance(ddof=1))
    for k in cfg.ranks:
        basis = bases[k][site]
        tests = tangent_tests(
            grad,
            basis,
            n_controls=cfg.n_controls,
            seed=cfg.seed,
            controls=cfg.controls,
            zeta=cfg.zeta,
            reference=reference,
            activation_moments=act,
        )
        rows.add("gradient", tests, rank=k, site=site)
        rows.add("residual", _share_stats(act, basis), rank=k, site=site)


def _embedding_rows(
    rows: _Rows,
    cfg: StudyConfig,
    embed: Tensor,
    prev: Tensor | None,
    counts: Any,
    bases: dict[int, Any] | None,
) -> None:
    """Frequency–distance statistics, and the split of the update since ``prev``."""
    from .embedding import frequency_distance, update_split

    site = Site(0, "embed")
    table = frequency_distance(embed, counts, n_permutations=cfg.n_permutations, seed=cfg.seed)
    values = dict(zip(table["statistic"], table["value"], strict=True))
    n_seen = int(values["n_seen"])
    cis = {
        stat: _fisher_ci(values[stat], n_seen, stat.startswith("spearman"))
        for stat in values
        if re.fullmatch(r"(pearson|spearman)_(mean_all|mean_seen|weighted|norm)", stat)
    }
    rows.add("embedding", values, site=site, cis=cis)
    if prev is None or bases is None:
        return
    for k, basis in bases.items():
        split = update_split(prev, embed, basis, counts)
        named = {
            f"update_{stat}" + ("" if bucket == "all" else f"_{bucket}"): value
            for bucket, stat, value in split.itertuples(index=False)
        }
        rows.add("embedding", named, rank=k, site=site)


def _analyse(
    cfg: StudyConfig,
    series: Any,
    windows: dict[str, list[int]],
    parts: dict[int, _Part],
    counts: Tensor,
    out: Path,
    progress: bool,
) -> tuple[Any, dict[str, Any]]:
    """The results table from the parts (deterministic), and the manifest's facts."""
    from tqdm.auto import tqdm

    from . import __version__
    from .probes.residual import write_basis_site

    start = time.perf_counter()
    steps = series.steps
    window = {s: "middle" for s in steps}
    for name in ("early", "late"):
        for i in windows[name]:
            window[steps[i]] = name
    early = [steps[i] for i in windows["early"]]
    hashes = {s: parts[s].meta["weights_hash"] for s in steps}
    first_with = {}
    for s in steps:
        first_with.setdefault(hashes[s], s)
    duplicates = {s: first_with[hashes[s]] for s in steps if first_with[hashes[s]] != s}
    first = parts[steps[0]]
    n_layers, d = first.meta["n_layers"], first.meta["d_model"]
    _check_ranks(cfg, d)
    sites = sorted(first.grads, key=lambda s: (s.layer, RESIDUAL_KINDS.index(s.kind)))
    writes = sorted((s for s in first.acts if s.kind in WRITE_KINDS), key=lambda s: s.hook_name)
    pooled_shape = {s: _pooled_shape([parts[t].grads[s] for t in steps]) for s in sites}
    bases = _fit_bases(cfg, series, early, parts, sites, out)
    embed_site = Site(0, "resid_pre")
    embed_bases = {k: b[embed_site] for k, b in bases.items()} if embed_site in sites else None

    rows = _Rows()
    counts_np = counts.numpy()
    prev: Tensor | None = None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_KD_WARNING)
        for step in tqdm(steps, desc="study: statistics", disable=not progress):
            part = parts[step]
            rows.at(step, window[step])
            losses = ("probe_loss", "train_loss", "eval_loss")
            rows.add(
                "checkpoint", {k: part.meta[k] for k in losses if part.meta.get(k) is not None}
            )
            if step in duplicates:
                rows.add("checkpoint", {"duplicate_of": duplicates[step]})
            for site in sites:
                _site_rows(rows, cfg, part, site, bases, pooled_shape[site])
            for k in cfg.ranks:
                for write in writes:
                    target = write_basis_site(write, bases[k], n_layers)
                    if target is not None:
                        stats = _share_stats(part.acts[write], bases[k][target])
                        rows.add("residual", stats, rank=k, site=write)
            embed = part.embed.double()
            _embedding_rows(rows, cfg, embed, prev, counts_np, embed_bases)
            prev = embed

    frame = rows.frame()
    notes = []
    if cfg.controls == "normal" and max(cfg.ranks) / d > 0.05:
        notes.append(
            f"k/d up to {max(cfg.ranks)}/{d}: normal controls are not exchangeable with Q_T, "
            "so energy/isotropy p-values are anti-conservative (see tangentlens.significance)."
        )
    info = {
        "library": f"tangentlens {__version__}",
        "versions": _versions(),
        "series": series.name,
        "steps": steps,
        "windows": {name: [steps[i] for i in idx] for name, idx in windows.items()},
        "weights_hashes": {str(s): hashes[s] for s in steps},
        "duplicates": {str(s): t for s, t in duplicates.items()},
        "sites": [s.hook_name for s in sites],
        "write_sites": [s.hook_name for s in writes],
        "bases": [f"bases/rank{k}.safetensors" for k in cfg.ranks],
        "n_rows": len(frame),
        "notes": notes,
        "timings": {
            "checkpoint_s": {str(s): parts[s].meta["seconds"] for s in steps},
            "analysis_s": time.perf_counter() - start,
        },
    }
    return frame, info


def _share_stats(moments: Moments, basis: Any) -> dict[str, float]:
    """Activation energy share in Q_T, E‖x Q‖² / E‖x‖² (uncentred), against chance k/d."""
    a = moments.second_moment()
    q = basis.basis_.to(a.device)
    total = float(torch.trace(a))
    share = float(torch.trace(q.T @ a @ q)) / total if total > 0 else math.nan
    chance = basis.k / basis.d
    return {"tangent_share": share, "chance_share": chance, "share_ratio": share / chance}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "transformer-lens", "nnsight"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out


def _write_results(out: Path, frame: Any) -> None:
    from .io import atomic_write

    atomic_write(out / "results.csv", lambda p: frame.to_csv(p, index=False))
    records = frame.astype(object).where(frame.notna(), None).to_dict("records")
    write_text(out / "results.json", json.dumps(records, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
