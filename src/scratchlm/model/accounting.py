"""Parameters, FLOPs and training memory of a model shape, as pure functions of a ModelConfig.

Nothing here imports torch: the numbers come from the shapes alone, so `scratchlm account`
answers instantly for shapes far too large to build. The tests check the parameter count
against ``sum(p.numel())`` of a built model for every variant.

Conventions (the usual ones of scaling-law accountings, so figures compare with papers):

- A matrix multiply of (m, k) by (k, n) costs ``2·m·n·k`` FLOPs (one multiply, one add).
  Element-wise work (norms, RoPE, softmax, SiLU, residual adds, the loss) is not counted:
  it is O(T·D) against the O(T·D²) of the matmuls.
- ``attention`` is the two products QKᵀ and PV over the *full* T×T score matrix,
  ``2·(2·T·T·d_model)`` per layer. Causal masking is *not* halved: a dense kernel computes
  the masked half too, and the published accountings (Kaplan et al., Chinchilla, MFU
  figures) use the full product. A causal-aware kernel does about half of this term.
- Grouped-query attention (``num_kv_heads``) shrinks k_proj and v_proj, their FLOPs and the
  KV cache; the attention products are unchanged (every query head still attends). A sliding
  window is not subtracted from ``attention`` either, for the same reason as the causal half
  (the math path computes the masked scores too); `model_flops_per_token`, which counts causal
  attention, counts only the keys inside the window.
- Training costs three forwards (backward = 2× forward for matmuls, `TRAIN_FORWARDS`),
  reported as ``train_flops_per_sequence``.
- MoE layers count only the experts a token is routed to (``top_k`` plus shared experts)
  in FLOPs and in ``active`` parameters, and every expert in ``total`` parameters. With a
  capacity factor some tokens are dropped; the FLOPs stay those of the dropless routing
  (an upper bound on the useful work).

This module owns the FLOP formulas of the whole package: `matmul_flops`, `ffn_flops` and
`attention_flops` (also what the layer and kernel benchmarks count), `forward_flops` of a config (`scratchlm
account`, the trainer's MFU) and `model_flops_per_token` of a built model (the benchmarks' MFU,
which counts every weight matrix and causal attention).

Attention fields are read with ``getattr`` and defaults too: ``num_kv_heads`` (None = num_heads),
``qk_norm`` (False), ``qkv_bias`` (False), ``sliding_window`` (None).

MoE fields are read with ``getattr`` and defaults, so this module works with a ModelConfig
whether or not it carries them yet: ``moe_num_experts`` (8), ``moe_top_k`` (2),
``moe_shared_experts`` (0), ``moe_capacity_factor`` (None = dropless). Each expert, routed
or shared, is a SwiGLU of width ``d_ff``.
"""

from __future__ import annotations

import math
from typing import Any

FP32_BYTES = 4
# fp32 weights + fp32 gradients + AdamW's two fp32 moments.
STATIC_BYTES_PER_PARAM = 16
# The optimizers of `optim.name` (scratchlm.optim.config.OPTIMIZER_NAMES) and the fp32 state each
# keeps per parameter it steps: AdamW two moments; Muon one momentum buffer, for the blocks'
# matrices only (the other parameters take AdamW steps inside the same optimizer).
OPTIMIZER_STATES = {"adamw": 2, "muon": 1}
# Forward passes' worth of matmul FLOPs in a training step: the backward pass computes the
# gradients of both operands of every matmul, twice the forward's work.
TRAIN_FORWARDS = 3
# FLOPs of an attention pass relative to its forward. The flash backward recomputes the scores
# (q·kᵀ) and runs four more products (dv, dp, dq, dk): five matmuls against the forward's two.
_ATTENTION_PASS = {"forward": (1, 1), "backward": (5, 2), "forward_backward": (7, 2)}


def matmul_flops(m: int, k: int, n: int) -> int:
    """FLOPs of an (m, k) by (k, n) matrix product: one multiply and one add per term.

    >>> matmul_flops(2, 3, 4)
    48
    """
    return 2 * m * k * n


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, is_causal: bool = False,
                    mode: str = "forward") -> int:
    """Matmul FLOPs of attention over (batch, heads, seq, head_dim) queries, keys and values.

    Forward: the products q·kᵀ and p·v, ``4·B·H·T²·d``, halved when causal (what a causal-aware
    kernel computes). ``mode`` "backward" is 2.5× the forward, "forward_backward" 3.5×.

    >>> attention_flops(1, 1, 4, 8), attention_flops(1, 1, 4, 8, True, "forward_backward")
    (512, 896)
    """
    if mode not in _ATTENTION_PASS:
        raise ValueError(f"mode must be one of {', '.join(_ATTENTION_PASS)}, got {mode!r}")
    forward = 2 * matmul_flops(batch * heads * seq, head_dim, seq)
    if is_causal:
        forward //= 2
    times, per = _ATTENTION_PASS[mode]
    return times * forward // per


