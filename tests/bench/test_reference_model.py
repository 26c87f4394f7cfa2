import numpy as np
import pytest
import torch

from scratchlm.bench.reference_model import (ReferenceLM, reference_adamw, rotate_halves, rotate_interleaved,
                                             rope_tables, window_batch)
from scratchlm.model.rope import RotaryEmbedding
from scratchlm.model.transformer import TransformerLM

SHAPE = dict(vocab_size=97, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48)


def _load_scratchlm_weights(ref: ReferenceLM, ours: TransformerLM) -> None:
    """Copy scratchlm's weights into the reference (q|k|v stacked into its one qkv Linear)."""
    p = dict(ours.named_parameters())
    with torch.no_grad():
        ref.embed.weight.copy_(p["token_embeddings.weight"])
        ref.head.weight.copy_(p["lm_head.weight"])
        ref.ln_f.weight.copy_(p["ln_final.weight"])
        for i, block in enumerate(ref.blocks):
            pre = f"layers.{i}."
            block.qkv.weight.copy_(torch.cat([p[pre + f"attn.{n}_proj.weight"] for n in "qkv"]))
            block.out.weight.copy_(p[pre + "attn.output_proj.weight"])
            for n in ("w1", "w2", "w3"):
                getattr(block, n).weight.copy_(p[pre + f"ffn.{n}.weight"])
            block.ln1.weight.copy_(p[pre + "ln1.weight"])
            block.ln2.weight.copy_(p[pre + "ln2.weight"])


def test_reference_gives_scratchlm_logits_with_scratchlm_weights():
    torch.manual_seed(0)
    ours = TransformerLM(**SHAPE).eval()
    ref = ReferenceLM(**SHAPE).eval()
    _load_scratchlm_weights(ref, ours)
    idx = torch.randint(0, SHAPE["vocab_size"], (3, 11))
    with torch.no_grad():
        torch.testing.assert_close(ref(idx), ours(idx), rtol=1e-4, atol=1e-4)


def test_interleaved_rotation_is_scratchlms_rope():
    d, T = 8, 5
    x = torch.randn(2, 3, T, d)
    cos, sin = rope_tables(d, T, 10_000.0)
    positions = torch.arange(T)
    torch.testing.assert_close(rotate_interleaved(x, cos, sin), RotaryEmbedding(10_000.0, d, T)(x, positions))


def test_rotate_halves_is_the_same_rotation_on_permuted_features():
    d, T = 8, 5
    x = torch.randn(2, 3, T, d)
    cos, sin = rope_tables(d, T, 10_000.0)
    halves_order = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # (x0, x2, .., x1, x3, ..)
    torch.testing.assert_close(rotate_halves(x[..., halves_order], cos, sin),
                               rotate_interleaved(x, cos, sin)[..., halves_order])


def test_checkpointed_blocks_give_the_same_logits_and_gradients():
    torch.manual_seed(0)
    plain = ReferenceLM(**SHAPE, rope_pairs="halves")
    checkpointed = ReferenceLM(**SHAPE, rope_pairs="halves", checkpoint_every=2)
    checkpointed.load_state_dict(plain.state_dict())
    idx = torch.randint(0, SHAPE["vocab_size"], (2, 9))
    a, b = plain(idx), checkpointed(idx)
    torch.testing.assert_close(a, b)
    a.square().mean().backward()
    b.square().mean().backward()
    torch.testing.assert_close(plain.blocks[0].qkv.weight.grad, checkpointed.blocks[0].qkv.weight.grad)


def test_unknown_rope_pairs_rejected():
    with pytest.raises(ValueError, match="rope_pairs"):
        ReferenceLM(**SHAPE, rope_pairs="rotated")


def test_adamw_decays_matrices_only():
    model = ReferenceLM(**SHAPE)
    opt = reference_adamw(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert not decay.get("fused")  # CPU parameters: not fused


def test_window_batch_targets_are_inputs_shifted_by_one():
    tokens = np.arange(100, dtype=np.uint16)
    x, y = window_batch(tokens, np.array([3, 50]), 6, "cpu")
    assert x.dtype == torch.int64 and x.shape == y.shape == (2, 6)
    assert x[0].tolist() == list(range(3, 9)) and y[1].tolist() == list(range(51, 57))
