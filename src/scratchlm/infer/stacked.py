"""Stacked projection weights for decoding: q|k|v and w1|w3 of each layer as one matrix.

A decode step at small batch is bound by the number of kernels it launches, not by the bytes it
reads: each of a GPT-2-small layer's seven projections is one small GEMM of ~4 us, most of it
fixed latency (docs/benchmarks/generate.md, the profile). Reading q, k and v through one
(d_q + 2·d_kv, d_model) matrix, and the gate and up projections of a SwiGLU through one
(2·d_ff, d_model) matrix, makes those five GEMMs two.

The model's parameters stay as they are (separate, so checkpoints, optimizers and FSDP see what
they always see); the engine keeps a stacked copy and refreshes it in place at the start of
every run, so the weights it decodes with are the ones the model has then (a policy trained
between rollouts), and a captured CUDA graph keeps reading the same buffers. Under autocast the
copy is kept in the autocast dtype, so a float32 policy is not cast to bf16 again on every step.

The attention and the SwiGLU read the copy through the KV-cache view they are given
(`view.stacked(layer_idx, "qkv" | "w13")`, applied by `model.layers.stacked_linear`): without a
view that offers it (training, evaluation, the plain KV cache) nothing changes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from scratchlm.model.attention import BiasedLinear
from scratchlm.model.layers import Linear, SwiGLU, hooked


def _plain(*modules: nn.Module) -> bool:
    """Projections whose math the stacked copy reproduces: all `Linear`, or all `BiasedLinear`,
    without hooks (a LoRA wrapper, FSDP's sharded weights or profiling hooks are left alone)."""
    kinds = {type(m) for m in modules}
    return (len(kinds) == 1 and kinds <= {Linear, BiasedLinear}
            and not any(hooked(m) for m in modules))


def fits_free_memory(nbytes: int, device: torch.device, share: float = 0.25) -> bool:
    """Whether `nbytes` are at most `share` of the memory free now on `device` (always on the CPU)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= share * free


class StackedProjections:
    """The stacked copies of one model's layers: `get(layer_idx, kind)` -> (weight, bias or None)
    or None where a layer's projections do not stack (kind "qkv" or "w13")."""

    def __init__(self, groups: dict[tuple[int, str], list[nn.Module]]) -> None:
        self.groups = groups
        self.stacked: dict[tuple[int, str], tuple[Tensor, Tensor | None]] = {}

    @classmethod
    def for_model(cls, model: nn.Module) -> StackedProjections:
        groups: dict[tuple[int, str], list[nn.Module]] = {}
        for i, layer in enumerate(getattr(model, "layers", [])):
            attn = getattr(layer, "attn", None)
            if attn is not None and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")):
                qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
                if _plain(*qkv):
                    groups[(attn.layer_idx, "qkv")] = qkv
            ffn = getattr(layer, "ffn", None)
            if type(ffn) is SwiGLU and _plain(ffn.w1, ffn.w3):
                groups[(getattr(attn, "layer_idx", i), "w13")] = [ffn.w1, ffn.w3]
        return cls(groups)

    def __len__(self) -> int:
        return len(self.groups)

    def nbytes(self) -> int:
        """Bytes the stacked copies take in the weights' own dtype (under autocast, to bf16, half that
        for a float32 model)."""
        return sum(m.weight.numel() * m.weight.element_size() for mods in self.groups.values() for m in mods)

    def fits(self, device: torch.device, share: float = 0.25) -> bool:
        """Whether the copies take at most `share` of the device memory free now (always on the CPU):
        a large model near the limit of its GPU decodes without them rather than run out of memory."""
        return fits_free_memory(self.nbytes(), device, share)

    @torch.no_grad()
    def refresh(self, dtype: torch.dtype | None = None) -> bool:
        """Copy the current weights in (cast to `dtype` if given). Returns True when buffers were
        (re)allocated, which makes steps captured over the old ones invalid."""
        new = False
        for key, mods in self.groups.items():
            weights = [m.weight for m in mods]
            dt = dtype if dtype is not None else weights[0].dtype
            rows = sum(w.shape[0] for w in weights)
            held = self.stacked.get(key)
            if held is None or held[0].dtype != dt or held[0].shape[0] != rows or held[0].device != weights[0].device:
                with torch.inference_mode(False):  # normal tensors, refreshable in or out of inference mode
                    w = torch.empty(rows, weights[0].shape[1], dtype=dt, device=weights[0].device)
                    b = (torch.empty(rows, dtype=dt, device=w.device) if isinstance(mods[0], BiasedLinear) else None)
                held = self.stacked[key] = (w, b)
                new = True
            w, b = held
            torch.cat([x.to(dt) for x in weights], out=w)
            if b is not None:
                torch.cat([m.bias.to(dt) for m in mods], out=b)
        return new

    def get(self, layer_idx: int, kind: str) -> tuple[Tensor, Tensor | None] | None:
        return self.stacked.get((layer_idx, kind))