def moe_shape(cfg: Any) -> dict[str, Any]:
    """The MoE fields of a config with their defaults: num_experts, top_k, shared, capacity_factor."""
    return {
        "num_experts": int(getattr(cfg, "moe_num_experts", 8)),
        "top_k": int(getattr(cfg, "moe_top_k", 2)),
        "shared": int(getattr(cfg, "moe_shared_experts", 0)),
        "capacity_factor": getattr(cfg, "moe_capacity_factor", None),
    }


def attention_shape(cfg: Any) -> dict[str, Any]:
    """The attention fields of a config with their defaults: head_dim, num_kv_heads, kv_dim
    (num_kv_heads · head_dim), qk_norm, qkv_bias, sliding_window."""
    head_dim = cfg.d_model // cfg.num_heads
    kv_heads = getattr(cfg, "num_kv_heads", None) or cfg.num_heads
    return {
        "head_dim": head_dim,
        "num_kv_heads": kv_heads,
        "kv_dim": kv_heads * head_dim,
        "qk_norm": bool(getattr(cfg, "qk_norm", False)),
        "qkv_bias": bool(getattr(cfg, "qkv_bias", False)),
        "sliding_window": getattr(cfg, "sliding_window", None),
    }


def _attention_params(cfg: Any) -> int:
    """Per-layer attention parameters: q and output (D·D each), k and v (D·kv_dim each), the
    q/k/v biases (D + 2·kv_dim) and the two QK-norm weights (head_dim each)."""
    D, a = cfg.d_model, attention_shape(cfg)
    n = 2 * D * D + 2 * D * a["kv_dim"]
    if a["qkv_bias"]:
        n += D + 2 * a["kv_dim"]
    if a["qk_norm"]:
        n += 2 * a["head_dim"]
    return n


def _ffn_params(cfg: Any) -> dict[str, int]:
    """Per-layer FFN parameters: total and active (touched by one token)."""
    D, F = cfg.d_model, cfg.d_ff
    if cfg.ffn == "swiglu":
        n = 3 * D * F
        return {"total": n, "active": n}
    if cfg.ffn in ("silu", "relu2"):  # two matrices, w1 and w2
        n = 2 * D * F
        return {"total": n, "active": n}
    if cfg.ffn == "moe":
        moe = moe_shape(cfg)
        expert = 3 * D * F
        router = D * moe["num_experts"]
        return {
            "total": router + (moe["num_experts"] + moe["shared"]) * expert,
            "active": router + (moe["top_k"] + moe["shared"]) * expert,
        }
    raise ValueError(f"unknown ffn {cfg.ffn!r}")


def count_params(cfg: Any) -> dict[str, int]:
    """Parameter count by component, with ``total`` and ``active`` (per-token, differs for MoE).

    Components: ``embedding`` (V·D), ``attention`` (4·D² per layer: q, k, v, output; with
    GQA 2·D² + 2·D·kv_dim, plus q/k/v biases and QK-norm weights when on),
    ``ffn`` (3·D·d_ff per layer for SwiGLU, 2·D·d_ff for SiLU and ReLU², router and all experts for MoE),
    ``norm`` (D per RMSNorm: two per layer and the final one; 0 without RMSNorm) and
    ``lm_head`` (V·D, 0 when tied to the embedding, which it then shares).

    >>> from scratchlm.model.config import ModelConfig
    >>> count_params(ModelConfig(vocab_size=100, d_model=8, num_layers=1, num_heads=2, d_ff=16))["total"]
    2264
    """
    V, D, L = cfg.vocab_size, cfg.d_model, cfg.num_layers
    ffn = _ffn_params(cfg)
    parts = {
        "embedding": V * D,
        "attention": L * _attention_params(cfg),
        "ffn": L * ffn["total"],
        "norm": (2 * L + 1) * D if cfg.use_rmsnorm else 0,
        "lm_head": 0 if cfg.tie_embeddings else V * D,
    }
    total = sum(parts.values())
    parts["total"] = total
    parts["active"] = total - L * (ffn["total"] - ffn["active"])
    # Without the embedding table (a lookup, no FLOPs): the "N" of scaling-law papers.
    parts["non_embedding"] = total - parts["embedding"]
    return parts


