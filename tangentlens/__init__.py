"""tangentlens: tangent-subspace probes and anisotropy statistics for language transformers."""

__version__ = "0.1.0"
