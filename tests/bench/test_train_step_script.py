"""benchmarks/train_step.py's orchestration on CPU, with a stand-in for the GPU measurement."""

import pytest

from tests.bench.test_scripts import load

TOKENS_PER_S = {"torch.nn reference (SDPA, fused AdamW)": 100.0, "torch.nn reference, loss compiled too": 125.0}


def fake_measure(name, make, shape, warmup, steps, flops_token, b2b_repeats=3):
    """A row shaped like measure_step's: scratchlm variants at 150 tokens/s, out of memory for
    the long-context reference above every-block checkpointing."""
    if name.startswith("torch.nn, checkpointing 1 block"):
        return {"variant": name, "error": "out of memory"}
    rate = TOKENS_PER_S.get(name, 150.0)
    return {"variant": name, "tokens_per_s": rate, "tokens_per_s_back_to_back": rate, "peak_gib": 2.0,
            "reserved_gib": 4.0}


def test_ratios_against_both_references_and_the_best_one():
    script = load("train_step")
    out = script.run_shape("tinystories", 1, 1, ["cudagraphs", "foreach"], measure=fake_measure)
    ref, ref_compiled, *ours = out["rows"]
    assert [r["variant"] for r in ours] == [script.VARIANTS["cudagraphs"][0], script.VARIANTS["foreach"][0]]
    assert ref_compiled["ratio_vs_reference"] == pytest.approx(1.25)
    for row in ours:
        assert row["ratio_vs_reference"] == pytest.approx(1.5)
        assert row["ratio_vs_best_reference"] == pytest.approx(1.2)  # the compiled-loss reference is faster
        assert row["peak_memory_vs_reference"] == pytest.approx(1.0)
    assert "ratio_vs_best_reference" not in ref_compiled


def test_without_references_each_variant_is_compared_with_the_first():
    script = load("train_step")
    seen = []

    def measure(name, *args, **kwargs):
        seen.append(name)
        rate = 120.0 if "FP8" in name else 150.0
        return {"variant": name, "tokens_per_s": rate, "tokens_per_s_back_to_back": rate, "peak_gib": 2.0,
                "reserved_gib": 4.0}

    out = script.run_shape("tinystories", 1, 1, ["cudagraphs", "cudagraphs_fp8"], measure=measure, references=False)
    assert seen == [script.VARIANTS["cudagraphs"][0], script.VARIANTS["cudagraphs_fp8"][0]]
    first, fp8 = out["rows"]
    assert fp8["ratio_vs_first_variant"] == pytest.approx(0.8) and "ratio_vs_first_variant" not in first
    assert not script.build_parser().parse_args(["--no-references"]).references


def test_long_context_compares_the_best_row_that_fits_on_each_side():
    script = load("train_step")
    out = script.run_shape("longctx", 1, 1, checkpoint_every=[1, 2], measure=fake_measure)
    assert out["best"]["reference"].startswith("torch.nn, checkpointing every block")
    failed = [r for r in out["rows"] if "error" in r]
    assert [r["checkpoint_every"] for r in failed] == [2]
    assert all("ratio_vs_reference" in r for r in out["rows"] if "tokens_per_s" in r and r is not out["rows"][0])
