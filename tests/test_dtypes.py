import pytest
import torch

from scratchlm.dtypes import DTYPE_NAMES, canonical_dtype, dtype_name, torch_dtype


@pytest.mark.parametrize("name, canonical, dtype", [
    ("bf16", "bf16", torch.bfloat16), ("bfloat16", "bf16", torch.bfloat16), ("BF16", "bf16", torch.bfloat16),
    ("fp32", "fp32", torch.float32), ("float32", "fp32", torch.float32), ("float", "fp32", torch.float32),
    ("fp16", "fp16", torch.float16), ("float16", "fp16", torch.float16), ("half", "fp16", torch.float16),
])
def test_both_spellings_name_one_dtype(name, canonical, dtype):
    assert canonical_dtype(name) == canonical
    assert torch_dtype(name) is dtype


def test_canonical_names_round_trip_through_torch():
    for name in DTYPE_NAMES:
        assert dtype_name(torch_dtype(name)) == name


def test_unknown_or_disallowed_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'; use one of fp32 \(float32\), bf16"):
        canonical_dtype("int8")
    with pytest.raises(ValueError, match="unknown dtype 'float16'"):
        canonical_dtype("float16", allowed=("fp32", "bf16"))
    with pytest.raises(ValueError):
        dtype_name(torch.int64)


def test_trainer_dtype_accepts_torch_spellings_and_stores_the_canonical_name():
    from scratchlm.train.config import TrainerConfig

    assert TrainerConfig(dtype="bfloat16").dtype == "bf16"
    assert TrainerConfig(dtype="float32").dtype == "fp32"
    assert TrainerConfig().dtype == "auto"
    with pytest.raises(ValueError, match="trainer.dtype"):
        TrainerConfig(dtype="fp16")
