"""Half-precision models: hooks see float16/bfloat16, statistics stay float64 and agree."""

import numpy as np
import pytest
import torch
from models import hf_folder, tokens

import tangentlens

pytestmark = pytest.mark.filterwarnings("ignore:k/d")


def _bridge(dtype):
    from transformer_lens import TransformerBridge

    return TransformerBridge.boot_transformers(str(hf_folder("llama")), dtype=dtype)


@pytest.fixture(scope="module")
def reference():
    model = _bridge(torch.float32)
    batches = [tokens("llama", batch=4, pos=16, seed=s) for s in range(3)]
    bases = tangentlens.fit_bases(model, batches, rank=4, progress=False)
    session = tangentlens.probes.run(
        model, batches, bases, ("residual", "gradient"), progress=False, n_controls=50
    )
    return batches, bases, session


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_gives_float64_statistics_close_to_float32(dtype, reference):
    batches, bases, ref = reference
    model = _bridge(dtype)
    assert next(model.parameters()).dtype == dtype
    session = tangentlens.probes.run(
        model, batches, bases, ("residual", "gradient"), progress=False, n_controls=50
    )
    for m in [*session.activation_moments.values(), *session.gradient_moments.values()]:
        assert m.mean.dtype == torch.float64 and torch.isfinite(m.covariance()).all()
    ours, theirs = session.results(), ref.results()
    key = ["probe", "site", "layer", "statistic"]
    shares = ours[ours.statistic == "tangent_share"].merge(
        theirs[theirs.statistic == "tangent_share"], on=key, suffixes=("", "_ref")
    )
    assert len(shares) >= 8
    tol = 0.05 if dtype == torch.bfloat16 else 0.01
    np.testing.assert_allclose(shares.value, shares.value_ref, atol=tol)
