"""Train a small Llama-style causal LM (or BERT-like encoder) and save a Pythia-like
checkpoint series.

``train(TrainConfig(), out_dir)`` trains a byte-level BPE tokenizer on the corpus, then
an HF ``LlamaForCausalLM`` (``objective="causal"``, next-token loss) or
``BertForMaskedLM`` (``objective="masked"``: the encoders the paper contrasts decoders
with; a seeded ``MASK_RATE`` of positions per step masked and predicted), and writes one
complete HF folder per scheduled step (``out_dir/step{N}``: safetensors weights, config,
tokenizer and ``tangentlens.json`` with step and loss). Every folder appears by an atomic
rename. The run is a pure function of the config: killed at any point and
started again, it resumes from the last finished checkpoint (weights, AdamW
state and RNG state, stored as safetensors + JSON) and ends with the same
weights as an uninterrupted run.

Seeds are the unit of replication: runs that differ only in ``seed`` differ in their
initialisation, batch order and masks, and share the train/probe split when they set one
``split_seed``, so a single probe set is held out from every one of them. The tokenizer
depends on the corpus and the config's vocabulary alone, never on a seed, so such runs may
take a finished run's tokenizer (``train(..., tokenizer_from=...)``) instead of training
the same one again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..core.digests import source_digest, tensor_hash
from ..core.errors import CorruptFileError, ResumeRefusedError, UsageError
from ..core.files import (
    atomic_folder,
    dataclass_from_dict,
    load_tensors,
    read_checked_json,
    read_json,
    remove_stale_temporaries,
    save_tensors,
    write_checked_json,
    write_json,
)
from ..core.folders import FolderLock, lock_folder
from ..core.settings import TRAIN
from ..core.validation import (
    OBJECTIVES,
    check_encoding,
    check_int,
    check_limits,
    check_seed,
    check_seq_len,
    is_int,
)
from ..models.batches import draw_masked
from ..version import __version__
from .checkpoints import METADATA_FILE, quiet_transformers
from .corpus import encoded, load_lines, token_batches
from .resume import (
    CONFIG_FILE,
    INPUT_KEYS,
    RESTART,
    SOURCE_KEY,
    STATE_FILE,
    TOKENIZER_DIR,
    check_finished,
    check_inputs,
    check_source,
    inputs_digest,
    is_started,
    load_resumed,
    missing_steps,
    resumable,
    start_over,
)

__all__ = ["CONFIG_FILE", "STATE_FILE", "TOKENIZER_DIR", "TrainConfig", "checkpoint_steps", "train"]

SPECIAL_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"  # the masked objective's extra special token
MASK_RATE = 0.15  # the fraction of positions the masked objective masks, as BERT's
_TMP_PREFIX = ".tmp-"


def checkpoint_steps(max_steps: int, last_log_step: int = 512, every: int = 1000) -> list[int]:
    """Pythia-like schedule: 0, then 1, 2, 4, … up to ``last_log_step``, then every
    ``every`` steps, always ending at ``max_steps``."""
    steps = {0, max_steps}
    p = 1
    while p <= min(last_log_step, max_steps):
        steps.add(p)
        p *= 2
    steps.update(range(last_log_step + every, max_steps, every))
    return sorted(steps)


@dataclass
class TrainConfig:
    """Everything that determines a training run (the run is a function of this).

    The defaults of the settings `tangentlens train` offers are `tangentlens.core.settings.TRAIN`.
    """

    corpus: str | None = TRAIN.corpus.default  # text file, folder of .txt, or None: the KJV
    encoding: str = TRAIN.encoding.default  # of the corpus files (decoded strictly)
    max_chars: int | None = None  # keep only the first characters of the corpus
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_mlp: int = 384
    seq_len: int = 64
    batch_size: int = 8
    max_steps: int = TRAIN.max_steps.default
    # checkpoints 0, 1, 2, 4, ..., 64, 128, 192, 256: five in the log-spaced steps before
    # the fast loss drop (the demo's early window), few later, where a study pays per file
    last_log_step: int = 64
    checkpoint_every: int = 64
    lr: float = 3e-3
    warmup_steps: int = 32
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    dropout: float = 0.0
    probe_fraction: float = 0.05
    eval_blocks: int = 32
    seed: int = TRAIN.seed.default
    split_seed: int | None = None  # seed of the train/probe split (None: ``seed``); see below
    num_threads: int = 1  # torch threads while training; results are exact for a fixed value
    tie_embeddings: bool = True  # as SmolLM2 and Gemma-3, the models it is compared with
    objective: str = TRAIN.objective.default  # "causal": Llama decoder; "masked": BERT encoder

    def __post_init__(self) -> None:
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        positive = [
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "d_mlp",
            "batch_size",
            "max_steps",
            "last_log_step",
            "checkpoint_every",
            "eval_blocks",
            "num_threads",
        ]
        for name in positive:
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise UsageError(f"TrainConfig.{name} must be a positive int; got {value!r}.")
            setattr(self, name, int(value))  # numpy ints too, as plain ints for JSON
        check_limits(self, "TrainConfig")
        self.seq_len = check_seq_len(self.seq_len, "TrainConfig.seq_len")
        self.seed = check_seed(self.seed, "TrainConfig.seed")
        self.warmup_steps = check_int(self.warmup_steps, "TrainConfig.warmup_steps", minimum=0)
        if self.split_seed is not None:
            check_seed(self.split_seed, "TrainConfig.split_seed")
            # one form per run: a split seed equal to the seed is the default split, so a
            # seed of a multi-seed run and the same seed trained alone are one config
            self.split_seed = None if self.split_seed == self.seed else int(self.split_seed)
        if self.max_chars is not None and (not is_int(self.max_chars) or self.max_chars < 1):
            raise UsageError(
                f"TrainConfig.max_chars must be None or a positive int; got {self.max_chars!r}."
            )
        self.encoding = check_encoding(self.encoding, "TrainConfig.encoding")
        if self.corpus is not None and not isinstance(self.corpus, str):
            raise UsageError(f"TrainConfig.corpus must be a path or None; got {self.corpus!r}.")
        if self.objective not in OBJECTIVES:
            raise UsageError(
                f"TrainConfig.objective must be one of {OBJECTIVES}; got {self.objective!r}."
            )
        reals = ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "dropout", "probe_fraction")
        for name in reals:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise UsageError(f"TrainConfig.{name} must be a number; got {value!r}.")
            if not math.isfinite(value):
                raise UsageError(f"TrainConfig.{name} must be finite; got {value!r}.")
        least = 256 + len(self.special_tokens)
        if self.vocab_size < least:
            raise UsageError(
                f"TrainConfig.vocab_size={self.vocab_size} is below the 256 byte tokens + "
                f"{least - 256} special token(s) of a byte-level BPE; use at least {least}."
            )
        if self.d_model % self.n_heads:
            raise UsageError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "change one of them."
            )
        if self.n_heads % self.n_kv_heads:
            raise UsageError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                "use a divisor of n_heads."
            )
        if self.objective == "causal" and (self.d_model // self.n_heads) % 2:
            raise UsageError("the head dimension d_model/n_heads must be even for rotary.")
        if self.warmup_steps > self.max_steps:  # the schedule would never leave warmup
            raise UsageError(
                f"max_steps={self.max_steps} is shorter than the learning-rate warmup "
                f"({self.warmup_steps} steps): train at least {self.warmup_steps} steps "
                "(--max-steps)."
            )
        checks = {
            "lr": self.lr > 0,
            "min_lr_ratio": 0.0 <= self.min_lr_ratio <= 1.0,
            "weight_decay": self.weight_decay >= 0,
            "betas": all(0.0 <= b < 1.0 for b in self.betas),
            "grad_clip": self.grad_clip > 0,
            "dropout": 0.0 <= self.dropout < 1.0,
            "probe_fraction": 0.0 < self.probe_fraction < 1.0,
        }
        for name, ok in checks.items():
            if not ok:
                raise UsageError(f"TrainConfig.{name}={getattr(self, name)!r} is out of range.")

    @classmethod
    def tiny(cls, **overrides: Any) -> TrainConfig:
        """A config that trains in about a second: for tests and smoke runs."""
        base: dict[str, Any] = dict(
            max_chars=40_000,
            vocab_size=320,
            d_model=32,
            n_layers=2,
            n_heads=2,
            n_kv_heads=1,
            d_mlp=64,
            seq_len=32,
            batch_size=4,
            max_steps=24,
            last_log_step=8,
            checkpoint_every=8,
            warmup_steps=4,
            eval_blocks=4,
        )
        base.update(overrides)
        return cls(**base)

    @property
    def special_tokens(self) -> list[str]:
        """The tokenizer's special tokens: a masked LM needs a mask token besides."""
        return [SPECIAL_TOKEN, MASK_TOKEN] if self.objective == "masked" else [SPECIAL_TOKEN]

    @property
    def split(self) -> int:
        """The seed of the train/probe split: ``split_seed``, else ``seed``. Seeds of one
        design set one ``split_seed`` so that the probe set is held out from all of them."""
        return self.seed if self.split_seed is None else self.split_seed

    @property
    def steps(self) -> list[int]:
        """The checkpoint schedule."""
        return checkpoint_steps(self.max_steps, self.last_log_step, self.checkpoint_every)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        return dataclass_from_dict(cls, d)


