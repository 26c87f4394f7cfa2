"""GPU kernels, each beside its pure-PyTorch reference.

- ``flash_attention_torch``: FlashAttention-2 tiling in plain PyTorch (``FlashAttentionTorch``),
  the readable reference.
- ``flash_attention_triton``: the same algorithm in Triton, forward and backward
  (``FlashAttentionTriton``, ``flash_attention``), registered as torch.library triton ops
  that torch.compile traces into (opaque custom ops after
  ``triton_support.set_op_registration("custom_op")``).
  ``flash_attention_qkv`` attends over the concatenated q|k|v projections and hands back their
  gradient as one tensor, RoPE undone inside the backward kernels.
- ``rope_triton``: RoPE on the q and k blocks of the concatenated projections in one pass
  (``rope_qk``), the forward rotation of ``flash_attention_qkv``.
- ``swiglu_triton``: SwiGLU's gate over the concatenated w1|w3 projections, its backward one
  Triton kernel that writes both gradients as one tensor.
- ``moe_triton``: a mixture-of-experts FFN's grouped GEMMs (``grouped_swiglu``), the dispatch
  gather in their loads and SwiGLU's forward and backward in their epilogues; ``moe_route_triton``
  its routing (softmax, top-k, gates) and the buffer layout in two kernels.
- ``fused_linear_cross_entropy``: the LM head and its loss, chunked so the (tokens x vocab)
  logits never exist at once.
- ``triton_support``: what the Triton kernels share (the guarded import, when a tensor can run
  them, registration as ops that torch.compile sees into, chosen once by ``set_op_registration``).

Nothing is imported here: triton and the kernels load only when a module is imported.
"""