def param_count(cfg: Any) -> int:
    """Total number of parameters; equals ``sum(p.numel() for p in build_model(cfg).parameters())``."""
    return count_params(cfg)["total"]


def ffn_flops(ffn: str, d_model: int, d_ff: int, tokens: int = 1, *, num_experts: int = 0, top_k: int = 0,
              shared: int = 0) -> int:
    """Forward FLOPs of one feed-forward layer over `tokens` tokens: "swiglu" (w1, w3, w2),
    "silu" or "relu2" (w1, w2) or "moe" (the router, and the SwiGLU of width d_ff of each of the `top_k`
    routed and `shared` experts a token goes through).

    >>> ffn_flops("swiglu", 8, 16), ffn_flops("moe", 8, 16, num_experts=4, top_k=2)
    (768, 1600)
    """
    expert = 3 * matmul_flops(tokens, d_model, d_ff)
    if ffn == "swiglu":
        return expert
    if ffn in ("silu", "relu2"):
        return 2 * matmul_flops(tokens, d_model, d_ff)
    if ffn == "moe":
        return matmul_flops(tokens, d_model, num_experts) + (top_k + shared) * expert
    raise ValueError(f"unknown ffn {ffn!r}")


def forward_flops(cfg: Any, seq_len: int | None = None) -> dict[str, int]:
    """Forward FLOPs for one sequence of ``seq_len`` tokens (default: context_length).

    Returns ``{"qkvo", "attention", "ffn", "lm_head", "total"}``; see the module docstring
    for what is counted (matmuls only, full T×T attention).
    """
    T = cfg.context_length if seq_len is None else seq_len
    V, D, L = cfg.vocab_size, cfg.d_model, cfg.num_layers
    moe = moe_shape(cfg)  # read by ffn_flops only for ffn="moe"
    ffn = ffn_flops(cfg.ffn, D, cfg.d_ff, T, num_experts=moe["num_experts"], top_k=moe["top_k"], shared=moe["shared"])
    kv_dim = attention_shape(cfg)["kv_dim"]
    parts = {
        "qkvo": L * (2 * matmul_flops(T, D, D) + 2 * matmul_flops(T, D, kv_dim)),
        "attention": L * attention_flops(1, 1, T, D),
        "ffn": L * ffn,
        "lm_head": matmul_flops(T, D, V),
    }
    parts["total"] = sum(parts.values())
    return parts


def model_flops_per_token(model: Any, seq_len: int) -> float:
    """Forward matmul FLOPs per token of a built model: 2 per weight of every matrix except the
    embedding table (a lookup), plus causal attention (q·kᵀ and p·v: 2·T·d_model per layer and
    token; with a sliding window W < T only the keys inside it: the causal term times
    sum_p min(p + 1, W) / (T·(T + 1)/2)). Unlike `forward_flops`, MoE layers count every expert's weights.

    Reads scratchlm's attribute names: ``token_embeddings``, ``layers``, ``d_model``,
    ``tie_embeddings``, and ``layers[0].attn.sliding_window`` when there is one.
    """
    emb = getattr(model, "token_embeddings", None)
    skip = {id(emb.weight)} if emb is not None and not getattr(model, "tie_embeddings", False) else set()
    matrix_params = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skip)
    layers = getattr(model, "layers", [])
    d_model = getattr(model, "d_model", 0)
    attention = attention_flops(1, 1, seq_len, d_model, is_causal=True) / seq_len
    window = getattr(getattr(layers[0], "attn", None), "sliding_window", None) if len(layers) else None
    if window is not None and window < seq_len:
        seen = window * (window + 1) // 2 + (seq_len - window) * window  # sum of min(p + 1, W)
        attention *= seen / (seq_len * (seq_len + 1) / 2)
    return 2.0 * matrix_params + len(layers) * attention


