"""The small-LM trainer: schedule, config, complete checkpoints, determinism, resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

from tangentlens.core.digests import tensor_hash
from tangentlens.core.errors import CorruptFileError, UsageError
from tangentlens.core.files import read_checked_json, write_checked_json
from tangentlens.data import resume
from tangentlens.data import train as train_module
from tangentlens.data.train import TrainConfig, checkpoint_steps, train
from tangentlens.study.config import open_series

CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tangentlens.json")
MASKED = TrainConfig.tiny(objective="masked", dropout=0.1)  # dropout: the RNG matters


def _hashes(out: Path) -> dict[str, str]:
    return {
        p.name: json.loads((p / "tangentlens.json").read_text())["weights_hash"]
        for p in sorted(out.glob("step*"))
    }


def _metadata(out: Path) -> list[dict]:
    steps = sorted(out.glob("step*"), key=lambda p: int(p.name[4:]))
    return [json.loads((p / "tangentlens.json").read_text()) for p in steps]


def _interrupted(config: TrainConfig, out: Path, after: int) -> Path:
    """``out`` as a kill right after checkpoint ``after`` leaves it (its state written,
    the next step's update not made)."""

    class Interrupted(Exception):
        pass

    checkpoint = train_module._checkpoint

    def interrupt(folder, step, *args):
        checkpoint(folder, step, *args)
        if step == after:
            raise Interrupted

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_module, "_checkpoint", interrupt)
        with pytest.raises(Interrupted):
            train(config, out, progress=False)
    assert not (out / f"step{config.max_steps}").exists()
    return out


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    return train(TrainConfig.tiny(), tmp_path_factory.mktemp("tiny"), progress=False)


@pytest.fixture(scope="module")
def masked_run(tmp_path_factory) -> Path:
    return train(MASKED, tmp_path_factory.mktemp("masked"), progress=False)


