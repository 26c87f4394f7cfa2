import pytest
import torch

from scratchlm.infer.generate import generate, left_pad
from scratchlm.model.transformer import TransformerLM
from tests.infer.cuda_models import peaked_cuda_lm

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8], [9, 10, 11], [12, 13, 14, 15, 16]]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    # float64 so that argmax never flips between mathematically equal computations
    m = TransformerLM(vocab_size=40, context_length=24, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                      rope_theta=10_000.0, dtype=torch.float64)
    with torch.no_grad():  # a sharper output distribution gives varied, confident greedy paths
        m.lm_head.weight.mul_(8)
    return m


def _greedy_reference(model, prompt, n):
    """The obvious loop: full forward over the whole sequence, argmax of the last logits."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq[-model.context_length :]]))[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


def test_left_pad():
    ids, pads = left_pad([[5, 6], [7]], torch.device("cpu"))
    assert ids.tolist() == [[5, 6], [0, 7]] and pads == [0, 1]


def test_uncached_greedy_matches_reference(model):
    out = generate(model, PROMPTS, 10, temperature=0, use_kv_cache=False)
    assert out == [_greedy_reference(model, p, 10) for p in PROMPTS]
    assert len({tuple(o) for o in out}) > 1


def test_cached_greedy_equals_uncached(model):
    cached = generate(model, PROMPTS, 12, temperature=0, use_kv_cache=True)
    uncached = generate(model, PROMPTS, 12, temperature=0, use_kv_cache=False)
    assert cached == uncached
    assert all(len(c) == 12 for c in cached)


def test_batched_equals_one_by_one(model):
    for use_cache in (True, False):
        batched = generate(model, PROMPTS, 8, temperature=0, use_kv_cache=use_cache)
        single = [generate(model, [p], 8, temperature=0, use_kv_cache=use_cache)[0] for p in PROMPTS]
        assert batched == single


def test_top_k_one_is_greedy(model):
    greedy = generate(model, PROMPTS, 6, temperature=0)
    assert generate(model, PROMPTS, 6, temperature=0.7, top_k=1, seed=3) == greedy
    assert generate(model, PROMPTS, 6, temperature=1.3, top_p=1e-9, seed=3) == greedy


def test_sampling_is_seeded_and_same_on_both_paths(model):
    a = generate(model, PROMPTS, 10, temperature=1.5, top_k=20, top_p=0.95, seed=7)
    b = generate(model, PROMPTS, 10, temperature=1.5, top_k=20, top_p=0.95, seed=7)
    c = generate(model, PROMPTS, 10, temperature=1.5, top_k=20, top_p=0.95, seed=7, use_kv_cache=False)
    d = generate(model, PROMPTS, 10, temperature=1.5, top_k=20, top_p=0.95, seed=8)
    assert a == b == c
    assert a != d


def test_stops_at_eos(model):
    free = generate(model, PROMPTS, 10, temperature=0)
    eos = free[0][3]
    out = generate(model, PROMPTS, 10, temperature=0, eos_id=eos)
    for f, o in zip(free, out):
        if eos in f:
            assert o == f[: f.index(eos) + 1]
        else:
            assert o == f
    assert out[0][-1] == eos and len(out[0]) <= 4


def test_context_limit(model):
    long_prompt = list(range(1, 21))  # 20 tokens, context_length 24
    cached = generate(model, [long_prompt, [3]], 10, temperature=0)
    assert len(cached[0]) == 4 and len(cached[1]) == 10  # a row stops at context_length
    uncached = generate(model, [long_prompt, [3]], 10, temperature=0, use_kv_cache=False)
    assert len(uncached[0]) == 10 and uncached[0][:4] == cached[0] and uncached[1] == cached[1]
    assert uncached[0] == _greedy_reference(model, long_prompt, 10)  # the window is cropped
    with pytest.raises(ValueError, match="context_length"):
        generate(model, [list(range(24))], 3)
    assert len(generate(model, [list(range(30))], 3, use_kv_cache=False, temperature=0)[0]) == 3


def test_bad_inputs_and_mode_restored(model):
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[]], 3)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[99]], 3)
    assert generate(model, [[1]], 0) == [[]]
    assert generate(model, [], 5) == []
    model.train()
    generate(model, [[1, 2]], 2, temperature=0)
    assert model.training
    model.eval()


@pytest.mark.gpu
def test_cached_equals_uncached_on_gpu():
    m = peaked_cuda_lm(num_layers=3, context_length=128)
    prompts = [list(range(1, 40)), [5], list(range(100, 117))]
    cached = generate(m, prompts, 30, temperature=0)
    assert cached == generate(m, prompts, 30, temperature=0, use_kv_cache=False)
    assert cached == [generate(m, [p], 30, temperature=0)[0] for p in prompts]
    sampled = generate(m, prompts, 30, temperature=1.0, top_p=0.9, seed=1)
    assert sampled == generate(m, prompts, 30, temperature=1.0, top_p=0.9, seed=1)


def test_greedy_matches_hugging_face_llama_generate():
    transformers = pytest.importorskip("transformers")
    from scratchlm.model.config import ModelConfig
    from scratchlm.model.hf import hf_config, to_hf_state_dict
    from scratchlm.model.transformer import build_model

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, context_length=64, d_model=64, num_layers=2, num_heads=4, d_ff=128)
    model = build_model(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4)
    options = {k: v for k, v in hf_config(cfg).items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**options)).eval()
    hf.load_state_dict(to_hf_state_dict(model.state_dict(), cfg))
    prompts = [list(range(1, 20)), list(range(30, 40)), [7, 8]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=15, min_new_tokens=15,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = out[:, width:].tolist()
    assert generate(model, prompts, 15, temperature=0) == expected
    assert generate(model, prompts, 15, temperature=0, use_kv_cache=False) == expected
