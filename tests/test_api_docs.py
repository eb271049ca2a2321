"""The public surface as API reference: each top-level entry point has a Google-style
docstring (Args / Returns / Raises / Example) whose Args name its parameters, and every
Example runs as written on a tiny model.

Examples share one convention (stated in each): ``model`` is a loaded model (a
TransformerLens bridge here: the tiny Llama of `tests/models.py`), ``texts`` a list of
strings, ``bases`` what `fit_bases` returns for them at rank 8, ``table`` the results of
`run` with those bases, and ``folder`` a local Hugging Face model folder.
"""

from __future__ import annotations

import doctest
import inspect
import re
import warnings
from typing import Any

import pytest
from models import _SENTENCES, hf_folder, tl_bridge

import tangentlens

ENTRY_POINTS = (
    "fit_bases",
    "probe",
    "run",
    "text_batches",
    "layerwise_probe",
    "ablate",
    "causal_effects",
    "head_effects",
    "DepthProfile",
    "head_arrays",
    "plot_heads",
    "load",
)
SECTIONS = ("Args", "Returns", "Raises", "Example")
_HEADER = re.compile(r"^([A-Z][A-Za-z ]*):$")


def sections(obj: Any) -> dict[str, str]:
    """A docstring's Google-style sections: a header alone on a line at the docstring's
    own indentation (``Args:``), its body the indented lines below it."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in inspect.cleandoc(obj.__doc__ or "").splitlines():
        header = _HEADER.match(line)
        if header:
            current = found.setdefault(header.group(1), [])
        elif line and not line.startswith(" "):
            current = None  # prose after a section ends it
        elif current is not None:
            current.append(line)
    return {name: "\n".join(body) for name, body in found.items()}


def _parameters(obj: Any) -> list[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    names = []
    for p in inspect.signature(target).parameters.values():
        if p.name == "self":
            continue
        names.append(f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name)
    return names


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_is_top_level_with_four_sections(name: str) -> None:
    obj = getattr(tangentlens, name)
    assert name in dir(tangentlens)
    found = sections(obj)
    missing = [s for s in SECTIONS if not found.get(s, "").strip()]
    assert not missing, f"tangentlens.{name} lacks {missing}"
    documented = re.findall(r"^    (\*{0,2}\w+):", found["Args"], flags=re.M)
    assert documented == _parameters(obj), f"tangentlens.{name}: Args out of step"
    assert re.search(r"^    \w+Error:", found["Raises"], flags=re.M), name
    assert ">>> " in found["Example"], name
    summary = inspect.cleandoc(obj.__doc__).splitlines()
    assert summary[0].endswith(".") and (len(summary) == 1 or not summary[1]), name


def test_dir_lists_the_public_names_and_each_resolves() -> None:
    """Tab completion shows what loads on first use: `dir` is `__all__`, every name in it
    resolves, and a private or unknown name does not."""
    names = dir(tangentlens)
    assert names == sorted(tangentlens.__all__) and set(ENTRY_POINTS) <= set(names)
    assert "__version__" in names and not any(
        n.startswith("_") and n != "__version__" for n in names
    )
    for name in names:
        assert getattr(tangentlens, name) is not None, name
    with pytest.raises(AttributeError, match="no_such_name"):
        tangentlens.no_such_name  # noqa: B018


@pytest.fixture(scope="module")
def namespace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the Examples take as given, built once the way their prose says."""
    model = tl_bridge("llama")
    texts = [*_SENTENCES, *(" ".join(reversed(s.split())) for s in _SENTENCES)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bases = tangentlens.fit_bases(model, texts, rank=8, progress=False)
        table = tangentlens.run(model, texts, bases, progress=False).results()
    return {
        "tangentlens": tangentlens,
        "model": model,
        "texts": texts,
        "bases": bases,
        "table": table,
        "folder": str(hf_folder("llama")),
    }


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_each_example_runs_as_written(
    name: str, namespace: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.chdir(tmp_path)  # an Example that writes a file writes it here
    example = sections(getattr(tangentlens, name))["Example"]
    test = doctest.DocTestParser().get_doctest(
        inspect.cleandoc(example), dict(namespace), f"tangentlens.{name}", None, 0
    )
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.run(test, out=lambda text: pytest.fail(text, pytrace=False))
    assert runner.summarize(verbose=False).attempted > 0
