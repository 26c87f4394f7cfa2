"""Conversion between scratchlm mixture-of-experts models and Hugging Face Mixtral / Qwen2-MoE.

Everything outside the FFN (embeddings, attention with its RoPE permutation, norms, LM head)
is the Llama mapping of ``scratchlm.model.hf``, reused as is; this module maps the MoE FFN and
the config. Which format a model goes to follows from its gating, the one thing the two
formats differ in that scratchlm can express:

- renormalised top-k, no shared experts, no q/k/v biases -> ``MixtralForCausalLM``: its
  router always divides the chosen probabilities by their sum.
- anything else (raw top-k probabilities, shared experts, or ``qkv_bias``) ->
  ``Qwen2MoeForCausalLM``, whose ``norm_topk_prob`` says whether to renormalise.

Both compute ``softmax(x Wᵣᵀ)`` in fp32, take the top k, and sum ``gate · w2(silu(w1 x) · w3 x)``
over the chosen experts, exactly as ``MoEFFN``; neither drops assignments (dropless).

Qwen2-MoE's shared expert. Hugging Face computes ``sigmoid(x · g) · shared(x)``, with a learnt
gate vector ``g`` and one SwiGLU of ``shared_expert_intermediate_size``; scratchlm's shared
experts are one SwiGLU of width ``moe_shared_experts · d_ff`` with no gate. The exact mapping:
``g = 0``, so the gate is ``sigmoid(0) = 1/2`` for every token, and ``down_proj = 2 · w2``.
Scaling by 2 and by 1/2 is exact in binary floating point, so ``1/2 · (2 w2) h`` is ``w2 h``
to the bit (no saturated sigmoid, which would only be close). Import reverses it and refuses a
non-zero gate, which has no scratchlm counterpart. Without shared experts the shared expert
has width 0 (``shared_expert_intermediate_size = 0``), which adds exactly nothing.

Qwen2-MoE's q/k/v projections have biases: a model with ``qkv_bias`` exports its own, one
without exports zeros, and import gives ``qkv_bias`` (the ``qkv_bias`` of config.json, true
unless it says otherwise), the biases permuted with their rows as for a dense Qwen2 (``hf``).
Weights are written in the per-expert layout of the published checkpoints
(``block_sparse_moe.experts.{j}.w1.weight`` for Mixtral, ``mlp.experts.{j}.gate_proj.weight``
for Qwen2-MoE), which every transformers version loads; import also reads transformers 5's
fused in-memory layout (``mlp.experts.gate_up_proj`` / ``down_proj``).

Training-only keys: Hugging Face's load-balancing loss is pooled over the layers and k times
scratchlm's (docs/moe.md), so export writes ``router_aux_loss_coef = moe_aux_coef / k`` and
import sets ``moe_aux_scope = "model"`` and ``moe_aux_coef = router_aux_loss_coef · k``.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import torch
from torch import Tensor

from scratchlm.errors import UserError
from scratchlm.model import hf

MODEL_TYPES = ("mixtral", "qwen2_moe")
_LLAMA_ONLY_KEYS = ("attention_bias", "mlp_bias", "pretraining_tp", "architectures", "model_type")
# model.layers.{i}.{block_sparse_moe|mlp}.{rest}
_FFN_KEY = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.(.+)")
_QKV_BIAS_KEY = re.compile(r"model\.layers\.\d+\.self_attn\.[qkv]_proj\.bias")
# Per-expert names of the published checkpoints: (gate, up, down) projection of expert j.
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}


def _dense(cfg: Any) -> Any:
    """The config with a SwiGLU FFN and no say on q/k/v biases (Qwen2-MoE's own; `export_format`
    decides about them): what ``hf``'s Llama mapping checks and converts."""
    dense = copy.copy(cfg)
    dense.ffn = "swiglu"
    dense.qkv_bias = False
    return dense


