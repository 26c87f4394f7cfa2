"""Conversion between scratchlm's TransformerLM and Hugging Face ``LlamaForCausalLM`` (both
ways) and ``Qwen2ForCausalLM`` (import).

The default scratchlm architecture (pre-norm, RMSNorm, RoPE, SwiGLU, no biases) is exactly
Llama's, grouped-query attention (``num_kv_heads`` = ``num_key_value_heads``) included, up to
two conventions:

- Names: ``layers.{i}.attn.q_proj`` is ``model.layers.{i}.self_attn.q_proj``, ``ffn.w1`` /
  ``w3`` / ``w2`` are ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``, and so on (``_NAMES``).
- RoPE pairs: scratchlm rotates *interleaved* pairs (x[2i], x[2i+1]) of each head; Hugging
  Face rotates *halves* (x[i], x[i + d/2]), both with frequency theta^(-2i/d). Permuting the
  rows of each head of W_q and W_k by [0, 2, 4, ..., 1, 3, 5, ...] turns one into the other.
  q·k is a sum over the head dimension, so permuting q and k alike leaves the attention
  scores, and hence the logits, unchanged; v and the output projection are untouched. W_k
  has num_kv_heads heads, each permuted alike.

Qwen2 is Llama plus biases on q, k and v (``model.qkv_bias``; the q and k biases are permuted
with their rows), usually with GQA, tied embeddings, rope_theta 1e6 and rms eps 1e-6, and an
optional sliding window. scratchlm applies one window to every layer, so a Qwen2 config whose
``use_sliding_window`` leaves some layers on full attention (``max_window_layers``) is refused.

Mixture-of-experts models (``ffn="moe"``) go to Mixtral or Qwen2-MoE instead: each public
function hands them to ``scratchlm.model.hf_moe``, which reuses the mapping here for everything
outside the FFN.

This module imports torch but not ``transformers``: an export needs only ``safetensors``, and
``transformers`` is used by the tests to check that the files load and give the same logits.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from scratchlm.errors import UserError
from scratchlm.fileio import write_text_atomic

EOS_TOKEN = "<|endoftext|>"
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json")

# scratchlm suffix -> Hugging Face suffix, inside layer i ("layers.{i}." / "model.layers.{i}.").
_LAYER_NAMES = {
    "ln1.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.q_proj.bias": "self_attn.q_proj.bias",
    "attn.k_proj.bias": "self_attn.k_proj.bias",
    "attn.v_proj.bias": "self_attn.v_proj.bias",
    "attn.output_proj.weight": "self_attn.o_proj.weight",
    "ln2.weight": "post_attention_layernorm.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embeddings.weight": "model.embed_tokens.weight",
    "ln_final.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# Rows permuted between RoPE conventions, and whether they have the query heads (else the kv heads).
_ROPE_PERMUTED = {"attn.q_proj.weight": True, "attn.k_proj.weight": False,
                  "attn.q_proj.bias": True, "attn.k_proj.bias": False}


def _head_rows(weight: Tensor, num_heads: int) -> tuple[int, Tensor]:
    # weight (num_heads · d_head, ...) as (rows, rest): a bias (rows,) becomes (rows, 1)
    out_features = weight.shape[0]
    d_head = out_features // num_heads
    if d_head * num_heads != out_features or d_head % 2:
        raise ValueError(f"cannot split {out_features} rows into {num_heads} heads of even size")
    return d_head, weight.reshape(out_features, -1)


def interleaved_to_half(weight: Tensor, num_heads: int) -> Tensor:
    """Reorder the rows of a q/k projection from interleaved RoPE pairs to rotate-half pairs.

    weight: (num_heads · d_head, d_in), or a bias (num_heads · d_head,). Within each head, output
    row j < d_head/2 is input row 2j and row d_head/2 + j is row 2j + 1: rows [0, 2, 4, ..., 1, 3, 5, ...].
    """
    d_head, w = _head_rows(weight, num_heads)
    return w.reshape(num_heads, d_head // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def half_to_interleaved(weight: Tensor, num_heads: int) -> Tensor:
    """Inverse of ``interleaved_to_half``; weight: (num_heads · d_head, d_in) or (num_heads · d_head,)."""
    d_head, w = _head_rows(weight, num_heads)
    return w.reshape(num_heads, 2, d_head // 2, -1).transpose(1, 2).reshape(weight.shape)


def _rope_heads(suffix: str, cfg: Any) -> int:
    """Heads of the rows of a RoPE-permuted tensor: the query heads, or the kv heads of k."""
    kv_heads = getattr(cfg, "num_kv_heads", None) or cfg.num_heads
    return cfg.num_heads if _ROPE_PERMUTED[suffix] else kv_heads


def _moe(cfg: Any):
    """``scratchlm.model.hf_moe`` when ``cfg`` is a mixture-of-experts model, else None."""
    if getattr(cfg, "ffn", None) != "moe":
        return None
    from scratchlm.model import hf_moe

    return hf_moe


def check_exportable(cfg: Any) -> None:
    """Raise UserError unless ``cfg`` is the Llama architecture (pre-norm, RMSNorm, RoPE, SwiGLU)
    or an MoE model that Mixtral or Qwen2-MoE expresses exactly."""
    if (moe := _moe(cfg)) is not None:
        return moe.check_exportable(cfg)
    problems = []
    if cfg.norm_position != "pre":
        problems.append(f"norm_position={cfg.norm_position!r} (needs 'pre')")
    if not cfg.use_rmsnorm:
        problems.append("use_rmsnorm=false (needs RMSNorm)")
    if not cfg.use_rope:
        problems.append("use_rope=false (needs RoPE)")
    if cfg.ffn != "swiglu":
        problems.append(f"ffn={cfg.ffn!r} (needs 'swiglu')")
    if getattr(cfg, "logit_softcap", 0):
        problems.append(f"logit_softcap={cfg.logit_softcap} (Llama has no logit cap)")
    if (cfg.d_model // cfg.num_heads) % 2:
        problems.append(f"odd head size {cfg.d_model // cfg.num_heads} (RoPE needs it even)")
    if getattr(cfg, "qk_norm", False):
        problems.append("qk_norm=true (Llama has no QK-norm)")
    if getattr(cfg, "sliding_window", None) is not None:
        problems.append(f"sliding_window={cfg.sliding_window} (Llama attends to the whole prefix)")
    if getattr(cfg, "qkv_bias", False):
        problems.append("qkv_bias=true (Llama's attention_bias would add an output bias too)")
    if problems:
        raise UserError(
            "only the default Llama architecture (optionally with num_kv_heads) can be exported to "
            "Hugging Face; this model has "
            + ", ".join(problems)
        )


def to_hf_state_dict(state_dict: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    """scratchlm TransformerLM state dict -> LlamaForCausalLM state dict (new contiguous tensors).

    With tied embeddings ``lm_head.weight`` is left out, as Hugging Face stores it once.
    """
    if (moe := _moe(cfg)) is not None:
        return moe.to_hf_state_dict(state_dict, cfg)
    check_exportable(cfg)
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        if name in _GLOBAL_NAMES:
            if name == "lm_head.weight" and cfg.tie_embeddings:
                continue
            out[_GLOBAL_NAMES[name]] = tensor.detach().clone().contiguous()
            continue
        prefix, _, rest = name.partition(".")
        index, _, suffix = rest.partition(".")
        if prefix != "layers" or not index.isdigit() or suffix not in _LAYER_NAMES:
            raise ValueError(f"unexpected state dict key {name!r}")
        tensor = tensor.detach()
        if suffix in _ROPE_PERMUTED:
            tensor = interleaved_to_half(tensor, _rope_heads(suffix, cfg))
        out[f"model.layers.{index}.{_LAYER_NAMES[suffix]}"] = tensor.clone().contiguous()
    return out


def from_hf_state_dict(hf_state_dict: dict[str, Tensor], cfg: Any, *, copy: bool = True) -> dict[str, Tensor]:
    """LlamaForCausalLM or Qwen2ForCausalLM state dict -> scratchlm TransformerLM state dict.

    Buffers such as ``rotary_emb.inv_freq`` are ignored; a missing ``lm_head.weight`` (tied
    embeddings) is filled with the embedding matrix. With ``copy=False`` tensors that need no
    change are returned as (detached) views of the given ones instead of copies.
    """
    if (moe := _moe(cfg)) is not None:
        return moe.from_hf_state_dict(hf_state_dict, cfg, copy=copy)
    global_back = {v: k for k, v in _GLOBAL_NAMES.items()}
    layer_back = {v: k for k, v in _LAYER_NAMES.items()}
    out: dict[str, Tensor] = {}
    for name, tensor in hf_state_dict.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name in global_back:
            out[global_back[name]] = tensor.detach().clone() if copy else tensor.detach()
            continue
        parts = name.split(".", 3)
        if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in layer_back:
            raise ValueError(f"unexpected Hugging Face state dict key {name!r}")
        suffix = layer_back[parts[3]]
        tensor = tensor.detach()
        if suffix in _ROPE_PERMUTED:
            tensor = half_to_interleaved(tensor, _rope_heads(suffix, cfg))
        out[f"layers.{parts[2]}.{suffix}"] = tensor.clone().contiguous() if copy else tensor
    if "lm_head.weight" not in out and "token_embeddings.weight" in out:
        out["lm_head.weight"] = out["token_embeddings.weight"]
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config(
    cfg: Any,
    *,
    dtype: torch.dtype = torch.float32,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of the equivalent ``LlamaConfig``, as a dict."""
    if (moe := _moe(cfg)) is not None:
        return moe.hf_config(cfg, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    check_exportable(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": getattr(cfg, "num_kv_heads", None) or cfg.num_heads,
        "head_dim": cfg.d_model // cfg.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.rmsnorm_eps,
        # Older readers take rope_theta at the top level, newer ones rope_parameters.
        "rope_theta": float(cfg.rope_theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": _dtype_name(dtype),
    }


def _qwen2_sliding_window(config: dict[str, Any]) -> int | None:
    """The one window of every layer of a Qwen2 config, None without one; UserError when only
    some layers slide (scratchlm applies one window to all)."""
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    if window is None:
        return None
    layers = config["num_hidden_layers"]
    first = config.get("max_window_layers", 28)
    kinds = config.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if set(kinds) == {"full_attention"}:
        return None
    if set(kinds) != {"sliding_attention"}:
        raise UserError(
            f"this Qwen2 config slides a window of {window} over only some layers (max_window_layers={first} "
            f"of {layers}); scratchlm applies one window to every layer: set use_sliding_window=false or "
            "max_window_layers=0 in config.json")
    return int(window)


def model_config_from_hf(config: dict[str, Any]) -> Any:
    """A ModelConfig from a Llama, Qwen2, Mixtral or Qwen2-MoE ``config.json`` dict (for Llama, the
    reverse of ``hf_config``)."""
    from scratchlm.model import hf_moe
    from scratchlm.model.config import ModelConfig

    model_type = config.get("model_type", "llama")
    if model_type in hf_moe.MODEL_TYPES:
        return hf_moe.model_config_from_hf(config)
    if model_type not in ("llama", "qwen2"):
        raise UserError(f"not a Llama or Qwen2 config: model_type={model_type!r}")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise UserError(f"num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
    if config.get("hidden_act", "silu") != "silu" or config.get("attention_bias") or config.get("mlp_bias"):
        raise UserError("only silu activations without biases are supported")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if head_dim * heads != config["hidden_size"]:
        raise UserError("head_dim * num_attention_heads must equal hidden_size")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise UserError("only default RoPE (no scaling) is supported")
    theta = rope.get("rope_theta", config.get("rope_theta", 10_000.0))
    return ModelConfig(
        vocab_size=config["vocab_size"],
        context_length=config["max_position_embeddings"],
        d_model=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        d_ff=config["intermediate_size"],
        rope_theta=float(theta),
        rmsnorm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        num_kv_heads=kv_heads if kv_heads != heads else None,
        qkv_bias=model_type == "qwen2",  # Qwen2: q/k/v biases, no others
        sliding_window=_qwen2_sliding_window(config) if model_type == "qwen2" else None,
    )


def _tokenizer_files(tokenizer: Any, out: Path, context_length: int) -> tuple[list[Path], int | None]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the
    files and the id of ``<|endoftext|>`` (None when the tokenizer has no such token)."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        source = Path(tmp) / "tokenizer.json"
        if not source.is_file():
            raise UserError("the tokenizer did not write a tokenizer.json; cannot export it")
        text = source.read_text(encoding="utf-8")
    write_text_atomic(out / "tokenizer.json", text)
    data = json.loads(text)
    eos_id = next((t["id"] for t in data.get("added_tokens", []) if t.get("content") == EOS_TOKEN), None)
    special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN} if eos_id is not None else {}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        **special,
    }
    files = [out / "tokenizer.json", out / "tokenizer_config.json", out / "special_tokens_map.json"]
    write_text_atomic(out / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2) + "\n")
    write_text_atomic(out / "special_tokens_map.json", json.dumps(special, indent=2) + "\n")
    return files, eos_id


