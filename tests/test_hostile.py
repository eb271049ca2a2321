"""Hostile input, part two: artifacts edited in place (verified by content, not by name),
stale and damaged parts, temporaries of every writer, UTF-16 text, bad arguments at the
public entry points on both backends, and faults of the environment. Each case asserts
the exception type or exit code, that the message names the file or argument, and that
nothing was lost or overwritten."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from models import hf_folder, hf_model, tl_bridge, tokens
from safetensors.torch import load_file, save_file
from test_reliability import ENV, STUDY, _error, _probe, _study_again

from tangentlens.analysis.interventions import causal_effects
from tangentlens.analysis.layerwise import layerwise_probe
from tangentlens.cli import main, workflows
from tangentlens.core import digests, files
from tangentlens.core.errors import BasisWeightsWarning, CorruptFileError, UsageError
from tangentlens.core.files import check_safetensors, remove_stale_temporaries
from tangentlens.core.stats import Moments
from tangentlens.core.subspace import TangentBasis
from tangentlens.core.validation import check_encoding
from tangentlens.data.corpus import read_text_file
from tangentlens.data.train import train
from tangentlens.probes import fit_bases, run
from tangentlens.probes.bases import BasisSet
from tangentlens.study import StudyConfig
from tangentlens.study.collect import load_part, load_probe_set, stale_parts

PART = Path("parts") / "step4.safetensors"


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quick series (``series/``) and a study of it (``study/``), made by the CLI."""
    root = tmp_path_factory.mktemp("world")
    train(workflows.train_config(quick=True), root / "series", progress=False)
    out = str(root / "study")
    assert main(["study", "--checkpoints", str(root / "series"), "--out", out, *STUDY]) == 0
    return root


def _snapshot(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (the lock file aside): what must survive."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != files.LOCK_FILE
    }


