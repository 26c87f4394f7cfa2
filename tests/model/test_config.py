"""ModelConfig's validation of the values no model can use."""

from __future__ import annotations

import pytest

from scratchlm.model.config import ModelConfig


@pytest.mark.parametrize("kwargs, message", [
    # inf: every activation was normalised to 0; negative: NaN wherever mean(x²) < -eps
    ({"rmsnorm_eps": float("inf")}, "model.rmsnorm_eps must be a finite number >= 0"),
    ({"rmsnorm_eps": -1e-5}, "model.rmsnorm_eps must be a finite number >= 0"),
    # inf: an OverflowError counting the capacity, in account and at the first training step
    ({"ffn": "moe", "moe_capacity_factor": float("inf")}, "model.moe_capacity_factor must be a positive finite"),
    ({"ffn": "moe", "moe_aux_coef": -0.01}, "model.moe_aux_coef must be a finite number >= 0"),
    ({"ffn": "moe", "moe_z_coef": float("nan")}, "model.moe_z_coef must be a finite number >= 0"),
    # a typo of extra digits: a TypeError (sizes past int64) or the CPU allocator's RuntimeError in train
    ({"vocab_size": 10**20}, r"model.vocab_size must be at most 2\*\*31 - 1, got 100000000000000000000"),
    ({"vocab_size": 10**12}, "model.vocab_size must be at most"),
    ({"d_model": 2**64, "num_heads": 1}, "model.d_model must be at most"),
    ({"d_ff": 2**31}, "model.d_ff must be at most"),
    ({"num_layers": 10**20}, "model.num_layers must be at most"),
])
def test_values_no_model_can_use_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_the_edges_that_work_are_accepted():
    ModelConfig(rmsnorm_eps=0.0)
    ModelConfig(ffn="moe", moe_capacity_factor=1e-3, moe_aux_coef=0.0, moe_z_coef=0.0)


@pytest.mark.parametrize("kwargs, note", [
    ({"moe_top_k": 4}, 'model.moe_top_k=4 has no effect (the moe_* options apply to model.ffn="moe"; this '
                       'model\'s ffn is "swiglu")'),
    ({"ffn": "relu2", "moe_num_experts": 4, "moe_aux_coef": 0.1, "moe_renormalize": False},
     'model.moe_num_experts=4, model.moe_aux_coef=0.1, model.moe_renormalize=false have no effect (the moe_* options '
     'apply to model.ffn="moe"; this model\'s ffn is "relu2")'),
    ({"use_rope": False, "rope_theta": 5e5}, "model.rope_theta=500000.0 has no effect (model.use_rope=false: no RoPE)"),
    ({"sliding_window": 256}, "model.sliding_window=256 has no effect at model.context_length=256 (no sequence is "
                              "longer than the window: every query sees its whole prefix)"),
    ({"context_length": 64, "sliding_window": 1000},
     "model.sliding_window=1000 has no effect at model.context_length=64 (no sequence is longer than the window: "
     "every query sees its whole prefix)"),
])
def test_options_the_model_never_reads_are_named(kwargs, note):
    assert ModelConfig(**kwargs).ignored_options() == [note]


@pytest.mark.parametrize("kwargs", [
    {}, {"ffn": "moe", "moe_top_k": 4, "moe_num_experts": 4}, {"rope_theta": 5e5}, {"use_rope": False},
    {"ffn": "relu2"}, {"sliding_window": 255}, {"context_length": 64, "sliding_window": 16},
])
def test_options_the_model_reads_are_not_named(kwargs):
    assert ModelConfig(**kwargs).ignored_options() == []
