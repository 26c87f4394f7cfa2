import pytest
import torch

from scratchlm.bench.profile import kernel_breakdown, kernel_class, kernel_times
from scratchlm.errors import UserError

# Kernel names as torch.profiler reported them for the gpt2small step on an H200.
NAMES = {
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "matmul",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
    "_bwd_dkdv_kernel": "attention",
    "_fwd_kernel": "attention",
    "_bwd_dq_kernel": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
    "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*)": "attention",
    "_cross_entropy_rows_kernel": "loss",
    "_adamw_kernel": "optimizer",
    "_swiglu_backward_kernel": "swiglu",
    "_rope_qk_bf16_kernel": "rope",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>": "optimizer",
    "triton_poi_fused_add_mul_sigmoid_sigmoid_backward_view_3": "inductor",
    "triton_red_fused__log_softmax__to_copy_prepare_softmax_online_15": "inductor",
    "Memset (Device)": "other",
    "void at::native::elementwise_kernel<128, 2, BinaryFunctor<float>>": "other",
}


@pytest.mark.parametrize("name", NAMES)
def test_kernel_class(name):
    assert kernel_class(name) == NAMES[name]


def test_kernel_breakdown_sums_by_class_largest_first():
    times = {"nvjet_a": (3.0, 2), "nvjet_b": (1.0, 1), "_fwd_kernel": (2.5, 12), "triton_poi_x": (0.5, 3),
             "Memset (Device)": (0.25, 9)}
    out = kernel_breakdown(times)
    assert out == {"matmul": 4.0, "attention": 2.5, "inductor": 0.5, "other": 0.25, "total": 7.25}
    assert list(out)[:4] == ["matmul", "attention", "inductor", "other"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_kernel_times_needs_cuda():
    with pytest.raises(UserError, match="CUDA"):
        kernel_times(lambda: None)


@pytest.mark.gpu
def test_kernel_times_sees_matmul_kernels_per_call():
    a = torch.randn(512, 512, device="cuda")
    times = kernel_times(lambda: a @ a, steps=3)
    matmul = {k: v for k, v in times.items() if kernel_class(k) == "matmul"}
    assert matmul and all(launches == 1 for _, launches in matmul.values())
    assert not any("#" in k for k in times)  # no user annotations
