"""Frequency vs distance to a centre, its permutation null, and the embedding-update split."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from tangentlens.analysis.embedding_geometry import (
    frequency_buckets,
    frequency_distance,
    update_split,
)
from tangentlens.core.subspace import TangentBasis


def _table(df) -> dict[str, float]:
    return dict(zip(df["statistic"], df["value"], strict=True))


def _data(vocab: int = 300, d: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    e = rng.normal(size=(vocab, d))
    counts = np.floor(rng.lognormal(2.0, 1.5, size=vocab))  # some zeros: unseen tokens
    counts[:5] = 0
    return e, counts


def test_correlations_match_brute_force_references():
    e, counts = _data()
    got = _table(frequency_distance(torch.tensor(e), torch.tensor(counts), n_permutations=20))
    seen = counts > 0
    es, cs = e[seen], counts[seen]
    centres = {
        "mean_all": e.mean(0),
        "mean_seen": es.mean(0),
        "weighted": np.average(es, axis=0, weights=cs),
        "norm": np.zeros(e.shape[1]),
    }
    for name, c in centres.items():
        dist = np.array([np.sqrt(((row - c) ** 2).sum()) for row in es])
        assert got[f"pearson_{name}"] == pytest.approx(stats.pearsonr(np.log(cs), dist)[0])
        assert got[f"spearman_{name}"] == pytest.approx(stats.spearmanr(np.log(cs), dist)[0])
    assert got["n_seen"] == seen.sum() and got["n_tokens"] == len(counts)


def test_permutation_null_matches_a_naive_loop():
    e, counts = _data(vocab=120, d=8, seed=1)
    got = _table(frequency_distance(e, counts, n_permutations=50, seed=7))
    seen = counts > 0
    es, cs = e[seen], counts[seen]
    rng = np.random.default_rng(7)
    null = []
    for _ in range(50):
        w = rng.permutation(cs)
        dist = np.linalg.norm(es - np.average(es, axis=0, weights=w), axis=1)
        null.append(stats.pearsonr(np.log(w), dist)[0])
    null = np.array(null)
    assert got["pearson_weighted_null_mean"] == pytest.approx(null.mean())
    assert got["pearson_weighted_null_std"] == pytest.approx(null.std(ddof=1))
    obs = got["pearson_weighted"]
    extreme = np.abs(null - null.mean()) >= abs(obs - null.mean())
    assert got["pearson_weighted_p_value"] == pytest.approx((1 + extreme.sum()) / 51)


def test_planted_frequent_tokens_near_the_centre():
    rng = np.random.default_rng(2)
    vocab, d = 400, 12
    counts = np.floor(rng.pareto(1.2, size=vocab) * 10) + 1
    centre = rng.normal(size=d) * 3
    direction = rng.normal(size=(vocab, d))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    radius = 10.0 / np.log1p(counts)  # frequent tokens sit close to the centre
    e = centre + direction * radius[:, None]
    got = _table(frequency_distance(e, counts, n_permutations=200))
    for name in ("mean_all", "mean_seen", "weighted"):
        assert got[f"pearson_{name}"] < -0.8, name
        assert got[f"spearman_{name}"] < -0.8, name
    # Far stronger than chance for the weighted centre, even though the null is not 0.
    assert got["pearson_weighted_p_value"] < 0.01
    assert (
        got["pearson_weighted"]
        < got["pearson_weighted_null_mean"] - 5 * got["pearson_weighted_null_std"]
    )


def test_permutation_null_is_centred_on_exchangeable_data():
    # Rows independent of frequency: the observed value is one draw from the null, whose
    # mean is the expected value (≈ 0 here, as no token carries most of the weight).
    ps = []
    for seed in range(5):
        e, counts = _data(vocab=500, d=16, seed=10 + seed)
        got = _table(frequency_distance(e, counts, n_permutations=200, seed=seed))
        assert abs(got["pearson_weighted_null_mean"]) < 0.05
        assert (
            abs(got["pearson_weighted"] - got["pearson_weighted_null_mean"])
            < 4 * got["pearson_weighted_null_std"]
        )
        ps.append(got["pearson_weighted_p_value"])
    assert max(ps) > 0.05
    again = frequency_distance(*_data(vocab=500, d=16, seed=10), n_permutations=200, seed=0)
    first = frequency_distance(*_data(vocab=500, d=16, seed=10), n_permutations=200, seed=0)
    assert again.equals(first)


def test_frequency_buckets_partition_the_vocabulary():
    counts = np.array([0, 5, 1, 1, 9, 0, 3, 2, 7, 4])
    buckets = frequency_buckets(counts, 4, vocab=12)
    assert list(buckets) == ["q1", "q2", "q3", "q4", "unseen"]
    assert sorted(np.concatenate(list(buckets.values())).tolist()) == list(range(12))
    assert buckets["q4"].tolist() == [8, 4]  # most frequent last
    assert set(buckets["unseen"].tolist()) == {0, 5, 10, 11}


def test_update_split_sums_and_extremes():
    rng = np.random.default_rng(3)
    vocab, d, k = 60, 10, 3
    q = torch.linalg.qr(torch.tensor(rng.normal(size=(d, k))))[0]
    basis = TangentBasis(q)
    before = rng.normal(size=(vocab, d))
    after = before + rng.normal(size=(vocab, d))
    counts = rng.integers(0, 5, size=vocab)
    df = update_split(before, after, basis, counts)
    for _, group in df.groupby("bucket"):
        s = dict(zip(group["statistic"], group["value"], strict=True))
        assert s["tangent"] + s["normal"] == pytest.approx(s["total"], rel=1e-12)
        assert 0.0 <= s["tangent_share"] <= 1.0 and s["chance_share"] == k / d
    per_bucket = df[(df.statistic == "total") & (df.bucket != "all")]["value"].sum()
    assert per_bucket == pytest.approx(df[(df.bucket == "all") & (df.statistic == "total")].value)
    qn = q.numpy()
    inside = update_split(before, before + rng.normal(size=(vocab, k)) @ qn.T, basis)
    assert inside.set_index("statistic").loc["tangent_share", "value"] == pytest.approx(1.0)
    ortho = before + rng.normal(size=(vocab, d)) @ (np.eye(d) - qn @ qn.T)
    outside = update_split(before, ortho, q)
    assert outside.set_index("statistic").loc["tangent_share", "value"] == pytest.approx(0.0)
    still = update_split(before, before, basis).set_index("statistic")
    assert np.isnan(still.loc["tangent_share", "value"])


def test_bad_input():
    e, counts = _data()
    with pytest.raises(ValueError, match="vocab, d"):
        frequency_distance(e[0], counts)
    with pytest.raises(ValueError, match="beyond the 300 embedding rows"):
        frequency_distance(e, np.ones(301))
    bad = e.copy()
    bad[3, 3] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        frequency_distance(bad, counts)
    with pytest.raises(ValueError, match="at least 3"):
        frequency_distance(e, np.r_[1, 1, np.zeros(298)])
    with pytest.raises(ValueError, match="non-negative"):
        frequency_distance(e, -np.ones(300))
    q = torch.linalg.qr(torch.randn(8, 2, dtype=torch.float64))[0]
    with pytest.raises(ValueError, match="fit the basis on this model"):
        update_split(e, e, q)
    with pytest.raises(ValueError, match="one shape"):
        update_split(e, e[:10], q)
    # Rows past the tokenizer (padded embeddings) count as unseen.
    padded = _table(frequency_distance(np.vstack([e, e[:4]]), counts, n_permutations=5))
    assert padded["n_tokens"] == 304 and padded["n_seen"] == (counts > 0).sum()
