"""Policies over scratchlm and Hugging Face models: generation, stop strings, save/load."""

from __future__ import annotations

import pytest
import torch

from scratchlm.align.policy import HFPolicy, ScratchPolicy, is_hf_directory, load_policy
from scratchlm.errors import UserError
from tests.char_tokenizer import tiny_llama_policies

PROMPTS = ["Start with 3. Add 4. What is the result?", "Start with 12. Times 2, then add 1."]


def test_scratch_generate_is_the_project_generator(tiny_policy):
    from scratchlm.infer.generate import generate

    out = tiny_policy.generate(PROMPTS, max_new_tokens=8, temperature=0.0)
    ids = generate(tiny_policy.model, [tiny_policy.encode(p) for p in PROMPTS], 8, temperature=0.0,
                   eos_id=tiny_policy.eos_id)
    assert [c.num_tokens for c in out] == [len(r) for r in ids]
    for comp, row in zip(out, ids):
        row = row[:-1] if row and row[-1] == tiny_policy.eos_id else row
        assert comp.text == tiny_policy.decode(row)


def test_sampling_is_reproducible_with_a_seed(tiny_policy):
    a = tiny_policy.generate(PROMPTS * 2, max_new_tokens=6, temperature=1.0, seed=3, batch_size=2)
    b = tiny_policy.generate(PROMPTS * 2, max_new_tokens=6, temperature=1.0, seed=3, batch_size=2)
    assert [c.text for c in a] == [c.text for c in b]


def test_stop_string_cuts_the_text(tiny_policy):
    class Scripted(ScratchPolicy):
        def decode(self, ids):
            return " 3+4=7 </think> <answer> 7 </answer> extra text"

    policy = Scripted(tiny_policy.model, tiny_policy.tokenizer, tiny_policy.model_config)
    comp = policy.generate(PROMPTS[:1], max_new_tokens=3, temperature=0.0, stop=("</answer>",))[0]
    assert comp.text == " 3+4=7 </think> <answer> 7 </answer>" and comp.stopped


def test_prompt_too_long_is_a_user_error(tiny_policy):
    with pytest.raises(UserError, match="leaves no room"):
        tiny_policy.generate(["word " * 400], max_new_tokens=4)


def test_save_and_load_scratch_policy(tiny_policy, tmp_path):
    step = tiny_policy.save(tmp_path / "run", step=7)
    assert step.name == "step_000007"
    loaded = load_policy(tmp_path / "run")
    assert isinstance(loaded, ScratchPolicy)
    ids = torch.tensor([tiny_policy.encode(PROMPTS[0])])
    torch.testing.assert_close(loaded.model(ids), tiny_policy.model(ids))
    assert loaded.encode(PROMPTS[1]) == tiny_policy.encode(PROMPTS[1])


def test_load_policy_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_policy(tmp_path / "missing")


def _save_random_llama(tmp_path, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer.save(tmp_path / "tok")
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eot_id, bos_token_id=tokenizer.eot_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok" / "tokenizer.json"),
                                     eos_token="<|endoftext|>")
    hf_tok.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_hf_policy_from_a_random_llama(tiny_tokenizer, tmp_path):
    pytest.importorskip("transformers")
    path = _save_random_llama(tmp_path, tiny_tokenizer)
    assert is_hf_directory(path)
    policy = load_policy(path)
    assert isinstance(policy, HFPolicy)
    assert policy.encode(PROMPTS[0]) == tiny_tokenizer.encode(PROMPTS[0])
    out = policy.generate(PROMPTS, max_new_tokens=5, temperature=0.0)
    assert len(out) == 2 and all(1 <= c.num_tokens <= 5 for c in out)
    sampled = policy.generate(PROMPTS, max_new_tokens=5, temperature=1.0, top_p=0.9, seed=1)
    assert len(sampled) == 2


