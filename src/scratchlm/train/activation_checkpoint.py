"""Activation checkpointing applied to a plain model from outside.

Each selected Transformer block's ``forward`` is replaced, on that module instance only, by a
call through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the block's
inner activations are dropped after the forward and recomputed during the backward, so
activation memory per block shrinks to its input. No wrapper module is inserted, so
``state_dict`` keys, hooks and ``isinstance`` checks on the model are unchanged.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing", "remove_activation_checkpointing"]

_ORIGINAL_FORWARD = "_scratchlm_forward_before_checkpointing"


def _blocks_of(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        return list(layers)
    inner = getattr(model, "module", None)  # DDP / FSDP / torch.compile wrappers keep the model here
    if inner is None:
        inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module):
        return _blocks_of(inner)
    raise TypeError(f"{type(model).__name__} has no `layers` ModuleList of blocks to checkpoint")


def apply_activation_checkpointing(model: nn.Module, every: int = 1, *,
                                   blocks: list[nn.Module] | None = None) -> int:
    """Checkpoint every ``every``-th block of ``model.layers`` (blocks 0, every, 2·every, ...).

    Returns how many blocks are checkpointed. ``every <= 0`` checkpoints none. Applying it
    twice does not nest checkpoints.
    """
    if every <= 0:
        return 0
    selected = [b for i, b in enumerate(blocks if blocks is not None else _blocks_of(model)) if i % every == 0]
    for block in selected:
        if _ORIGINAL_FORWARD in block.__dict__:
            continue
        original = block.forward
        setattr(block, _ORIGINAL_FORWARD, original)

        @functools.wraps(original)
        def checkpointed(*args, _forward=original, **kwargs):
            if not torch.is_grad_enabled():  # nothing to save in no-grad/eval: plain forward
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed
    return len(selected)


def remove_activation_checkpointing(model: nn.Module, *, blocks: list[nn.Module] | None = None) -> int:
    """Undo `apply_activation_checkpointing`; returns how many blocks were restored."""
    restored = 0
    for block in blocks if blocks is not None else _blocks_of(model):
        if _ORIGINAL_FORWARD in block.__dict__:
            del block.forward
            delattr(block, _ORIGINAL_FORWARD)
            restored += 1
    return restored
