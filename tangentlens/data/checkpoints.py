"""Checkpoint series: ordered training steps, loaders, early/late windows, weight hashes.

Three sources give the same :class:`CheckpointSeries`:

* the folder written by :func:`tangentlens.data.train.train` (``step{N}`` subfolders with
  ``tangentlens.json`` metadata) or any folder of HF checkpoints named ``step{N}`` /
  ``checkpoint-{N}``: :meth:`CheckpointSeries.from_folder`;
* hub revisions such as Pythia's ``step{N}`` branches (needs internet):
  :meth:`CheckpointSeries.from_hub`.

Every loaded checkpoint is hashed (:func:`tangentlens.core.digests.tensor_hash` of its state
dict); a step whose weights equal an earlier step's is flagged (public Pythia
branches are known to serve duplicated weights).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import list_repo_refs
from safetensors import SafetensorError
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

from ..core.digests import tensor_hash
from ..core.errors import CorruptFileError, MissingFileError, UsageError
from ..core.files import check_safetensors, is_model_folder, read_checked_json
from ..core.validation import check_window_fraction
from ..models import loading as models
from ..models.loading import (
    TOKENIZER_FILES,
    check_model_folder,
    quiet_transformers,
    safetensors_files,
)

__all__ = [
    "Checkpoint",
    "CheckpointSeries",
    "LoadedCheckpoint",
    "parse_step",
    "window_indices",
]

METADATA_FILE = "tangentlens.json"
_STEP_NAMES = (re.compile(r"^step[-_]?(\d+)$"), re.compile(r"^checkpoint[-_](\d+)$"))

Loader = Callable[["Checkpoint"], tuple[Any, Any]]


def parse_step(name: str, pattern: str | None = None) -> int | None:
    """The step in a folder or revision name (``step1000``, ``checkpoint-1000``), else None.

    ``pattern`` (e.g. ``"step{step}"``) matches one revision format instead.
    """
    if pattern is not None:
        regex = re.escape(pattern).replace(re.escape("{step}"), r"(\d+)")
        m = re.fullmatch(regex, name)
        return int(m.group(1)) if m else None
    for regex in _STEP_NAMES:
        m = regex.match(name)
        if m:
            return int(m.group(1))
    return None


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint: a step and where it lives (a local folder, or a hub id + revision)."""

    step: int
    source: str
    revision: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_local(self) -> bool:
        return self.revision is None

    @property
    def name(self) -> str:
        return f"step{self.step}"


@dataclass
class LoadedCheckpoint:
    """A loaded checkpoint: HF model and tokenizer, weight hash, duplicate flag.

    ``backend_model`` is the model wrapped for ``backend`` (TransformerBridge or
    nnsight), or None when loaded with ``backend=None``.
    """

    checkpoint: Checkpoint
    model: Any
    tokenizer: Any
    weights_hash: str
    duplicate_of: int | None = None
    backend: str | None = None
    backend_model: Any = None

    @property
    def step(self) -> int:
        return self.checkpoint.step


def _weight_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """Parameter shapes from safetensors headers (no weights read; each file checked whole),
    or None if unknown."""
    files = safetensors_files(folder)
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        header = check_safetensors(f)
        for name, info in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(info["shape"])
    return shapes


def _shape_mismatch(a: dict[str, tuple[int, ...]], b: dict[str, tuple[int, ...]]) -> str | None:
    if set(a) != set(b):
        diff = sorted(set(a) ^ set(b))
        return f"parameter names differ ({', '.join(diff[:3])}{' …' if len(diff) > 3 else ''})"
    for name in sorted(a):
        if a[name] != b[name]:
            return f"{name} is {list(b[name])}, not {list(a[name])}"
    return None


