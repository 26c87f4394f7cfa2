"""Math evaluation: generate an answer to each question, grade it, summarise.

Per-example records (JSONL) keep the prompt, the response, the ground truth and the three
rewards; the summary counts the examples whose answer is right, whose format is right, and
those formatted but wrong (the model follows the protocol but reasons badly), and the
decoding throughput.

    records, summary = evaluate_policy(policy, examples, template=get_template("r1_zero"),
                                       reward_fn=r1_zero_reward, max_new_tokens=512)
    print(format_summary(summary))
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scratchlm.align.datasets import MathExample
from scratchlm.align.prompts import PromptTemplate
from scratchlm.align.reward_registry import get_reward_fn
from scratchlm.align.rewards import RewardFn
from scratchlm.fileio import atomic_open


def evaluate_policy(
    policy: Any,
    examples: Sequence[MathExample],
    *,
    template: PromptTemplate,
    reward_fn: RewardFn | str,
    max_new_tokens: int = 512,
    batch_size: int = 64,
    temperature: float = 0.0,
    top_p: float | None = None,
    seed: int = 0,
    progress: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Greedy (default) answers to `examples`, graded by `reward_fn`: (records, summary).

    `reward_fn` is a function or the name of a registered reward (reward_registry.REWARDS).
    """
    reward_fn = get_reward_fn(reward_fn)
    prompts = [template.format(ex.question) for ex in examples]
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    bar = _progress(len(prompts), progress)
    generated = 0
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first:first + batch_size]
        completions = policy.generate(chunk, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, stop=template.stop, seed=seed + first, batch_size=batch_size)
        for i, (prompt, comp) in enumerate(zip(chunk, completions)):
            ex = examples[first + i]
            rewards = reward_fn(comp.text, ex.answer)
            generated += comp.num_tokens
            records.append({"index": first + i, "question": ex.question, "ground_truth": ex.answer,
                            "prompt": prompt, "response": comp.text, "num_tokens": comp.num_tokens,
                            "stopped": comp.stopped, **rewards, **ex.meta})
        bar.update(len(chunk))
    bar.close()
    return records, summarize(records, seconds=time.perf_counter() - start, generated_tokens=generated)


def summarize(records: Sequence[dict[str, Any]], *, seconds: float = 0.0, generated_tokens: int = 0) -> dict[str, Any]:
    """Counts and rates over graded records (each with format_reward / answer_reward)."""
    total = len(records)
    correct = sum(r["answer_reward"] == 1.0 for r in records)
    formatted = sum(r["format_reward"] == 1.0 for r in records)
    return {
        "total": total,
        "answer_correct": correct,
        "format_correct": formatted,
        "formatted_wrong": formatted - correct,
        "unformatted": total - formatted,
        "accuracy": correct / total if total else 0.0,
        "format_rate": formatted / total if total else 0.0,
        "mean_response_tokens": sum(r.get("num_tokens", 0) for r in records) / total if total else 0.0,
        "generated_tokens": generated_tokens,
        "seconds": seconds,
        "tokens_per_s": generated_tokens / seconds if seconds > 0 else 0.0,
    }


def format_summary(summary: dict[str, Any], title: str = "") -> str:
    """The summary as an aligned text table."""
    rows = [
        ("total", f"{summary['total']}"),
        ("answer correct", f"{summary['answer_correct']}"),
        ("format correct", f"{summary['format_correct']}"),
        ("formatted but wrong", f"{summary['formatted_wrong']}"),
        ("unformatted", f"{summary['unformatted']}"),
        ("accuracy", f"{100 * summary['accuracy']:.2f}%"),
        ("format rate", f"{100 * summary['format_rate']:.2f}%"),
        ("mean response tokens", f"{summary['mean_response_tokens']:.1f}"),
        ("generated tokens/s", f"{summary['tokens_per_s']:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [title] if title else []
    lines += [f"{k:<{width}}  {v:>10}" for k, v in rows]
    return "\n".join(lines)


def write_jsonl(records: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    """One JSON object per line (parent folders created), streamed to a temporary file that then
    replaces `path` (`scratchlm.fileio.atomic_open`): never a file cut short."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(out) as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="eval", unit="q")