# --------------------------------------------------------------------------- parts
def _train_tokenizer(lines: list[str], config: TrainConfig) -> Any:
    """A byte-level BPE trained on ``lines``, wrapped as a PreTrainedTokenizerFast (with a
    ``mask_token`` for the masked objective, so ``mask_token_id`` survives a reload)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=config.special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line + "\n" for line in lines], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        unk_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
        **({"mask_token": MASK_TOKEN} if config.objective == "masked" else {}),
    )


def _new_model(config: TrainConfig, tokenizer: Any) -> Any:
    """A freshly initialised model for ``config.objective`` (from the current torch RNG)."""
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

    special = tokenizer.convert_tokens_to_ids(SPECIAL_TOKEN)
    shape = dict(  # what both architectures read from the config alike
        vocab_size=len(tokenizer),
        hidden_size=config.d_model,
        intermediate_size=config.d_mlp,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        max_position_embeddings=config.seq_len,
        tie_word_embeddings=config.tie_embeddings,
    )
    if config.objective == "masked":
        # mask_token_id in the config too: a model wrapped without its tokenizer (nnsight)
        # still finds it for loss="mlm"
        return BertForMaskedLM(
            BertConfig(
                **shape,
                hidden_dropout_prob=config.dropout,
                attention_probs_dropout_prob=config.dropout,
                pad_token_id=special,
                mask_token_id=tokenizer.mask_token_id,
            )
        )
    llama = LlamaConfig(
        **shape,
        num_key_value_heads=config.n_kv_heads,
        attention_dropout=config.dropout,
        bos_token_id=special,
        eos_token_id=special,
        pad_token_id=special,
    )
    return LlamaForCausalLM(llama)


def _inputs(config: TrainConfig, x: Tensor, mask_id: int | None, key: str) -> dict[str, Tensor]:
    """The model's inputs and labels for blocks ``x``: the next tokens (causal), or
    ``MASK_RATE`` of the positions (at least one per block) replaced by the mask token and
    predicted (masked). The mask is a pure function of (seed, ``key``), so resumed runs
    draw the same masks; its generator is its own, apart from the dropout RNG."""
    if config.objective == "causal":
        return {"input_ids": x, "labels": x}
    everywhere = torch.ones(x.shape, dtype=torch.bool)
    chosen = draw_masked(everywhere, MASK_RATE, zlib.crc32(f"mask {config.seed} {key}".encode()))
    return {"input_ids": x.masked_fill(chosen, mask_id), "labels": x.masked_fill(~chosen, -100)}


def _lr(config: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` at ``max_steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.max_steps - config.warmup_steps)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - config.warmup_steps) / span)))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cos)


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors = {f"opt.{i}.{key}": v for i, state in sd["state"].items() for key, v in state.items()}
    return tensors, {"param_groups": sd["param_groups"]}


def _load_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, Tensor], meta: dict) -> None:
    state: dict[int, dict[str, Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith("opt."):
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = value
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _atomic_dir(final: Path, fill: Callable[[Path], Any]) -> None:
    """`atomic_folder` under the trainer's temporary prefix, which `_prepare_out_dir`
    clears when a killed run left one."""
    atomic_folder(final, fill, prefix=f"{_TMP_PREFIX}{final.name}-")


def _read_json(path: Path) -> dict[str, Any]:
    return read_json(path, dict, fix="delete it and rerun")


def _prepare_out_dir(config: TrainConfig, out: Path, lock: FolderLock) -> None:
    """Claim ``out`` for this config (a run's folder: resumed, never mixed with another
    config's), clear what killed runs left, record the config."""
    cfg_path = out / CONFIG_FILE

    def same_config() -> bool:  # a run without a folder record: its config file decides
        return cfg_path.is_file() and TrainConfig.from_dict(_read_json(cfg_path)) == config

    if is_started(out) and cfg_path.is_file() and not same_config():
        saved = _read_json(cfg_path)
        diff = sorted(k for k, v in config.to_dict().items() if saved.get(k) != v)
        raise ResumeRefusedError(
            f"{out} holds a `tangentlens train` run with another configuration (differs in "
            f"{diff}): rerun with its options to resume, {RESTART}."
        )

    lock.claim(
        config.to_dict(),
        (CONFIG_FILE, STATE_FILE, TOKENIZER_DIR, "step*"),
        results=(STATE_FILE, TOKENIZER_DIR, "step*"),
        adopt=same_config,
    )
    for stale in out.glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    remove_stale_temporaries(out)
    if not same_config():
        write_json(cfg_path, config.to_dict())


# --------------------------------------------------------------------------- train
def train(
    config: TrainConfig,
    out_dir: str | Path,
    progress: bool = True,
    *,
    tokenizer_from: str | Path | None = None,
    restart: bool = TRAIN.restart.default,
) -> Path:
    """Train (or resume) a run; returns ``out_dir``, which holds ``step{N}`` checkpoints.

    ``tokenizer_from``: the ``tokenizer`` folder of a run of this config but for its seed,
    copied instead of training the tokenizer again (it is no function of the seed: same
    corpus, same tokenizer); a run that has its tokenizer already keeps it. The caller's
    torch RNG state and thread count are restored afterwards.

    A rerun resumes only the same run: another configuration, corpus text or tokenizer
    than the folder's checkpoints were trained with, or a training state written by another
    tangentlens source, is a `UsageError`. ``restart``: delete
    the folder's checkpoints first and train from step 0 (`start_over`).
    """
    out = Path(out_dir)
    with lock_folder(out, "train") as lock:
        if restart:
            start_over(out)
        _prepare_out_dir(config, out, lock)
        if not missing_steps(out, config.steps):  # finished: if on these inputs, and whole
            lines = load_lines(config.corpus, config.max_chars, config.encoding)
            check_finished(out, inputs_digest(lines, out / TOKENIZER_DIR), config.corpus)
            return out
        threads = torch.get_num_threads()
        torch.set_num_threads(config.num_threads)
        try:
            with torch.random.fork_rng(devices=[]):
                _run(config, out, progress, tokenizer_from)
        finally:
            torch.set_num_threads(threads)
    return out


def _run(config: TrainConfig, out: Path, progress: bool, tokenizer_from: str | Path | None) -> None:
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    lines = load_lines(config.corpus, config.max_chars, config.encoding)
    tok_dir = out / TOKENIZER_DIR
    if tok_dir.is_dir() and not is_started(out):
        # no checkpoint records which corpus it came from: made again (seconds), so a
        # corpus edited after a kill here cannot pair with a tokenizer of the old text
        shutil.rmtree(tok_dir)
    if not tok_dir.is_dir():
        if tokenizer_from is None:
            _atomic_dir(tok_dir, _train_tokenizer(lines, config).save_pretrained)
        else:
            source = Path(tokenizer_from)
            if not (source / "tokenizer.json").is_file():
                raise UsageError(
                    f"{source} holds no tokenizer.json; pass the tokenizer folder of a "
                    "finished run of this config (another seed), or None to train one."
                )
            _atomic_dir(tok_dir, lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True))
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    inputs = inputs_digest(lines, tok_dir)
    check_inputs(out, inputs, config.corpus)
    data = token_batches(
        tokenizer,
        config.corpus,
        ids=encoded(tokenizer, lines),
        seq_len=config.seq_len,
        probe_fraction=config.probe_fraction,
        seed=config.split,
    )
    data = dataclasses.replace(data, seed=config.seed)  # the batch order is the run's own
    mask_id = tokenizer.mask_token_id
    eval_inputs = _inputs(config, data.probe[: config.eval_blocks], mask_id, "eval")

    torch.manual_seed(config.seed)
    model = _new_model(config, tokenizer)
    opt = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )
    start = 0
    if resumable(out, config.steps):
        start = _resume(out, model, opt)

    schedule = set(config.steps)
    bar = tqdm(
        total=config.max_steps, initial=start, desc="train", disable=not progress, leave=False
    )
    for step in range(start, config.max_steps + 1):
        rng = torch.get_rng_state()  # before this step's forward: dropout replays on resume
        x = data.batch(step, config.batch_size)
        for group in opt.param_groups:
            group["lr"] = _lr(config, step)
        model.train()
        loss = model(**_inputs(config, x, mask_id, f"step {step}")).loss
        if step in schedule:
            metadata = {
                "step": step,
                "loss": loss.item(),
                "eval_loss": _eval_loss(model, eval_inputs),
                "tokens_seen": step * config.batch_size * config.seq_len,
                "lr": _lr(config, step),
                "config": config.to_dict(),
                **inputs,
                "tangentlens_version": __version__,
            }
            _checkpoint(out, step, model, tokenizer, opt, rng, metadata)
        if step == config.max_steps:
            break
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()


