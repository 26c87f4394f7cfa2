"""SFT, expert iteration and GRPO loops on a one-layer model (seconds each)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scratchlm.align.config import ExpertIterationConfig, GRPOConfig, OptimConfig, SamplingConfig, SFTConfig
from scratchlm.align.evaluate import evaluate_policy
from scratchlm.align.expert_iteration import expert_iteration, filter_rewarded
from scratchlm.align.grpo import grpo_train
from scratchlm.align.prompts import get_template
from scratchlm.align.sft import ContextFit, encode_pairs, fit_pairs, sft_train
from scratchlm.align.task import ArithmeticTask, arithmetic_reward
from scratchlm.errors import UserError

TEMPLATE = get_template("r1_zero")


def _pairs(examples):
    return [(TEMPLATE.format(e.question), TEMPLATE.response(e.reasoning, e.answer)) for e in examples]


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_encode_pairs_appends_eos_and_fits_the_context(tiny_policy):
    (p, r), = encode_pairs(tiny_policy, [("Start with 3.", " 3 </think> <answer> 3 </answer>")])
    assert r[-1] == tiny_policy.eos_id and p == tiny_policy.encode("Start with 3.")
    long = encode_pairs(tiny_policy, [("Start", " 7" * 400)])
    assert len(long[0][0]) + len(long[0][1]) == tiny_policy.context_length + 1


def test_sft_refuses_pairs_that_all_fill_the_context(tiny_policy):
    # Returned no steps, and the command saved the starting policy as the fine-tuned one.
    start = _params(tiny_policy.model)
    with pytest.raises(UserError, match="no SFT pair fits the model's context of 160 tokens"):
        sft_train(tiny_policy, [(" 7" * 400, " 7")], sft=SFTConfig(micro_batch_size=1, grad_accum_steps=1),
                  optim=OptimConfig(lr=1e-2))
    assert all(torch.equal(a, b) for a, b in zip(start, _params(tiny_policy.model)))


@pytest.mark.parametrize("packed", [False, True])
def test_sft_reports_the_pairs_it_leaves_out_or_cuts_short(tiny_policy, packed):
    # Pairs longer than the context were dropped or cut without a word.
    pairs = [("Start with 3.", " 3 </think> <answer> 3 </answer>"), (" 7" * 400, " 7"), ("Start", " 7" * 400)]
    events = []
    history = sft_train(tiny_policy, pairs, sft=SFTConfig(micro_batch_size=1, grad_accum_steps=1, max_steps=2,
                                                          packed=packed),
                        optim=OptimConfig(lr=1e-3), log=events.append, report=events.append,
                        evaluate=lambda step: {"accuracy": 0.5, "step_seen": step})
    start = {"phase": "sft", "step": 0, "eval_accuracy": 0.5, "eval_step_seen": 0}
    if packed:  # packing keeps every token of every pair
        assert events[0] == start
        assert {k: history[0][k] for k in ("pairs", "pairs_left_out", "pairs_cut")} == {
            "pairs": 3, "pairs_left_out": 0, "pairs_cut": 0}
    else:
        assert events[:2] == ["sft: 2 of 3 pairs are longer than the model's context of 160 tokens: 1 left out "
                              "(the prompt fills it), 1 with the response cut short", start]
        assert {k: history[0][k] for k in ("pairs", "pairs_left_out", "pairs_cut")} == {
            "pairs": 3, "pairs_left_out": 1, "pairs_cut": 1}
    assert not any(isinstance(e, str) for e in events[2:])  # one line, at the start
    assert [h["step"] for h in history] == [1, 2] and "pairs" not in history[1]
    events.clear()
    sft_train(tiny_policy, pairs[:1], sft=SFTConfig(micro_batch_size=1, grad_accum_steps=1, max_steps=1),
              optim=OptimConfig(lr=1e-3), report=events.append)
    assert events == []  # nothing to report when every pair fits


def test_fit_pairs_counts_the_pairs_left_out_and_cut():
    chars = SimpleNamespace(encode=lambda text: [ord(c) for c in text], eos_id=0, context_length=8)  # 9 tokens fit
    pairs = [("abc", "defgh"), ("abc", "defghi"), ("abcdefghi", "x"), ("abcdefgh", "x")]
    data, fit = fit_pairs(chars, pairs)
    assert fit == ContextFit(total=4, left_out=1, cut=2, context_length=8)  # losing only the end-of-text is a cut
    assert [len(p) + len(r) for p, r in data] == [9, 9, 9] and data == encode_pairs(chars, pairs)
    assert fit.metrics() == {"pairs": 4, "pairs_left_out": 1, "pairs_cut": 2}
    assert ContextFit(4, 0, 0, 8).describe() == ""


def test_sft_memorises_worked_solutions_and_stops(tiny_policy):
    examples = ArithmeticTask(difficulty=1).examples(4, seed=3)
    # 60 steps: at 40 the format was learnt for only about half of the initialisation seeds.
    history = sft_train(tiny_policy, _pairs(examples), sft=SFTConfig(micro_batch_size=4, grad_accum_steps=1, max_steps=60),
                        optim=OptimConfig(lr=1e-2, warmup_steps=5, max_grad_norm=1.0))
    assert len(history) == 60 and history[-1]["loss"] < 0.2 * history[0]["loss"]
    assert all(h["token_entropy"] >= 0 for h in history)
    records, summary = evaluate_policy(tiny_policy, examples, template=TEMPLATE, reward_fn=arithmetic_reward,
                                       max_new_tokens=24)
    # The format and the stop are learnt exactly; one-layer arithmetic may still slip.
    assert summary["format_rate"] == 1.0 and summary["accuracy"] >= 0.5, [r["response"] for r in records]
    assert all(r["stopped"] for r in records)


def test_filter_rewarded_keeps_distinct_successes():
    kept = filter_rewarded(["a", "a", "b", "b"], ["x", "x", "y", "z"],
                           [{"reward": 1.0}, {"reward": 1.0}, {"reward": 0.0}, {"reward": 1.0}])
    assert kept == [("a", "x"), ("b", "z")]


def test_expert_iteration_runs_and_logs(tiny_policy):
    examples = ArithmeticTask(difficulty=1).examples(4, seed=3)
    sft_train(tiny_policy, _pairs(examples), sft=SFTConfig(micro_batch_size=4, grad_accum_steps=1, max_steps=40),
              optim=OptimConfig(lr=1e-2, warmup_steps=5))
    rows = []

    def format_only(response, truth):  # after a short SFT the format is reliable, the sums not yet
        r = arithmetic_reward(response, truth)
        return {**r, "reward": r["format_reward"]}

    history = expert_iteration(
        tiny_policy, examples, template=TEMPLATE, reward_fn=format_only,
        ei=ExpertIterationConfig(n_ei_steps=2, questions_per_step=4, group_size=2),
        sft=SFTConfig(micro_batch_size=2, grad_accum_steps=1), optim=OptimConfig(lr=1e-3),
        sampling=SamplingConfig(temperature=0.3, max_new_tokens=24, batch_size=8),
        evaluate=lambda step: {"accuracy": float(step)}, log=rows.append)
    assert [h["step"] for h in history] == [0, 1, 2] and rows == history
    assert history[1]["kept"] > 0 and history[1]["sft_steps"] >= 1
    assert {"rollout_reward", "token_entropy", "response_tokens_mean", "eval_accuracy"} <= set(history[1])


def test_grpo_without_reward_signal_leaves_the_policy_unchanged(tiny_policy):
    before = _params(tiny_policy.model)
    examples = ArithmeticTask(difficulty=1).examples(8)
    history = grpo_train(tiny_policy, examples, template=TEMPLATE, reward_fn=lambda r, g: {
        "format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0},
        grpo=GRPOConfig(n_grpo_steps=1, rollout_batch_size=8, group_size=4, train_batch_size=4, grad_accum_steps=2),
        optim=OptimConfig(lr=1e-2, weight_decay=0.0), sampling=SamplingConfig(max_new_tokens=6))
    assert history[-1]["reward_mean"] == 1.0 and history[-1]["zero_std_groups"] == 1.0
    for a, b in zip(before, tiny_policy.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_grpo_clip_off_policy_epochs_run_and_report(tiny_policy):
    before = _params(tiny_policy.model)
    examples = ArithmeticTask(difficulty=1).examples(8)
    # A reward that depends on the response, so groups have spread and gradients are non-zero.
    reward = lambda r, g: {"format_reward": 1.0, "answer_reward": 0.0, "reward": float(len(r) % 2)}  # noqa: E731
    history = grpo_train(tiny_policy, examples, template=TEMPLATE, reward_fn=reward,
                         grpo=GRPOConfig(n_grpo_steps=2, rollout_batch_size=8, group_size=4, train_batch_size=4,
                                         grad_accum_steps=2, loss_type="grpo_clip", epochs_per_rollout_batch=2,
                                         length_normalization="constant", eval_every=1),
                         optim=OptimConfig(lr=1e-2), sampling=SamplingConfig(max_new_tokens=6, batch_size=4),
                         evaluate=lambda step: {"accuracy": 0.0})
    assert [h["step"] for h in history] == [0, 1, 2]
    assert 0.0 <= history[-1]["clip_fraction"] <= 1.0 and history[-1]["grad_norm"] > 0
    assert "eval_accuracy" in history[1] and history[1]["rollout_tokens_per_s"] > 0
    assert history[1]["eval_s"] > 0 and history[1]["update_s"] > 0  # the phases' wall seconds
    assert any(not torch.equal(a, b) for a, b in zip(before, tiny_policy.model.parameters()))


def test_grpo_raises_the_reward_of_a_simple_preference(tiny_policy):
    """Rewarding responses whose first token is even shifts probability towards them."""
    examples = ArithmeticTask(difficulty=1).examples(4)
    prompt_ids = torch.tensor([tiny_policy.encode(TEMPLATE.format(examples[0].question))])

    def even_mass():
        with torch.no_grad():
            probs = tiny_policy.model(prompt_ids)[0, -1].softmax(-1)
        return float(probs[0::2].sum())

    def reward(response, truth):
        ids = tiny_policy.encode(response)
        return {"format_reward": 1.0, "answer_reward": 0.0, "reward": float(bool(ids) and ids[0] % 2 == 0)}

    start = even_mass()
    grpo_train(tiny_policy, examples[:1], template=TEMPLATE, reward_fn=reward,
               grpo=GRPOConfig(n_grpo_steps=15, rollout_batch_size=16, group_size=16, train_batch_size=16,
                               grad_accum_steps=1),
               optim=OptimConfig(lr=3e-2), sampling=SamplingConfig(max_new_tokens=1, batch_size=16))
    end = even_mass()
    assert end > start + 0.2


def test_grpo_stops_when_its_time_is_up_and_still_evaluates(tiny_policy):
    examples = ArithmeticTask(difficulty=1).examples(8)
    evaluated = []
    history = grpo_train(tiny_policy, examples, template=TEMPLATE, reward_fn=arithmetic_reward,
                         grpo=GRPOConfig(n_grpo_steps=50, rollout_batch_size=4, group_size=2, train_batch_size=4,
                                         grad_accum_steps=1, eval_every=0, max_seconds=1e-9),
                         optim=OptimConfig(lr=1e-3), sampling=SamplingConfig(max_new_tokens=4, batch_size=4),
                         evaluate=lambda step: evaluated.append(step) or {"accuracy": 0.0})
    assert [h["step"] for h in history] == [0, 1] and evaluated == [0, 1]
    assert "eval_accuracy" in history[-1] and "retokenized_fraction" in history[-1]


def test_grpo_train_is_its_named_steps_run_in_order(tiny_policy):
    """The steps of grpo.py, called by hand with the same seeds, give bit-identical weights and metrics."""
    import copy
    import random

    from scratchlm.align.grpo import rollout_batch, sample_rollouts, score_rollouts, step_metrics, update_policy
    from scratchlm.align.sft import make_optimizer

    by_hand = copy.deepcopy(tiny_policy)
    examples = ArithmeticTask(difficulty=1).examples(8)
    reward = lambda r, g: {"format_reward": 1.0, "answer_reward": 0.0, "reward": float(len(r) % 2)}  # noqa: E731
    grpo = GRPOConfig(n_grpo_steps=2, rollout_batch_size=8, group_size=4, train_batch_size=4, grad_accum_steps=2,
                      loss_type="grpo_clip", epochs_per_rollout_batch=2)
    optim, sampling = OptimConfig(lr=1e-2, warmup_steps=1), SamplingConfig(max_new_tokens=6, batch_size=4)
    history = grpo_train(tiny_policy, examples, template=TEMPLATE, reward_fn=reward, grpo=grpo, optim=optim,
                         sampling=sampling, seed=3)

    rng, optimizer, update, rows = random.Random(3), make_optimizer(by_hand.model, optim), 0, []
    for step in (1, 2):
        rollouts = sample_rollouts(by_hand, examples, template=TEMPLATE, grpo=grpo, sampling=sampling, rng=rng)
        advantages, raw, reward_meta = score_rollouts(rollouts, reward, grpo)
        batch, retokenized = rollout_batch(by_hand, rollouts)
        meta, lr, n = update_policy(by_hand, optimizer, batch, advantages[:, None], raw[:, None], grpo=grpo,
                                    optim=optim, normalize_constant=6.0, first_update=update, total_updates=8, rng=rng)
        update += n
        rows.append(step_metrics(step, lr, meta, reward_meta, rollouts, retokenized))
    assert update == 8
    phases = ("rollout_s", "score_s", "batch_s", "update_s")
    drop = ("rollout_tokens_per_s", "elapsed_s", *phases)  # wall time
    assert [{k: v for k, v in r.items() if k not in drop} for r in rows] == [
        {k: v for k, v in h.items() if k not in drop} for h in history]
    assert 0 < history[0]["elapsed_s"] <= history[1]["elapsed_s"]
    for h in history:  # no evaluation here: the phases are the whole step, less the bookkeeping
        assert all(h[k] >= 0 for k in phases) and "eval_s" not in h
    assert 0.5 * history[0]["elapsed_s"] < sum(history[0][k] for k in phases) <= history[0]["elapsed_s"]
    for a, b in zip(tiny_policy.model.parameters(), by_hand.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_grpo_compiled_log_probs_give_the_eager_updates(tiny_policy):
    import copy

    examples = ArithmeticTask(difficulty=1).examples(8)
    reward = lambda r, g: {"format_reward": 1.0, "answer_reward": 0.0, "reward": float(len(r) % 2)}  # noqa: E731
    start = copy.deepcopy(tiny_policy.model.state_dict())
    runs = {}
    for compile in (False, True):
        tiny_policy.model.load_state_dict(start)
        history = grpo_train(tiny_policy, examples, template=TEMPLATE, reward_fn=reward,
                             grpo=GRPOConfig(n_grpo_steps=2, rollout_batch_size=8, group_size=4, train_batch_size=8,
                                             grad_accum_steps=2, loss_type="grpo_clip", compile=compile),
                             optim=OptimConfig(lr=1e-2), sampling=SamplingConfig(max_new_tokens=6, batch_size=8),
                             seed=3)
        runs[compile] = (history, _params(tiny_policy.model))
    (eager, w_eager), (compiled, w_compiled) = runs[False], runs[True]
    assert [h["reward_mean"] for h in compiled] == [h["reward_mean"] for h in eager]  # the same rollouts
    for key in ("loss", "token_entropy", "grad_norm"):
        torch.testing.assert_close([h[key] for h in compiled], [h[key] for h in eager], rtol=1e-4, atol=1e-5)
    assert eager[-1]["grad_norm"] > 0
    for a, b in zip(w_compiled, w_eager):  # Adam's first steps magnify last-bit differences
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_sft_with_compiled_log_probs_gives_the_eager_steps(tiny_policy):
    import copy

    pairs = _pairs(ArithmeticTask(difficulty=1).examples(6))
    start = copy.deepcopy(tiny_policy.model.state_dict())
    runs = {}
    for compile in (False, True):
        tiny_policy.model.load_state_dict(start)
        history = sft_train(tiny_policy, pairs, sft=SFTConfig(micro_batch_size=3, grad_accum_steps=1, max_steps=3,
                                                               compile=compile),
                            optim=OptimConfig(lr=1e-2, warmup_steps=1), seed=0)
        runs[compile] = (history, _params(tiny_policy.model))
    (eager, w_eager), (compiled, w_compiled) = runs[False], runs[True]
    for key in ("loss", "token_entropy", "grad_norm", "response_tokens"):
        torch.testing.assert_close([h[key] for h in compiled], [h[key] for h in eager], rtol=1e-4, atol=1e-5)
    assert eager[-1]["loss"] < eager[0]["loss"]
    for a, b in zip(w_compiled, w_eager):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_blockwise_compiled_log_probs_equal_eager_with_one_graph_for_every_block():
    from torch._dynamo.testing import CompileCounterWithBackend

    from scratchlm.align.compiled_logprobs import blockwise_compiled_log_probs
    from scratchlm.align.logprobs import response_log_probs
    from scratchlm.model.transformer import TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(vocab_size=40, context_length=32, d_model=16, num_layers=4, num_heads=2, d_ff=32)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = blockwise_compiled_log_probs(backend=counter)
    for B, T in ((3, 9), (2, 17), (4, 5)):
        ids, labels = torch.randint(0, 40, (B, T)), torch.randint(0, 40, (B, T))
        got = compiled(model, ids, labels, return_token_entropy=True)
        (got["log_probs"].sum()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        expected = response_log_probs(model, ids, labels, return_token_entropy=True)
        expected["log_probs"].sum().backward()
        torch.testing.assert_close(got["log_probs"], expected["log_probs"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["token_entropy"], expected["token_entropy"], rtol=1e-5, atol=1e-5)
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
        model.zero_grad()
    # one graph for all four blocks and one for the head, whatever the shapes (dynamic)
    assert counter.frame_count == 2
    with pytest.raises(ValueError, match="exceeds context_length"):
        compiled(model, torch.zeros(1, 33, dtype=torch.long), torch.zeros(1, 33, dtype=torch.long))


def test_learning_rate_warms_up_from_the_first_update_and_ends_at_the_floor():
    from scratchlm.align.sft import learning_rate

    cfg = OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.0)
    assert [learning_rate(s, 5, cfg) for s in range(5)] == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0])
    # The first update of a warm-up was at rate 0: all of a 1-step run, which learnt nothing.
    assert learning_rate(0, 1, OptimConfig(lr=1e-3, warmup_steps=5)) == pytest.approx(2e-4)
    assert learning_rate(0, 1, OptimConfig(lr=1e-3)) == 1e-3
    no_warmup = OptimConfig(lr=1.0, min_lr_ratio=0.1)
    assert [learning_rate(s, 3, no_warmup) for s in range(3)] == pytest.approx([1.0, 0.55, 0.1])


def test_fit_warmup_refuses_shortens_or_keeps_a_warmup_as_long_as_the_run(caplog):
    from scratchlm.align.sft import fit_warmup

    optim = OptimConfig(lr=1e-3, warmup_steps=5)
    with pytest.raises(UserError) as err:
        fit_warmup(optim, 5, "of this run (dpo.max_steps=5)")
    assert str(err.value).startswith("optim.warmup_steps=5 is not shorter than the 5 optimizer updates of this run "
                                     "(dpo.max_steps=5)") and "optim.warmup_steps below 5" in str(err.value)
    with caplog.at_level("WARNING", logger="scratchlm.align"):
        assert fit_warmup(optim, 6, "of this run", long_warmup="shorten") is optim
    assert not caplog.records  # shorter than the run: nothing to say
    with caplog.at_level("WARNING", logger="scratchlm.align"):
        assert fit_warmup(optim, 5, "of this run", long_warmup="shorten").warmup_steps == 0  # a tenth of the run
        assert fit_warmup(OptimConfig(warmup_steps=60), 50, "of this run", long_warmup="shorten").warmup_steps == 5
    caplog.clear()
    with caplog.at_level("WARNING", logger="scratchlm.align"):
        shortened = fit_warmup(optim, 1, "of this run (sft.max_steps=1)", long_warmup="shorten")
    assert shortened == OptimConfig(lr=1e-3, warmup_steps=0)
    (record,) = caplog.records
    assert "optim.warmup_steps=5" in record.getMessage() and "the 1 optimizer update of" in record.getMessage()
    assert fit_warmup(optim, 1, "", long_warmup="keep") is optim
    assert fit_warmup(optim, 0, "") is optim  # no update at all (grpo.n_grpo_steps = 0): nothing to warm up


def test_loops_refuse_a_warmup_as_long_as_the_run_before_evaluating(tiny_policy):
    examples = ArithmeticTask(difficulty=1).examples(4, seed=3)
    start = _params(tiny_policy.model)

    def evaluate(step):
        raise AssertionError("evaluated before the warm-up was checked")

    long = OptimConfig(lr=1e-2, warmup_steps=2)
    with pytest.raises(UserError, match=r"optim.warmup_steps=2 is not shorter than the 1 optimizer update of this "
                                        r"run \(1 epoch\(s\) of 4 pairs, 4 a step\)"):
        sft_train(tiny_policy, _pairs(examples), sft=SFTConfig(micro_batch_size=4, grad_accum_steps=1),
                  optim=long, evaluate=evaluate)
    grpo = GRPOConfig(n_grpo_steps=1, rollout_batch_size=4, group_size=2, train_batch_size=4, grad_accum_steps=1)
    sampling = SamplingConfig(max_new_tokens=4, batch_size=4)
    with pytest.raises(UserError, match=r"the 1 optimizer update of this run \(grpo.n_grpo_steps=1 x 1 a step\)"):
        grpo_train(tiny_policy, examples, template=TEMPLATE, reward_fn=arithmetic_reward, grpo=grpo, optim=long,
                   sampling=sampling, evaluate=evaluate)
    with pytest.raises(UserError, match=r"the 1 optimizer update that the SFT of an expert-iteration step takes at "
                                        r"most \(ei.sft_epochs=1 over ei.questions_per_step x ei.group_size = 4"):
        expert_iteration(tiny_policy, examples, template=TEMPLATE, reward_fn=arithmetic_reward,
                         ei=ExpertIterationConfig(n_ei_steps=1, questions_per_step=2, group_size=2),
                         sft=SFTConfig(micro_batch_size=4, grad_accum_steps=1), optim=long, sampling=sampling,
                         evaluate=evaluate)
    assert all(torch.equal(a, b) for a, b in zip(start, _params(tiny_policy.model)))


def test_a_shortened_warmup_trains_at_the_full_rate(tiny_policy):
    examples = ArithmeticTask(difficulty=1).examples(4, seed=3)
    history = sft_train(tiny_policy, _pairs(examples), sft=SFTConfig(micro_batch_size=4, grad_accum_steps=1,
                                                                     max_steps=1),
                        optim=OptimConfig(lr=1e-2, warmup_steps=20), long_warmup="shorten")
    assert [h["lr"] for h in history] == [1e-2]


def test_a_time_limited_grpo_run_keeps_its_warmup(tiny_policy):
    # Its number of updates is not known in advance: no error, the warm-up is left as it is.
    history = grpo_train(tiny_policy, ArithmeticTask(difficulty=1).examples(8), template=TEMPLATE,
                         reward_fn=arithmetic_reward,
                         grpo=GRPOConfig(n_grpo_steps=1, rollout_batch_size=4, group_size=2, train_batch_size=4,
                                         grad_accum_steps=1, max_seconds=3600.0),
                         optim=OptimConfig(lr=1e-3, warmup_steps=4), sampling=SamplingConfig(max_new_tokens=4))
    assert history[-1]["lr"] == pytest.approx(1e-3 / 4)
