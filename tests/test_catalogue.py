"""The catalogue of statistics: entries, registration, the writer's refusal of unknown
names, the generated docs, and that a real run emits only catalogued names."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tangentlens.core import catalogue, results
from tangentlens.core.catalogue import STATISTICS, Statistic, check_names, register
from tangentlens.core.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


def _table(statistic: str) -> pd.DataFrame:
    row = {"probe": "mine", "hook": "blocks.0.hook_resid_pre", "site": "resid_pre", "layer": 0}
    return results.frame([{**row, "head": None, "statistic": statistic, "value": 1.0}])


@pytest.fixture
def clean_catalogue():
    """Entries a test registers are removed afterwards."""
    before = dict(STATISTICS)
    yield
    STATISTICS.clear()
    STATISTICS.update(before)


def test_entries_are_complete() -> None:
    assert len(STATISTICS) > 100
    for name, stat in STATISTICS.items():
        assert stat.name == name
        assert stat.probes and all(isinstance(p, str) and p for p in stat.probes)
        for text in (stat.definition, stat.conditions, stat.reading):
            assert isinstance(text, str) and text.strip(), name


def test_delta_iso_entries_name_zeta_and_the_reference() -> None:
    for name in ("delta_iso_tangent", "delta_iso_normal", "iso_statistic", "isotropy_p_value"):
        stat = catalogue.get(name)
        assert "ζ" in stat.paper_option and "reference" in stat.paper_option
        # one definition: the study's pooled reference, a pool of one in a probe session
        assert "pooled_shape" in stat.definition and "same number" in stat.definition


def test_the_catalogue_imports_no_torch() -> None:
    code = "import sys, tangentlens.core.catalogue; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_register_accepts_the_same_entry_and_refuses_another(clean_catalogue) -> None:
    known = catalogue.get("energy_ratio")
    register(known)  # identical: fine
    with pytest.raises(UsageError, match="energy_ratio"):
        register(Statistic("energy_ratio", "mine", "other", "other", "other"))
    assert catalogue.get("energy_ratio") is known
    with pytest.raises(UsageError, match="Statistic"):
        register("energy_ratio")  # type: ignore[arg-type]


def test_check_names_names_the_unknown_and_the_fix() -> None:
    check_names(["tangent_share", "p_value"], "here")
    with pytest.raises(UsageError) as err:
        check_names(["tangent_share", "my_stat", "other_stat", "my_stat"], "writing x")
    text = str(err.value)
    assert "'my_stat'" in text and "'other_stat'" in text and "tangent_share" not in text
    assert "writing x" in text and "tangentlens.core.catalogue.register(Statistic(" in text
    with pytest.raises(UsageError, match="my_stat"):
        catalogue.get("my_stat")


def test_write_refuses_an_unregistered_name_and_writes_nothing(tmp_path, clean_catalogue):
    table = _table("my_stat")
    folder = tmp_path / "out"
    with pytest.raises(UsageError, match="'my_stat'"):
        results.write(table, folder)
    assert not folder.exists() or not any(folder.iterdir())
    assert len(results.frame(table)) == 1  # in-memory tables take any name
    register(Statistic("my_stat", "mine", "x²", "the site", "larger: more"))
    csv, _ = results.write(table, folder)
    assert list(results.read(csv)["statistic"]) == ["my_stat"]


def test_statistics_md_is_generated() -> None:
    text = (ROOT / "docs" / "STATISTICS.md").read_text(encoding="utf-8")
    assert text == catalogue.document(), (
        "docs/STATISTICS.md is stale: run "
        "`python -m tangentlens.core.catalogue > docs/STATISTICS.md`"
    )
    assert "python -m tangentlens.core.catalogue > docs/STATISTICS.md" in text.splitlines()[0]
    for name in STATISTICS:
        assert f"| `{name}` |" in text


def test_main_prints_the_document() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "tangentlens.core.catalogue"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        encoding="utf-8",
    )
    assert run.stdout == catalogue.document()


def test_readme_points_to_the_catalogue() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.findall(r"<!-- statistics:begin -->\n(.*?)<!-- statistics:end -->", readme, re.S)
    assert len(found) == 1
    assert "docs/STATISTICS.md" in found[0]
    assert not any(line.startswith("|") for line in found[0].splitlines())


# ---------------------------------------------------------------- a real run
def test_a_run_of_every_probe_emits_only_catalogued_names(one_thread) -> None:
    from models import tl_bridge, tokens

    from tangentlens.probes import fit_bases, run

    model = tl_bridge("gpt2")
    bases = fit_bases(model, [tokens("gpt2", 4, 12, seed=1)], rank=4, progress=False)
    probes = ("residual", "attention", "gradient", "activation", "weight_gradient")
    session = run(model, [tokens("gpt2", 3, 12)], bases, probes, n_controls=20, progress=False)
    table = session.results(progress=False)
    assert set(table["probe"]) >= {*probes, "basis"}
    emitted = set(table["statistic"])
    assert emitted <= set(STATISTICS), sorted(emitted - set(STATISTICS))
    for name in emitted:
        probe = set(table.loc[table["statistic"] == name, "probe"])
        assert probe <= set(STATISTICS[name].probes), (name, probe)
