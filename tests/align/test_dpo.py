"""DPO: the loss, sequence log-probabilities, the reference, the loop, and preference files."""

from __future__ import annotations

import json
import math

import pytest
import torch

from scratchlm.align.config import DPOConfig, OptimConfig
from scratchlm.align.dpo import (
    dpo_loss,
    dpo_train,
    encode_preference_pairs,
    evaluate_preferences,
    frozen_copy,
    pair_log_probs,
    preference_batch,
    sequence_log_probs,
)
from scratchlm.align.preferences import (
    PreferencePair,
    arithmetic_preference_pairs,
    hold_out,
    load_preference_pairs,
    read_preference_pairs,
)
from scratchlm.errors import UserError


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _own_preference(policy, encoded):
    """Share of pairs where the policy alone gives the chosen response the higher log-probability."""
    with torch.no_grad():
        logps = sequence_log_probs(policy.model, preference_batch(encoded, policy.pad_id, policy.device))
    B = len(encoded)
    return float((logps[:B] > logps[B:]).float().mean())


def test_loss_matches_the_formula_on_hand_made_log_probs():
    pc = torch.tensor([-3.0, -10.0, -1.5, -40.0])
    pr = torch.tensor([-4.0, -2.0, -1.5, -35.0])
    rc = torch.tensor([-3.5, -9.0, -2.0, -41.0])
    rr = torch.tensor([-3.0, -2.5, -1.0, -30.0])
    beta = 0.3
    losses, chosen_rewards, rejected_rewards = dpo_loss(pc, pr, rc, rr, beta)
    for i in range(4):
        z = beta * ((pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item()))
        assert losses[i].item() == pytest.approx(-math.log(1 / (1 + math.exp(-z))), rel=1e-6)
        assert chosen_rewards[i].item() == pytest.approx(beta * (pc[i].item() - rc[i].item()), rel=1e-6)
        assert rejected_rewards[i].item() == pytest.approx(beta * (pr[i].item() - rr[i].item()), rel=1e-6)
    # Far from the boundary it neither overflows nor loses the linear tail.
    zero = torch.zeros(1)
    assert dpo_loss(torch.tensor([-1000.0]), zero, zero, zero, 1.0)[0].item() == pytest.approx(1000.0)
    assert dpo_loss(torch.tensor([1000.0]), zero, zero, zero, 1.0)[0].item() == 0.0


def test_gradient_at_the_reference_is_beta_over_two():
    logps = torch.tensor([-5.0, -7.0], requires_grad=True)
    ref = torch.tensor([-5.0, -7.0])
    loss = dpo_loss(logps[:1], logps[1:], ref[:1], ref[1:], beta=0.2)[0].sum()
    assert loss.item() == pytest.approx(math.log(2))
    loss.backward()
    assert logps.grad.tolist() == pytest.approx([-0.1, 0.1])  # chosen pushed up, rejected down


def test_sequence_log_probs_score_the_response_tokens_only(tiny_policy):
    pairs = [(tiny_policy.encode("Start with 3."), tiny_policy.encode(" 3 </answer>"), tiny_policy.encode(" 4")),
             (tiny_policy.encode("Start with 12. Add 2."), tiny_policy.encode(" 14"), tiny_policy.encode(" 9 </answer>"))]
    batch = preference_batch(pairs, tiny_policy.pad_id, tiny_policy.device)
    got = sequence_log_probs(tiny_policy.model, batch)
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    for i, (prompt, response) in enumerate(rows):
        ids = torch.tensor([prompt + response])
        log_probs = torch.log_softmax(tiny_policy.model(ids[:, :-1]).float(), -1)[0]
        want = sum(log_probs[t, ids[0, t + 1]] for t in range(len(prompt) - 1, len(prompt) + len(response) - 1))
        assert got[i].item() == pytest.approx(want.item(), rel=1e-5)


