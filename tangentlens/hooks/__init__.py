"""Where the model is touched: sites, the backend protocol, and its backends."""

from .base import Backend, Handle, get_backend
from .sites import KINDS, RESIDUAL_KINDS, WRITE_KINDS, Site, select_sites

__all__ = [
    "KINDS",
    "RESIDUAL_KINDS",
    "WRITE_KINDS",
    "Backend",
    "Handle",
    "Site",
    "get_backend",
    "select_sites",
]