def _hf_loader(checkpoint: Checkpoint) -> tuple[Any, Any]:
    """Load an HF language model and its tokenizer (local folder, or hub id + revision):
    a masked LM (``config.architectures`` ``...ForMaskedLM``, e.g. a ``train`` run with
    ``objective="masked"``) with its MLM head, anything else as a causal LM."""
    source, revision = checkpoint.source, checkpoint.revision
    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(source, revision=revision)
            names = getattr(config, "architectures", None) or []
            masked = any(n.endswith("ForMaskedLM") for n in names)
            auto = AutoModelForMaskedLM if masked else AutoModelForCausalLM
            model = auto.from_pretrained(source, revision=revision, config=config)
    except SafetensorError as err:
        raise CorruptFileError(
            f"the weights of {checkpoint.source} are damaged ({err}); restore that checkpoint."
        ) from err
    model.eval()
    return model, _hf_tokenizer(checkpoint)


def _hf_tokenizer(checkpoint: Checkpoint) -> Any:
    """The tokenizer saved with a local checkpoint (its folder, else the parent) or a hub
    revision's; None when a local checkpoint has none."""
    if not checkpoint.is_local:
        return AutoTokenizer.from_pretrained(checkpoint.source, revision=checkpoint.revision)
    folder = Path(checkpoint.source)
    for candidate in (folder, folder.parent):
        if any((candidate / f).is_file() for f in TOKENIZER_FILES):
            try:
                return AutoTokenizer.from_pretrained(candidate)
            except (OSError, ValueError) as err:  # a file missing or damaged beside the rest
                first = (str(err).splitlines() or [type(err).__name__])[0]
                raise CorruptFileError(
                    f"the tokenizer files in {candidate} do not load ({first}); restore them "
                    "from the run's tokenizer/ folder, or delete that checkpoint."
                ) from err
    return None


def _list_hub_branches(repo_id: str) -> list[str]:
    try:
        refs = list_repo_refs(repo_id)
    except Exception as err:  # offline, unknown repo, auth: all end the same way for a user
        raise UsageError(
            f"cannot list the revisions of {repo_id!r} ({type(err).__name__}); it is no local "
            "folder either: go online, pass steps=[...] explicitly, or use a local folder of "
            "checkpoints."
        ) from err
    return [b.name for b in refs.branches]