def export_format(cfg: Any) -> str:
    """"mixtral" or "qwen2_moe", the format that expresses ``cfg``'s MoE exactly; UserError when
    neither does (on top of ``hf.check_exportable``'s refusals of non-Llama architectures)."""
    from scratchlm.model.moe import renormalizes

    hf.check_exportable(_dense(cfg))
    experts, top_k = cfg.moe_num_experts, cfg.moe_top_k
    factor = cfg.moe_capacity_factor
    # Capacity ceil(f·N·k/E) >= N (each expert's most possible assignments) for every N iff f·k >= E.
    if factor is not None and factor * top_k < experts:
        raise UserError(
            f"model.moe_capacity_factor={factor:g} can drop assignments, which Mixtral and Qwen2-MoE never do; "
            f"only dropless models export (capacity factor none or at least moe_num_experts/moe_top_k="
            f"{experts / top_k:g})"
        )
    if renormalizes(top_k, cfg.moe_renormalize) and not cfg.moe_shared_experts and not getattr(cfg, "qkv_bias", False):
        return "mixtral"
    return "qwen2_moe"


def check_exportable(cfg: Any) -> None:
    """Raise UserError unless ``cfg`` is an MoE model that Mixtral or Qwen2-MoE expresses exactly."""
    export_format(cfg)


