"""``progress=False`` silences every bar: each entry point that can show one (loading,
fitting, probing, linear probes, interventions) writes no bar to stderr."""

from __future__ import annotations

import re
import warnings

import pytest
from models import _SENTENCES, hf_folder, tl_bridge

import tangentlens

BAR = re.compile(r"\d+%\||it/s|s/it")
TEXTS = [*_SENTENCES, *(" ".join(reversed(s.split())) for s in _SENTENCES)]


def test_progress_false_shows_no_bar(capfd: pytest.CaptureFixture, one_thread) -> None:
    folder = str(hf_folder("llama"))
    model = tl_bridge("llama")
    capfd.readouterr()  # building the tiny models shows their own bars
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = {
            b: tangentlens.load(folder, b, progress=False) for b in ("transformer_lens", "nnsight")
        }
        bases = tangentlens.fit_bases(model, TEXTS, rank=4, progress=False)
        tangentlens.run(model, TEXTS, bases, progress=False).results()
        tangentlens.run(loaded["nnsight"].model, TEXTS, bases, ("residual",), progress=False)
        tangentlens.layerwise_probe(model, TEXTS, bases, "position", n_folds=2, progress=False)
        tangentlens.causal_effects(model, TEXTS, bases, n_null=2, progress=False)
        tangentlens.head_effects(model, TEXTS, bases, layers=[0], n_null=2, progress=False)
    err = capfd.readouterr().err
    assert not BAR.search(err), err[-2000:]


def test_load_shows_its_bar_unless_told(capfd: pytest.CaptureFixture) -> None:
    """The check above can see a bar: loading with the default shows transformers' own."""
    from transformers.utils import logging as hf_logging

    if not hf_logging.is_progress_bar_enabled():
        pytest.skip("transformers' bars are off in this environment")
    folder = str(hf_folder("llama"))
    capfd.readouterr()
    tangentlens.load(folder, "nnsight")
    assert BAR.search(capfd.readouterr().err)