def activation_bytes_per_sequence(cfg: Any, seq_len: int | None = None) -> dict[str, int]:
    """Bytes of activations autograd keeps for the backward pass, one fp32 sequence, by part.

    These are the tensors scratchlm's own ops save (written from elementary tensor ops, so a
    softmax keeps its exponentials as well as its output); the tests check the total against
    what ``torch.autograd.graph.saved_tensors_hooks`` sees. Per layer (T tokens, D = d_model,
    H heads, F = d_ff, E experts, k = top_k, S shared experts):

    - each RMSNorm (two per layer): its input, the normalised x/rms and the weighted output
      that feeds the next matmul (3·T·D); without RMSNorm, only the matmul input (T·D);
    - attention, "math" backend: q and k after RoPE, v, and the attention output fed to
      ``output_proj`` (4·T·D); the scaled scores, their exponentials and the probabilities
      (3·H·T·T, the term quadratic in T); flash backends keep only a (H, T) log-sum-exp
      beyond those (H·T): their output, laid out (T, H, d), is itself what feeds ``output_proj``.
      With GQA, k and v are kept with their kv_dim = Hkv·d columns by a backend that declares
      `grouped_kv` or with one kv head (repeating it is a view), else as repeated to D columns
      (what attends is the copy); QK-norm adds, per
      norm, its input and the normalised x/rms (2·T·(D + kv_dim) for q and k);
    - SwiGLU: w1 x, sigmoid(w1 x), silu(w1 x), w3 x and the product fed to w2 (5·T·F);
      SiLU FFN: w1 x, its sigmoid and silu(w1 x) (3·T·F); ReLU² FFN: relu(w1 x), which both
      the ReLU's and the square's backward read, and its square fed to w2 (2·T·F);
    - MoE: the router logits, probabilities and their logarithms (3·T·E), the gathered
      expert inputs and the expert outputs before the weighted sum (2·k·T·D), and 5·F per
      token for each routed and shared expert ((k + S)·5·T·F). With a capacity factor the
      experts run on the E·C padded rows instead of k·T (C = ceil(factor·T·k/E)).

    After the stack: the final RMSNorm (3·T·D) and the float32 logits and their
    exponentials inside the cross-entropy (2·T·V), plus with ``logit_softcap`` the tanh that
    the cap saves (T·V). Ignored as small: per-row statistics
    such as 1/rms or softmax maxima (O(T·H)), the RoPE cos/sin rows, boolean masks and
    integer ids. Residual additions keep nothing. Mixed precision roughly halves the total;
    activation checkpointing trades most of it for recomputation.
    """
    T = cfg.context_length if seq_len is None else seq_len
    V, D, L, F, H = cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.d_ff, cfg.num_heads
    # Without RMSNorm the next matmul still keeps its input: the residual stream itself.
    norm = 3 * T * D if cfg.use_rmsnorm else T * D
    scores = 3 * H * T * T if cfg.attention_backend == "math" else H * T
    a = attention_shape(cfg)
    # k and v as they attend: repeated to D columns, unless the backend takes the kv heads or there
    # is one kv head (its repeat is a stride-0 view)
    kv = a["kv_dim"] if _grouped_backend(cfg.attention_backend) or a["num_kv_heads"] == 1 else D
    qkv = 2 * T * D + 2 * T * kv + (2 * T * (D + a["kv_dim"]) if a["qk_norm"] else 0)
    if cfg.ffn == "swiglu":
        ffn = 5 * T * F
    elif cfg.ffn == "silu":
        ffn = 3 * T * F
    elif cfg.ffn == "relu2":
        ffn = 2 * T * F
    elif cfg.ffn == "moe":
        moe = moe_shape(cfg)
        k, E, cf = moe["top_k"], moe["num_experts"], moe["capacity_factor"]
        # With a capacity the experts run on E·C = capacity_factor·k·T padded rows.
        rows = k * T if cf is None else E * math.ceil(cf * T * k / E)
        ffn = 3 * T * E + k * T * D + rows * D + (rows + moe["shared"] * T) * 5 * F
    else:
        raise ValueError(f"unknown ffn {cfg.ffn!r}")
    elements = {
        "norms": (2 * L + 1) * norm,
        "attention": L * (qkv + scores),
        "ffn": L * ffn,
        "loss": (3 if getattr(cfg, "logit_softcap", 0) else 2) * T * V,
    }
    out = {k: v * FP32_BYTES for k, v in elements.items()}
    out["total"] = sum(out.values())
    return out


def _grouped_backend(name: str) -> bool:
    # Whether the backend takes k and v with their own kv heads (a class attribute: nothing is built).
    from scratchlm.model.attention_backends import ATTENTION_BACKENDS

    backend = ATTENTION_BACKENDS.get(name)
    return bool(getattr(backend, "grouped_kv", False))