def export_hf(model: torch.nn.Module, cfg: Any, out: str | Path, *, tokenizer: Any = None) -> list[Path]:
    """Write a Hugging Face Llama (Mixtral, Qwen2-MoE for MoE) directory for ``model``; return the files written.

    ``transformers.AutoModelForCausalLM.from_pretrained(out)`` then gives the same logits, and
    ``AutoTokenizer.from_pretrained(out)`` (when a tokenizer is given) the same ids.
    """
    from safetensors.torch import save_file

    check_exportable(cfg)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    eos_id = None
    if tokenizer is not None:
        tok_files, eos_id = _tokenizer_files(tokenizer, out, cfg.context_length)
        files += tok_files

    state = to_hf_state_dict(model.state_dict(), cfg)
    dtype = next(iter(state.values())).dtype
    save_file({k: v.cpu() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    files.append(out / "model.safetensors")

    config = hf_config(cfg, dtype=dtype, bos_token_id=eos_id, eos_token_id=eos_id)
    write_text_atomic(out / "config.json", json.dumps(config, indent=2) + "\n")
    # No max_length: transformers warns when it meets max_new_tokens, the usual argument.
    generation = {"bos_token_id": eos_id, "eos_token_id": eos_id}
    write_text_atomic(out / "generation_config.json", json.dumps(generation, indent=2) + "\n")
    files += [out / "config.json", out / "generation_config.json"]
    return files
