import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scratchlm.errors import UserError
from scratchlm.kernels import triton_support

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def unchosen(monkeypatch):
    # A process in which no op has been registered yet.
    monkeypatch.setattr(triton_support, "_registration", None)


def test_default_is_triton_op_where_torch_has_it(unchosen, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    expected = "triton_op" if hasattr(torch.library, "triton_op") else "custom_op"
    assert triton_support.op_registration() == expected


def test_choice_is_fixed_once_made(unchosen):
    triton_support.set_op_registration("custom_op")
    assert triton_support.op_registration() == "custom_op"
    triton_support.set_op_registration("custom_op")  # the same choice again is fine
    with pytest.raises(UserError, match="already registered as 'custom_op'"):
        triton_support.set_op_registration("triton_op")
    with pytest.raises(UserError, match="choose one of triton_op, custom_op"):
        triton_support.set_op_registration("opaque")


def test_triton_op_is_refused_under_the_interpreter(unchosen, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(UserError, match="use 'custom_op'"):
        triton_support.set_op_registration("triton_op")


_CHILD = """
import torch
from scratchlm.kernels import triton_support
{setup}
from scratchlm.kernels import flash_attention_triton as fa
from scratchlm.kernels.flash_attention_torch import naive_attention
from torch._library.triton import triton_ops_to_kernels
print(triton_support.op_registration(), "scratchlm::flash_attention_forward" in triton_ops_to_kernels)
q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
torch.testing.assert_close(fa.flash_attention(q, k, v, True), naive_attention(q, k, v, True), rtol=1e-5, atol=1e-5)
"""


@pytest.mark.skipif(not hasattr(torch.library, "triton_op"), reason="torch without triton_op")
@pytest.mark.parametrize("setup,expected", [
    ("", "triton_op True"),
    ("triton_support.set_op_registration('custom_op')", "custom_op False"),
])
def test_registration_is_chosen_by_a_call_not_the_environment(setup, expected):
    # The variable that used to choose it is set in both runs and changes nothing.
    env = {**os.environ, "PYTHONPATH": str(SRC), "SCRATCHLM_FLASH_TRITON_OP": "0", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", _CHILD.format(setup=setup)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[-2] == expected
