"""CheckpointSeries: loaders, windows, hashing, duplicate flags and bad input."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from tangentlens import probes
from tangentlens.core.errors import CorruptFileError, UnstableBasisWarning
from tangentlens.data.checkpoints import Checkpoint, CheckpointSeries, _hf_loader, parse_step
from tangentlens.data.corpus import encode, load_lines
from tangentlens.data.train import TrainConfig, train
from tangentlens.models import loading as models


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return train(TrainConfig.tiny(), tmp_path_factory.mktemp("run"), progress=False)


@pytest.fixture(scope="module")
def masked_run(tmp_path_factory) -> Path:
    config = TrainConfig.tiny(objective="masked")
    return train(config, tmp_path_factory.mktemp("masked"), progress=False)


def _fake_series(n: int, steps: list[int] | None = None) -> CheckpointSeries:
    steps = steps or list(range(n))
    return CheckpointSeries([Checkpoint(s, f"fake/{s}") for s in steps])


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_parse_step():
    assert parse_step("step1000") == 1000
    assert parse_step("checkpoint-64") == 64
    assert parse_step("step_3") == 3
    assert parse_step("main") is None and parse_step("steps") is None
    assert parse_step("ckpt-7", "ckpt-{step}") == 7 and parse_step("step7", "ckpt-{step}") is None


def test_trainer_output_loads_and_hashes_match_metadata(run):
    series = CheckpointSeries.from_folder(run)
    assert series.steps == TrainConfig.tiny().steps
    assert "loss" in series[0].metadata and series[-1].metadata["step"] == series.steps[-1]
    loaded = series.load(len(series) - 1)
    assert loaded.step == series.steps[-1]
    assert loaded.weights_hash == series[-1].metadata["weights_hash"]
    assert loaded.tokenizer("In the beginning")["input_ids"]
    assert loaded.duplicate_of is None and loaded.backend_model is None


def test_hf_checkpoint_folders_with_parent_tokenizer(run, tmp_path):
    for step in (0, 8, 16):
        dst = tmp_path / f"checkpoint-{step}"
        shutil.copytree(run / f"step{step}", dst)
        for name in ("tokenizer.json", "tokenizer_config.json", "tangentlens.json"):
            (dst / name).unlink()
    shutil.copytree(run / "tokenizer", tmp_path, dirs_exist_ok=True)
    (tmp_path / "notes").mkdir()
    series = CheckpointSeries.from_folder(tmp_path)
    assert series.steps == [0, 8, 16] and series[1].metadata == {}
    loaded = series.load(series.index(8))
    assert len(loaded.tokenizer) == loaded.model.config.vocab_size


def test_a_checkpoint_tokenizer_that_does_not_load_names_its_folder(run, tmp_path):
    """tokenizer.json deleted beside the tokenizer's config: one line naming the folder,
    not the tokenizer library's error."""
    series_dir = Path(shutil.copytree(run, tmp_path / "run"))
    (series_dir / "step8" / "tokenizer.json").unlink()
    series = CheckpointSeries.from_folder(series_dir)
    with pytest.raises(CorruptFileError, match="step8") as err:
        series.load_tokenizer(series.index(8))
    assert "restore them" in _one_line(err)


def test_windows_by_index_and_by_step():
    series = _fake_series(7, [0, 1, 2, 4, 8, 16, 32])
    # by step (default): steps <= 9.6 and >= 22.4, the late one widened to two checkpoints
    assert series.windows() == {"early": [0, 1, 2, 3, 4], "late": [5, 6]}
    assert series.windows(by="index") == {"early": [0, 1, 2], "late": [4, 5, 6]}
    # never overlapping, even when half of an odd count rounds up
    assert series.windows(0.5, by="index") == {"early": [0, 1, 2], "late": [4, 5, 6]}
    with pytest.raises(ValueError, match="--window-fraction"):  # 0.5 by step: 16 in both
        series.windows(0.5)
    even = _fake_series(5, [0, 2, 4, 6, 8])  # the midpoint is early's alone
    assert even.windows(0.5) == {"early": [0, 1, 2], "late": [3, 4]}
    with pytest.raises(ValueError, match="share steps"):
        series.windows(early=(0, 8), late=(8, 32))
    ranged = series.windows(early=(0, 1), late=(10, 100), by="index")
    assert ranged == {"early": [0, 1], "late": [5, 6]}
    with pytest.raises(ValueError, match="at least 2") as err:
        _fake_series(3).windows(0.3)
    assert "add checkpoints" in _one_line(err)
    with pytest.raises(ValueError, match="at least 2"):
        series.windows(late=(30, 40))
    with pytest.raises(ValueError, match="do not overlap"):
        series.windows(0.6)
    with pytest.raises(ValueError, match="not in the series"):
        series.index(3)