def kv_cache_bytes(cfg: Any, seq_len: int | None = None, batch_size: int = 1, bytes_per_element: int = 2) -> int:
    """Bytes of a decoding KV cache for `batch_size` rows of `seq_len` tokens (default
    context_length), bf16 by default: keys and values of num_kv_heads heads in every layer,
    2·L·B·T·kv_dim elements. The static cache keeps every position, window or not.

    >>> from scratchlm.model.config import ModelConfig
    >>> kv_cache_bytes(ModelConfig(d_model=64, num_layers=2, num_heads=8, num_kv_heads=2), seq_len=10)
    1280
    """
    T = cfg.context_length if seq_len is None else seq_len
    return 2 * cfg.num_layers * batch_size * T * attention_shape(cfg)["kv_dim"] * bytes_per_element


def muon_param_count(cfg: Any) -> int:
    """Parameters that ``optim.name = "muon"`` steps with Muon: the 2-D matrices of the blocks
    (`scratchlm.optim.muon.is_muon_param`), that is q, k, v and output of attention, the FFN's
    matrices, and for MoE the router and the shared experts. The 3-D expert stacks, biases, norm
    gains, the embedding and lm_head take AdamW steps."""
    D, F, L = cfg.d_model, cfg.d_ff, cfg.num_layers
    attention = 2 * D * D + 2 * D * attention_shape(cfg)["kv_dim"]
    if cfg.ffn == "moe":
        moe = moe_shape(cfg)
        ffn = D * moe["num_experts"] + moe["shared"] * 3 * D * F
    else:
        ffn = _ffn_params(cfg)["total"]
    return L * (attention + ffn)


def optimizer_state_bytes(cfg: Any, optimizer: str = "adamw") -> int:
    """Bytes of fp32 optimizer state after the first step: AdamW's two moments per parameter
    (8 bytes); Muon's one momentum buffer per parameter of its matrices (4 bytes, see
    `muon_param_count`) and AdamW's two moments for the rest. Step counters are not counted."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")
    total = param_count(cfg)
    own = muon_param_count(cfg) if optimizer == "muon" else total
    return FP32_BYTES * (OPTIMIZER_STATES[optimizer] * own + OPTIMIZER_STATES["adamw"] * (total - own))


def train_memory_bytes(cfg: Any, optimizer: str = "adamw") -> dict[str, int]:
    """Training memory: ``static`` (fp32 weights and grads, and the optimizer's state: 16
    bytes/param with AdamW's m and v, less with Muon's single momentum, see
    `optimizer_state_bytes`) and ``activations_per_sequence`` (fp32, one sequence of
    context_length; see ``activation_bytes_per_sequence`` for the tensors counted)."""
    return {
        "static": 2 * FP32_BYTES * param_count(cfg) + optimizer_state_bytes(cfg, optimizer),
        "activations_per_sequence": activation_bytes_per_sequence(cfg)["total"],
    }


def max_batch_size(cfg: Any, memory_bytes: int, optimizer: str = "adamw") -> int:
    """Largest fp32 batch of context_length sequences whose static + activation memory fits."""
    mem = train_memory_bytes(cfg, optimizer)
    free = memory_bytes - mem["static"]
    return max(0, free // mem["activations_per_sequence"])


def account(cfg: Any, optimizer: str = "adamw") -> dict[str, Any]:
    """The full report of `scratchlm account`: params, FLOPs and memory of one config, trained
    with `optimizer` (``optim.name``: "adamw" or "muon").

    The top-level keys ``params``, ``forward_flops``, ``forward_flops_breakdown`` and
    ``train_memory_bytes`` are a stable interface; the rest is informative.
    """
    params = count_params(cfg)
    flops = forward_flops(cfg)
    breakdown = {k: v for k, v in flops.items() if k != "total"}
    report: dict[str, Any] = {
        "params": params["total"],
        "forward_flops": flops["total"],
        "forward_flops_breakdown": breakdown,
        "train_memory_bytes": train_memory_bytes(cfg, optimizer),
        "optimizer": optimizer,
        "optimizer_state_bytes": optimizer_state_bytes(cfg, optimizer),
        "params_breakdown": params,
        "context_length": cfg.context_length,
        "forward_flops_per_token": flops["total"] // cfg.context_length,
        "train_flops_per_sequence": TRAIN_FORWARDS * flops["total"],
        "train_flops_per_token": TRAIN_FORWARDS * flops["total"] // cfg.context_length,
        "activation_bytes_breakdown": activation_bytes_per_sequence(cfg),
        "kv_cache_bytes_per_sequence": kv_cache_bytes(cfg),  # bf16, context_length tokens
        "attention_flops_counting": "full T x T (no causal halving)",
    }
    if cfg.ffn == "moe":
        report["moe"] = moe_shape(cfg)
    return report
