"""Figures, the summary against the paper, and a self-contained HTML report from a
long results table (`tangentlens.core.results`).

>>> from tangentlens import report
>>> report.write_report("runs/study", "runs/study/report.html")   # a study's folder
>>> fig = report.plot_depth_profile(session.results())  # a `tangentlens.probe` session
"""

from .claims import Claim, Estimate
from .figures import (
    FIGURES,
    Rendered,
    plot_depth_profile,
    plot_energy_over_training,
    plot_frequency_distance,
    plot_head_heatmap,
    plot_intrinsic_dimension,
    plot_isotropy_removal,
    render_figures,
)
from .page import load_results, write_overview, write_report
from .summary import SummaryRow, format_summary, summary
from .table import PAPER
from .verdicts import paper_claims

__all__ = [
    "FIGURES",
    "PAPER",
    "Claim",
    "Estimate",
    "Rendered",
    "SummaryRow",
    "format_summary",
    "load_results",
    "paper_claims",
    "plot_depth_profile",
    "plot_energy_over_training",
    "plot_frequency_distance",
    "plot_head_heatmap",
    "plot_intrinsic_dimension",
    "plot_isotropy_removal",
    "render_figures",
    "summary",
    "write_overview",
    "write_report",
]
