"""Test helpers: hook hygiene counts (not part of the library)."""

from __future__ import annotations

from typing import Any

from torch import nn
from transformer_lens.hook_points import HookPoint

from tangentlens.hooks.families import unwrap


def hook_counts(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Hooks on every module (and on a bridge's wrapped HF model): torch's forward-pre,
    forward, backward-pre and backward hooks, the gradient hooks on its own parameters,
    plus TL's fwd/bwd handle lists on HookPoints. Hook hygiene means this is identical
    before and after any probe."""
    roots = [("", model)]
    original = getattr(model, "original_model", None)
    if isinstance(original, nn.Module) and original is not model:
        roots.append(("original_model.", original))
    counts: dict[str, tuple[int, ...]] = {}
    for prefix, root in roots:
        for name, module in root.named_modules():
            row = (
                len(module._forward_pre_hooks),
                len(module._forward_hooks),
                len(module._backward_pre_hooks),
                len(module._backward_hooks),
            )
            if isinstance(module, HookPoint):
                row += (len(module.fwd_hooks), len(module.bwd_hooks))
            row += (sum(len(p._backward_hooks or ()) for p in module.parameters(recurse=False)),)
            counts[prefix + name] = row
    return counts


def hf_hook_counts(model: Any) -> dict[str, tuple[int, int, int]]:
    """Per HF module under an nnsight model: (forward, forward-pre, backward) hooks."""
    return {
        name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for name, m in unwrap(model).named_modules()
    }