def test_at_the_reference_the_loss_is_log_two_and_a_step_prefers_chosen(tiny_policy):
    pairs = arithmetic_preference_pairs(4, seed=1)
    encoded = encode_preference_pairs(tiny_policy, pairs)
    reference = frozen_copy(tiny_policy.model)
    assert not any(p.requires_grad for p in reference.parameters())
    batch = preference_batch(encoded, tiny_policy.pad_id, tiny_policy.device)
    pc, pr, rc, rr = pair_log_probs(tiny_policy.model, reference, batch)
    assert pc.requires_grad and not rc.requires_grad and not rr.requires_grad
    losses, chosen_rewards, rejected_rewards = dpo_loss(pc, pr, rc, rr, beta=0.1)
    assert losses.tolist() == pytest.approx([math.log(2)] * 4, abs=1e-6)
    assert chosen_rewards.abs().max() == 0 and rejected_rewards.abs().max() == 0
    losses.mean().backward()
    with torch.no_grad():
        for p in tiny_policy.model.parameters():
            p -= 1e-2 * p.grad
    after = pair_log_probs(tiny_policy.model, reference, batch)
    assert (after[0] > pc.detach()).all()  # chosen up
    assert (after[0] - after[1] > pc.detach() - pr.detach()).all()  # the margin grows
    assert dpo_loss(*after, beta=0.1)[0].mean() < math.log(2)


def test_training_raises_preference_accuracy_on_its_pairs(tiny_policy):
    pairs = arithmetic_preference_pairs(8, seed=2)
    encoded = encode_preference_pairs(tiny_policy, pairs)
    before = _own_preference(tiny_policy, encoded)
    start = _params(tiny_policy.model)
    history = dpo_train(tiny_policy, pairs, dpo=DPOConfig(beta=0.5, micro_batch_size=4, grad_accum_steps=2,
                                                          max_steps=30, eval_every=10),
                        optim=OptimConfig(lr=3e-3, warmup_steps=3), eval_pairs=pairs)
    assert [h["step"] for h in history] == list(range(31))
    first, last = history[0], history[-1]
    assert first["eval_loss"] == pytest.approx(math.log(2), abs=1e-6) and first["eval_reward_accuracy"] == 0.0
    assert last["eval_reward_accuracy"] == 1.0 and last["eval_reward_margin"] > 0.5
    assert last["eval_loss"] < 0.5 * first["eval_loss"]
    assert "eval_loss" in history[10] and "eval_loss" not in history[11]
    assert _own_preference(tiny_policy, encoded) > before and _own_preference(tiny_policy, encoded) == 1.0
    # The reference stayed the starting policy: scored against a fresh copy of it, nothing moved.
    reference = frozen_copy(tiny_policy.model)
    with torch.no_grad():
        for p, q in zip(reference.parameters(), start):
            p.copy_(q)
    again = evaluate_preferences(tiny_policy.model, reference, encoded, beta=0.5, pad_id=tiny_policy.pad_id)
    assert again["reward_accuracy"] == last["eval_reward_accuracy"]
    assert again["loss"] == pytest.approx(last["eval_loss"], rel=1e-5)


def test_accumulation_matches_one_big_microbatch(tiny_policy, monkeypatch):
    """4 microbatches of 1 pair give the gradient that 1 microbatch of the same 4 pairs gives."""
    from scratchlm.align import dpo as dpo_module

    pairs = arithmetic_preference_pairs(4, seed=4)
    with torch.no_grad():  # off the reference, so the gradient is not the trivial one of log 2
        reference = frozen_copy(tiny_policy.model)
        for p in tiny_policy.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    grads = []

    def capture(model, optimizer, lr, max_grad_norm):
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.zero_grad(set_to_none=True)  # no step: both runs see the same weights
        return 0.0

    monkeypatch.setattr(dpo_module, "optimizer_step", capture)
    rows = [dpo_train(tiny_policy, pairs, dpo=DPOConfig(micro_batch_size=micro, grad_accum_steps=accum, max_steps=1),
                      optim=OptimConfig(), reference=reference)[-1] for micro, accum in ((4, 1), (1, 4))]
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(*grads))
    assert any(g.abs().max() > 0 for g in grads[0])
    assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-5) and rows[0]["loss"] != pytest.approx(math.log(2))


