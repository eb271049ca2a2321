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

``FAMILIES`` covers every architecture the paper and current models use (``ENCODERS``
are bidirectional; ``BRIDGE_FAMILIES`` the ones a TransformerLens 4.3 bridge boots).
``sharp=True`` builds them with O(1) scores (init std 0.2, random biases and norm
weights, 12-token windows cut by small sliding windows), so exactness checks see
non-uniform patterns, every bias and norm, and masked local attention:

>>> folder = hf_folder("gemma3", sharp=True)   # q/k norms, sliding layer 0, global layer 1
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
FAMILIES = (
    *ARCHITECTURES,
    "roberta",
    "qwen2",
    "olmo",
    "mistral",
    "gemma3",
    "qwen3",
    "olmo2",
    "gptj",
    "eurobert",
    "modernbert",
)
ENCODERS = ("bert", "roberta", "eurobert", "modernbert")
BRIDGE_FAMILIES = tuple(f for f in FAMILIES if f not in ("eurobert", "modernbert"))
WINDOW = 4  # sliding window of the sharp families' local layers (ModernBERT: |q − k| ≤ 4)

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


def _hf_config(arch: str, tokenizer: Any, sharp: bool = False) -> Any:
    import transformers as tf

    # special ids inside the tiny vocabulary (GPT-2's default 50256 is not)
    common: dict[str, Any] = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    if arch not in ENCODERS:
        common |= {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.bos_token_id}
    elif arch != "bert":
        common |= {"bos_token_id": tokenizer.cls_token_id, "eos_token_id": tokenizer.sep_token_id}
    if sharp:
        common["initializer_range"] = 0.2
    if arch in FAMILIES[len(ARCHITECTURES) :]:
        return _family_config(arch, tokenizer, common)
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


def _family_config(arch: str, tokenizer: Any, common: dict[str, Any]) -> Any:
    """The families beyond the original four: GQA where the family has it, partial rotary
    (GPT-J), q/k norms (Qwen3, Gemma 3, OLMo 2), sliding windows (Mistral on every layer;
    Qwen2 and Gemma 3 on layer 0 or 1; ModernBERT's local layer 1 of 3)."""
    import transformers as tf

    shape = {
        "hidden_size": D_MODEL,
        "num_hidden_layers": N_LAYERS,
        "num_attention_heads": N_HEADS,
        "intermediate_size": 2 * D_MODEL,
        "max_position_embeddings": N_CTX,
        **common,
    }
    gqa = {"num_key_value_heads": 2}
    encoder_ids = {
        "mask_token_id": tokenizer.mask_token_id,
        "cls_token_id": tokenizer.cls_token_id,
        "sep_token_id": tokenizer.sep_token_id,
    }
    if arch == "roberta":
        return tf.RobertaConfig(**shape)
    if arch == "qwen2":
        window = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}
        return tf.Qwen2Config(**shape, **gqa, **window)
    if arch == "olmo":
        return tf.OlmoConfig(**shape)
    if arch == "mistral":
        return tf.MistralConfig(**shape, **gqa, sliding_window=WINDOW)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            **shape,
            **gqa,
            head_dim=D_MODEL // N_HEADS,
            query_pre_attn_scalar=D_MODEL // N_HEADS,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        )
    if arch == "qwen3":
        return tf.Qwen3Config(**shape, **gqa, head_dim=D_MODEL // N_HEADS)
    if arch == "olmo2":
        return tf.Olmo2Config(**shape, **gqa)
    if arch == "gptj":
        return tf.GPTJConfig(
            n_embd=D_MODEL,
            n_layer=N_LAYERS,
            n_head=N_HEADS,
            n_positions=N_CTX,
            rotary_dim=4,
            **common,
        )
    if arch == "eurobert":
        return tf.EuroBertConfig(**shape, **gqa, mask_token_id=tokenizer.mask_token_id)
    if arch == "modernbert":
        return tf.ModernBertConfig(
            **{**shape, "num_hidden_layers": 3},
            **encoder_ids,
            local_attention=2 * WINDOW,
            global_attn_every_n_layers=2,
        )
    raise ValueError(f"arch must be one of {FAMILIES}; got {arch!r}.")


_HF_CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "neox": "GPTNeoXForCausalLM",
    "llama": "LlamaForCausalLM",
    "bert": "BertForMaskedLM",
    "roberta": "RobertaForMaskedLM",
    "qwen2": "Qwen2ForCausalLM",
    "olmo": "OlmoForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gptj": "GPTJForCausalLM",
    "eurobert": "EuroBertForMaskedLM",
    "modernbert": "ModernBertForMaskedLM",
}


@cache
def _root() -> Path:
    return Path(tempfile.mkdtemp(prefix="tangentlens-models-"))


@torch.no_grad()
def _randomize_affine(model: torch.nn.Module, seed: int) -> None:
    """Random biases (std 0.2) and norm weights (1 ± 0.2; Gemma's offset ones ± 0.2)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        elif p.ndim == 1 and ("ln" in name or "norm" in name.lower()):
            offset = 0.0 if "gemma" in type(model).__name__.lower() else 1.0
            p.copy_(offset + 0.2 * torch.randn(p.shape, generator=gen))


def hf_folder(arch: str, sharp: bool = False) -> Path:
    """A local HF folder with a random-weight ``arch`` model and its tokenizer (cached)."""
    return _folder(arch, bool(sharp))


@cache
def _folder(arch: str, sharp: bool) -> Path:
    import transformers as tf

    if arch not in FAMILIES:
        raise ValueError(f"arch must be one of {FAMILIES}; got {arch!r}.")
    folder = _root() / (f"{arch}-sharp" if sharp else arch)
    tokenizer = _build_tokenizer(folder, bert=arch in ENCODERS)
    config = _hf_config(arch, tokenizer, sharp)
    torch.manual_seed(SEED)
    model = getattr(tf, _HF_CLASSES[arch])(config)
    if sharp:
        _randomize_affine(model, seed=SEED + 1)
    model.save_pretrained(folder)
    return folder


def hf_model(arch: str, sharp: bool = False) -> Any:
    """A fresh plain HF model loaded from :func:`hf_folder` (eval mode; sharp ones with eager
    attention, whose weights ``output_attentions`` returns)."""
    import transformers as tf

    cls = getattr(tf, _HF_CLASSES[arch])
    kwargs = {"attn_implementation": "eager"} if sharp else {}
    return cls.from_pretrained(hf_folder(arch, sharp), **kwargs).eval()


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


def tl_bridge(arch: str, sharp: bool = False) -> Any:
    """A TransformerLens bridge (cached per session): an HF arch, or ``"native"``."""
    return _bridge(arch, bool(sharp))


@cache
def _bridge(arch: str, sharp: bool) -> Any:
    from transformer_lens.model_bridge import TransformerBridge

    if arch == "native":
        model = TransformerBridge.boot_native(native_config())
    else:
        folder = hf_folder(arch, sharp)
        model = TransformerBridge.boot_transformers(str(folder), device="cpu")
    return model.eval()


def tokens(arch: str, batch: int = 3, pos: int = 12, seed: int = SEED) -> torch.Tensor:
    """Random token ids ``(batch, pos)`` valid for ``arch`` (no special tokens)."""
    if arch in ALL_MODELS:
        vocab = tl_bridge(arch).cfg.d_vocab
    else:
        import transformers as tf

        vocab = tf.AutoConfig.from_pretrained(hf_folder(arch)).vocab_size
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
