"""Evaluation records and summary, and the eval-math command end to end on a tiny model."""

from __future__ import annotations

import json

import pytest

from scratchlm.align.datasets import MathExample
from scratchlm.align.evaluate import evaluate_policy, format_summary, summarize
from scratchlm.align.policy import Completion
from scratchlm.align.prompts import get_template
from scratchlm.align.rewards import r1_zero_reward


class CannedPolicy:
    """Answers each prompt with a fixed response, to test grading without a model."""

    def __init__(self, responses):
        self.responses = responses
        self.calls = []

    def generate(self, prompts, *, max_new_tokens, temperature=1.0, top_p=None, stop=(), seed=None, batch_size=64):
        self.calls.append(len(prompts))
        return [Completion(self.responses[p], 3, True) for p in prompts]


def test_summary_counts_correct_formatted_and_wrong():
    t = get_template("r1_zero")
    examples = [MathExample("a", "1"), MathExample("b", "2"), MathExample("c", "3"), MathExample("d", "4")]
    responses = {t.format("a"): " </think> <answer> 1 </answer>", t.format("b"): " </think> <answer> 5 </answer>",
                 t.format("c"): " 3", t.format("d"): " </think> <answer> 4.0 </answer>"}
    policy = CannedPolicy(responses)
    records, summary = evaluate_policy(policy, examples, template=t, reward_fn=r1_zero_reward, batch_size=3)
    assert policy.calls == [3, 1]
    assert [r["reward"] for r in records] == [1.0, 0.0, 0.0, 1.0]
    assert {k: summary[k] for k in ("total", "answer_correct", "format_correct", "formatted_wrong", "unformatted")} == {
        "total": 4, "answer_correct": 2, "format_correct": 3, "formatted_wrong": 1, "unformatted": 1}
    assert summary["accuracy"] == 0.5 and summary["generated_tokens"] == 12
    table = format_summary(summary, title="t")
    assert "formatted but wrong" in table and "50.00%" in table


def test_summarize_empty():
    assert summarize([])["accuracy"] == 0.0


def test_eval_math_command_on_a_tiny_run(tiny_policy, tmp_path, capsys):
    from scratchlm.cli import main

    tiny_policy.save(tmp_path / "run")
    out = tmp_path / "res" / "results.jsonl"
    code = main(["eval-math", str(tmp_path / "run"), "--dataset", "arith:1", "--limit", "3", "--max-new-tokens", "4",
                 "--out", str(out), "--device", "cpu"])
    assert code in (0, None)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and {"prompt", "response", "ground_truth", "reward", "format_reward"} <= set(rows[0])
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["total"] == 3 and summary["dataset"] == "arith:1"
    assert "answer correct" in capsys.readouterr().out


def test_eval_math_command_user_errors(tmp_path, capsys):
    from scratchlm.cli import main

    assert main(["eval-math", str(tmp_path / "nope"), "--dataset", "arith:1", "--limit", "2"]) == 2
    assert "error" in capsys.readouterr().err
    assert main(["eval-math", str(tmp_path), "--dataset", "imagenet"]) == 2


def test_eval_math_command_grades_with_the_named_reward(tiny_policy, tmp_path, capsys):
    from scratchlm.align.rewards import gsm8k_last_number_reward
    from scratchlm.cli import main

    tiny_policy.save(tmp_path / "run")
    out = tmp_path / "results.jsonl"
    assert main(["eval-math", str(tmp_path / "run"), "--dataset", "arith:1", "--limit", "4", "--max-new-tokens", "6",
                 "--template", "question_only", "--reward", "gsm8k_last_number", "--out", str(out),
                 "--device", "cpu"]) in (0, None)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:  # every response graded by its last number
        assert row["reward"] == gsm8k_last_number_reward(row["response"], row["ground_truth"])["reward"]
    assert json.loads(out.with_suffix(".summary.json").read_text())["reward"] == "gsm8k_last_number"
    capsys.readouterr()
    assert main(["eval-math", str(tmp_path / "run"), "--dataset", "arith:1", "--reward", "bleu"]) == 2
    err = capsys.readouterr().err
    assert "unknown reward 'bleu'; choose one of" in err and len(err.strip().splitlines()) == 1


def test_evaluate_policy_takes_a_reward_name():
    t = get_template("question_only")
    examples = [MathExample("a", "B"), MathExample("b", "1234.5")]
    policy = CannedPolicy({t.format("a"): " The correct answer is (b).", t.format("b"): " She pays $1,234.50."})
    records, _ = evaluate_policy(policy, examples, template=t, reward_fn="multiple_choice")
    assert [r["reward"] for r in records] == [1.0, 0.0]
    records, _ = evaluate_policy(policy, examples, template=t, reward_fn="gsm8k_last_number")
    assert [r["reward"] for r in records] == [0.0, 1.0]