def test_fewer_pairs_than_a_microbatch_report_the_mean_over_the_microbatch(tiny_policy):
    """One pair and micro_batch_size=2: the microbatch holds it twice, so the loss at the reference
    is log 2 (it was halved: one pair's loss summed, divided by two)."""
    dpo = DPOConfig(micro_batch_size=2, grad_accum_steps=1, max_steps=1)
    history = dpo_train(tiny_policy, arithmetic_preference_pairs(1), dpo=dpo, optim=OptimConfig(lr=0.0))
    assert history[-1]["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_save_every_calls_back(tiny_policy):
    saved = []
    dpo_train(tiny_policy, arithmetic_preference_pairs(4), dpo=DPOConfig(micro_batch_size=2, grad_accum_steps=1,
                                                                          max_steps=5, save_every=2),
              optim=OptimConfig(lr=1e-3), save=saved.append)
    assert saved == [2, 4]


def test_hf_llama_policy_scores_as_its_scratch_twin_and_trains(tiny_policy, tmp_path):
    pytest.importorskip("transformers")
    from scratchlm.align.policy import HFPolicy, load_policy
    from scratchlm.model.hf import export_hf

    export_hf(tiny_policy.model, tiny_policy.model_config, tmp_path / "hf", tokenizer=tiny_policy.tokenizer)
    hf = load_policy(tmp_path / "hf")
    assert isinstance(hf, HFPolicy)
    pairs = arithmetic_preference_pairs(4, seed=5)
    encoded = encode_preference_pairs(hf, pairs)
    assert encoded == encode_preference_pairs(tiny_policy, pairs)
    batch = preference_batch(encoded, hf.pad_id, hf.device)
    with torch.no_grad():
        ours, theirs = sequence_log_probs(tiny_policy.model, batch), sequence_log_probs(hf.model, batch)
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    start = _params(hf.model)
    history = dpo_train(hf, pairs, dpo=DPOConfig(micro_batch_size=2, grad_accum_steps=1, max_steps=6, eval_every=0),
                        optim=OptimConfig(lr=3e-3), eval_pairs=pairs)
    assert history[-1]["eval_reward_accuracy"] > 0 and history[-1]["eval_loss"] < math.log(2)
    assert any(not torch.equal(a, b) for a, b in zip(start, _params(hf.model)))


def test_pairs_whose_prompt_fills_the_context_are_left_out(tiny_policy):
    long = PreferencePair(" 7" * 400, " 1", " 2")
    short = PreferencePair("Start with 3.", " 3" * 400, " 4")
    encoded = encode_preference_pairs(tiny_policy, [long, short])
    assert len(encoded) == 1
    prompt, chosen, rejected = encoded[0]
    assert len(prompt) + len(chosen) == tiny_policy.context_length + 1 and rejected[-1] == tiny_policy.eos_id
    with pytest.raises(UserError, match="context"):
        dpo_train(tiny_policy, [long], dpo=DPOConfig(max_steps=1), optim=OptimConfig())


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_read_preference_pairs_and_its_errors(tmp_path):
    row = {"prompt": "Q: 1+1?", "chosen": " 2", "rejected": " 3"}
    good = _write(tmp_path / "good.jsonl", [json.dumps(row), "", json.dumps({**row, "extra": 1})])
    assert read_preference_pairs(good) == [PreferencePair("Q: 1+1?", " 2", " 3")] * 2
    with pytest.raises(UserError, match="not found"):
        read_preference_pairs(tmp_path / "missing.jsonl")
    with pytest.raises(UserError, match=f"preference file {tmp_path} is a directory, not a file"):
        read_preference_pairs(tmp_path)  # (it was reported as not found)
    bad = _write(tmp_path / "bad.jsonl", [json.dumps(row), "{not json"])
    with pytest.raises(UserError, match=r"bad.jsonl:2: not valid JSON"):
        read_preference_pairs(bad)
    missing = _write(tmp_path / "keys.jsonl", [json.dumps(row), json.dumps({"prompt": "x", "chosen": "y"})])
    with pytest.raises(UserError, match=r"keys.jsonl:2: missing key rejected"):
        read_preference_pairs(missing)
    with pytest.raises(UserError, match=r":1: expected a JSON object"):
        read_preference_pairs(_write(tmp_path / "list.jsonl", ["[1, 2]"]))
    with pytest.raises(UserError, match=r":1: chosen must be a string"):
        read_preference_pairs(_write(tmp_path / "num.jsonl", [json.dumps({**row, "chosen": 2})]))
    with pytest.raises(UserError, match="no preference pairs"):
        read_preference_pairs(_write(tmp_path / "empty.jsonl", ["", "  "]))
    same = _write(tmp_path / "same.jsonl", [json.dumps(row), "", json.dumps({**row, "rejected": " 2"}),
                                            json.dumps({**row, "chosen": " 3"})])
    with pytest.raises(UserError, match=r"same.jsonl:3: chosen and rejected are the same response"):
        read_preference_pairs(same)  # (the first such line; a blank line still counts)
    for message in ("not valid JSON", "missing key"):
        with pytest.raises(UserError) as err:
            read_preference_pairs(bad if "JSON" in message else missing)
        assert "\n" not in str(err.value)


def test_arith_pairs_and_hold_out():
    pairs = load_preference_pairs("arith:2", limit=20, seed=1)
    assert len(pairs) == 20 and all(p.chosen != p.rejected for p in pairs)
    test = load_preference_pairs("arith:2", split="test", limit=20, seed=1)
    assert not {p.prompt for p in pairs} & {p.prompt for p in test}
    train, held = hold_out(pairs, 0.25, seed=0)
    assert len(held) == 5 and len(train) == 15 and set(train) | set(held) == set(pairs)
    assert hold_out(pairs, 0.25, seed=0) == (train, held) and hold_out(pairs, 0.0)[1] == []
    assert len(hold_out(pairs[:3], 0.01)[1]) == 1
    with pytest.raises(UserError, match="integer"):
        load_preference_pairs("arith:x")


def test_preference_file_errors_name_the_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "caf\xe9", "chosen": "b", '
                     b'"rejected": "c"}\n')
    with pytest.raises(UserError, match=r"pairs.jsonl:2: not UTF-8 text"):
        load_preference_pairs(str(path))
    with pytest.raises(UserError, match="at least 1"):
        load_preference_pairs("arith:0")