def _tamper(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Edit a safetensors file's tensors and save it again with its old header (hash
    included), as a hand edit with safetensors would."""
    tensors = load_file(str(path))
    header = check_safetensors(path).get("__metadata__", {})
    change(tensors)
    save_file(tensors, str(path), metadata=header)


def _times3(tensors: dict[str, torch.Tensor]) -> None:
    key = next(k for k in tensors if k.startswith("gradient/grad/") and k.endswith("/scatter"))
    tensors[key] = tensors[key] * 3


def _float16(tensors: dict[str, torch.Tensor]) -> None:
    for key, t in tensors.items():
        if t.is_floating_point():
            tensors[key] = t.half()


def _swap_tokens(tensors: dict[str, torch.Tensor]) -> None:
    tokens = tensors["tokens"]
    tensors["tokens"] = torch.where(tokens == tokens[0, 0], tokens[0, 1], tokens)


def _flip_basis(tensors: dict[str, torch.Tensor]) -> None:
    key = next(k for k in tensors if k.endswith("/basis"))
    tensors[key] = -tensors[key]  # still orthonormal: only the content hash tells


def _copy_study(w: Path, tmp: Path) -> Path:
    out = tmp / "study"
    shutil.copytree(w / "study", out)
    return out


def _cfg(w: Path) -> StudyConfig:
    return workflows.study_config(str(w / "series"), quick=True, rank=4)


# ------------------------------------------------------- 1. verified by content, not name
TAMPERED_API: dict[str, tuple[Callable[[Path], Any], str, Callable[[dict], None]]] = {
    "part scaled by 3": (load_part, str(PART), _times3),
    "part re-saved as float16": (load_part, str(PART), _float16),
    "probe set with other valid tokens": (
        lambda p: load_probe_set(p, StudyConfig(checkpoints="x")),
        "probe_set.safetensors",
        _swap_tokens,
    ),
    "bases with a flipped basis": (BasisSet.load, "bases/rank4.safetensors", _flip_basis),
}


@pytest.mark.parametrize("name", list(TAMPERED_API))
def test_a_tampered_artifact_is_refused_by_content(name: str, world: Path, tmp_path: Path) -> None:
    load, rel, change = TAMPERED_API[name]
    path = _copy_study(world, tmp_path) / rel
    _tamper(path, change)
    before = path.read_bytes()
    with pytest.raises(CorruptFileError) as err:
        load(path)
    assert path.name in str(err.value) and "delete it" in str(err.value)
    assert path.read_bytes() == before  # refused, not deleted or rewritten


def test_a_tampered_tangent_basis_file_is_refused(tmp_path: Path) -> None:
    path = TangentBasis(torch.linalg.qr(torch.randn(8, 2, dtype=torch.float64))[0]).save(
        tmp_path / "basis.safetensors"
    )
    _tamper(path, lambda ts: ts.update(basis=-ts["basis"]))
    with pytest.raises(CorruptFileError, match=r"basis\.safetensors"):
        TangentBasis.load(path)


@pytest.mark.parametrize(
    ("rel", "change"),
    [(str(PART), _times3), (str(PART), _float16), ("probe_set.safetensors", _swap_tokens)],
    ids=["part x3", "part float16", "probe set tokens"],
)
def test_a_study_rerun_refuses_a_tampered_file_and_keeps_everything(
    rel: str, change: Callable[[dict], None], world: Path, tmp_path: Path, capsys: Any
) -> None:
    out = _copy_study(world, tmp_path)
    _tamper(out / rel, change)
    before = _snapshot(out)
    line = _error(_study_again(world, out), capsys)
    assert Path(rel).name in line and "delete it" in line
    after = _snapshot(out)
    assert set(before) <= set(after) and after[rel] == before[rel]  # nothing lost


def test_save_tensors_records_the_hash_and_load_hides_it(tmp_path: Path) -> None:
    path = files.save_tensors(tmp_path / "x.safetensors", {"a": torch.arange(4)}, {"k": "v"})
    assert check_safetensors(path)["__metadata__"][files.CONTENT_KEY]
    tensors, meta = files.load_tensors(path, verified=True)
    assert meta == {"k": "v"} and tensors["a"].tolist() == [0, 1, 2, 3]
    header = check_safetensors(path)["__metadata__"]
    save_file(load_file(str(path)), str(path), metadata={**header, "k": "w"})  # edited beside
    with pytest.raises(CorruptFileError, match=r"x\.safetensors was changed.*metadata"):
        files.load_tensors(path)
    save_file({"a": torch.arange(4)}, str(path), metadata={"k": "v"})  # no hash
    assert files.load_tensors(path)[1] == {"k": "v"}
    with pytest.raises(CorruptFileError, match=r"x\.safetensors"):
        files.load_tensors(path, verified=True)


def test_checked_json_refuses_an_edit_and_reads_a_file_without_a_digest(tmp_path: Path) -> None:
    record = {"claims": [{"value": 3.08, "seeds": (0, 1)}], "step": 4}
    path = files.write_checked_json(tmp_path / "s.json", record)
    assert files.read_checked_json(path) == {
        "claims": [{"value": 3.08, "seeds": [0, 1]}],
        "step": 4,
    }
    path.write_text(path.read_text().replace("3.08", "9.08"))
    with pytest.raises(CorruptFileError, match=r"s\.json was changed"):
        files.read_checked_json(path)
    files.write_json(path, {"a": 1})  # another tool's file: no digest to check
    assert files.read_checked_json(path) == {"a": 1}


def test_load_tensors_of_a_folder_names_it(tmp_path: Path) -> None:
    (tmp_path / "x.safetensors").mkdir()
    with pytest.raises(CorruptFileError, match=r"x\.safetensors"):
        files.load_tensors(tmp_path / "x.safetensors")


@pytest.mark.parametrize(("value", "word"), [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_a_part_with_nan_in_its_embedding_names_the_file(
    value: float, word: str, world: Path, tmp_path: Path
) -> None:
    path = _copy_study(world, tmp_path) / PART

    def nan(ts: dict) -> None:
        ts["embed"][0, 0] = value

    _tamper(path, nan)
    header = check_safetensors(path)["__metadata__"]
    header[files.CONTENT_KEY] = digests.tensor_hash(load_file(str(path)))  # a consistent hash
    header[files.METADATA_KEY] = files.metadata_hash(header)
    save_file(load_file(str(path)), str(path), metadata=header)
    with pytest.raises(CorruptFileError) as err:
        load_part(path)
    assert "step4.safetensors" in str(err.value) and word in str(err.value)
    assert "delete it" in str(err.value) and "model" not in str(err.value)


def test_a_part_path_that_is_a_folder_is_named(world: Path, tmp_path: Path, capsys: Any) -> None:
    out = _copy_study(world, tmp_path)
    (out / PART).unlink()
    (out / PART).mkdir()
    line = _error(_study_again(world, out), capsys)
    assert "step4.safetensors" in line and "delete it" in line
    assert (out / PART).is_dir()


# ------------------------------------------------------- 2. a changed checkpoint recomputes
class _Ckpt:
    def __init__(self, step: int, weights: str | None) -> None:
        self.step, self.metadata, self.source = step, {"weights_hash": weights}, f"step{step}"


def test_a_corpus_edited_in_place_makes_another_probe_set(world: Path, tmp_path: Path) -> None:
    """A probe set records the text it was cut from, not only the corpus's path: the same
    file edited in place is cut again (and every part, keyed by the probe tokens, with it)."""
    from dataclasses import replace

    from tangentlens.data import corpus
    from tangentlens.study.collect import probe_set
    from tangentlens.study.config import open_series

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(corpus.load_lines(None, 300_000)), encoding="utf-8")
    cfg = replace(_cfg(world), corpus=str(text))
    series, out = open_series(cfg.checkpoints), tmp_path / "out"
    out.mkdir()
    before, _ = probe_set(cfg, series, out)
    assert torch.equal(load_probe_set(out / "probe_set.safetensors", cfg)[0], before)
    text.write_text(text.read_text(encoding="utf-8").replace("God", "Dog"), encoding="utf-8")
    assert load_probe_set(out / "probe_set.safetensors", cfg) is None  # not this text's
    after, _ = probe_set(cfg, series, out)
    assert not torch.equal(before, after)


def test_a_part_of_retrained_weights_or_without_a_hash_is_recomputed(
    world: Path, tmp_path: Path
) -> None:
    out = _copy_study(world, tmp_path)
    cfg = _cfg(world)
    probe_tokens = load_probe_set(out / "probe_set.safetensors", cfg)
    assert probe_tokens is not None
    steps = sorted(int(p.stem.removeprefix("step")) for p in (out / "parts").glob("step*"))
    metas = {s: load_part(out / "parts" / f"step{s}.safetensors").meta for s in steps}
    series = [_Ckpt(s, metas[s]["weights_hash"]) for s in steps]
    assert stale_parts(cfg, series, out, probe_tokens[0]) == []
    series[1] = _Ckpt(steps[1], "0" * 64)  # retrained in place: the checkpoint says so
    unhashed = out / "parts" / f"step{steps[2]}.safetensors"
    save_file(load_file(str(unhashed)), str(unhashed), metadata={
        k: v for k, v in check_safetensors(unhashed)["__metadata__"].items()
        if k != files.CONTENT_KEY})  # fmt: skip
    assert stale_parts(cfg, series, out, probe_tokens[0]) == [1, 2]
    assert not (out / "parts" / f"step{steps[1]}.safetensors").exists()
    assert not unhashed.exists()
    assert (out / "parts" / f"step{steps[0]}.safetensors").exists()


def test_a_checkpoint_whose_metadata_lies_names_the_checkpoint_and_the_fix() -> None:
    from tangentlens.study.collect import check_parts_match

    class _P:
        def __init__(self) -> None:
            self.meta = {"weights_hash": "a" * 64}

    with pytest.raises(CorruptFileError) as err:
        check_parts_match([_Ckpt(4, "b" * 64)], {4: _P()})
    assert "step4" in str(err.value) and "restore" in str(err.value)
    assert "new output folder" not in str(err.value)


# ------------------------------------------------------------------ 3. every temporary
def test_every_writers_temporaries_are_cleared(tmp_path: Path) -> None:
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / ".tmpA1b2C3").write_bytes(b"half")  # safetensors' own temporary
    (parts / ".step4.safetensors.x1.tmp").write_bytes(b"half")  # atomic_write's
    (tmp_path / ".bases.ab12.tmp").mkdir()  # atomic_folder's
    (tmp_path / ".bases.ab12.tmp" / "x").write_bytes(b"half")
    (tmp_path / "keep.safetensors").write_bytes(b"mine")
    assert remove_stale_temporaries(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["keep.safetensors", "parts"]


def test_a_study_rerun_clears_safetensors_temporaries(world: Path, tmp_path: Path) -> None:
    out = _copy_study(world, tmp_path)
    (out / "parts" / ".tmpXy12Zw").write_bytes(b"half a part")
    before = _snapshot(out)
    assert main(_study_again(world, out)) == 0
    assert not list(out.rglob(".tmp*"))
    assert all((out / k).is_file() for k in before if ".tmp" not in k)


# ---------------------------------------------------------------------- 4. UTF-16 text
@pytest.mark.parametrize("codec", ["utf-16", "utf-16-le", "utf-16-be"])
def test_utf16_text_is_named_with_its_encoding(codec: str, tmp_path: Path) -> None:
    path = tmp_path / "input.txt"
    path.write_bytes("In the beginning was the Word.\n".encode(codec) * 20)
    with pytest.raises(UsageError) as err:
        read_text_file(path)
    assert "input.txt" in str(err.value) and "--encoding utf-16" in str(err.value)
    assert "binary" not in str(err.value)
    assert read_text_file(path, "utf-16" if codec == "utf-16" else codec).startswith("In")


def test_text_a_codec_cannot_decode_names_the_file_and_the_option(tmp_path: Path) -> None:
    """punycode fails with a UnicodeError that has no byte offset: still the file and the fix."""
    path = tmp_path / "input.txt"
    path.write_text("In the beginning was the Word — ünïcödé.\n", encoding="utf-8")
    with pytest.raises(UsageError) as err:
        read_text_file(path, "punycode")
    assert "input.txt" in str(err.value) and "--encoding" in str(err.value)


def test_cli_probe_of_utf16_text_names_the_option(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "input.txt"
    path.write_bytes("In the beginning was the Word.\n".encode("utf-16") * 50)
    line = _error(_probe(hf_folder("llama"), tmp_path / "o", "--text", str(path)), capsys)
    assert "input.txt" in line and "--encoding utf-16" in line


@pytest.mark.parametrize("encoding", ["undefined", "base64", "rot13"])
def test_encodings_that_read_no_text_are_refused(encoding: str) -> None:
    with pytest.raises(UsageError, match="encoding"):
        check_encoding(encoding, "--encoding")


# ------------------------------------------------------------ 5. the public entry points
@pytest.fixture(scope="module")
def llama() -> dict[str, Any]:
    """The tiny Llama on both backends, bases fitted on it, and clean token ids."""
    import nnsight

    bridge = tl_bridge("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn_model = nnsight.NNsight(hf_model("llama"))
    ids = tokens("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bases = fit_bases(bridge, [ids, ids], rank=2, progress=False)
    return {"transformer_lens": bridge, "nnsight": nn_model, "ids": ids, "bases": bases}


def _mask(ids: torch.Tensor, value: float) -> dict[str, torch.Tensor]:
    mask = torch.ones(ids.shape)
    mask[0, -1] = value
    return {"input_ids": ids, "attention_mask": mask}


BAD_BATCHES: dict[str, tuple[Callable[[torch.Tensor], Any], tuple[str, ...]]] = {
    "ids past the vocabulary": (lambda t: t + 10**5, ("batches", "vocabulary")),
    "negative ids": (lambda t: t - 100, ("batches", "vocabulary")),
    "bool ids": (lambda t: t > 10, ("bool",)),
    "no batches": (lambda t: [], ("batches",)),
    "a (0, n) batch": (lambda t: t[:0], ("no tokens",)),
    "longer than the context": (
        lambda t: torch.full((1, 100_000), 5, dtype=torch.long), ("batches", "seq_len")),
    "mask of zeros": (
        lambda t: {"input_ids": t, "attention_mask": torch.zeros_like(t)}, ("attention_mask",)),
    "mask holding 2": (lambda t: _mask(t, 2), ("attention_mask", "2")),
    "mask holding -1": (lambda t: _mask(t, -1), ("attention_mask", "-1")),
    "mask holding NaN": (lambda t: _mask(t, float("nan")), ("attention_mask", "nan")),
}  # fmt: skip


@pytest.mark.parametrize("backend", ["transformer_lens", "nnsight"])
@pytest.mark.parametrize("name", list(BAD_BATCHES))
def test_run_refuses_bad_batches(name: str, backend: str, llama: dict[str, Any]) -> None:
    make, needles = BAD_BATCHES[name]
    with pytest.raises(UsageError) as err:
        run(llama[backend], make(llama["ids"]), llama["bases"], ("residual",), progress=False)
    for needle in needles:
        assert needle in str(err.value), (name, str(err.value))


@pytest.mark.parametrize("name", ["ids past the vocabulary", "no batches", "mask holding 2"])
def test_fit_bases_refuses_bad_batches(name: str, llama: dict[str, Any]) -> None:
    make, needles = BAD_BATCHES[name]
    with pytest.raises(UsageError, match=needles[0]):
        fit_bases(llama["transformer_lens"], make(llama["ids"]), rank=2, progress=False)


def test_ids_of_another_tokenizer_are_refused(world: Path, llama: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(world / "series" / "tokenizer")
    text = "In the beginning God created the heaven and the earth. " * 4
    ids = torch.tensor([other(text)["input_ids"]])
    assert int(ids.max()) >= 41  # the trainer's 320 tokens against the tiny Llama's
    with pytest.raises(UsageError, match="tokenizer"):
        run(llama["nnsight"], ids, llama["bases"], ("residual",), progress=False)


@pytest.mark.parametrize("layers", [True, [0, True], "0", 7])
def test_layers_must_be_ints(layers: Any, llama: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match="layers"):
        run(llama["transformer_lens"], llama["ids"], llama["bases"], ("residual",),
            layers=layers, progress=False)  # fmt: skip


def test_layerwise_probe_layers_true(llama: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match="layers"):
        layerwise_probe(llama["transformer_lens"], llama["ids"], llama["bases"], "position",
                        layers=True, progress=False)  # fmt: skip


def test_causal_effects_refuses_empty_batches_and_a_basis_of_another_site(
    llama: dict[str, Any],
) -> None:
    bases = llama["bases"]
    with pytest.raises(UsageError, match="batches"):
        causal_effects(llama["transformer_lens"], [], bases, progress=False)
    moved = {"blocks.1.hook_resid_pre": bases["blocks.0.hook_resid_pre"]}
    with pytest.raises(UsageError) as err:
        causal_effects(llama["transformer_lens"], llama["ids"], moved, progress=False)
    assert "blocks.1.hook_resid_pre" in str(err.value) and "fit_bases" in str(err.value)


def test_absurd_moments_width_names_the_memory() -> None:
    with pytest.raises(UsageError) as err:
        Moments(d=10**7)
    assert "d=10,000,000" in str(err.value) and "GiB" in str(err.value)


def _fresh_llama(nan: bool = False, seed: int | None = None) -> Any:
    """Another copy of the tiny Llama under nnsight: NaN embeddings, or other weights of
    the same shapes."""
    import nnsight
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_folder("llama"))
    if nan:
        with torch.no_grad():
            model.get_input_embeddings().weight.fill_(float("nan"))
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nnsight.NNsight(model)


def test_nan_activations_with_the_residual_probe_name_the_site(llama: dict[str, Any]) -> None:
    with pytest.raises(UsageError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore", BasisWeightsWarning)  # NaN embeddings: other weights
        run(_fresh_llama(nan=True), llama["ids"], llama["bases"], ("residual",), progress=False)
    assert "hook_resid" in str(err.value) or "hook_" in str(err.value)
    assert "NaN" in str(err.value)


def test_bases_of_other_weights_warn_and_the_warning_is_the_override(
    llama: dict[str, Any],
) -> None:
    model = _fresh_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        own = fit_bases(model, [llama["ids"]] * 2, rank=2, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BasisWeightsWarning)
        run(model, llama["ids"], own, ("residual",), progress=False)  # its own: silent
    other = _fresh_llama(seed=1)
    with pytest.warns(BasisWeightsWarning, match="fit_bases"):
        run(other, llama["ids"], own, ("residual",), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BasisWeightsWarning)  # the override
        assert run(other, llama["ids"], own, ("residual",), progress=False).results() is not None


def test_one_model_hashes_alike_under_both_backends(llama: dict[str, Any]) -> None:
    import nnsight

    from tangentlens.hooks.families import unwrap
    from tangentlens.probes.bases import weights_hash

    bridge = llama["transformer_lens"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        same = nnsight.NNsight(unwrap(bridge))  # the bridge's own HF model, under nnsight
    assert weights_hash(bridge) == weights_hash(same)
    assert weights_hash(same) != weights_hash(_fresh_llama(seed=2))


# --------------------------------------------------------- 6. faults of the environment
def _llama_copy(tmp: Path) -> Path:
    folder = tmp / "model"
    shutil.copytree(hf_folder("llama"), folder)
    return folder


def _edit_config(tmp: Path, change: Callable[[dict], dict]) -> Path:
    folder = _llama_copy(tmp)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(change(config)))
    return folder


def _bad_tokenizer(tmp: Path) -> Path:
    folder = _llama_copy(tmp)
    (folder / "tokenizer.json").write_text("{not json")
    return folder


MODEL_FOLDERS: dict[str, tuple[Callable[[Path], Path], tuple[str, ...]]] = {
    "corrupt tokenizer.json": (_bad_tokenizer, ("tokenizer.json", "restore")),
    "config.json is {}": (lambda t: _edit_config(t, lambda c: {}), ("config.json", "model_type")),
    "remote code": (
        lambda t: _edit_config(t, lambda c: {**c, "auto_map": {"AutoModel": "m.M"}}),
        ("remote code", "auto_map", "trust_remote_code")),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MODEL_FOLDERS))
def test_a_hostile_model_folder_is_one_line(name: str, tmp_path: Path, capsys: Any) -> None:
    make, needles = MODEL_FOLDERS[name]
    folder = make(tmp_path)
    before = _snapshot(folder)
    line = _error(_probe(folder, tmp_path / "out"), capsys)
    for needle in needles:
        assert needle in line, (name, line)
    assert _snapshot(folder) == before


ARGUMENTS: dict[str, tuple[Callable[[Path, Path], list[str]], tuple[str, ...]]] = {
    "--max-steps 10**12": (
        lambda w, t: ["train", "--quick", "--out", str(t / "o"), "--max-steps", str(10**12)],
        ("max_steps", "at most")),
    "probe --n-controls 10**9": (
        lambda w, t: _probe(hf_folder("llama"), t / "o", "--n-controls", str(10**9)),
        ("--n-controls", "at most")),
    "study --n-controls 10**9": (
        lambda w, t: _study_again(w, t / "o", "--n-controls", str(10**9)),
        ("n_controls", "at most")),
    "--encoding undefined": (
        lambda w, t: ["train", "--quick", "--out", str(t / "o"), "--encoding", "undefined"],
        ("--encoding", "undefined")),
    "a 300-character --out": (
        lambda w, t: _probe(hf_folder("llama"), t / ("x" * 300)), ("x" * 50, "--out")),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ARGUMENTS))
def test_an_absurd_argument_is_one_line(
    name: str, world: Path, tmp_path: Path, capsys: Any
) -> None:
    make, needles = ARGUMENTS[name]
    line = _error(make(world, tmp_path), capsys)
    for needle in needles:
        assert needle in line, (name, line)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").rglob("*.csv"))


@pytest.mark.parametrize(
    "code", [errno.ENAMETOOLONG, errno.EMFILE, errno.ENFILE, errno.EISDIR], ids=errno.errorcode.get
)
def test_environment_errnos_are_one_line_naming_the_fix(
    code: int, world: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError(code, os.strerror(code), str(tmp_path / "report.html"))

    monkeypatch.setattr(workflows, "render_report", fail)
    line = _error(["report", str(world / "study"), "--out", str(tmp_path / "r.html")], capsys)
    assert "report.html" in line and os.strerror(code) in line


def test_missing_matplotlib_is_one_line(world: Path, tmp_path: Path) -> None:
    script = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from tangentlens.cli import main\n"
        f"sys.exit(main(['report', {str(world / 'study')!r}, '--out', "
        f"{str(tmp_path / 'r.html')!r}, '-q']))\n"
    )
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert "matplotlib" in lines[-1] and "pip install matplotlib" in lines[-1]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "r.html").exists()