def test_identical_weights_under_different_steps_are_flagged(run, tmp_path):
    for step in (0, 8, 16):
        shutil.copytree(run / f"step{step}", tmp_path / f"step{step}")
    shutil.copytree(run / "step8", tmp_path / "step12")
    series = CheckpointSeries.from_folder(tmp_path)
    hashes = series.hash_all(progress=False)
    assert hashes[8] == hashes[12] != hashes[16]
    assert series.duplicates() == {12: 8}
    assert series.load(series.index(12)).duplicate_of == 8
    assert series.load(series.index(8)).duplicate_of is None


def test_hub_revisions_offline_with_injected_loader(run):
    listed = ["main", "step0", "step16", "step8", "refs/pr/1"]
    seen: list[tuple[str, str | None]] = []

    def loader(ckpt: Checkpoint):
        seen.append((ckpt.source, ckpt.revision))
        return _hf_loader(Checkpoint(ckpt.step, str(run / ckpt.revision)))

    series = CheckpointSeries.from_hub(
        "EleutherAI/pythia-14m", loader=loader, list_revisions=lambda repo: listed
    )
    assert series.steps == [0, 8, 16]
    assert [c.revision for c in series] == ["step0", "step8", "step16"]
    loaded = series.load(1)
    assert seen == [("EleutherAI/pythia-14m", "step8")]
    assert (
        loaded.weights_hash
        == json.loads((run / "step8" / "tangentlens.json").read_text())["weights_hash"]
    )
    chosen = CheckpointSeries.from_hub("org/m", [100, 5], revision_format="ckpt-{step}")
    assert [(c.step, c.revision) for c in chosen] == [(5, "ckpt-5"), (100, "ckpt-100")]
    with pytest.raises(ValueError, match="no revisions named like"):
        CheckpointSeries.from_hub("org/m", list_revisions=lambda repo: ["main"])
    with pytest.raises(ValueError, match="lacks"):
        CheckpointSeries.from_hub("org/m", [1], revision_format="v1")
    wrapped = series.load(0, backend="nnsight")  # wrapped in memory: no second load
    assert wrapped.backend_model._module is wrapped.model


