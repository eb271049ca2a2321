"""One default per setting: every option of every command, left out, gives the API's own
default (read from the signatures and config dataclasses), and its help shows that value.

Each command runs in-process with its workflow replaced by a stub that records what the
command line passed and stops.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tangentlens.data.train as train_module
from tangentlens.cli import commands as cli
from tangentlens.cli import demo, workflows
from tangentlens.core import settings
from tangentlens.data.train import TrainConfig
from tangentlens.probes import registry
from tangentlens.study import StudyConfig

# the real functions (the tests replace them in their modules with stubs)
PROBE_MODEL, RUN_STUDY, DEMO = workflows.probe_model, workflows.run_study, demo.demo
RENDER_REPORT, TRAIN = workflows.render_report, train_module.train


class Called(Exception):
    """Raised by a stub in place of a workflow; ``got`` is what the command passed."""

    def __init__(self, **got: Any) -> None:
        super().__init__("stub called")
        self.got = got


def _param(function: Callable[..., Any], name: str) -> Any:
    default = inspect.signature(function).parameters[name].default
    assert default is not inspect.Parameter.empty, f"{function.__name__}({name}) has no default"
    return default


def _field(cls: type, name: str) -> Any:
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    assert field.default is not dataclasses.MISSING, f"{cls.__name__}.{name} has no default"
    return field.default


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _action(command: str, dest: str) -> argparse.Action:
    return next(a for a in _subparser(command)._actions if a.dest == dest)


def _help(command: str, dest: str) -> str:
    """The option's help as ``--help`` prints it (``%(default)s`` filled in)."""
    parser = _subparser(command)
    return parser._get_formatter()._expand_help(_action(command, dest))


def _shown(command: str, dest: str) -> str:
    """The default the help names: ``X`` of ``(default: X)``, ``(default: X; ...)`` or
    ``(default: X, or the trainer's ...)``."""
    text = " ".join(_help(command, dest).split())
    match = re.search(r"\(default: (.+?)(?:; .*|, or .*)?\)$", text)
    assert match, f"{command} --{dest}: the help shows no default: {text!r}"
    return match.group(1)


def _expected_help(api: Any, record: settings.Setting) -> str:
    """A value's help text; a default of None is named in words by its settings record."""
    assert record.default == api
    return record.default_text if api is None else settings.shown(api)


