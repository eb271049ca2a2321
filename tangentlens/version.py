"""The version of tangentlens (one place; read by packaging and provenance)."""

__version__ = "0.1.0"