def test_schedule_is_pythia_like():
    assert checkpoint_steps(1000, 512, 100) == [
        *(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        *(612, 712, 812, 912, 1000),
    ]
    assert checkpoint_steps(20, 512, 100) == [0, 1, 2, 4, 8, 16, 20]
    steps = TrainConfig().steps
    assert steps[:3] == [0, 1, 2] and steps[-1] == TrainConfig().max_steps


def test_config_round_trip_and_validation():
    cfg = TrainConfig.tiny(seed=3)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown TrainConfig keys"):
        TrainConfig.from_dict({"d_modle": 64})
    bad = [
        ({"d_model": 30, "n_heads": 4}, "not divisible by n_heads"),
        ({"n_kv_heads": 3}, "not divisible by n_kv_heads"),
        ({"max_steps": 0}, "positive int"),
        ({"vocab_size": 100}, "at least 257"),
        ({"lr": -1.0}, "lr"),
        ({"dropout": 1.0}, "dropout"),
        ({"objective": "mlm"}, "objective must be one of"),
        ({"objective": "masked", "vocab_size": 257}, "at least 258"),
        ({"d_model": 30, "n_heads": 2, "n_kv_heads": 1}, "even for rotary"),
        ({"split_seed": -1}, "split_seed must be an int in"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            TrainConfig(**kwargs)
    TrainConfig(objective="masked", d_model=30, n_heads=2)  # no rotary in BERT


def test_split_seed_is_the_split_and_has_one_form():
    """Seeds of one design share a split; a split seed equal to the seed is the default
    split, stored as None, so a run is one config whether trained alone or as a seed."""
    shared = TrainConfig.tiny(seed=2, split_seed=0)
    assert shared.split == 0 and shared.split_seed == 0
    alone = TrainConfig.tiny(seed=2, split_seed=2)
    assert alone == TrainConfig.tiny(seed=2) and alone.split_seed is None and alone.split == 2


def test_every_checkpoint_is_a_complete_hf_folder(tiny_run):
    cfg = TrainConfig.tiny()
    assert sorted(int(p.name[4:]) for p in tiny_run.glob("step*")) == cfg.steps
    assert not list(tiny_run.glob(".tmp-*"))
    final = tiny_run / f"step{cfg.max_steps}"
    for name in CHECKPOINT_FILES:
        assert (final / name).is_file()
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    meta = json.loads((final / "tangentlens.json").read_text())
    assert meta["step"] == cfg.max_steps and meta["config"] == cfg.to_dict()
    assert tensor_hash(model.state_dict()) == meta["weights_hash"]
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_key_value_heads == cfg.n_kv_heads
    assert len(tokenizer) == model.config.vocab_size <= cfg.vocab_size
    first = json.loads((tiny_run / "step0" / "tangentlens.json").read_text())
    assert meta["eval_loss"] < first["eval_loss"]  # it learns


def test_same_seed_same_weights(tiny_run, tmp_path):
    again = train(TrainConfig.tiny(), tmp_path / "again", progress=False)
    assert _hashes(again) == _hashes(tiny_run)
    other = train(TrainConfig.tiny(seed=1, max_steps=4), tmp_path / "other", progress=False)
    assert _hashes(other)["step4"] != _hashes(tiny_run)["step4"]


def test_progress_bar_shows_loss_and_can_be_silenced(tmp_path, capfd):
    cfg = TrainConfig.tiny(max_steps=2, warmup_steps=1)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    threads = torch.get_num_threads()
    train(cfg, tmp_path / "quiet", progress=False)
    assert torch.equal(torch.rand(3), expected)  # the caller's RNG is left alone
    assert torch.get_num_threads() == threads
    assert capfd.readouterr().err == ""
    train(cfg, tmp_path / "loud", progress=True)
    assert "loss=" in capfd.readouterr().err


def test_finished_run_is_not_redone_and_config_must_match(tiny_run):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_run.glob("step*")}
    train(TrainConfig.tiny(), tiny_run, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in tiny_run.glob("step*")} == before
    with pytest.raises(ValueError, match=r"another configuration \(differs in \['seed'\]\)"):
        train(TrainConfig.tiny(seed=9), tiny_run, progress=False)


def test_a_finished_rerun_names_a_damaged_checkpoint_and_the_fix(tiny_run, tmp_path):
    """A finished run is not trained again, but its checkpoints are checked as a study
    would open them: a truncated weights file is named with the rebuild, and the rebuild
    gives the same weights."""
    out = tmp_path / "copy"
    shutil.copytree(tiny_run, out)
    weights = out / "step16" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(CorruptFileError) as err:
        train(TrainConfig.tiny(), out, progress=False)
    assert str(weights) in str(err.value) and "rerun train" in str(err.value)
    shutil.rmtree(out / "step16")
    train(TrainConfig.tiny(), out, progress=False)
    assert _hashes(out) == _hashes(tiny_run)
    # without its record nothing checks a checkpoint's weights: never read, always rebuilt
    (out / "step8" / "tangentlens.json").unlink()
    with pytest.raises(CorruptFileError, match=r"step8 has no tangentlens\.json"):
        open_series(str(out))
    with pytest.raises(CorruptFileError, match=r"step8 has no tangentlens\.json") as err:
        train(TrainConfig.tiny(), out, progress=False)
    assert "rerun train" in str(err.value)


def test_rerun_checks_folders_it_would_rewrite(tiny_run, tmp_path):
    # A kill between a folder's rename and the state write leaves folders ahead of the
    # state: the rerun recomputes them, keeps them, and refuses weights that differ.
    out = tmp_path / "copy"
    shutil.copytree(tiny_run, out)
    (out / "train_state.safetensors").unlink()
    shutil.rmtree(out / "step24")
    kept = (out / "step16" / "model.safetensors").stat().st_mtime_ns
    train(TrainConfig.tiny(), out, progress=False)
    assert _hashes(out) == _hashes(tiny_run)
    assert (out / "step16" / "model.safetensors").stat().st_mtime_ns == kept
    (out / "train_state.safetensors").unlink()
    shutil.rmtree(out / "step24")
    meta = read_checked_json(out / "step8" / "tangentlens.json")
    meta["weights_hash"] = "0" * 64  # as another run's weights would record it
    write_checked_json(out / "step8" / "tangentlens.json", meta)
    with pytest.raises(CorruptFileError, match="delete the folder"):
        train(TrainConfig.tiny(), out, progress=False)
    path = out / "step8" / "tangentlens.json"
    path.write_text(path.read_text().replace("0" * 64, "1" * 64))  # edited by hand
    with pytest.raises(CorruptFileError, match=r"tangentlens\.json was changed"):
        train(TrainConfig.tiny(), out, progress=False)


def test_a_deleted_checkpoint_is_rebuilt_and_the_study_names_it_first(tiny_run, tmp_path):
    # the state resumes only from the last step: a finished run missing an earlier folder
    # trains again from step 0, checking the folders it keeps
    out = tmp_path / "copy"
    shutil.copytree(tiny_run, out)
    shutil.rmtree(out / "step8")
    with pytest.raises(UsageError, match=r"copy lacks the checkpoints of steps \[8\]"):
        open_series(str(out))
    kept = (out / "step16" / "model.safetensors").stat().st_mtime_ns
    train(TrainConfig.tiny(), out, progress=False)
    assert _hashes(out) == _hashes(tiny_run)
    assert (out / "step16" / "model.safetensors").stat().st_mtime_ns == kept
    assert open_series(str(out)).steps == open_series(str(tiny_run)).steps
    last = max(int(p.name[4:]) for p in out.glob("step*"))
    shutil.rmtree(out / f"step{last}")  # the last one too: the state says it was written
    with pytest.raises(UsageError, match=rf"steps \[{last}\]"):
        open_series(str(out))
    # a damaged training state says nothing of the checkpoints: a study reads the folders
    # it finds, and only a resume, which needs the state, names the file
    shutil.copytree(tiny_run / f"step{last}", out / f"step{last}")
    state = out / "train_state.safetensors"
    state.write_bytes(state.read_bytes()[:100])
    assert open_series(str(out)).steps == open_series(str(tiny_run)).steps


@pytest.mark.parametrize("kill_after", ["step8", "step40"])
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path, kill_after):
    cfg = TrainConfig.tiny(max_steps=240, checkpoint_every=16, dropout=0.1)  # RNG matters
    reference = train(cfg, tmp_path / "reference", progress=False)
    out = tmp_path / "killed"
    script = (
        "import json, sys\n"
        "from tangentlens.data.train import TrainConfig, train\n"
        "train(TrainConfig.from_dict(json.loads(sys.argv[1])), sys.argv[2], progress=False)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(cfg.to_dict()), str(out)],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            ended = proc.poll() is not None  # read before the folder: no race with the exit
            if (out / kill_after).exists():
                break
            assert not ended, "the training subprocess ended early"
            assert time.monotonic() < deadline, "the training subprocess made no checkpoint"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert not (out / f"step{cfg.max_steps}").exists(), "killed too late to test a resume"
    for folder in out.glob("step*"):  # no partial folder under a final name
        assert all((folder / name).is_file() for name in CHECKPOINT_FILES)
        AutoModelForCausalLM.from_pretrained(folder)
    train(cfg, out, progress=False)
    assert not list(out.glob(".tmp-*"))
    assert _hashes(out) == _hashes(reference)


def test_masked_objective_trains_a_bert_encoder(masked_run):
    assert sorted(int(p.name[4:]) for p in masked_run.glob("step*")) == MASKED.steps
    final = masked_run / f"step{MASKED.max_steps}"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"]
    model = AutoModelForMaskedLM.from_pretrained(final)
    meta = _metadata(masked_run)
    assert tensor_hash(model.state_dict()) == meta[-1]["weights_hash"]
    assert model.config.tie_word_embeddings
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    for folder in (final, masked_run / "tokenizer"):  # the step folder or its parent
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert tokenizer.mask_token == "<|mask|>"
        assert tokenizer.mask_token_id == config["mask_token_id"] is not None
    assert all(torch.isfinite(torch.tensor([m["loss"], m["eval_loss"]])).all() for m in meta)
    assert meta[-1]["eval_loss"] < meta[0]["eval_loss"] - 0.5  # it learns


def test_masked_inputs_are_seeded_per_step():
    x = torch.arange(8 * 32).view(8, 32) + 10
    one = train_module._inputs(MASKED, x, 1, "step 3")
    assert torch.equal(one["input_ids"], train_module._inputs(MASKED, x, 1, "step 3")["input_ids"])
    chosen = one["labels"] != -100
    assert chosen.any(1).all() and 0.05 < chosen.float().mean() < 0.3
    assert (one["input_ids"][chosen] == 1).all() and torch.equal(one["labels"][chosen], x[chosen])
    assert torch.equal(one["input_ids"][~chosen], x[~chosen])
    other = train_module._inputs(MASKED, x, 1, "step 4")["labels"] != -100
    assert not torch.equal(other, chosen)


def test_masked_resume_after_an_interrupt_matches_uninterrupted_run(masked_run, tmp_path):
    out = _interrupted(MASKED, tmp_path / "interrupted", after=8)
    train(MASKED, out, progress=False)
    assert _hashes(out) == _hashes(masked_run)
    assert [m["eval_loss"] for m in _metadata(out)] == [
        m["eval_loss"] for m in _metadata(masked_run)
    ]


def test_a_resume_refuses_changed_weights_in_the_checkpoint_it_resumes_from(tiny_run, tmp_path):
    cfg = TrainConfig.tiny()
    out = _interrupted(cfg, tmp_path / "interrupted", after=8)
    weights = out / "step8" / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] += 1.0  # a valid file, other weights
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CorruptFileError, match="step8") as err:
        train(cfg, out, progress=False)
    assert "weights_hash" in str(err.value) and "rerun" in str(err.value)
    assert not (out / f"step{cfg.max_steps}").exists()  # nothing trained on from them
    shutil.rmtree(out / "step8")  # the fix the message names: rebuilt from step 0
    train(cfg, out, progress=False)
    assert _hashes(out) == _hashes(tiny_run)


def test_a_resume_by_another_source_is_refused(tmp_path, monkeypatch):
    cfg = TrainConfig.tiny()
    out = _interrupted(cfg, tmp_path / "interrupted", after=4)
    monkeypatch.setattr(resume, "source_digest", lambda: "another tangentlens")
    with pytest.raises(UsageError, match=r"train_state\.safetensors") as err:
        train(cfg, out, progress=False)
    assert "--restart" in str(err.value)
    assert not (out / "step8").exists()  # nothing trained on by the other code
