"""Tiny random-weight models for tests, built offline and cached per session.

Each Hugging Face architecture is saved with ``save_pretrained`` plus a small
word-level tokenizer into a folder, then booted as a TransformerLens 4.x bridge
from that folder. The plain HF folders are reused by the nnsight backend tests.

>>> from models import hf_folder, tl_bridge  # tests/ is on sys.path under pytest
>>> model = tl_bridge("llama")            # TransformerBridge, 2 layers, d_model 32
>>> folder = hf_folder("gpt2")            # a local HF folder (config, weights, tokenizer)

The fixtures ``any_model`` and ``causal_model`` yield ``(name, bridge)``; import them into
a test module (``from models import any_model  # noqa: F401``) to use them, or
parametrize over ``ALL_MODELS`` and call ``tl_bridge(name)``.
"""

from __future__ import annotations

import os
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

ARCHITECTURES = ("gpt2", "neox", "llama", "bert")
ALL_MODELS = (*ARCHITECTURES, "native")
CAUSAL = ("gpt2", "neox", "llama", "native")

D_MODEL = 32
N_LAYERS = 2
N_HEADS = 4
N_CTX = 64
SEED = 0

_SENTENCES = [
    "the cat sat on the mat",
    "a dog ran in the park and the cat ran after it",
    "in the beginning was the word and the word was with god",
    "tangent directions carry most of the gradient energy early in training",
    "small models learn fast on small data",
    "every layer writes into the residual stream",
]


def _build_tokenizer(folder: Path, *, bert: bool) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] if bert else ["<pad>", "<unk>", "<s>"]
    unk = specials[1]
    tok = Tokenizer(models.WordLevel(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(_SENTENCES, trainers.WordLevelTrainer(special_tokens=specials))
    if bert:
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
        )
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="[UNK]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
        )
    else:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>"
        )
    fast.save_pretrained(folder)
    return fast


def _hf_config(arch: str, tokenizer: Any) -> Any:
    import transformers as tf

    # special ids inside the tiny vocabulary (GPT-2's default 50256 is not)
    common = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    if arch != "bert":
        common |= {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.bos_token_id}
    if arch == "gpt2":
        return tf.GPT2Config(
            n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS, n_positions=N_CTX, **common
        )
    if arch == "neox":
        return tf.GPTNeoXConfig(
            hidden_size=D_MODEL,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS,
            intermediate_size=4 * D_MODEL,
            max_position_embeddings=N_CTX,
            rotary_pct=0.25,
            use_parallel_residual=True,
            **common,
        )
    if arch == "llama":
        return tf.LlamaConfig(
            hidden_size=D_MODEL,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS,
            num_key_value_heads=2,
            intermediate_size=2 * D_MODEL,
            max_position_embeddings=N_CTX,
            **common,
        )
    if arch == "bert":
        return tf.BertConfig(
            hidden_size=D_MODEL,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS,
            intermediate_size=4 * D_MODEL,
            max_position_embeddings=N_CTX,
            **common,
        )
    raise ValueError(f"arch must be one of {ARCHITECTURES}; got {arch!r}.")


_HF_CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "neox": "GPTNeoXForCausalLM",
    "llama": "LlamaForCausalLM",
    "bert": "BertForMaskedLM",
}


@cache
def _root() -> Path:
    return Path(tempfile.mkdtemp(prefix="tangentlens-models-"))


@cache
def hf_folder(arch: str) -> Path:
    """A local HF folder with a random-weight ``arch`` model and its tokenizer (cached)."""
    import transformers as tf

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}; got {arch!r}.")
    folder = _root() / arch
    tokenizer = _build_tokenizer(folder, bert=arch == "bert")
    config = _hf_config(arch, tokenizer)
    torch.manual_seed(SEED)
    model = getattr(tf, _HF_CLASSES[arch])(config)
    model.save_pretrained(folder)
    return folder


def hf_model(arch: str) -> Any:
    """A fresh plain HF model loaded from :func:`hf_folder` (eval mode)."""
    import transformers as tf

    return getattr(tf, _HF_CLASSES[arch]).from_pretrained(hf_folder(arch)).eval()


def native_config(**overrides: Any) -> Any:
    from transformer_lens.config import TransformerBridgeConfig

    kwargs = {
        "d_model": D_MODEL,
        "d_head": D_MODEL // N_HEADS,
        "n_heads": N_HEADS,
        "n_layers": N_LAYERS,
        "n_ctx": N_CTX,
        "d_vocab": 50,
        "d_mlp": 4 * D_MODEL,
        "act_fn": "gelu",
        "seed": SEED,
        **overrides,
    }
    return TransformerBridgeConfig(**kwargs)


@cache
def tl_bridge(arch: str) -> Any:
    """A TransformerLens bridge (cached per session): an HF arch, or ``"native"``."""
    from transformer_lens.model_bridge import TransformerBridge

    if arch == "native":
        model = TransformerBridge.boot_native(native_config())
    else:
        folder = hf_folder(arch)
        model = TransformerBridge.boot_transformers(str(folder), device="cpu")
    return model.eval()


def tokens(arch: str, batch: int = 3, pos: int = 12, seed: int = SEED) -> torch.Tensor:
    """Random token ids ``(batch, pos)`` valid for ``arch`` (no special tokens)."""
    vocab = tl_bridge(arch).cfg.d_vocab
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (batch, pos), generator=gen)


def padded_batch(arch: str, batch: int = 3, pos: int = 12, seed: int = SEED) -> dict:
    """``{"input_ids", "attention_mask"}`` with right padding on all but the first row."""
    ids = tokens(arch, batch, pos, seed)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, pos - 2 * row :] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="session", params=ALL_MODELS)
def any_model(request: pytest.FixtureRequest) -> tuple[str, Any]:
    """``(name, bridge)`` for every tiny architecture."""
    return request.param, tl_bridge(request.param)


@pytest.fixture(scope="session", params=CAUSAL)
def causal_model(request: pytest.FixtureRequest) -> tuple[str, Any]:
    """``(name, bridge)`` for every tiny causal LM."""
    return request.param, tl_bridge(request.param)
