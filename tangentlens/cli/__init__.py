"""The ``tangentlens`` command: `commands` parses and prints, `workflows` does each
command's work."""

from .commands import build_parser, main

__all__ = ["build_parser", "main"]