def test_bad_input_gives_one_line_errors(run, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        CheckpointSeries.from_folder(tmp_path / "missing")
    _one_line(err)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no checkpoints in") as err:
        CheckpointSeries.from_folder(tmp_path / "empty")
    _one_line(err)
    with pytest.raises(ValueError, match="single checkpoint; pass its parent"):
        CheckpointSeries.from_folder(run / "step0")

    mixed = tmp_path / "mixed"
    for step in (0, 8):
        shutil.copytree(run / f"step{step}", mixed / f"step{step}")
    cfg = LlamaConfig.from_pretrained(run / "step0")
    cfg.intermediate_size *= 2
    LlamaForCausalLM(cfg).save_pretrained(mixed / "step16")
    with pytest.raises(ValueError, match="step 16 does not match step 0") as err:
        CheckpointSeries.from_folder(mixed)
    assert "remove the odd checkpoint" in _one_line(err)

    partial = tmp_path / "partial"
    shutil.copytree(run / "step0", partial / "step0")
    (partial / "step4").mkdir()
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        CheckpointSeries.from_folder(partial)

    (partial / "step4").rmdir()
    (partial / "step0" / "tangentlens.json").write_text("{truncated")
    with pytest.raises(ValueError, match="is corrupt") as err:
        CheckpointSeries.from_folder(partial)
    _one_line(err)

    with pytest.raises(ValueError, match="a and b are both step 1"):
        CheckpointSeries([Checkpoint(1, "a"), Checkpoint(1, "b")])
    (partial / "step0" / "tangentlens.json").unlink()
    shutil.copytree(partial / "step0", partial / "step00")
    with pytest.raises(ValueError) as err:  # two folders of one step: both named
        CheckpointSeries.from_folder(partial)
    assert str(partial / "step0") in str(err.value) and str(partial / "step00") in str(err.value)
    _one_line(err)
    with pytest.raises(ValueError, match="at least one checkpoint"):
        CheckpointSeries([])


def test_shape_change_is_caught_at_load_for_any_loader(run):
    cfg = LlamaConfig.from_pretrained(run / "step0")
    wide = LlamaConfig.from_pretrained(run / "step0", hidden_size=cfg.hidden_size * 2)
    models = {0: LlamaForCausalLM(cfg), 1: LlamaForCausalLM(wide)}
    series = CheckpointSeries(
        [Checkpoint(0, "x", "step0"), Checkpoint(1, "x", "step1")],
        loader=lambda c: (models[c.step], None),
        tokenizer=run / "tokenizer",
    )
    series.load(0)
    with pytest.raises(ValueError, match="does not match step 0"):
        series.load(1)


def test_backend_hook_wraps_a_local_checkpoint(run):
    series = CheckpointSeries.from_folder(run)
    loaded = series.load(1, backend="transformer_lens")
    assert loaded.backend == "transformer_lens"
    assert type(loaded.backend_model).__name__ == "TransformerBridge"
    tokens = loaded.tokenizer("In the beginning", return_tensors="pt")["input_ids"]
    logits = loaded.backend_model(tokens)
    assert logits.shape[-1] == loaded.model.config.vocab_size


def test_masked_lm_checkpoints_load_with_their_head(masked_run):
    series = CheckpointSeries.from_folder(masked_run)
    loaded = series.load(len(series) - 1)
    assert type(loaded.model).__name__ == "BertForMaskedLM"
    assert loaded.weights_hash == series[-1].metadata["weights_hash"]
    assert loaded.tokenizer.mask_token_id == loaded.model.config.mask_token_id is not None
    wrapped = series.load(1, backend="nnsight").backend_model
    assert wrapped._module.config.architectures == ["BertForMaskedLM"]


@pytest.mark.parametrize("backend", ["transformer_lens", "nnsight"])
def test_gradient_probe_with_mlm_loss_on_a_masked_checkpoint(masked_run, backend):
    folder = masked_run / "step24"
    model, tokenizer = models.load(str(folder), backend=backend)
    ids = encode(tokenizer, load_lines(max_chars=2_000))[:64].view(4, 16)
    batches = list(ids.split(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnstableBasisWarning)
        bases = probes.fit_bases(model, batches, rank=4, progress=False)
    session = probes.run(
        model, batches, bases, ("gradient",), loss="mlm", n_controls=10, progress=False
    )
    rows = session.results()
    gradient = rows[rows["probe"] == "gradient"]
    assert len(gradient) and gradient["value"].notna().all()


def test_windows_by_step_are_early_in_training_not_the_first_files(run):
    """Log-spaced early checkpoints: by step, early is the first 30 % of training; each
    window keeps at least the two checkpoints nearest its end."""
    series = CheckpointSeries.from_folder(run)
    steps = series.steps
    by_step = series.windows(0.3)
    span = 0.3 * (steps[-1] - steps[0])
    early = [steps[i] for i in by_step["early"]]
    assert early == [s for s in steps if s <= span] or len(early) == 2
    assert [steps[i] for i in by_step["late"]][-1] == steps[-1]
    assert len(by_step["late"]) >= 2
    by_index = series.windows(0.3, by="index")
    assert len(by_index["early"]) == len(by_index["late"])
    with pytest.raises(ValueError, match="'step' or 'index'"):
        series.windows(0.3, by="time")
