"""The decoder-only Transformer LM (Llama layout) and its ablation variants.

Default architecture: token embedding -> num_layers x [x + attn(ln1(x)); x + ffn(ln2(x))]
-> ln_final -> lm_head, with RMSNorm, RoPE, SwiGLU, causal attention, no biases.

Variants (keyword options, the field names of `ModelConfig`), and what they do to the
state_dict (default keys are listed in DESIGN.md):
- norm_position="post": x = ln1(x + attn(x)); x = ln2(x + ffn(x)). Same keys; ln_final is
  kept so every layout loads the same way.
- use_rmsnorm=False: ln1, ln2 and ln_final are identities, so their `.weight` keys are absent.
- use_rope=False (NoPE): no positional information except the causal mask; no keys change
  (RoPE has no parameters).
- ffn="silu": ungated `w2(silu(w1 x))`, so `ffn.w3.weight` is absent. ffn="relu2": ungated
  `w2(relu(w1 x)²)` (`layers.ReLU2FFN`), `ffn.w3.weight` absent too. ffn="moe" asks
  `scratchlm.model.moe.build_moe_ffn(d_model, d_ff, device=, dtype=, **moe_options)` for the
  module (build_model takes the options from the config's `moe_*` fields through
  `scratchlm.model.moe.moe_options(cfg)`); the keys under `ffn.` are then the MoE's own.
- tie_embeddings=True: `lm_head.weight` *is* `token_embeddings.weight` (one Parameter, so
  `model.lm_head.weight` works everywhere). The state_dict then holds only
  `token_embeddings.weight` (safetensors refuses aliased tensors), and loading accepts a
  state dict with or without `lm_head.weight` (if present it must equal the embedding). The
  shared matrix gets the lm_head's initialisation: the N(0, 1) embedding scale would start
  training with logits of std sqrt(d_model).
- logit_softcap=c > 0: logits = c·tanh(logits / c); `lm_head` is a `layers.SoftcappedLinear`,
  so decoding, which calls `lm_head` on the hidden states, caps them too. No keys change.
- zero_init_output=True: each block's `attn.output_proj.weight` and `ffn.w2` (for MoE the
  experts' stacked `w2` and the shared experts' `ffn.shared.w2.weight`) start at zero, so
  every block starts as the identity and the residual stream as the embeddings (the
  modded-nanogpt speedrun's init). `lm_head` keeps its init: tied, it is the embedding table,
  and a zero head too would leave only itself a gradient at the first step. No keys change.
- low_precision_residual=True: under autocast the residual stream is held in the autocast dtype
  (bf16) from the embedding on, instead of float32: the blocks' adds, the RMSNorms' inputs and
  the residual's gradient then move half the bytes (the modded-nanogpt speedrun's bf16
  stream). Without autocast nothing changes. No keys change.
- attention_backend: "math" or another name registered in `attention_backends.ATTENTION_BACKENDS`
  ("flash_torch", "flash_triton", ...; see attention_backends.py); no keys change.
- qkv_init: "fused" (default) or "separate", the init scale of q/k/v (see attention.py); no keys change.
- fused_projections: True (default) computes q/k/v, and SwiGLU's w1/w3, each as one forward
  matmul over the concatenated weights in mixed-precision training (`layers.project_together`);
  no keys change.
- num_kv_heads (grouped-query attention): `attn.k_proj.weight` and `attn.v_proj.weight` are
  (num_kv_heads · d_model / num_heads, d_model); a KV cache stores that many heads.
- qk_norm=True: RMSNorm over the head size on q and k (before RoPE); adds
  `layers.{i}.attn.q_norm.weight` and `layers.{i}.attn.k_norm.weight`.
- sliding_window=W: each query attends to at most the last W keys; no keys change.
- qkv_bias=True: adds `layers.{i}.attn.{q,k,v}_proj.bias` (Qwen2's layout).
- packed_qkv_backward: True (default) with fused_projections and "flash_triton" on CUDA makes
  q/k/v's backward one matmul each way as well (see attention.py); elsewhere it changes nothing;
  no keys change.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from scratchlm.model.attention import MultiHeadSelfAttention
from scratchlm.model.functional import compute_dtype
from scratchlm.model.layers import Embedding, Linear, ReLU2FFN, RMSNorm, SiLUFFN, SoftcappedLinear, SwiGLU
from scratchlm.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from scratchlm.model.config import ModelConfig


def _make_norm(use_rmsnorm: bool, d_model: int, eps: float, device, dtype) -> nn.Module:
    return RMSNorm(d_model, eps=eps, device=device, dtype=dtype) if use_rmsnorm else nn.Identity()


def _moe_module():
    """scratchlm.model.moe, imported only when an MoE FFN is asked for."""
    from scratchlm.errors import UserError

    try:
        moe = importlib.import_module("scratchlm.model.moe")
    except ModuleNotFoundError as e:
        if e.name != "scratchlm.model.moe":
            raise
        raise UserError("model.ffn='moe' is not available: scratchlm.model.moe is not installed") from None
    if not hasattr(moe, "build_moe_ffn"):
        raise UserError("model.ffn='moe' is not available: scratchlm.model.moe has no build_moe_ffn")
    return moe


def _make_ffn(kind: str, d_model: int, d_ff: int, moe_options: dict[str, Any] | None, device, dtype,
              fused: bool = True) -> nn.Module:
    if kind == "swiglu":
        return SwiGLU(d_model, d_ff, device=device, dtype=dtype, fused=fused)
    if kind == "silu":
        return SiLUFFN(d_model, d_ff, device=device, dtype=dtype)
    if kind == "relu2":
        return ReLU2FFN(d_model, d_ff, device=device, dtype=dtype)
    if kind == "moe":
        return _moe_module().build_moe_ffn(d_model, d_ff, device=device, dtype=dtype, **(moe_options or {}))
    raise ValueError(f"unknown ffn {kind!r}; choose 'swiglu', 'silu', 'relu2' or 'moe'")


class TransformerBlock(nn.Module):
    """One residual block: x (B, T, d_model) -> (B, T, d_model). Submodules ln1, attn, ln2, ffn.

    Builds its own RotaryEmbedding(rope_theta, d_model / num_heads, max_seq_len) unless a
    shared `rope` is passed (TransformerLM shares one across its blocks) or use_rope=False.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        max_seq_len: int,
        rope_theta: float,
        *,
        norm_position: str = "pre",
        use_rmsnorm: bool = True,
        use_rope: bool = True,
        ffn: str = "swiglu",
        attention_backend: str = "math",
        qkv_init: str = "fused",
        fused_projections: bool = True,
        packed_qkv_backward: bool = True,
        num_kv_heads: int | None = None,
        qk_norm: bool = False,
        sliding_window: int | None = None,
        qkv_bias: bool = False,
        rmsnorm_eps: float = 1e-5,
        moe_options: dict[str, Any] | None = None,
        rope: RotaryEmbedding | None = None,
        layer_idx: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position must be 'pre' or 'post', got {norm_position!r}")
        self.norm_position = norm_position
        if use_rope and rope is None:
            rope = RotaryEmbedding(rope_theta, d_model // num_heads, max_seq_len, device=device)
        self.ln1 = _make_norm(use_rmsnorm, d_model, rmsnorm_eps, device, dtype)
        self.attn = MultiHeadSelfAttention(
            d_model,
            num_heads,
            rope if use_rope else None,
            backend=attention_backend,
            qkv_init=qkv_init,
            fused_qkv=fused_projections,
            packed_backward=packed_qkv_backward,
            num_kv_heads=num_kv_heads,
            qk_norm=qk_norm,
            sliding_window=sliding_window,
            qkv_bias=qkv_bias,
            norm_eps=rmsnorm_eps,
            layer_idx=layer_idx,
            device=device,
            dtype=dtype,
        )
        self.ln2 = _make_norm(use_rmsnorm, d_model, rmsnorm_eps, device, dtype)
        self.ffn = _make_ffn(ffn, d_model, d_ff, moe_options, device, dtype, fused=fused_projections)

    def forward(
        self,
        x: Tensor,
        token_positions: Tensor | None = None,
        kv_cache: Any = None,
        *,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        if self.norm_position == "pre":
            # the decoding engine's view may run a decode step of this block in fused kernels
            fused = kv_cache.fused_block(self, x) if hasattr(kv_cache, "fused_block") else None
            if fused is not None:
                return fused(x, token_positions)
            x = x + self.attn(self.ln1(x), token_positions, kv_cache, attention_mask=attention_mask)
            return x + self._ffn(self.ln2(x), kv_cache)
        x = self.ln1(x + self.attn(x, token_positions, kv_cache, attention_mask=attention_mask))
        return self.ln2(x + self._ffn(x, kv_cache))

    def _ffn(self, x: Tensor, kv_cache: Any) -> Tensor:
        # the decoding engine's view may hold a SwiGLU's w1|w3 stacked as one matrix
        stacked = kv_cache.stacked(self.attn.layer_idx, "w13") if hasattr(kv_cache, "stacked") else None
        return self.ffn(x) if stacked is None else self.ffn(x, stacked)


class TransformerLM(nn.Module):
    """Decoder-only LM: token ids (B, T) -> logits (B, T, vocab_size), for T <= context_length.

    Submodules token_embeddings, layers (ModuleList of TransformerBlock), ln_final, lm_head.
    Variants are keyword options; see the module docstring for each and its state_dict keys.
    """

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        rope_theta: float = 10_000.0,
        *,
        norm_position: str = "pre",
        use_rmsnorm: bool = True,
        use_rope: bool = True,
        ffn: str = "swiglu",
        tie_embeddings: bool = False,
        attention_backend: str = "math",
        qkv_init: str = "fused",
        fused_projections: bool = True,
        packed_qkv_backward: bool = True,
        num_kv_heads: int | None = None,
        qk_norm: bool = False,
        sliding_window: int | None = None,
        qkv_bias: bool = False,
        rmsnorm_eps: float = 1e-5,
        moe_options: dict[str, Any] | None = None,
        logit_softcap: float = 0.0,
        zero_init_output: bool = False,
        low_precision_residual: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.low_precision_residual = low_precision_residual
        self.context_length = context_length
        self.d_model = d_model
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.tie_embeddings = tie_embeddings
        self.token_embeddings = Embedding(vocab_size, d_model, device=device, dtype=dtype)
        # One RoPE table shared by all blocks: it has no parameters and is the same everywhere.
        rope = RotaryEmbedding(rope_theta, d_model // num_heads, context_length, device=device) if use_rope else None
        self.layers = nn.ModuleList(
            TransformerBlock(
                d_model,
                num_heads,
                d_ff,
                context_length,
                rope_theta,
                norm_position=norm_position,
                use_rmsnorm=use_rmsnorm,
                use_rope=use_rope,
                ffn=ffn,
                attention_backend=attention_backend,
                qkv_init=qkv_init,
                fused_projections=fused_projections,
                packed_qkv_backward=packed_qkv_backward,
                num_kv_heads=num_kv_heads,
                qk_norm=qk_norm,
                sliding_window=sliding_window,
                qkv_bias=qkv_bias,
                rmsnorm_eps=rmsnorm_eps,
                moe_options=moe_options,
                rope=rope,
                layer_idx=i,
                device=device,
                dtype=dtype,
            )
            for i in range(num_layers)
        )
        self.ln_final = _make_norm(use_rmsnorm, d_model, rmsnorm_eps, device, dtype)
        self.logit_softcap = logit_softcap
        if logit_softcap > 0:
            self.lm_head = SoftcappedLinear(d_model, vocab_size, logit_softcap, device=device, dtype=dtype)
        else:
            self.lm_head = Linear(d_model, vocab_size, device=device, dtype=dtype)
        if zero_init_output:
            for block in self.layers:
                _zero_output_projections(block)
        # What runs each block in an uncached, unmasked forward: `block_runner(block, x)` in place
        # of `block(x)`. None (plain calls) unless set from outside: `trainer.compile_scope="blocks"`
        # sets one torch.compile of a block call that every block shares (scratchlm.parallel.parallelize).
        self.block_runner: Callable[[nn.Module, Tensor], Tensor] | None = None
        if tie_embeddings:
            self.token_embeddings.weight = self.lm_head.weight
            self.register_state_dict_post_hook(_drop_tied_lm_head)
            self.register_load_state_dict_pre_hook(_accept_tied_lm_head)

    def hidden_states(
        self,
        token_ids: Tensor,
        token_positions: Tensor | None = None,
        kv_cache: Any = None,
        *,
        attention_mask: Tensor | None = None,
        final_norm: bool = True,
    ) -> Tensor:
        """The final normalised residual stream, (B, T, d_model): what lm_head is applied to.

        token_ids: (B, T) int. token_positions: (T,) or (B, T); defaults to 0 .. T-1, or with
        a `kv_cache` to the positions after those already cached. attention_mask: (B, T)
        bool, True at real tokens (left padding), for uncached calls only. final_norm=False
        returns the residual stream before ln_final (for a head that applies the norm itself).
        """
        T = token_ids.shape[-1]
        if kv_cache is None and T > self.context_length:
            raise ValueError(f"sequence of {T} tokens exceeds context_length={self.context_length}")
        if kv_cache is not None and token_positions is None:
            token_positions = kv_cache.positions(T, device=token_ids.device)
            end = kv_cache.seq_len + T - kv_cache.min_pad
            if end > self.context_length:
                raise ValueError(
                    f"a KV cache holding {kv_cache.seq_len - kv_cache.min_pad} tokens cannot take {T} more: "
                    f"context_length={self.context_length}"
                )
        if token_positions is None and attention_mask is not None:
            # Left padding: a row's first real token is position 0.
            token_positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        x = self.token_embeddings(token_ids)  # (B, T, d_model)
        if self.low_precision_residual:
            x = x.to(compute_dtype(x))  # the autocast dtype under autocast, else unchanged
        runner = self.block_runner
        if runner is not None and kv_cache is None and attention_mask is None and token_positions is None:
            for layer in self.layers:
                x = runner(layer, x)
            return self.ln_final(x) if final_norm else x
        for layer in self.layers:
            x = layer(x, token_positions, kv_cache, attention_mask=attention_mask)
        return self.ln_final(x) if final_norm else x

    def head_inputs(self, token_ids: Tensor, token_positions: Tensor | None = None, kv_cache: Any = None,
                    *, attention_mask: Tensor | None = None) -> Tensor:
        """`hidden_states` in the dtype the LM head's matmul runs in: the autocast dtype under
        autocast (where ``lm_head`` would cast them itself), else unchanged. This is the input of
        the fused head and loss (`fused_linear_cross_entropy`); compiled with the trunk, the cast
        is written by the final norm's kernel instead of being a pass of its own, and the head's
        gradient comes back in that dtype (it is computed in it)."""
        h = self.hidden_states(token_ids, token_positions, kv_cache, attention_mask=attention_mask)
        return h.to(compute_dtype(h)) if h.is_floating_point() else h

    def forward(
        self,
        token_ids: Tensor,
        token_positions: Tensor | None = None,
        kv_cache: Any = None,
        *,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, T, vocab_size); arguments as in `hidden_states`."""
        return self.lm_head(self.hidden_states(token_ids, token_positions, kv_cache, attention_mask=attention_mask))


@contextlib.contextmanager
def blocks_run_by(model: TransformerLM, runner: Callable[[nn.Module, Tensor], Tensor] | None) -> Iterator[TransformerLM]:
    """Inside the ``with`` block `model`'s blocks run through `runner` (None: plain calls), as
    its `block_runner`; the runner it had comes back after."""
    saved, model.block_runner = model.block_runner, runner
    try:
        yield model
    finally:
        model.block_runner = saved


def run_block(block: nn.Module, x: Tensor) -> Tensor:
    """One block's forward, as `TransformerLM.block_runner` calls it. Under one torch.compile it
    serves every block of a model: they share their code, and their weights are the graph's inputs."""
    return block(x)


@torch.no_grad()
def _zero_output_projections(block: TransformerBlock) -> None:
    """Zero the matrices that write a block's branches into the residual stream."""
    block.attn.output_proj.weight.zero_()
    w2 = getattr(block.ffn, "w2", None)
    if w2 is not None:
        (w2.weight if isinstance(w2, nn.Module) else w2).zero_()
    shared = getattr(block.ffn, "shared", None)  # MoE shared experts: a SwiGLU beside the routed ones
    if shared is not None:
        shared.w2.weight.zero_()


def _drop_tied_lm_head(module: nn.Module, state_dict: dict[str, Tensor], prefix: str, local_metadata) -> None:
    state_dict.pop(prefix + "lm_head.weight", None)


def _accept_tied_lm_head(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args) -> None:
    # Both submodules load the shared Parameter, so give each its key (copying it twice is harmless).
    emb_key, head_key = prefix + "token_embeddings.weight", prefix + "lm_head.weight"
    emb, head = state_dict.get(emb_key), state_dict.get(head_key)
    if emb is None and head is not None:
        state_dict[emb_key] = head
    elif head is None and emb is not None:
        state_dict[head_key] = emb
    elif emb is not None and emb is not head and not torch.equal(emb, head.to(emb.device, emb.dtype)):
        raise ValueError(
            "this model ties lm_head to token_embeddings, but the state dict has different "
            "lm_head.weight and token_embeddings.weight (an untied checkpoint)"
        )


def build_model(cfg: ModelConfig, device=None, dtype=None) -> TransformerLM:
    """The TransformerLM described by a ModelConfig, built directly on `device` in `dtype`.

    The config is kept as `model.config` (checkpoints store it from there).
    """
    model = TransformerLM(
        vocab_size=cfg.vocab_size,
        context_length=cfg.context_length,
        d_model=cfg.d_model,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        d_ff=cfg.d_ff,
        rope_theta=cfg.rope_theta,
        norm_position=cfg.norm_position,
        use_rmsnorm=cfg.use_rmsnorm,
        use_rope=cfg.use_rope,
        ffn=cfg.ffn,
        tie_embeddings=cfg.tie_embeddings,
        attention_backend=cfg.attention_backend,
        qkv_init=cfg.qkv_init,
        fused_projections=cfg.fused_projections,
        packed_qkv_backward=cfg.packed_qkv_backward,
        num_kv_heads=cfg.num_kv_heads,
        qk_norm=cfg.qk_norm,
        sliding_window=cfg.sliding_window,
        qkv_bias=cfg.qkv_bias,
        rmsnorm_eps=cfg.rmsnorm_eps,
        moe_options=_moe_module().moe_options(cfg) if cfg.ffn == "moe" else None,
        logit_softcap=cfg.logit_softcap,
        zero_init_output=cfg.zero_init_output,
        low_precision_residual=cfg.low_precision_residual,
        device=device,
        dtype=dtype,
    )
    model.config = cfg
    return model