def _run(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv("TANGENTLENS_DEBUG", "1")  # the stub's exception reaches the test
    with pytest.raises(Called) as called:
        cli.main(argv)
    return called.value.got


def _options(command: str) -> set[str]:
    return {a.dest for a in _subparser(command)._actions} - {"help"}


# ----------------------------------------------------------------------------- probe
# CLI dest -> the keyword of `workflows.probe_model` it sets (same names throughout)
PROBE_OPTIONS = (
    "backend",
    "text",
    "encoding",
    "rank",
    "layers",
    "tokens",
    "seq_len",
    "batch_size",
    "n_controls",
    "world_size",
)
# further API functions that take the same setting and must default to the same value
PROBE_ALSO = {
    "n_controls": (workflows.probe_checkpoint,),
    "batch_size": (workflows.probe_checkpoint,),
    "world_size": (workflows.probe_checkpoint,),
}


@pytest.fixture
def probe_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    def stub(name: str, out: Path, **options: Any) -> None:
        raise Called(name=name, out=out, **options)

    monkeypatch.setattr(workflows, "probe_model", stub)
    return _run(["probe", "--model", "m", "--out", str(tmp_path / "o")], monkeypatch)


def test_probe_lists_every_option() -> None:
    assert _options("probe") == {*PROBE_OPTIONS, "model", "out", "quiet"}


@pytest.mark.parametrize("dest", PROBE_OPTIONS)
def test_probe_default_is_the_api_default(dest: str, probe_call: dict[str, Any]) -> None:
    api = _param(PROBE_MODEL, dest)
    assert probe_call[dest] == api
    for function in PROBE_ALSO.get(dest, ()):
        assert _param(function, dest) == api, function.__qualname__
    assert _shown("probe", dest) == _expected_help(api, getattr(settings.PROBE, dest))


def test_probe_n_controls_is_the_probes_default(probe_call: dict[str, Any]) -> None:
    """`tangentlens probe`, `probe_model`, `probe_checkpoint` and `probes.run` (which
    builds a `ProbeSession`) draw the same number of controls."""
    probes = registry.option_defaults()["n_controls"]
    assert probe_call["n_controls"] == probes
    assert _shown("probe", "n_controls") == str(probes)


def test_probe_quiet(probe_call: dict[str, Any]) -> None:
    assert probe_call["progress"] == _param(PROBE_MODEL, "progress")


# ----------------------------------------------------------------------------- train
TRAIN_OPTIONS = ("corpus", "encoding", "max_steps", "seed", "objective")  # = TrainConfig field
SEED_OPTIONS = ("seeds", "n_seeds")  # of `workflows.train_seeds` and `demo.demo`


def _train_call(argv: list[str], monkeypatch: pytest.MonkeyPatch, out: Path) -> dict[str, Any]:
    def stub(
        config: TrainConfig, out_dir: Path, progress: bool = True, restart: bool = False
    ) -> None:
        raise Called(config=config, progress=progress, restart=restart)

    monkeypatch.setattr(train_module, "train", stub)
    return _run(["train", "--out", str(out), *argv], monkeypatch)


def test_train_lists_every_option() -> None:
    assert _options("train") == {*TRAIN_OPTIONS, *SEED_OPTIONS, "out", "quick", "quiet", "restart"}


@pytest.mark.parametrize("dest", TRAIN_OPTIONS)
def test_train_default_is_the_config_default(
    dest: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    got = _train_call([], monkeypatch, tmp_path)
    api = _field(TrainConfig, dest)
    assert getattr(got["config"], dest) == api
    assert _shown("train", dest) == _expected_help(api, getattr(settings.TRAIN, dest))


def test_train_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    got = _train_call([], monkeypatch, tmp_path)
    assert got["progress"] == _param(TRAIN, "progress")
    assert got["restart"] == _param(TRAIN, "restart") == settings.TRAIN.restart.default
    assert _action("train", "restart").default == settings.TRAIN.restart.default
    assert _action("train", "quick").default == _param(workflows.train_config, "quick")
    assert _train_call(["--restart"], monkeypatch, tmp_path)["restart"] is True


def test_train_seeds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Left out, --seeds and --n-seeds train one series (`train`, not `train_seeds`), as
    `train_seeds` does with its default; given, they reach `train_seeds` as a tuple."""
    assert _param(workflows.train_seeds, "seeds") == settings.TRAIN.seeds.default is None
    assert _shown("train", "seeds") == settings.TRAIN.seeds.default_text
    assert _shown("train", "n_seeds") == settings.TRAIN.n_seeds.default_text
    got = _train_call([], monkeypatch, tmp_path)
    assert got["config"].seed == _field(TrainConfig, "seed")

    def stub(config: TrainConfig, out: Path, **options: Any) -> None:
        raise Called(config=config, **options)

    monkeypatch.setattr(workflows, "train_seeds", stub)
    for argv, seeds in ((["--seeds", "2,0"], (2, 0)), (["--n-seeds", "3"], (0, 1, 2))):
        got = _run(["train", "--out", str(tmp_path), *argv], monkeypatch)
        assert got["seeds"] == seeds and got["progress"] is True


def test_train_quick(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    got = _train_call(["--quick"], monkeypatch, tmp_path)
    for name, value in settings.QUICK_TRAIN.items():
        assert getattr(got["config"], name) == value
    assert f"; {value} with --quick)" in " ".join(_help("train", "max_steps").split())


# ----------------------------------------------------------------------------- study
STUDY_OPTIONS = {  # CLI dest -> StudyConfig field
    "backend": "backend",
    "rank": "rank",
    "n_controls": "n_controls",
    "controls": "controls",
    "window_fraction": "window_fraction",
    "windows": "windows",
    "early": "early",
    "late": "late",
    "sequences": "n_sequences",
    "seq_len": "seq_len",
    "head_sequences": "head_sequences",
    "corpus": "corpus",
    "encoding": "encoding",
    "seed": "seed",
}


def _study_call(argv: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    def stub(config: StudyConfig, out: Path, **options: Any) -> None:
        raise Called(config=config, **options)

    monkeypatch.setattr(workflows, "run_study", stub)
    series = tmp_path / "series"  # an existing folder; not a `tangentlens train` one
    series.mkdir(exist_ok=True)
    base = ["study", "--checkpoints", str(series), "--out", str(tmp_path / "o")]
    return _run([*base, *argv], monkeypatch)


def test_study_lists_every_option() -> None:
    expected = {*STUDY_OPTIONS, "world_size", "checkpoints", "out", "quick", "quiet"}
    assert _options("study") == expected


@pytest.mark.parametrize("dest", STUDY_OPTIONS)
def test_study_default_is_the_config_default(
    dest: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    got = _study_call([], monkeypatch, tmp_path)
    field = STUDY_OPTIONS[dest]
    api = _field(StudyConfig, field)
    assert getattr(got["config"], field) == api
    assert _shown("study", dest) == _expected_help(api, getattr(settings.STUDY, field))


def test_study_n_controls_is_the_probes_default() -> None:
    probes = registry.option_defaults()
    assert _field(StudyConfig, "n_controls") == probes["n_controls"]
    assert _field(StudyConfig, "zeta") == probes["zeta"]
    assert _field(StudyConfig, "head_null") == probes["head_null"]


def test_study_world_size_and_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    got = _study_call([], monkeypatch, tmp_path)
    api = _param(RUN_STUDY, "world_size")
    assert got["world_size"] == api
    assert _shown("study", "world_size") == str(api)
    assert got["progress"] == _param(RUN_STUDY, "progress")
    assert _action("study", "quick").default == _param(workflows.study_config, "quick")


def test_study_quick(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    got = _study_call(["--quick"], monkeypatch, tmp_path)
    for name, value in settings.QUICK_STUDY.items():
        assert getattr(got["config"], name) == value
    for dest, name in (("n_controls", "n_controls"), ("sequences", "n_sequences")):
        text = " ".join(_help("study", dest).split())
        assert f"; {settings.QUICK_STUDY[name]} with --quick)" in text


def test_the_demos_study_is_the_flags_the_readme_names(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    flags = ["--early", "0:8", "--sequences", "128", "--head-sequences", "4"]
    got = _study_call(flags, monkeypatch, tmp_path)
    for name, value in settings.DEMO_STUDY.items():
        assert getattr(got["config"], name) == value
    readme = Path(__file__).resolve().parents[1] / "README.md"
    assert " ".join(flags) in " ".join(readme.read_text(encoding="utf-8").split())


# ----------------------------------------------------------------------------- demo, report
def test_demo_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    def stub(out: Path, **options: Any) -> None:
        raise Called(out=out, **options)

    monkeypatch.setattr(demo, "demo", stub)
    got = _run(["demo"], monkeypatch)
    assert _options("demo") == {"out", "quick", "quiet", *SEED_OPTIONS}
    # no --seeds: demo() picks its seeds, the ones the help names (and --quick's)
    assert got["seeds"] is None is _param(DEMO, "seeds")
    assert demo.demo_seeds(None, quick=False) == settings.DEMO.seeds.default
    assert demo.demo_seeds(None, quick=True) == settings.QUICK_DEMO["seeds"]
    quick = settings.shown(settings.QUICK_DEMO["seeds"])
    assert f"(default: {settings.shown(settings.DEMO.seeds.default)}; {quick} with --quick)" in (
        " ".join(_help("demo", "seeds").split())
    )
    assert _shown("demo", "n_seeds") == settings.DEMO.n_seeds.default_text
    assert _run(["demo", "--seeds", "1,3"], monkeypatch)["seeds"] == (1, 3)
    assert _run(["demo", "--n-seeds", "2"], monkeypatch)["seeds"] == (0, 1)
    out = _action("demo", "out").default  # the command line's own: demo() takes a folder
    assert got["out"] == Path(out) and _shown("demo", "out") == out
    assert got["quick"] == _param(DEMO, "quick")
    assert got["progress"] == _param(DEMO, "progress")


def test_report_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def stub(folder: str, target: str | None = None) -> None:
        raise Called(folder=folder, target=target)

    monkeypatch.setattr(workflows, "render_report", stub)
    got = _run(["report", str(tmp_path)], monkeypatch)
    assert _options("report") == {"dir", "out", "quiet"}
    assert got["target"] == _param(RENDER_REPORT, "target") is None
    assert _shown("report", "out") == "DIR/report.html"  # what render_report does with None


def test_version(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"tangentlens {cli.__version__}"
