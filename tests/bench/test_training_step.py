import inspect

import pytest

from scratchlm.bench.training_step import SHAPES, VARIANTS, make_scratchlm, model_kwargs, reference_flops_per_token


@pytest.mark.parametrize("key", sorted(SHAPES))
def test_reference_flops_count_matrix_weights_and_causal_attention(key):
    s = SHAPES[key]
    d, L, T = s["d_model"], s["num_layers"], s["context_length"]
    per_layer = 4 * d * d + 3 * d * s["d_ff"]  # q|k|v and output; w1, w3 and w2
    expected = 2 * (L * per_layer + s["vocab_size"] * d) + 2 * L * T * d  # embedding table excluded
    assert reference_flops_per_token(s) == expected


def test_gpt2small_flops_are_the_documented_238m():
    assert round(reference_flops_per_token(SHAPES["gpt2small"]) / 1e6) == 238


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_is_a_valid_scratchlm_configuration(name):
    label, options = VARIANTS[name]
    assert label.startswith("scratchlm")
    inspect.signature(make_scratchlm).bind(SHAPES["tinystories"], {}, **options)
    assert options["optimizer"] in ("scratchlm", "torch_fused", "triton")


def test_model_kwargs_drop_the_batch():
    assert "batch" not in model_kwargs(SHAPES["gpt2small"])
    assert model_kwargs(SHAPES["gpt2small"])["d_model"] == 768


def test_the_atomic_dq_variant_runs_each_step_in_that_mode_and_restores_it():
    from scratchlm.bench.training_step import _with_atomic_dq
    from scratchlm.kernels.flash_attention_triton import backward_dq

    seen = []
    _with_atomic_dq(lambda: seen.append(backward_dq()))()
    assert seen == ["atomic"] and backward_dq() == "recompute"

    def fails():
        raise RuntimeError("out of memory")
    with pytest.raises(RuntimeError):
        _with_atomic_dq(fails)()
    assert backward_dq() == "recompute"
