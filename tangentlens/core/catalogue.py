"""The catalogue of statistics: every name a results table may hold, what it means, what it
conditions on, how to read it, and the paper's setting where the package has an option.

`STATISTICS` maps each name to a `Statistic`. The package's own probes and analyses
register theirs here (below); a probe of yours registers its names with
``tangentlens.core.catalogue.register(Statistic(...))``. `tangentlens.core.results.write` refuses a
table whose ``statistic`` column holds a name the catalogue lacks (`check_names`), so a
written table never holds a number nobody defined. ``python -m tangentlens.core.catalogue``
prints ``docs/STATISTICS.md`` (`document`).

A name may be emitted by several probes (``tangent_share`` by ``residual``, ``gradient``
and ``weight_gradient``); its entry says what it measures for each, and the table's
``probe`` column says which it is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import UsageError

__all__ = ["STATISTICS", "Statistic", "check_names", "document", "get", "markdown", "register"]


@dataclass(frozen=True)
class Statistic:
    """One statistic of a results table.

    ``probe``: the probe(s) or analysis that emit it (the table's ``probe`` column), a
    name or a tuple of names; ``definition``: the formula; ``conditions``: what it
    conditions on (site, basis Q_T, rank k, controls, window, ...); ``reading``: how to
    read it; ``paper_option``: the paper's setting, where the package has an option.
    """

    name: str
    probe: str | tuple[str, ...]
    definition: str
    conditions: str
    reading: str
    paper_option: str = ""

    @property
    def probes(self) -> tuple[str, ...]:
        """``probe`` as a tuple."""
        return (self.probe,) if isinstance(self.probe, str) else tuple(self.probe)


STATISTICS: dict[str, Statistic] = {}


def register(*stats: Statistic) -> None:
    """Add statistics to the catalogue. Registering an identical entry again is a no-op;
    another entry under a registered name is a `UsageError`."""
    for stat in stats:
        if not isinstance(stat, Statistic):
            raise UsageError(f"register takes Statistic entries; got {type(stat).__name__}.")
        if not isinstance(stat.name, str) or not stat.name:
            raise UsageError(f"a statistic's name must be a non-empty string; got {stat.name!r}.")
        known = STATISTICS.get(stat.name)
        if known is not None and known != stat:
            raise UsageError(
                f"the statistic {stat.name!r} is already in the catalogue with another entry "
                f"({known}); choose another name for yours."
            )
    for stat in stats:
        STATISTICS[stat.name] = stat


def get(name: str) -> Statistic:
    """The catalogue's entry for ``name``; a `UsageError` naming the fix if there is none."""
    check_names([name], "get")
    return STATISTICS[name]


def _shown(name: object) -> str:
    return repr(name) if isinstance(name, str) else f"{name!r} (not a string)"


def check_names(names: Iterable[object], where: str) -> None:
    """A `UsageError` naming every entry of ``names`` that is not a catalogued statistic
    (``where`` says what was being done), and how to register it."""
    unknown = []
    for name in names:
        missing = name is None or (isinstance(name, float) and math.isnan(name))
        if missing or not isinstance(name, str) or name not in STATISTICS:
            shown = _shown(None if missing else name)
            if shown not in unknown:
                unknown.append(shown)
    if unknown:
        raise UsageError(
            f"{where}: the statistic(s) {', '.join(sorted(unknown))} are not in the catalogue "
            "of statistics (docs/STATISTICS.md). Register each with "
            "tangentlens.core.catalogue.register(Statistic(name, probe, definition, conditions, "
            "reading)) before writing, or drop those rows."
        )


# ------------------------------------------------------------------------- the entries
_S = Statistic
_TOKENS = "the tokens seen (padding left out)"
_SITE = "the site, its basis Q_T (rank k, fitted at that site), " + _TOKENS
_GRAD = (
    "the site, Q_T (rank k), the gradients ∂L/∂h of " + _TOKENS + "; positions whose "
    "gradient is zero by construction (each sequence's last position under the next-token "
    "loss) left out"
)
_CONTROLS = "; the n matched-rank random frames (n_controls, seed)"
_STUDY = "; in a study also the checkpoint and the rank column"
_KD = "k and d only"
_ISO_OPTION = (
    "ζ (StudyConfig.zeta and the gradient probe's zeta, one default; the paper's "
    "shrinkage) and the reference R: the trace-normalised gradient covariance pooled over "
    "the checkpoints analysed together, scaled to the checkpoint's trace"
)
_ISO_DEF = (
    "IsoScore* is the IsoScore (PR − 1)/(d − 1), PR = tr(S)²/tr(S²), of S = (1 − ζ)·C + ζ·R, C "
    "the gradient covariance (n − 1 normalisation); after removing a frame Q it is measured in "
    "the complement's coordinates (dimension d − k). R is the trace-normalised gradient "
    "covariance averaged over the checkpoints analysed together, scaled to this checkpoint's "
    "trace (significance.pooled_shape, reference_at). A probe session analyses each "
    "checkpoint (tag) alone, so R is that checkpoint's own covariance and ζ has no effect; "
    "a study and a probe session of one checkpoint give the same number."
)
_BASE = [
    _S("tangent_share", ("residual", "gradient", "weight_gradient"),
       "E‖vQ_T‖²/E‖v‖² = tr(Q_TᵀHQ_T)/tr(H), H = E[v vᵀ] uncentred. residual: v = the "
       "activation (at attn_out/mlp_out: the block's write, in the basis of the residual site "
       "it writes into); gradient: v = ∂L/∂h; weight_gradient: H = S = Σ G Gᵀ of the weight "
       "gradients of the maps reading the site",
       _SITE + _STUDY, "k/d (chance_share) for an isotropic v; 1: all energy in Q_T",
       "the paper's E(Q_T)"),
    _S("chance_share", ("residual", "gradient", "weight_gradient"),
       "k/d: the expected tangent_share of an isotropic vector (the exact mean over uniformly "
       "random k-frames)", _KD, "the level tangent_share is compared with"),
    _S("share_ratio", "residual", "tangent_share / chance_share = tangent_share·d/k",
       _SITE + _STUDY, "1: no more energy in Q_T than an isotropic vector; >1: biased into Q_T"),
    _S("energy_ratio", ("gradient", "weight_gradient"),
       "s/((1 − s)·k/(d − k)), s = tangent_share: the share in Q_T over the exact mean share "
       "of a uniformly random k-frame in the complement of Q_T (closed form, no Monte Carlo)",
       _GRAD + _STUDY, "1: Q_T holds as much gradient energy as a normal control; >1: more; "
       "inf when s = 1",
       "the paper's mean over 20 normal controls estimates the same denominator"),
    _S("p_value", ("gradient", "weight_gradient", "intervention"),
       "gradient, weight_gradient: (1 + #{E(Q) ≥ E(Q_T)})/(n + 1) over n uniformly random "
       "(Haar) k-frames Q of the whole space, E the energy share (one-sided, exact under any "
       "rotation-invariant null; E(Q), traces in float32, ties E(Q_T) within 16 float32 "
       "rounding steps, so an exact tie counts). intervention: "
       "(1 + #{|Δ_null| ≥ |Δ|})/(n_null + 1), Δ the "
       "metric change of the ablation, Δ_null that of ablating uniformly random k-frames "
       "(two-sided)", _GRAD + _CONTROLS + " (intervention: the batches, metric and n_null)",
       "small: Q_T is special for these tokens; the smallest possible value is 1/(n + 1)",
       "controls: uniform here, normal in p_value_normal (the paper's)"),
    _S("p_value_normal", ("gradient", "weight_gradient"),
       "p_value's energy test against n frames drawn orthogonal to Q_T (normal controls); "
       "emitted only when 2k < d", _GRAD + _CONTROLS,
       "as p_value, but anti-conservative when k/d is not small (normal controls are not "
       "exchangeable with Q_T; a warning from k/d = 0.05 on)", "the paper's controls (normal, "
       "n = 20)"),
    _S("normalized_ratio", ("gradient", "weight_gradient"),
       "energy_ratio of the gradient object over the same closed-form ratio of the site's "
       "activations (their uncentred second moment E[x xᵀ] over the same sequences; every "
       "real token, so also each sequence's last position, whose gradient is zero under the "
       "next-token loss: one token in L at L tokens a sequence): the random-backprop null, "
       "since for Δ independent of x, E[G Gᵀ] ∝ E[x xᵀ]", _GRAD + _STUDY,
       "1: the gradients favour Q_T only as much as the activations do; >1: more"),
    _S("delta_iso_tangent", "gradient",
       "ΔIso*_T = IsoScore*(gradient covariance after removing Q_T) − IsoScore*(before). "
       + _ISO_DEF, _GRAD + "; ζ and R" + _STUDY,
       "positive: Q_T is what makes the gradients anisotropic; 0: removing it changes nothing",
       _ISO_OPTION),
    _S("delta_iso_normal", "gradient",
       "the mean over the n normal controls (frames orthogonal to Q_T; 2k < d only) of "
       "IsoScore*(after removing the control) − IsoScore*(before), with the same ζ and R as "
       "delta_iso_tangent. " + _ISO_DEF, _GRAD + _CONTROLS + "; ζ and R",
       "the ΔIso* of removing an ordinary direction set; compare delta_iso_tangent with it",
       _ISO_OPTION + "; normal controls as in the paper"),
    _S("iso_statistic", "gradient",
       "delta_iso_tangent minus the mean ΔIso* over n uniformly random k-frames (same ζ, R). "
       + _ISO_DEF, _GRAD + _CONTROLS + "; ζ and R",
       "0: removing Q_T raises IsoScore* no more than a random frame; >0: more", _ISO_OPTION),
    _S("isotropy_p_value", "gradient",
       "(1 + #{ΔIso*_Q ≥ ΔIso*_T})/(n + 1) over n uniformly random k-frames Q (same ζ, R; "
       "a ΔIso*_Q within 16 float32 rounding steps of ΔIso*_T, absolute, counts as a tie). "
       + _ISO_DEF, _GRAD + _CONTROLS + "; ζ and R",
       "small: removing Q_T makes the gradients more isotropic than removing a random frame",
       _ISO_OPTION + "; controls: uniform (exact)"),
    _S("isotropy_p_value_normal", "gradient",
       "isotropy_p_value against n normal controls (frames orthogonal to Q_T; 2k < d only). "
       + _ISO_DEF, _GRAD + _CONTROLS + "; ζ and R",
       "as isotropy_p_value; anti-conservative when k/d is not small",
       _ISO_OPTION + "; the paper's normal controls"),
    _S("mean_sq_norm", ("residual", "activation"), "E‖x‖²: the uncentred mean squared norm of "
       "the activation at the site", "the site, " + _TOKENS, "the stream's scale"),
    _S("n_tokens", ("residual", "gradient", "activation", "embedding"),
       "residual, activation: token positions counted at the site; gradient: gradient vectors "
       "counted (zero-by-construction positions left out); embedding: rows of the embedding "
       "matrix (the vocabulary)", "the site and the tokens seen (embedding: the model)",
       "the sample size behind the site's other numbers"),
    _S("share_amplification", "residual",
       "share_ratio[l]/share_ratio[p], p the previous probed layer of the same residual site "
       "kind; no row at the first. Interval: joint jackknife (a group left out of both layers) "
       "of the log ratio, exponentiated; a warning names layers without a basis between",
       _SITE, "1: the bias neither grows nor shrinks from p to l; >1: it grows"),
    _S("energy_amplification", "gradient",
       "energy_ratio[l]/energy_ratio[p], p the previous probed layer of the same residual "
       "site kind; no row at the first; joint jackknife interval of the log ratio, "
       "exponentiated", _GRAD,
       "1: the gradient bias toward Q_T is unchanged from p to l; >1: it grows"),
    _S("n_passes", "weight_gradient", "backward passes folded into S = Σ G Gᵀ",
       "the batches run", "the sample size behind the site's weight-gradient numbers"),
    _S("kv_group", "attention",
       "head // (n_heads // n_kv_heads): the key/value head this head shares (GQA)",
       "the model's architecture", "heads with one value share keys and values"),
    _S("linearised_qk_norm", "attention",
       "a flag (value 1, head empty): the layer normalises q/k, so its score split freezes "
       "each norm's scale per token and head (a linearisation)", "the model's architecture",
       "present: this layer's score shares rest on the linearisation"),
    _S("eigengap", "basis",
       "λ_k/λ_{k+1} of the activation covariance Q_T was fitted on", "the fitting tokens",
       "near 1: Q_T's last direction is poorly determined; large: a clear gap"),
    _S("chance_overlap", "basis",
       "k/d: the expected overlap of two independent uniformly random k-frames", _KD,
       "the level split_half_overlap is compared with"),
    _S("split_half_overlap", "basis",
       "‖Q_AᵀQ_B‖²_F/k for bases fitted on the even and the odd groups of sequences",
       "the fitting tokens", "1: Q_T is a property of the model; near chance_overlap: noise"),
    _S("drift_overlap", "basis",
       "‖Q_TᵀQ_c‖²_F/k, Q_c the top-k PCA subspace of this checkpoint's own activations",
       "the study's Q_T and this checkpoint's activations (rank k)",
       "1: the checkpoint's top-k subspace is still Q_T; k/d: unrelated"),
    _S("twonn_dimension", "activation",
       "TwoNN intrinsic dimension of the reservoir sample, neighbours from other sequences only",
       "the site and the sampled tokens; the checkpoint",
       "the dimension of the point cloud", "the paper's TwoNN is twonn_dimension_within"),
    _S("twonn_dimension_within", "activation",
       "TwoNN intrinsic dimension of the reservoir sample, all neighbours (the plain estimate)",
       "the site and the sampled tokens; the checkpoint",
       "lower than twonn_dimension where consecutive positions are near-duplicates",
       "the paper's TwoNN"),
    _S("effective_rank", "activation",
       "exp(entropy of the normalised singular values of the centred activations)",
       "the site, " + _TOKENS + "; the checkpoint", "1: one direction; d: isotropic"),
    _S("participation_ratio", "activation", "tr(C)²/tr(C²), C the activation covariance",
       "the site, " + _TOKENS + "; the checkpoint", "1: one direction; d: isotropic"),
    _S("isoscore", "activation", "IsoScore (PR − 1)/(d − 1) of the activation covariance",
       "the site, " + _TOKENS + "; the checkpoint", "0: one direction; 1: isotropic"),
    _S("grad_isoscore", "gradient", "IsoScore (PR − 1)/(d − 1) of the gradient covariance",
       _GRAD + "; the checkpoint", "0: one direction; 1: isotropic"),
    _S("grad_effective_rank", "gradient",
       "effective rank of the gradients (exp entropy of normalised singular values)",
       _GRAD + "; the checkpoint", "1: one direction; d: isotropic"),
    _S("probe_loss", "checkpoint", "mean loss per predicted token on the study's probe "
       "sequences", "the checkpoint and the probe sequences", "lower: a better model"),
    _S("train_loss", "checkpoint", "the training loss the checkpoint recorded",
       "the checkpoint's metadata", "lower: a better fit to the training batch"),
    _S("eval_loss", "checkpoint", "the evaluation loss the checkpoint recorded",
       "the checkpoint's metadata", "lower: a better model"),
    _S("duplicate_of", "checkpoint",
       "the step of an earlier checkpoint with bit-identical weights", "the weight hashes",
       "present: this checkpoint repeats that one"),
    _S("n_seen", "embedding", "vocabulary rows seen at least once in the corpus",
       "the model and the corpus counts", "the sample size of the correlations"),
    _S("n_permutations", "embedding", "count shuffles behind the weighted centre's null",
       "StudyConfig.n_permutations", "more: a finer p-value"),
    _S("delta_metric", "intervention",
       "metric with `part` of the activation (or of a head's score) removed − clean metric "
       "(default metric: mean next-token loss per predicted token)",
       "the site (or head), Q_T, component (tangent/normal part), the batches and metric",
       "> 0: the removed part helps the model"),
    _S("delta_metric_null_mean", "intervention",
       "mean of delta_metric over n_null uniformly random k-frames removed instead",
       "as delta_metric; n_null and seed", "what removing k random directions costs"),
    _S("delta_metric_null_std", "intervention", "standard deviation (ddof 1) of that null",
       "as delta_metric; n_null and seed", "the spread of the null"),
    _S("z", "intervention", "(delta_metric − delta_metric_null_mean)/delta_metric_null_std",
       "as delta_metric; n_null and seed", "|z| large: the removal matters more than random"),
    _S("p_value_floor", "intervention", "1/(n_null + 1): the smallest p_value this null allows",
       "n_null", "p_value cannot fall below it; 8 frames never reach 0.05, 99 reach 0.01"),
    _S("accuracy", "linear",
       "cross-validated accuracy (folds over sequences) of a logistic-regression probe on the "
       "full activation, its tangent or its normal part (component)",
       "the site, Q_T, the labels and the sampled tokens", "vs chance_accuracy"),
    _S("chance_accuracy", "linear", "the majority label's frequency in the sample",
       "the labels and the sampled tokens", "the accuracy of always guessing the majority"),
    _S("balanced_accuracy", "linear",
       "cross-validated mean over labels of each label's recall (sklearn "
       "balanced_accuracy_score), folds over sequences; t interval over folds clipped to [0, 1]",
       "as accuracy", "vs chance_balanced_accuracy; not flattered by a majority label"),
    _S("chance_balanced_accuracy", "linear", "1/(number of labels in the sample)",
       "the labels and the sampled tokens", "the balanced accuracy of any constant guess"),
    _S("roc_auc", "linear",
       "cross-validated ROC AUC of the probe's probabilities, one-vs-rest macro mean over "
       "labels when there are more than two; t interval over folds clipped to [0, 1]",
       "as accuracy", "0.5: chance; 1: the labels are perfectly ranked"),
]  # fmt: skip

# --- attention: score shares of the split TT + TN + NT + NN + bias, and their nulls
_TERMS = ("TT", "TN", "NT", "NN", "bias")
_HEAD = "the layer's attention input, Q_T fitted there (rank k), the head, " + _TOKENS
_NULL = (
    "; head_null random frames orthogonal to Q_T (seed + layer), on the first "
    "head_null_sequences sequences the probe sees"
)
_KL = (
    "mean over kept query rows of KL(P ‖ P_TT) in nats, P = softmax(score + mask), P_TT = "
    "softmax(TT + bias + mask)"
)
_SCORE = [
    (f"score_share_{t}", f"E_{t}/Σ_u E_u, E_u = Σ u² over the unmasked score entries, u in "
     "TT, TN, NT, NN, bias (T: the tangent part x Q_T Q_Tᵀ of the input, N: the rest)",
     "the shares sum to 1; compare with their _null")
    for t in _TERMS
] + [("pattern_kl_TT", _KL, "0: TT + bias alone give the pattern")]  # fmt: skip
_ATTENTION = []
for _name, _definition, _reading in _SCORE:
    _ATTENTION += [
        _S(_name, "attention", _definition, _HEAD, _reading),
        _S(f"{_name}_null", "attention", f"mean of {_name} over the null frames used as Q_T",
           _HEAD + _NULL, f"what {_name} is for k ordinary directions"),
        _S(f"{_name}_null_std", "attention", f"standard deviation of {_name} over the null "
           "frames", _HEAD + _NULL, "the spread of the null"),
        _S(f"{_name}_null_sample", "attention", f"{_name} of Q_T itself on the null's "
           "sequences: what _p_value and _z compare with the frames",
           _HEAD + _NULL, f"equal to {_name} when the null saw every sequence"),
        _S(f"{_name}_p_value", "attention", f"(1 + #{{frames j: |{_name}_j − m| ≥ |s − m|}})"
           f"/(n + 1), two-sided, s = {_name}_null_sample, m the mean of s and the n = "
           "head_null frame values together, all on the same sequences; floor 1/(n + 1) "
           "(0.01 with 99 frames)", _HEAD + _NULL,
           "small: Q_T is not an ordinary k-frame for this head, in either direction (the "
           f"sign is in {_name} − {_name}_null): either is a finding, and the shares sum to 1, "
           "so one term's excess is another's shortfall. Exact when Q_T and the frames are "
           "exchangeable; the frames avoid Q_T, so it errs small by a margin of order k/d. It "
           "cannot fall below 1/(n + 1)"),
        _S(f"{_name}_z", "attention", f"({_name}_null_sample − {_name}_null)/{_name}_null_std "
           "(0 where the "
           "null does not vary and equals it, ±inf where it differs); only with at least 99 "
           "frames, since a spread estimated from a few is too noisy to divide by",
           _HEAD + _NULL, "|z| large: Q_T is special for this head; test with _p_value"),
    ]  # fmt: skip
_WRITE = "the head, W_O, the basis of the residual stream written into (rank k), " + _TOKENS
_ATTENTION += [
    _S("head_null_sequences", "attention", "sequences the head null's frames (and each "
       "_null_sample) were computed on: the first head_null_sequences the probe saw, per "
       "process", "the layer's attention input; head_null_sequences", "fewer than the "
       "probe's sequences: the null's rows rest on this many"),
    _S("write_share", "attention", "Σ‖z_h W_O^h Q_T‖²/Σ‖z_h W_O^h‖²: the share of the head's "
       "write in Q_T", _WRITE, "k/d: isotropic; >k/d: the head writes into Q_T"),
    _S("write_chance_share", "attention", "k/d: the mean write_share over uniformly random "
       "k-frames", _KD, "the level write_share is compared with"),
    _S("write_share_ratio", "attention", "write_share·d/k", _WRITE, "1: chance; >1: into Q_T"),
    _S("write_share_null_std", "attention", "closed-form standard deviation of the share over "
       "uniformly random k-frames", _WRITE, "the spread of the null"),
    _S("write_share_z", "attention", "(write_share − k/d)/write_share_null_std", _WRITE,
       "|z| large: the write's share is far from random"),
] + [
    _S(f"write_basis_{kind}", "attention", f"a flag (head empty) whose value is the layer of "
       f"the {kind} basis the attention writes were measured in", "the bases available",
       f"e.g. 3: measured in blocks.3.hook_{kind}")
    for kind in ("resid_mid", "resid_post", "resid_pre")
]  # fmt: skip

# --- embedding: frequency vs distance to a centre, and the split of the embedding update
_CENTRES = {
    "mean_all": "the mean of all rows",
    "mean_seen": "the mean of the seen rows",
    "weighted": "the count-weighted mean of the seen rows",
    "norm": "the origin",
}
_EMB = "the checkpoint's embedding matrix and the corpus token counts (seen tokens only)"
_EMBEDDING = []
for _kind, _what in (("pearson", "Pearson"), ("spearman", "Spearman")):
    for _centre, _at in _CENTRES.items():
        _EMBEDDING.append(
            _S(f"{_kind}_{_centre}", "embedding", f"{_what} correlation of log(count) with the "
               f"distance of each seen row to {_at}; interval by Fisher's z", _EMB,
               "< 0: frequent tokens sit nearer the centre")
        )  # fmt: skip
    _NULL_W = f"{_kind}_weighted under counts shuffled across the seen tokens"
    _EMBEDDING += [
        _S(f"{_kind}_weighted_null_mean", "embedding", f"mean of {_NULL_W}",
           _EMB + "; n_permutations, seed", "the correlation the weighting alone produces"),
        _S(f"{_kind}_weighted_null_std", "embedding", f"standard deviation of {_NULL_W}",
           _EMB + "; n_permutations, seed", "the spread of that null"),
        _S(f"{_kind}_weighted_p_value", "embedding", f"(1 + #{{|null − mean| ≥ |r − mean|}})/"
           f"(1 + n), two-sided, for {_NULL_W}", _EMB + "; n_permutations, seed",
           "small: the weighted correlation is not an artefact of the weighting"),
    ]  # fmt: skip
_UPDATE = {
    "total": ("‖ΔE‖², ΔE = E_now − E_previous checkpoint", "the size of the update"),
    "tangent": ("‖ΔE Q_T‖²", "the update's energy in Q_T"),
    "normal": ("‖ΔE − ΔE Q_T Q_Tᵀ‖² (tangent + normal = total)", "the rest"),
    "tangent_share": ("‖ΔE Q_T‖²/‖ΔE‖² (NaN for no update)", "k/d: isotropic; >k/d: into Q_T"),
    "chance_share": ("k/d", "the level update_tangent_share is compared with"),
    "n_tokens": ("vocabulary rows in the bucket", "the bucket's size"),
}
_BUCKETS = {"": "all rows", **{f"_q{i}": f"frequency quartile {i} (1: rarest)" for i in (1, 2)}}
_BUCKETS |= {f"_q{i}": f"frequency quartile {i}" for i in (3, 4)}
_BUCKETS["_unseen"] = "rows never seen in the corpus"
for _stat, (_definition, _reading) in _UPDATE.items():
    for _suffix, _rows in _BUCKETS.items():
        _EMBEDDING.append(
            _S(f"update_{_stat}{_suffix}", "embedding", f"{_definition}, over {_rows}",
               "two consecutive checkpoints, Q_T of resid_pre at layer 0 (rank k), the counts",
               _reading)
        )  # fmt: skip

# --- window summaries of a study
_WIN = "the rank; the checkpoints of the window; jackknife interval over groups of sequences"
_WINDOW = []
for _name, _definition in (
    ("gradient_energy_ratio", "mean of the gradient probe's energy_ratio over residual sites"),
    ("weight_gradient_energy_ratio", "mean of weight_gradient energy_ratio over input sites"),
    (
        "weight_gradient_normalized_ratio",
        "mean of weight_gradient normalized_ratio (energy "
        "ratio over the activations' own ratio: 1 under random backprop) over input sites; the "
        "jackknife leaves each group out of both S and the activations",
    ),
    ("gradient_delta_iso_excess", "mean of delta_iso_tangent − delta_iso_normal over sites"),
):
    _WINDOW += [
        _S(_name, "window", _definition + " and the checkpoints of the window (early, late)",
           _WIN, "compare early with late", "early/late windows: StudyConfig.window_fraction"),
        _S(f"{_name}_late_minus_early", "window", f"{_name} of the late window − of the early "
           "(window late-early)", _WIN, "> 0: the quantity grows during training",
           "early/late windows: StudyConfig.window_fraction"),
    ]  # fmt: skip

_BUILTIN = (*_BASE, *_ATTENTION, *_EMBEDDING, *_WINDOW)
register(*_BUILTIN)


# ------------------------------------------------------------------------- documents
_INTRO = """\
<!-- generated by `python -m tangentlens.core.catalogue > docs/STATISTICS.md`; edit
tangentlens/core/catalogue.py, not this file -->
# Statistics

Every name the `statistic` column of a tangentlens results table can hold. Q_T is a rank-k
orthonormal basis (d × k) fitted by centred PCA on activations at a site; a *frame* is a
k-dimensional orthonormal basis, *uniform* frames are drawn from the whole space (exact
p-values), *normal* ones orthogonal to Q_T (the paper's controls). Where a row has
`ci_low`/`ci_high`, they are a 95 % delete-a-group jackknife interval over groups of whole
sequences (the probes' ratios on the log scale and shares on the logit scale, so neither
leaves its range, `share_ratio`'s the share's times d/k; a study's window rows plainly),
except where a row says otherwise (Pearson and Spearman r: Fisher's z; linear probes: a t
interval over folds). The `probe` column says which probe emitted a row.
`tangentlens.core.results.write` refuses a name not listed here; register your own with
`tangentlens.core.catalogue.register(Statistic(...))`.
"""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def markdown(stats: Iterable[Statistic] | None = None) -> str:
    """A markdown table of ``stats`` (default: the whole catalogue, in registration order)."""
    lines = [
        "| statistic | probe | definition | conditions on | how to read | paper's option |",
        "|---|---|---|---|---|---|",
    ]
    for s in STATISTICS.values() if stats is None else stats:
        cells = [f"`{s.name}`", ", ".join(s.probes), s.definition, s.conditions, s.reading]
        lines.append("| " + " | ".join(_cell(c) for c in [*cells, s.paper_option]) + " |")
    return "\n".join(lines) + "\n"


def document() -> str:
    """The text of ``docs/STATISTICS.md``: a short introduction and the package's own
    statistics (`markdown`), without any registered since import."""
    return _INTRO + "\n" + markdown(_BUILTIN)


def main() -> None:
    """Print `document` (``python -m tangentlens.core.catalogue > docs/STATISTICS.md``)."""
    print(document(), end="")


if __name__ == "__main__":
    main()