def test_eval_math_command_checks_its_options_before_evaluating(tiny_policy, tmp_path, capsys, monkeypatch):
    import pytest

    from scratchlm.align import evaluate
    from scratchlm.cli import main

    tiny_policy.save(tmp_path / "run")

    def no_evaluation(*args, **kwargs):
        raise AssertionError("evaluated before the options were checked")

    monkeypatch.setattr(evaluate, "evaluate_policy", no_evaluation)
    base = ["eval-math", str(tmp_path / "run"), "--dataset", "arith:1", "--limit", "2", "--device", "cpu"]
    for extra, message in [(["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
                           (["--batch-size", "0"], "--batch-size must be positive"),
                           (["--temperature", "-1"], "--temperature must be a number >= 0"),
                           (["--out", str(tmp_path)], "is a directory; give a file name")]:
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err
    with pytest.raises(AssertionError, match="evaluated"):  # a good --out in a new folder gets that far
        main([*base, "--out", str(tmp_path / "new" / "r.jsonl"), "--debug"])
    assert (tmp_path / "new").is_dir()


@pytest.mark.parametrize("whole", [0, 1])
def test_eval_math_outputs_are_old_or_whole_new_when_a_write_fails(tiny_policy, tmp_path, capsys, cut_writes, whole):
    from scratchlm.cli import main

    tiny_policy.save(tmp_path / "run")
    out = tmp_path / "results.jsonl"
    args = ["eval-math", str(tmp_path / "run"), "--dataset", "arith:1", "--max-new-tokens", "4", "--out", str(out),
            "--device", "cpu"]
    assert main([*args, "--limit", "3"]) in (0, None)
    records, summary = out.read_text(), out.with_suffix(".summary.json").read_text()
    cut_writes(after=whole)  # the first `whole` files are written whole, the next is cut by a full disk
    assert main([*args, "--limit", "2"]) not in (0, None)
    assert "No space left" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == (3 if whole == 0 else 2)  # the old records or the new, whole
    assert out.with_suffix(".summary.json").read_text() == summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl", "results.summary.json", "run"]
    if whole == 0:
        assert out.read_text() == records


def test_eval_math_refuses_prompts_without_room_before_evaluating(tiny_policy, tmp_path, capsys, monkeypatch):
    # A prompt longer than the model's context failed only once the evaluation reached its batch.
    from scratchlm.align import evaluate
    from scratchlm.cli import main

    tiny_policy.save(tmp_path / "run")
    ctx = tiny_policy.context_length
    data = tmp_path / "mixed.jsonl"
    rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "3+4? " * ctx, "answer": "#### 7"},
            {"question": "2+2?", "answer": "#### 4"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["eval-math", str(tmp_path / "run"), "--dataset", str(data), "--max-new-tokens", "2", "--device", "cpu",
            "--template", "question_only"]
    real = evaluate.evaluate_policy

    def no_evaluation(*args, **kwargs):
        raise AssertionError("evaluated before the prompts were checked")

    monkeypatch.setattr(evaluate, "evaluate_policy", no_evaluation)
    assert main(base) == 2
    err = capsys.readouterr().err.strip()
    assert f"1 of 3 prompts leave no room for an answer in the model's context of {ctx} tokens" in err
    assert "--skip-long" in err and "\n" not in err
    monkeypatch.setattr(evaluate, "evaluate_policy", real)
    out = tmp_path / "res.jsonl"
    assert main([*base, "--skip-long", "--out", str(out)]) == 0
    graded = [json.loads(line)["ground_truth"] for line in out.read_text().splitlines()]
    assert graded == ["2", "4"]
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["total"] == 2 and summary["skipped_too_long"] == 1
    assert "skipped 1 problem(s)" in capsys.readouterr().out


def test_eval_math_says_when_no_prompt_fits(tiny_policy, tmp_path, capsys):
    from scratchlm.cli import main

    tiny_policy.save(tmp_path / "run")
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"question": "3+4? " * tiny_policy.context_length, "answer": "#### 7"}) + "\n")
    for extra in ([], ["--skip-long"]):
        assert main(["eval-math", str(tmp_path / "run"), "--dataset", str(data), "--device", "cpu", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert "no prompt leaves room for an answer" in err and "\n" not in err