def test_an_hf_policy_save_cut_off_keeps_the_policy_saved_before(tiny_tokenizer, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    policy = load_policy(_save_random_llama(tmp_path, tiny_tokenizer))
    out = tmp_path / "run" / "policy"
    policy.save(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def cut_off(directory, *args, **kwargs):  # the weights half written, then a full disk
        from pathlib import Path

        (Path(directory) / "model.safetensors").write_bytes(before["model.safetensors"][:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(policy.model, "save_pretrained", cut_off)
    with pytest.raises(OSError, match="No space left"):
        policy.save(out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in out.parent.iterdir()] == ["policy"]  # (no temporary folder left)
    assert isinstance(load_policy(out), HFPolicy)


@pytest.mark.parametrize("damage, message", [
    ("config", "cannot load the model .*OSError"),  # was transformers' OSError, exit 1
    ("model_type", "cannot load the model .*ValueError: Unrecognized model"),
    ("weights", "cannot load the model .*SafetensorError"),
    ("tokenizer", "cannot load the tokenizer"),
])
def test_a_damaged_hf_directory_is_a_user_error(tiny_tokenizer, tmp_path, damage, message):
    pytest.importorskip("transformers")
    path = _save_random_llama(tmp_path, tiny_tokenizer)
    if damage == "config":
        (path / "config.json").write_text("{", encoding="utf-8")
    elif damage == "model_type":
        (path / "config.json").write_text("{}", encoding="utf-8")
    elif damage == "weights":
        (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:100])
    else:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (path / name).unlink(missing_ok=True)
    with pytest.raises(UserError, match=message):
        load_policy(path)


def test_hf_export_generates_what_the_scratch_policy_generates(tiny_policy, tmp_path):
    pytest.importorskip("transformers")
    from scratchlm.model.hf import export_hf

    export_hf(tiny_policy.model, tiny_policy.model_config, tmp_path / "hf", tokenizer=tiny_policy.tokenizer)
    hf = load_policy(tmp_path / "hf")
    assert isinstance(hf, HFPolicy)
    ours = [c.text for c in tiny_policy.generate(PROMPTS, max_new_tokens=8, temperature=0.0)]
    theirs = [c.text for c in hf.generate(PROMPTS, max_new_tokens=8, temperature=0.0)]
    assert ours == theirs


def _text_decoder(vocab):
    return lambda ids: "".join(vocab[i] for i in ids)


def test_finish_completion_keeps_the_sampled_ids():
    from scratchlm.align.policy import finish_completion

    vocab = {0: "<eos>", 1: " 7", 2: "0", 3: " </answer>", 4: " junk", 5: "70"}
    decode = _text_decoder(vocab)
    # Ended on end-of-text right after the stop string: all ids kept, the eos included.
    c = finish_completion([1, 2, 3, 0], 0, ("</answer>",), decode)
    assert (c.text, c.token_ids, c.stopped, c.num_tokens) == (" 70 </answer>", [1, 2, 3, 0], True, 4)
    # Went on after the stop string: text and ids cut after the token completing it, no eos.
    c = finish_completion([5, 3, 4, 4], 0, ("</answer>",), decode)
    assert (c.text, c.token_ids, c.stopped, c.num_tokens) == ("70 </answer>", [5, 3], True, 4)
    # Ran out of budget: nothing cut, not stopped.
    c = finish_completion([1, 2], 0, ("</answer>",), decode)
    assert (c.text, c.token_ids, c.stopped) == (" 70", [1, 2], False)


def test_scratch_completions_carry_the_generated_ids(tiny_policy):
    from scratchlm.infer.generate import generate

    out = tiny_policy.generate(PROMPTS, max_new_tokens=8, temperature=1.0, seed=5)
    ids = generate(tiny_policy.model, [tiny_policy.encode(p) for p in PROMPTS], 8, temperature=1.0,
                   eos_id=tiny_policy.eos_id, seed=5)
    assert [c.token_ids for c in out] == ids


def _written_elements(fn):
    """Elements that tensor copies (copy_, clone, to, stack, cat) write while `fn` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    copies = {aten.copy_, aten.clone, aten._to_copy, aten.stack, aten.cat}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in copies:
                Count.n += out.numel()
            return out

    with Count():
        fn()
    return Count.n


def test_hf_policy_refreshes_the_engine_twin_with_one_copy_at_most(tmp_path):
    hf, policy, reference = tiny_llama_policies(num_key_value_heads=2)
    prompts = ["hello there", "x", "a longer prompt of text"]

    def same_as_reference():
        ours = [c.token_ids for c in policy.generate(prompts, max_new_tokens=12, temperature=0.0)]
        return ours == [c.token_ids for c in reference.generate(prompts, max_new_tokens=12, temperature=0.0)]

    assert same_as_reference()
    twin = policy._twin[0]
    addresses = {k: v.data_ptr() for k, v in twin.state_dict().items()}
    size = sum(p.numel() for p in hf.parameters())
    # each weight is copied into the twin at most once a call (none that it can share)
    assert _written_elements(policy._engine_twin) <= size
    # a training step changes every weight in place: the next generate follows
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p), alpha=0.05)
        hf.lm_head.weight.mul_(-1)
    assert same_as_reference()
    # the twin's weights stay where they were (the engine's captured steps read them there)
    assert {k: v.data_ptr() for k, v in twin.state_dict().items()} == addresses
    # a weight given new memory (not updated in place) is followed too
    layer = hf.model.layers[1]
    layer.mlp.down_proj.weight = torch.nn.Parameter(torch.randn_like(layer.mlp.down_proj.weight))
    layer.self_attn.q_proj.weight = torch.nn.Parameter(torch.randn_like(layer.self_attn.q_proj.weight))
    assert same_as_reference()
