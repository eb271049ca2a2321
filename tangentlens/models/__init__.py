"""The model side beyond the hooks: what a model is fed (`batches`) and how real
models are loaded offline (`loading`, whose names this package re-exports)."""

from .loading import (
    KNOWN_MODELS,
    HubUnavailableError,
    KnownModel,
    LoadedModel,
    cache_dir,
    check_model_folder,
    gemma3_folder,
    is_hub_id,
    load,
    minilm_folder,
    model_folder,
    quiet_transformers,
    smollm2_folder,
    wrap,
)

__all__ = [
    "KNOWN_MODELS",
    "HubUnavailableError",
    "KnownModel",
    "LoadedModel",
    "cache_dir",
    "check_model_folder",
    "gemma3_folder",
    "is_hub_id",
    "load",
    "minilm_folder",
    "model_folder",
    "quiet_transformers",
    "smollm2_folder",
    "wrap",
]