def window_indices(
    steps: list[int], fraction: float, by: str, losses: Mapping[int, float] | None = None
) -> dict[str, list[int]]:
    """Indices of the early and late checkpoints of ``steps`` (sorted) under one rule.

    ``by="step"``: the first and last ``fraction`` of the training steps, and at least
    the two nearest each end (with log-spaced early checkpoints, "early" is early in
    training, not the first few files). ``by="index"``: the first and last
    ``ceil(fraction * n)`` checkpoints (the paper's rule), never overlapping.
    ``by="progress"``: early = the checkpoints before ``fraction`` of the loss drop from
    the first to the last checkpoint (``losses``: step → loss), late = those after
    ``1 − fraction`` of it; empty windows where the loss does not drop. The series'
    windows and the report's window panel both use this one rule set."""
    n = len(steps)
    if by == "index":
        k = min(math.ceil(fraction * n - 1e-9), n // 2)
        return {"early": list(range(k)), "late": list(range(n - k, n))}
    if by == "step":
        first, last = steps[0], steps[-1]
        span = fraction * (last - first)
        early_n = sum(s <= first + span for s in steps)
        late_n = sum(s >= last - span and s > first + span for s in steps)  # 0.5: disjoint
        # a window holds at least two checkpoints: the two nearest its end of training
        early_n, late_n = max(early_n, min(2, n // 2)), max(late_n, min(2, n // 2))
        return {"early": list(range(early_n)), "late": list(range(n - late_n, n))}
    if by == "progress":
        losses = losses or {}
        drop = losses[steps[0]] - losses[steps[-1]] if n and all(s in losses for s in steps) else 0
        if not drop > 0:
            return {"early": [], "late": []}
        done = [(losses[steps[0]] - losses[s]) / drop for s in steps]
        early_n = max(next((i for i, p in enumerate(done) if p >= fraction), n), 1)
        late_from = max((i + 1 for i, p in enumerate(done) if p < 1 - fraction), default=0)
        return {"early": list(range(early_n)), "late": list(range(late_from, n))}
    raise UsageError(f"windows go by 'step', 'index' or 'progress'; got {by!r}.")


class CheckpointSeries:
    """Checkpoints ordered by step, loaded one at a time, hashed as they load.

    ``loader(checkpoint) -> (model, tokenizer)`` is injectable (the default loads HF
    folders or hub revisions with ``AutoModelForCausalLM``, masked LMs with
    ``AutoModelForMaskedLM``); ``tokenizer`` overrides the tokenizer of every checkpoint
    (an object or a folder).
    """

    def __init__(
        self,
        checkpoints: Sequence[Checkpoint],
        *,
        loader: Loader | None = None,
        tokenizer: Any = None,
        name: str = "",
    ) -> None:
        items = sorted(checkpoints, key=lambda c: c.step)
        if not items:
            raise UsageError("a CheckpointSeries needs at least one checkpoint; got none.")
        steps = [c.step for c in items]
        repeated = sorted({s for s in steps if steps.count(s) > 1})
        if repeated:
            # folders (step1, step01) or revisions: name the sources, which the user renames
            sources = [
                c.source if c.is_local else f"{c.source}@{c.revision}"
                for c in items
                if c.step == repeated[0]
            ]
            raise UsageError(
                f"{' and '.join(map(str, sources))} are both step {repeated[0]}; give each "
                "checkpoint one step (rename or move one of them)."
            )
        self.checkpoints: list[Checkpoint] = items
        self.name = name
        self._loader: Loader = loader or _hf_loader
        self._tokenizer = tokenizer
        self.hashes_: dict[int, str] = {}
        # first seen (step, parameter shapes), per kind: "file" headers, "model" state dicts
        self._shapes: dict[str, tuple[int, dict[str, tuple[int, ...]]]] = {}

    # ---------------------------------------------------------------- builders
    @classmethod
    def from_folder(cls, path: str | Path, *, tokenizer: Any = None) -> CheckpointSeries:
        """Checkpoints in ``path``: subfolders named ``step{N}`` or ``checkpoint-{N}``.

        Parameter shapes are checked from the safetensors headers at once.
        """
        root = Path(path).expanduser()
        if not root.exists():
            raise MissingFileError(
                f"checkpoint folder {root} does not exist; pass the --out folder of "
                "`tangentlens train` or a folder of step{{N}}/checkpoint-{{N}} subfolders."
            )
        if not root.is_dir():
            raise UsageError(f"{root} is a file; pass a folder of checkpoint subfolders.")
        found: list[Checkpoint] = []
        for sub in sorted(root.iterdir()):
            step = parse_step(sub.name) if sub.is_dir() else None
            if step is None:
                continue
            if not is_model_folder(sub):
                raise UsageError(
                    f"{sub} has no config.json or weights: an incomplete checkpoint; "
                    "delete it or finish writing it."
                )
            check_model_folder(sub, tokenizer=False)
            meta_path = sub / METADATA_FILE
            meta = {}
            if meta_path.is_file():
                fix = "delete that checkpoint folder and rerun the training that wrote it"
                meta = read_checked_json(meta_path, fix=fix)
            found.append(Checkpoint(step, str(sub), None, meta))
        if not found:
            single = (root / "config.json").is_file()
            hint = " (it is a single checkpoint; pass its parent)" if single else ""
            raise UsageError(
                f"no checkpoints in {root}{hint}: expected subfolders named step{{N}} or "
                "checkpoint-{N}, each an HF model folder."
            )
        series = cls(found, tokenizer=tokenizer, name=str(root))
        for ckpt in series.checkpoints:
            shapes = _weight_shapes(Path(ckpt.source))
            if shapes is not None:
                series._check_shapes(ckpt.step, shapes, "file")
        return series

    @classmethod
    def from_hub(
        cls,
        repo_id: str,
        steps: Sequence[int] | None = None,
        *,
        revision_format: str = "step{step}",
        loader: Loader | None = None,
        list_revisions: Callable[[str], list[str]] | None = None,
        tokenizer: Any = None,
    ) -> CheckpointSeries:
        """Hub revisions of ``repo_id`` named by ``revision_format`` (Pythia: ``step{step}``).

        With ``steps=None`` the branches are listed (``list_revisions``, default
        ``huggingface_hub.list_repo_refs``) and every one that matches is taken.
        """
        if "{step}" not in revision_format:
            raise UsageError(
                f"revision_format {revision_format!r} lacks '{{step}}'; e.g. 'step{{step}}'."
            )
        if steps is None:
            names = (list_revisions or _list_hub_branches)(repo_id)
            steps = [s for n in names if (s := parse_step(n, revision_format)) is not None]
            if not steps:
                raise UsageError(
                    f"{repo_id!r} has no revisions named like {revision_format!r}; "
                    "pass revision_format= or steps=."
                )
        found = [Checkpoint(int(s), repo_id, revision_format.format(step=int(s))) for s in steps]
        return cls(found, loader=loader, tokenizer=tokenizer, name=repo_id)

    # ---------------------------------------------------------------- access
    def __len__(self) -> int:
        return len(self.checkpoints)

    def __iter__(self) -> Iterator[Checkpoint]:
        return iter(self.checkpoints)

    def __getitem__(self, i: int) -> Checkpoint:
        return self.checkpoints[i]

    def __repr__(self) -> str:
        return f"CheckpointSeries({self.name!r}, steps={self.steps})"

    @property
    def steps(self) -> list[int]:
        return [c.step for c in self.checkpoints]

    def index(self, step: int) -> int:
        """Position of ``step`` in the series."""
        try:
            return self.steps.index(step)
        except ValueError:
            raise UsageError(f"step {step} is not in the series; steps are {self.steps}.") from None

    # ---------------------------------------------------------------- windows
    def windows(
        self,
        fraction: float = 0.3,
        *,
        by: str = "step",
        early: tuple[int, int] | None = None,
        late: tuple[int, int] | None = None,
    ) -> dict[str, list[int]]:
        """Indices of the early and late windows.

        ``by="step"`` (default): the checkpoints in the first and in the last ``fraction``
        of the training steps (with log-spaced early checkpoints, "early" is early in
        training, not the first few files), and at least the two nearest each end.
        ``by="index"``: the first and last ``ceil(fraction * n)`` checkpoints (the
        paper's rule). ``early`` / ``late`` as
        inclusive step ranges ``(lo, hi)`` override either one. Each window needs at
        least 2 checkpoints.
        """
        fraction = check_window_fraction(fraction, "fraction")
        if by not in ("step", "index"):
            raise UsageError(f"windows go by 'step' or 'index'; got {by!r}.")
        out = window_indices(self.steps, fraction, by)
        for name, rng in (("early", early), ("late", late)):
            if rng is not None:
                lo, hi = rng
                out[name] = [i for i, s in enumerate(self.steps) if lo <= s <= hi]
        ranges = {"early": early, "late": late}
        for name, idx in out.items():
            if len(idx) < 2:
                rng = ranges[name]
                how = f"steps {rng}" if rng is not None else f"fraction={fraction} by {by}"
                raise UsageError(
                    f"the {name} window holds {len(idx)} checkpoint(s) ({how}); it needs at "
                    "least 2: add checkpoints, raise the fraction or widen the step range."
                )
        shared = sorted(self.steps[i] for i in set(out["early"]) & set(out["late"]))
        if shared:
            raise UsageError(
                f"the early and late windows share steps {shared} (fraction={fraction} by "
                f"{by}, early {early}, late {late}): lower the fraction (--window-fraction) or "
                "give disjoint step ranges (--early/--late)."
            )
        return out

    # ---------------------------------------------------------------- loading
    def load(self, i: int, *, backend: str | None = None) -> LoadedCheckpoint:
        """Load checkpoint ``i`` (an index; see :meth:`index` for steps), hash its weights
        and flag it if an earlier-hashed step had identical weights.

        ``backend`` (``"transformer_lens"`` or ``"nnsight"``) also wraps the loaded model
        (:func:`tangentlens.models.wrap`; no second load).
        """
        ckpt = self.checkpoints[i]
        model, tokenizer = self._loader(ckpt)
        tokenizer = self._check_tokenizer(ckpt, tokenizer)
        state = model.state_dict()
        self._check_shapes(ckpt.step, {k: tuple(v.shape) for k, v in state.items()}, "model")
        digest = tensor_hash(state)
        self.hashes_[ckpt.step] = digest
        loaded = LoadedCheckpoint(ckpt, model, tokenizer, digest, self.duplicate_of(ckpt.step))
        if backend is not None:
            loaded.backend = backend
            loaded.backend_model = models.wrap(
                model, tokenizer, backend, source=str(ckpt.source), revision=ckpt.revision
            )
        return loaded

    def load_tokenizer(self, i: int) -> Any:
        """Checkpoint ``i``'s tokenizer without its weights (what a probe set is cut with).

        An injected ``loader`` yields model and tokenizer together, so with one (and no
        ``tokenizer`` override) the checkpoint is loaded and its weights dropped."""
        ckpt = self.checkpoints[i]
        if self._tokenizer is not None:
            return self._resolve_tokenizer()
        found = _hf_tokenizer(ckpt) if self._loader is _hf_loader else self._loader(ckpt)[1]
        return self._check_tokenizer(ckpt, found)

    def hash_all(self, progress: bool = True) -> dict[int, str]:
        """Load and hash every checkpoint (one at a time); returns ``{step: hash}``."""
        for i in tqdm(range(len(self)), desc="hash checkpoints", disable=not progress):
            if self.checkpoints[i].step not in self.hashes_:
                self.load(i)
        return dict(self.hashes_)

    def duplicate_of(self, step: int) -> int | None:
        """The smallest other hashed step whose weights equal ``step``'s, else None."""
        digest = self.hashes_.get(step)
        if digest is None:
            return None
        same = [s for s, h in self.hashes_.items() if h == digest and s != step]
        return min(same) if same and min(same) < step else None

    def duplicates(self) -> dict[int, int]:
        """``{step: earlier step with identical weights}`` over the hashed checkpoints."""
        out = {s: self.duplicate_of(s) for s in sorted(self.hashes_)}
        return {s: d for s, d in out.items() if d is not None}

    # ---------------------------------------------------------------- internals
    def _check_tokenizer(self, ckpt: Checkpoint, found: Any) -> Any:
        """The series' override, else ``found``; a `MissingFileError` when neither exists."""
        tokenizer = self._resolve_tokenizer() if self._tokenizer is not None else found
        if tokenizer is None:
            raise MissingFileError(
                f"no tokenizer for {ckpt.source}: save one in the checkpoint folder or its "
                "parent, or pass tokenizer= to the series."
            )
        return tokenizer

    def _resolve_tokenizer(self) -> Any:
        if isinstance(self._tokenizer, str | Path):
            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer)
        return self._tokenizer

    def _check_shapes(self, step: int, shapes: dict[str, tuple[int, ...]], kind: str) -> None:
        if kind not in self._shapes:
            self._shapes[kind] = (step, shapes)
            return
        first_step, first = self._shapes[kind]
        problem = _shape_mismatch(first, shapes)
        if problem is not None:
            raise UsageError(
                f"checkpoint step {step} does not match step {first_step}: {problem}; "
                "a series holds one architecture: remove the odd checkpoint."
            )