def _resume(out: Path, model: Any, opt: torch.optim.Optimizer) -> int:
    """Load the training state and the checkpoint it resumes from; returns its step. A
    damaged or tampered state is a `CorruptFileError` with the fix."""
    path = out / STATE_FILE
    tensors, meta = load_tensors(path)
    check_source(path, meta)
    try:
        start = int(meta["step"])
        load_resumed(out / f"step{start}", model)
        _load_optimizer(opt, tensors, json.loads(meta["optimizer"]))
        torch.set_rng_state(tensors["rng"])
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as err:
        if isinstance(err, UsageError | CorruptFileError):
            raise
        raise CorruptFileError(
            f"{path} is damaged ({type(err).__name__}: {err}); delete it and rerun: training "
            "restarts and checks every checkpoint it writes again."
        ) from err
    return start


@torch.no_grad()
def _eval_loss(model: Any, inputs: dict[str, Tensor]) -> float:
    model.eval()
    loss = float(model(**inputs).loss)
    model.train()
    return loss


def _checkpoint(
    out: Path,
    step: int,
    model: Any,
    tokenizer: Any,
    opt: torch.optim.Optimizer,
    rng: Tensor,
    metadata: dict[str, Any],
) -> None:
    """Write ``step{N}`` atomically (unless a resumed run already wrote it), then the
    training state that resumes from it."""
    weights_hash = tensor_hash(model.state_dict())
    final = out / f"step{step}"
    if final.is_dir():
        saved = read_checked_json(final / METADATA_FILE, fix="delete the folder and rerun")
        saved = saved.get("weights_hash")
        if saved != weights_hash:
            raise CorruptFileError(
                f"{final}: this run's weights there are not its {METADATA_FILE}'s weights_hash "
                "(the checkpoint changed since it was written, or another torch build or thread "
                "count made it): delete the folder and rerun train, which rebuilds it."
            )
    else:
        meta = {**metadata, "weights_hash": weights_hash}

        def fill(tmp: Path) -> None:
            with quiet_transformers():
                model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            write_checked_json(tmp / METADATA_FILE, meta)

        _atomic_dir(final, fill)
    tensors, opt_meta = _optimizer_tensors(opt)
    tensors["rng"] = rng
    inputs = {key: metadata[key] for key in INPUT_KEYS}
    state = {"step": str(step), "optimizer": json.dumps(opt_meta), **inputs}
    state[SOURCE_KEY] = source_digest()
    save_tensors(out / STATE_FILE, tensors, state)
