"""Shape and variant options of the Transformer LM."""

from __future__ import annotations

import math
from dataclasses import dataclass

from scratchlm.config import changed_fields, settings_text
from scratchlm.model.attention_backends import attention_backend_names
from scratchlm.model.moe import GEMMS

# The largest vocab_size, context_length, d_model, ... a config may name: far past any model, and
# small enough that the product of two fits the int64 sizes of torch's tensors.
MAX_DIM = 2**31 - 1


@dataclass
class ModelConfig:
    """A Llama-style decoder; the defaults are the TinyStories 17M shape."""

    vocab_size: int = 10_000  # number of token ids (tokenizer vocab incl. special tokens)
    context_length: int = 256  # longest sequence the model accepts (RoPE table size)
    d_model: int = 512  # residual stream width
    num_layers: int = 4  # Transformer blocks
    num_heads: int = 16  # attention heads; d_model must be divisible by it
    # Key/value heads (grouped-query attention); none = num_heads. Must divide num_heads: query head
    # h reads kv head h // (num_heads / num_kv_heads). Fewer kv heads, a smaller KV cache.
    num_kv_heads: int | None = None
    qk_norm: bool = False  # RMSNorm over head_dim on q and k of every head, before RoPE (Qwen3, OLMo2)
    # Causal attention in which each query sees at most the last sliding_window keys (itself
    # included); none = the whole prefix.
    sliding_window: int | None = None
    qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj (Qwen2); every other module stays bias-free
    d_ff: int = 1344  # hidden width of the feed-forward network
    rope_theta: float = 10_000.0  # RoPE base
    rmsnorm_eps: float = 1e-5  # epsilon inside RMSNorm
    norm_position: str = "pre"  # "pre" (Llama) or "post" (original Transformer) ablation
    use_rmsnorm: bool = True  # False: identity instead of RMSNorm (ablation)
    use_rope: bool = True  # False: no positional encoding at all (NoPE ablation)
    ffn: str = "swiglu"  # "swiglu", "silu" (ungated, ablation), "relu2" (w2(relu(w1 x)²), ungated) or "moe"
    tie_embeddings: bool = False  # share token_embeddings.weight with lm_head.weight
    attention_backend: str = "math"  # "math" (reference) or another name in attention_backends.ATTENTION_BACKENDS
    # Init std of q_proj, k_proj, v_proj: "fused" sqrt(2/(d+3d)), the Glorot scale of the one d -> 3d
    # map they form (as a fused qkv nn.Linear; d -> d + 2·kv_dim with num_kv_heads); "separate"
    # sqrt(2/(d+d)) each (before Dec 2026), sqrt(2/(d+kv_dim)) for k and v with num_kv_heads.
    qkv_init: str = "fused"
    # Mixed-precision training computes q/k/v, and SwiGLU's w1/w3, each as one forward matmul over
    # the concatenated weights (wider GPU matmuls); parameters, names and maths are the same.
    fused_projections: bool = True
    # With fused_projections and attention_backend="flash_triton" on CUDA: q|k|v go whole into the
    # attention, whose backward undoes RoPE in its kernels and hands back one gradient, so q/k/v's
    # backward is one matmul each way too (docs/benchmarks/train_step.md).
    packed_qkv_backward: bool = True
    moe_num_experts: int = 8  # ffn="moe": routed experts per layer, each a SwiGLU of width d_ff
    moe_top_k: int = 2  # ffn="moe": experts each token is sent to
    moe_capacity_factor: float | None = None  # ffn="moe": capacity ceil(f*tokens*top_k/experts); none = dropless
    moe_shared_experts: int = 0  # ffn="moe": experts every token also goes through
    moe_aux_coef: float = 0.01  # ffn="moe": weight of the load-balancing loss in the training loss
    moe_z_coef: float = 0.001  # ffn="moe": weight of the router z-loss in the training loss
    # Logits = c·tanh(logits / c) with c = logit_softcap, bounding them to (-c, c); 0 = off (Gemma 2's
    # and the modded-nanogpt speedrun's cap; 15-30 is usual). Not with trainer.fused_lm_head.
    logit_softcap: float = 0.0
    # Start every block as the identity: attention's output_proj and the FFN's w2 (MoE: the
    # experts' and the shared experts' w2) initialised to zero. lm_head keeps its init (tied, it
    # is the embedding table).
    zero_init_output: bool = False
    # Under autocast, hold the residual stream in the autocast dtype (bf16) instead of float32: the
    # blocks' adds, the norms' inputs and the residual's gradient move half the bytes (the
    # modded-nanogpt speedrun's bf16 stream). Numerics change (each add rounds to bf16).
    low_precision_residual: bool = False
    # ffn="moe": expert matmuls; "auto" (grouped GEMM on CUDA bf16), "grouped_mm", "triton", "portable"
    moe_gemm: str = "auto"
    # ffn="moe": renormalise the top-k router probabilities to sum to 1 (true) or weight each
    # expert by its raw probability (false); none: renormalise when moe_top_k > 1.
    moe_renormalize: bool | None = None
    # ffn="moe": load-balancing loss per "layer" (summed over layers) or one for the whole "model"
    # (routing pooled over layers, as transformers computes it); docs/moe.md.
    moe_aux_scope: str = "layer"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
            if getattr(self, name) > MAX_DIM:  # (a typo of extra digits: torch's overflow or allocator errors)
                raise ValueError(f"model.{name} must be at most 2**31 - 1, got {getattr(self, name)}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"model.rope_theta must be a positive finite number, got {self.rope_theta}")
        if not (math.isfinite(self.rmsnorm_eps) and self.rmsnorm_eps >= 0):
            # (inf normalised every activation to 0; a negative eps gives NaN where mean(x²) < -eps)
            raise ValueError(f"model.rmsnorm_eps must be a finite number >= 0, got {self.rmsnorm_eps}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.num_heads ({self.num_heads})"
            )
        if self.use_rope and (self.d_model // self.num_heads) % 2:
            raise ValueError(
                f"model.d_model / model.num_heads = {self.d_model // self.num_heads} is odd: RoPE rotates pairs "
                "of a head's dimensions, so the head size must be even (or set model.use_rope=false)"
            )
        if self.num_kv_heads is not None and (self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads):
            raise ValueError(
                f"model.num_kv_heads ({self.num_kv_heads}) must be a positive divisor of model.num_heads "
                f"({self.num_heads})"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"model.sliding_window must be positive or none, got {self.sliding_window}")
        if self.norm_position not in ("pre", "post"):
            raise ValueError(f"model.norm_position must be 'pre' or 'post', got {self.norm_position!r}")
        if self.ffn not in ("swiglu", "silu", "relu2", "moe"):
            raise ValueError(f"model.ffn must be 'swiglu', 'silu', 'relu2' or 'moe', got {self.ffn!r}")
        if not (math.isfinite(self.logit_softcap) and self.logit_softcap >= 0):
            raise ValueError(f"model.logit_softcap must be >= 0 (0 = off), got {self.logit_softcap}")
        if self.ffn == "moe":
            if not 1 <= self.moe_top_k <= self.moe_num_experts:
                raise ValueError(
                    f"model.moe_top_k must be between 1 and model.moe_num_experts ({self.moe_num_experts}), "
                    f"got {self.moe_top_k}"
                )
            if self.moe_gemm not in GEMMS:
                raise ValueError(f"model.moe_gemm must be one of {', '.join(GEMMS)}, got {self.moe_gemm!r}")
            if self.moe_shared_experts < 0:
                raise ValueError(f"model.moe_shared_experts must be >= 0, got {self.moe_shared_experts}")
            if self.moe_capacity_factor is not None and not (
                    math.isfinite(self.moe_capacity_factor) and self.moe_capacity_factor > 0):
                raise ValueError(f"model.moe_capacity_factor must be a positive finite number or none (dropless), "
                                 f"got {self.moe_capacity_factor}")
            for name in ("moe_aux_coef", "moe_z_coef"):  # loss weights: a negative one rewards what it should punish
                if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                    raise ValueError(f"model.{name} must be a finite number >= 0, got {getattr(self, name)}")
            if self.moe_renormalize is not None and not isinstance(self.moe_renormalize, bool):
                raise ValueError(f"model.moe_renormalize must be true, false or none, got {self.moe_renormalize!r}")
            if self.moe_aux_scope not in ("layer", "model"):
                raise ValueError(f"model.moe_aux_scope must be 'layer' or 'model', got {self.moe_aux_scope!r}")
        if self.qkv_init not in ("fused", "separate"):
            raise ValueError(f"model.qkv_init must be 'fused' or 'separate', got {self.qkv_init!r}")
        if self.attention_backend not in attention_backend_names():
            names = ", ".join(repr(name) for name in attention_backend_names())
            raise ValueError(f"model.attention_backend must be one of {names}, got {self.attention_backend!r}")

    def ignored_options(self) -> list[str]:
        """One line for each group of options set away from their defaults that this model never
        reads (the moe_* options of a model whose ffn is not "moe", rope_theta without RoPE, a
        sliding_window no shorter than context_length), for a command to print: they would
        otherwise be ignored silently."""
        changed = changed_fields(self)
        notes = []
        moe = [name for name in changed if name.startswith("moe_")]
        if moe and self.ffn != "moe":
            notes.append(f"{settings_text('model', self, moe)} no effect (the moe_* options apply to "
                         f"model.ffn=\"moe\"; this model's ffn is \"{self.ffn}\")")
        if "rope_theta" in changed and not self.use_rope:
            notes.append(f"{settings_text('model', self, ['rope_theta'])} no effect (model.use_rope=false: no RoPE)")
        if self.sliding_window is not None and self.sliding_window >= self.context_length:
            notes.append(f"{settings_text('model', self, ['sliding_window'])} no effect at model.context_length="
                         f"{self.context_length} (no sequence is longer than the window: every query sees its whole "
                         "prefix)")
        return notes