def hf_config(cfg: Any, *, dtype: torch.dtype = torch.float32, bos_token_id: int | None = None,
              eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of the equivalent ``MixtralConfig`` or ``Qwen2MoeConfig``, as a dict."""
    from scratchlm.model.moe import renormalizes

    kind = export_format(cfg)
    llama = hf.hf_config(_dense(cfg), dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    common = {k: v for k, v in llama.items() if k not in _LLAMA_ONLY_KEYS}
    top_k = cfg.moe_top_k
    moe = {
        "num_experts_per_tok": top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": cfg.moe_aux_coef / top_k,
    }
    if kind == "mixtral":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            **common,
            "intermediate_size": cfg.d_ff,
            "num_local_experts": cfg.moe_num_experts,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
            **moe,
        }
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        **common,
        "intermediate_size": cfg.d_ff,  # the dense MLP of mlp_only_layers; there are none
        "moe_intermediate_size": cfg.d_ff,
        "shared_expert_intermediate_size": cfg.moe_shared_experts * cfg.d_ff,
        "num_experts": cfg.moe_num_experts,
        "norm_topk_prob": renormalizes(top_k, cfg.moe_renormalize),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "qkv_bias": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.num_layers,
        **moe,
    }


def to_hf_state_dict(state_dict: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    """scratchlm MoE TransformerLM state dict -> Mixtral / Qwen2-MoE state dict (new tensors)."""
    kind = export_format(cfg)
    ffn: dict[str, Tensor] = {}
    rest: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        parts = name.split(".", 3)
        if len(parts) == 4 and parts[0] == "layers" and parts[2] == "ffn":
            ffn[name] = tensor.detach()
        else:
            rest[name] = tensor
    out = hf.to_hf_state_dict(rest, _dense(cfg))
    gate, up, down = _EXPERT_NAMES[kind]
    for i in range(cfg.num_layers):
        src = f"layers.{i}.ffn."
        dst = f"model.layers.{i}.{'block_sparse_moe' if kind == 'mixtral' else 'mlp'}."
        out[dst + "gate.weight"] = ffn.pop(src + "router.weight").clone().contiguous()
        for name, weights in ((gate, ffn.pop(src + "w1")), (up, ffn.pop(src + "w3")), (down, ffn.pop(src + "w2"))):
            for j, w in enumerate(weights.unbind(0)):
                out[f"{dst}experts.{j}.{name}.weight"] = w.clone().contiguous()
        if kind == "qwen2_moe":
            d_model = cfg.d_model
            like = out[dst + "gate.weight"]
            if cfg.moe_shared_experts:
                w1, w3 = ffn.pop(src + "shared.w1.weight"), ffn.pop(src + "shared.w3.weight")
                w2 = ffn.pop(src + "shared.w2.weight") * 2  # undone by the gate sigmoid(0) = 1/2
            else:
                w1 = w3 = like.new_zeros(0, d_model)
                w2 = like.new_zeros(d_model, 0)
            out[dst + "shared_expert.gate_proj.weight"] = w1.clone().contiguous()
            out[dst + "shared_expert.up_proj.weight"] = w3.clone().contiguous()
            out[dst + "shared_expert.down_proj.weight"] = w2.contiguous()
            out[dst + "shared_expert_gate.weight"] = like.new_zeros(1, d_model)
            for proj in ("q_proj", "k_proj", "v_proj"):
                weight = out[f"model.layers.{i}.self_attn.{proj}.weight"]
                out.setdefault(f"model.layers.{i}.self_attn.{proj}.bias", weight.new_zeros(weight.shape[0]))
    if ffn:
        raise ValueError(f"unexpected MoE state dict keys {sorted(ffn)}")
    return out


def from_hf_state_dict(hf_state_dict: dict[str, Tensor], cfg: Any, *, copy: bool = True) -> dict[str, Tensor]:
    """Mixtral / Qwen2-MoE state dict (published per-expert layout or transformers 5's fused one)
    -> scratchlm MoE TransformerLM state dict. UserError for weights scratchlm cannot express
    exactly: a non-zero shared-expert gate, or a non-zero q/k/v bias when ``cfg.qkv_bias`` is false.
    ``copy=False``: tensors that need no change are views of the given ones (`hf.from_hf_state_dict`)."""
    layers: dict[int, dict[str, Tensor]] = {}
    rest: dict[str, Tensor] = {}
    for name, tensor in hf_state_dict.items():
        match = _FFN_KEY.fullmatch(name)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor.detach()
        elif _QKV_BIAS_KEY.fullmatch(name) and not getattr(cfg, "qkv_bias", False):
            if torch.any(tensor != 0):
                raise UserError(f"{name} is not zero but model.qkv_bias is false: import with the "
                                "directory's own config (model_config_from_hf), which sets it")
        else:
            rest[name] = tensor
    out = hf.from_hf_state_dict(rest, _dense(cfg), copy=copy)
    if sorted(layers) != list(range(cfg.num_layers)):
        raise ValueError(f"expected MoE weights for layers 0..{cfg.num_layers - 1}, found {sorted(layers)}")
    for i, ffn in layers.items():
        dst = f"layers.{i}.ffn."
        router = ffn.pop("gate.weight")
        out[dst + "router.weight"] = router.clone() if copy else router
        w1, w3, w2 = _experts(ffn, cfg.moe_num_experts, f"model.layers.{i}", copy=copy)
        out[dst + "w1"], out[dst + "w3"], out[dst + "w2"] = w1, w3, w2
        out.update({dst + k: v for k, v in _shared(ffn, cfg, f"model.layers.{i}", copy=copy).items()})
        if ffn:
            raise ValueError(f"unexpected Hugging Face MoE keys in layer {i}: {sorted(ffn)}")
    return out


def _experts(ffn: dict[str, Tensor], num_experts: int, where: str, *,
             copy: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Stacked (w1, w3, w2) from one layer's expert tensors; the tensors used are popped."""
    if "experts.gate_up_proj" in ffn:  # transformers 5: (E, 2F, D) gate then up, and (E, D, F)
        w1, w3 = ffn.pop("experts.gate_up_proj").chunk(2, dim=1)
        w2 = ffn.pop("experts.down_proj")
        if not copy:
            return w1, w3, w2
        return w1.clone().contiguous(), w3.clone().contiguous(), w2.clone().contiguous()
    for names in _EXPERT_NAMES.values():
        if f"experts.0.{names[0]}.weight" in ffn:
            try:
                stacked = [torch.stack([ffn.pop(f"experts.{j}.{n}.weight") for j in range(num_experts)])
                           for n in names]
            except KeyError as e:
                raise ValueError(f"{where}: missing expert weight {e}") from None
            return stacked[0], stacked[1], stacked[2]
    raise ValueError(f"{where}: no expert weights found")


def _shared(ffn: dict[str, Tensor], cfg: Any, where: str, *, copy: bool = True) -> dict[str, Tensor]:
    """scratchlm ``shared.*`` weights from a Qwen2-MoE layer's shared expert (popped), undoing the
    factor 2 of the gate sigmoid(0) = 1/2; empty without a shared expert."""
    if "shared_expert_gate.weight" not in ffn:
        return {}
    gate = ffn.pop("shared_expert_gate.weight")
    w1 = ffn.pop("shared_expert.gate_proj.weight")
    w3 = ffn.pop("shared_expert.up_proj.weight")
    w2 = ffn.pop("shared_expert.down_proj.weight")
    if w1.shape[0] == 0:
        return {}
    if torch.any(gate != 0):
        raise UserError(
            f"{where}.mlp.shared_expert_gate is not zero: scratchlm's shared experts have no input-dependent "
            "gate, so this Qwen2-MoE model cannot be converted exactly"
        )
    if w1.shape[0] != cfg.moe_shared_experts * cfg.d_ff:
        raise ValueError(f"{where}: shared expert width {w1.shape[0]} does not match the config")
    if copy:
        w1, w3 = w1.clone(), w3.clone()
    return {"shared.w1.weight": w1, "shared.w3.weight": w3, "shared.w2.weight": w2 * 0.5}


def model_config_from_hf(config: dict[str, Any]) -> Any:
    """A ModelConfig (``ffn="moe"``) from a Mixtral or Qwen2-MoE ``config.json`` dict."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise UserError(f"not a Mixtral or Qwen2-MoE config: model_type={kind!r}")
    layers = config["num_hidden_layers"]
    top_k = config["num_experts_per_tok"]
    if kind == "mixtral":
        experts, width, shared, renormalize = config["num_local_experts"], config["intermediate_size"], 0, True
        window = config.get("sliding_window")
        if window is not None and window < config["max_position_embeddings"]:
            raise UserError(f"Mixtral sliding-window attention (sliding_window={window}) is not supported")
    else:
        experts, width = config["num_experts"], config["moe_intermediate_size"]
        renormalize = bool(config.get("norm_topk_prob", False))
        step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
        if experts < 1 or step < 1 or any(i in dense or (i + 1) % step for i in range(layers)):
            raise UserError("Qwen2-MoE models with dense layers (mlp_only_layers, decoder_sparse_step > 1) are "
                            "not supported: every scratchlm MoE layer is sparse")
        if config.get("use_sliding_window"):
            raise UserError("Qwen2-MoE sliding-window attention (use_sliding_window=true) is not supported")
        shared_width = config["shared_expert_intermediate_size"]
        shared, remainder = divmod(shared_width, width) if width > 0 else (0, 1)
        if remainder:
            raise UserError(
                f"Qwen2-MoE shared_expert_intermediate_size={shared_width} is not a multiple of "
                f"moe_intermediate_size={width}: scratchlm's shared experts are moe_shared_experts · d_ff wide"
            )
    llama = {**config, "model_type": "llama", "intermediate_size": width, "attention_bias": False, "mlp_bias": False}
    try:
        return dataclasses.replace(
            hf.model_config_from_hf(llama),
            ffn="moe",
            moe_num_experts=experts,
            moe_top_k=top_k,
            moe_shared_experts=shared,
            moe_renormalize=renormalize,
            moe_capacity_factor=None,
            moe_aux_scope="model",
            moe_aux_coef=float(config.get("router_aux_loss_coef", 0.001)) * top_k,
            qkv_bias=kind == "qwen2_moe" and bool(config.get("qkv_bias", True)),
        )
    except ValueError as e:
        raise UserError(f"{kind} config: {e}") from None