def test_dpo_reports_the_training_and_held_out_pairs_it_leaves_out_or_cuts_short(tiny_policy):
    # They were dropped or cut without a word (and held-out metrics silently covered fewer pairs).
    long = PreferencePair(" 7" * 400, " 1", " 2")
    cut = PreferencePair("Start with 3.", " 4", " 3" * 400)  # only the rejected response runs over
    pairs = arithmetic_preference_pairs(3, seed=6)
    events = []
    history = dpo_train(tiny_policy, [*pairs, long, cut], dpo=DPOConfig(micro_batch_size=2, grad_accum_steps=1,
                                                                         max_steps=2, eval_every=0),
                        optim=OptimConfig(lr=1e-3), eval_pairs=[*pairs, long], log=events.append,
                        report=events.append)
    assert events[0] == ("dpo: 2 of 5 training pairs are longer than the model's context of 160 tokens: 1 left out "
                         "(the prompt fills it), 1 with the response cut short; 1 of 4 held-out pairs are longer "
                         "than the model's context of 160 tokens: 1 left out (the prompt fills it)")
    assert not any(isinstance(e, str) for e in events[1:])
    assert history[0]["step"] == 0 and "pairs" not in history[0]
    assert {k: history[1][k] for k in ("pairs", "pairs_left_out", "pairs_cut", "eval_pairs", "eval_pairs_left_out",
                                       "eval_pairs_cut")} == {"pairs": 5, "pairs_left_out": 1, "pairs_cut": 1,
                                                              "eval_pairs": 4, "eval_pairs_left_out": 1,
                                                              "eval_pairs_cut": 0}
    events.clear()
    dpo_train(tiny_policy, pairs, dpo=DPOConfig(max_steps=1), optim=OptimConfig(), report=events.append)
    assert events == []


def test_a_warmup_as_long_as_the_run_is_refused_or_shortened(tiny_policy):
    # A 1-step run with a 5-step warm-up trained at rate 0 and changed nothing.
    pairs = arithmetic_preference_pairs(4, seed=2)
    dpo, optim = DPOConfig(micro_batch_size=2, grad_accum_steps=1, max_steps=1), OptimConfig(lr=1e-3, warmup_steps=5)
    start = _params(tiny_policy.model)
    with pytest.raises(UserError, match=r"optim.warmup_steps=5 is not shorter than the 1 optimizer update of this "
                                        r"run \(dpo.max_steps=1\)"):
        dpo_train(tiny_policy, pairs, dpo=dpo, optim=optim)
    assert all(torch.equal(a, b) for a, b in zip(start, _params(tiny_policy.model)))
    history = dpo_train(tiny_policy, pairs, dpo=dpo, optim=optim, long_warmup="shorten")
    assert [h["lr"] for h in history] == [1e-3]
    assert any(not torch.equal(a, b) for a, b in zip(start, _params(tiny_policy.model)))
