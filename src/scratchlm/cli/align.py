"""Command-line entry points: ``scratchlm sft | expert-iteration | grpo | dpo | eval-math``.

The training commands read a TOML preset (``configs/align-*.toml``) with dotted overrides,
write the resolved config, ``metrics.jsonl``, one ``eval_step_N.jsonl`` per evaluation and
the final policy (``policy/``, a run directory or a Hugging Face directory) into
``run.out_dir``. Ctrl-C (SIGINT) or SIGTERM stops them after the optimizer step in progress
with that policy and the training state (``resume/``) saved (`scratchlm.align.interrupt`); they
exit with 130 or 143, and the same command with ``--resume`` continues the run as if it had not
stopped (`scratchlm.align.resume`). With ``run.resume_every`` they also save both every N steps,
so that ``--resume`` continues a run killed outright from the last of those. A ``run.out_dir``
that already holds a run (its ``policy/``, training state or metrics) is refused, before anything
is read or written, unless ``--resume`` continues it or ``--overwrite`` starts afresh over it.

    scratchlm sft align-sft --policy.path=runs/base --data.dataset=gsm8k
    scratchlm sft align-sft --policy.path=runs/base --data.dataset=gsm8k --resume
    scratchlm grpo align-grpo --policy.path=runs/align-sft/policy
    scratchlm dpo dpo --policy.path=runs/align-sft/policy --data.train_path=pairs.jsonl
    scratchlm eval-math runs/align-grpo/policy --dataset gsm8k --limit 200 --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scratchlm.errors import UserError
from scratchlm.fileio import check_writable_dir, resolve_path

log = logging.getLogger("scratchlm.align")


class MetricsWriter:
    """Appends metric dicts to ``metrics.jsonl`` and logs a short line for each.

    A rerun into the same folder starts the file afresh; a resumed run (`resumed_at`, the step it
    stopped at) keeps the records of the steps before and moves the others (the row of that step,
    the record of the stop) to ``metrics.dropped.jsonl``: the resumed run logs that step again."""

    def __init__(self, out_dir: Path, *, resumed_at: int | None = None) -> None:
        from scratchlm.train.metrics import truncate_metrics

        self.path = out_dir / "metrics.jsonl"
        out_dir.mkdir(parents=True, exist_ok=True)
        if resumed_at is None:
            self.path.write_text("", encoding="utf-8")
        else:
            truncate_metrics(self.path, resumed_at - 1)

    def __call__(self, row: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                 if k in ("phase", "step", "loss", "rollout_reward", "reward_mean", "eval_accuracy",
                          "eval_format_rate", "token_entropy", "kept", "clip_fraction", "reward_accuracy",
                          "reward_margin", "eval_loss", "eval_reward_accuracy", "eval_reward_margin",
                          "interrupted")}
        log.info("%s", shown)
        print(json.dumps(shown), flush=True)


def _parse(prog: str, argv: Sequence[str], config_cls: type, default_preset: str, description: str):
    """(config, how a long warm-up is taken (`_long_warmup`), whether --resume was given)."""
    from scratchlm.config import load_config, split_overrides

    positional, overrides = split_overrides(argv)
    parser = argparse.ArgumentParser(prog=f"scratchlm {prog}", description=description,
                                     epilog="Override any config field with --section.key=value. Ctrl-C or SIGTERM "
                                            "stops after the optimizer step in progress, saving the policy and the "
                                            "training state; --resume continues from there.")
    parser.add_argument("config", nargs="?", default=default_preset,
                        help=f"TOML preset (path or name in configs/; default {default_preset})")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="continue the interrupted run in run.out_dir as if it had not stopped (same config)")
    mode.add_argument("--overwrite", action="store_true",
                      help="start afresh in a run.out_dir that holds a run already, replacing its metrics, policy "
                           "and training state (by default such a run.out_dir is refused)")
    args = parser.parse_args(positional)
    cfg = load_config(config_cls, args.config, overrides)
    for note in cfg.ignored_options():  # options this command never reads: said, not ignored silently
        log.warning("note: %s", note)
    if not (args.resume or args.overwrite):
        _check_no_earlier_run(Path(cfg.run.out_dir))
    return cfg, _long_warmup(args.config, default_preset, overrides), args.resume


def _check_no_earlier_run(out_dir: Path) -> None:
    """Refuse a run.out_dir that holds what an earlier run wrote (its policy, training state or
    metrics), which a fresh run would replace: --resume or --overwrite says what to do with it."""
    _check_out_dir(out_dir)  # (a file, a training run or a Hugging Face directory: refused whatever the flags)
    found = [name for name in ("policy", "resume", "resume.previous") if (out_dir / name).exists()]
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append("metrics.jsonl")
    if found:
        raise UserError(f"run.out_dir {out_dir} already holds a run ({', '.join(found)}); pass --resume to continue "
                        "it or --overwrite to replace it, or choose another run.out_dir")


def _long_warmup(preset: str, default_preset: str, overrides: Sequence[str]) -> str:
    """How the training loop takes a warm-up not shorter than the run (`align.sft.fit_warmup`):
    one the user chose, with --optim.warmup_steps or in a config file of their own, is refused;
    the command's default preset's is shortened, with a warning."""
    from scratchlm.config import ConfigError, parse_override, resolve_preset

    if any(parse_override(text)[0] == ["optim", "warmup_steps"] for text in overrides):
        return "refuse"
    try:
        default = resolve_preset(preset).resolve() == resolve_preset(default_preset).resolve()
    except (ConfigError, OSError):
        default = False
    return "shorten" if default else "refuse"


def _require_policy_path(cfg: Any) -> None:
    if not cfg.policy.path:
        raise UserError("set the starting model with --policy.path=PATH (a run directory or a HF model directory)")


def _check_out_dir(out_dir: Path) -> None:
    """run.out_dir is rewritten (config.toml, metrics.jsonl): refuse a file, a training run's folders
    and a Hugging Face model directory."""
    from scratchlm.align.policy import is_hf_directory

    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"run.out_dir {out_dir} exists and is not a directory")
    if is_hf_directory(out_dir):  # its config.toml would make it read as a scratchlm run
        raise UserError(f"run.out_dir {out_dir} is a Hugging Face model directory (it has a config.json): "
                        "a scratchlm run written there would mix with the model; choose another run.out_dir")
    if (out_dir / "checkpoints").is_dir() or ((out_dir / "model.safetensors").is_file()
                                               and (out_dir / "config.toml").is_file()):
        raise UserError(f"run.out_dir {out_dir} is a training run or checkpoint: its config.toml and "
                        "metrics.jsonl would be overwritten; choose another run.out_dir")


def _resumable(cfg: Any, point: Any, state: Any, policy: Any, out_dir: Path) -> dict[str, Any]:
    """The arguments every post-training loop takes to stop, resume and save resumably: hand its
    state to `point` on a signal, continue from `state` (None: from the start), and save the policy
    and state every `run.resume_every` steps."""
    return {"on_stop": point.keep, "resume": None if state is None else state.loop,
            "resume_every": cfg.run.resume_every, "on_checkpoint": point.saver(policy, out_dir / "policy")}


def _start(cfg: Any, check: Callable[[Any], None] | None = None, *, point: Any = None, state: Any = None):
    """Seed, policy, then the output folder with the resolved config (a bad policy writes nothing).

    `check(policy)`, when given, runs before anything is written: what it refuses leaves
    run.out_dir as it was. `point` is the run's `ResumePoint`: with the `state` it read (--resume),
    the policy comes from run.out_dir/policy, checked to be the one saved with that state (or the
    state before it, `SavedState.check_policy`), which is returned with the policy and the folder;
    without one, a state left by an interrupted run is discarded (the run starts afresh)."""
    import torch

    from scratchlm.align.policy import load_policy
    from scratchlm.config import save_config
    from scratchlm.device import resolve_device

    _require_policy_path(cfg)
    torch.manual_seed(cfg.run.seed)
    out_dir = Path(cfg.run.out_dir)
    _check_out_dir(out_dir)
    saved = resolve_path(out_dir / "policy", f"run.out_dir {out_dir}")
    start = resolve_path(Path(cfg.policy.path), f"policy.path {cfg.policy.path}")
    if start == saved or saved in start.parents:
        # policy/ is rewritten (and its older steps pruned): the starting model would be lost.
        raise UserError(f"policy.path {cfg.policy.path} is inside {out_dir / 'policy'}, where this run saves its "
                        "policy over it; choose another run.out_dir")
    policy = load_policy(cfg.policy.path if state is None else out_dir / "policy", resolve_device(cfg.policy.device))
    if state is not None:
        state = state.check_policy(policy, out_dir / "policy")
    if check is not None:
        check(policy)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out_dir / "config.toml")
    if point is not None and state is None:
        point.discard(fresh_run=True)
    elif point is not None:
        point.settle(state)
    return policy, out_dir, state


def _inputs(cfg: Any):
    """Template, reward function, training and evaluation examples: read before anything is written."""
    from scratchlm.align.prompts import get_template
    from scratchlm.align.reward_registry import select_reward

    _require_policy_path(cfg)
    template = get_template(cfg.data.template)
    reward_fn = select_reward(cfg.data.reward, template=cfg.data.template, dataset=cfg.data.dataset)
    train, evals = _examples(cfg, eval_split=False), _examples(cfg, eval_split=True)
    data = cfg.data
    for examples, name, split in ((train, data.dataset, data.split),
                                  (evals, data.eval_dataset or data.dataset, data.eval_split)):
        if not examples:
            raise UserError(f"{name}/{split} has no examples")
    return template, reward_fn, train, evals


def _examples(cfg: Any, *, eval_split: bool):
    from scratchlm.align.datasets import load_examples

    data = cfg.data
    dataset = (data.eval_dataset or data.dataset) if eval_split else data.dataset
    limit = (data.eval_limit if eval_split else data.limit) or None
    return load_examples(dataset, data.eval_split if eval_split else data.split,
                         data_dir=data.data_dir or None, limit=limit, seed=cfg.run.seed)


def _prompt_lengths(policy: Any, examples: Sequence[Any], template: Any) -> list[int]:
    """Tokens of each example's question in the prompt template."""
    return [len(policy.encode(template.format(ex.question))) for ex in examples]


def _check_prompts_fit(cfg: Any, template: Any, train: Sequence[Any], evals: Sequence[Any]) -> Callable[[Any], None]:
    """A `_start` check: UserError when a training or evaluation prompt leaves the policy no room
    for one new token in its context (generation refuses it, but only at the first rollout or
    evaluation that draws it, after metrics.jsonl has been rewritten)."""
    data = cfg.data

    def check(policy: Any) -> None:
        ctx = policy.context_length
        for examples, what, name, split in ((train, "training", data.dataset, data.split),
                                            (evals, "evaluation", data.eval_dataset or data.dataset, data.eval_split)):
            long = [n for n in _prompt_lengths(policy, examples, template) if n >= ctx]
            if long:
                raise UserError(f"{len(long)} of {len(examples)} {what} prompts ({name}/{split}) leave no room for a "
                                f"response in the policy's context of {ctx} tokens (the longest has {max(long)}); "
                                "filter the data to shorter questions or use a policy with a longer context")

    return check


def _evaluator(policy: Any, cfg: Any, template: Any, examples: Any, out_dir: Path):
    from scratchlm.align.evaluate import evaluate_policy, write_jsonl
    from scratchlm.align.reward_registry import select_reward

    # The default reward follows the evaluation dataset (which may not be the training one), as in eval-math.
    data = cfg.data
    reward_fn = select_reward(data.reward, template=data.template, dataset=data.eval_dataset or data.dataset)

    def evaluate(step: int) -> dict[str, Any]:
        records, summary = evaluate_policy(policy, examples, template=template, reward_fn=reward_fn,
                                           max_new_tokens=cfg.sampling.eval_max_new_tokens,
                                           batch_size=cfg.sampling.batch_size, seed=cfg.run.seed)
        write_jsonl(records, out_dir / f"eval_step_{step}.jsonl")
        return {k: summary[k] for k in ("accuracy", "format_rate", "mean_response_tokens", "tokens_per_s")}

    return evaluate


def sft_pairs(examples: Sequence[Any], template: Any) -> list[tuple[str, str]]:
    """(prompt, target response) for every example that has a worked solution."""
    return [(template.format(ex.question), template.response(ex.reasoning, ex.answer))
            for ex in examples if ex.reasoning]


def sft_command(argv: list[str]) -> int:
    """``scratchlm sft [config] [--section.key=value ...]``: SFT on worked solutions."""
    from scratchlm.align.config import SFTRunConfig
    from scratchlm.align.interrupt import run_interruptible
    from scratchlm.align.sft import fit_warmup, schedule_length, sft_train
    from scratchlm.align.resume import ResumePoint

    cfg, long_warmup, resume = _parse("sft", argv, SFTRunConfig, "align-sft",
                                      "Supervised fine-tuning on worked solutions.")
    template, _, train, evals = _inputs(cfg)
    pairs = sft_pairs(train, template)
    if not pairs:
        raise UserError(f"dataset {cfg.data.dataset!r} has no worked solutions to fine-tune on")
    if cfg.sft.max_steps or not cfg.sft.packed:
        # Checked now, before anything is written, on the pairs' count: pairs too long for the
        # context (left out) or packed windows (counted once encoded) only shorten the run,
        # and sft_train checks it again on the count it trains on.
        sft = cfg.sft
        cfg.optim = fit_warmup(cfg.optim, *schedule_length(sft.max_steps, sft.num_epochs, len(pairs),
                                                           sft.micro_batch_size * sft.grad_accum_steps, section="sft"),
                               long_warmup=long_warmup)
    point = ResumePoint(cfg.run.out_dir, command="sft", config=cfg, data=pairs, argv=argv)
    state = point.read() if resume else None
    # Training pairs too long are left out or cut (sft_train reports them); evaluation prompts must fit.
    policy, out_dir, state = _start(cfg, _check_prompts_fit(cfg, template, (), evals), point=point, state=state)
    metrics = MetricsWriter(out_dir, resumed_at=None if state is None else state.step)
    evaluate = _evaluator(policy, cfg, template, evals, out_dir)
    history = run_interruptible(
        lambda stop: sft_train(policy, pairs, sft=cfg.sft, optim=cfg.optim, seed=cfg.run.seed, log=metrics,
                               progress=cfg.run.progress, report=print, evaluate=evaluate, long_warmup=long_warmup,
                               stop=stop, **_resumable(cfg, point, state, policy, out_dir)),
        phase="sft", policy=policy, out=out_dir / "policy", log=metrics, evaluation="eval_accuracy", resume=point)
    # Saved before the final evaluation, so that a Ctrl-C during it loses no training.
    policy.save(out_dir / "policy", step=len(history))
    point.discard()
    metrics({"phase": "sft", "step": len(history), **{f"eval_{k}": v for k, v in evaluate(len(history)).items()}})
    return 0


def expert_iteration_command(argv: list[str]) -> int:
    """``scratchlm expert-iteration [config] [--section.key=value ...]``."""
    from scratchlm.align.config import ExpertIterationRunConfig
    from scratchlm.align.expert_iteration import check_train_examples, expert_iteration, round_updates
    from scratchlm.align.resume import ResumePoint
    from scratchlm.align.interrupt import run_interruptible
    from scratchlm.align.sft import fit_warmup

    cfg, long_warmup, resume = _parse("expert-iteration", argv, ExpertIterationRunConfig, "align-ei",
                                      "Expert iteration: sample, keep rewarded responses, fine-tune on them.")
    template, reward_fn, train, evals = _inputs(cfg)
    check_train_examples(train, cfg.ei)
    bound = round_updates(cfg.ei, cfg.sft)
    if bound is not None:  # (checked before anything is written)
        cfg.optim = fit_warmup(cfg.optim, *bound, long_warmup=long_warmup)
    point = ResumePoint(cfg.run.out_dir, command="expert-iteration", config=cfg, data=train, argv=argv)
    state = point.read() if resume else None
    policy, out_dir, state = _start(cfg, _check_prompts_fit(cfg, template, train, evals), point=point, state=state)
    metrics = MetricsWriter(out_dir, resumed_at=None if state is None else state.step)
    evaluate = _evaluator(policy, cfg, template, evals, out_dir)
    history = run_interruptible(
        lambda stop: expert_iteration(policy, train, template=template, reward_fn=reward_fn, ei=cfg.ei, sft=cfg.sft,
                                      optim=cfg.optim, sampling=cfg.sampling, evaluate=evaluate, seed=cfg.run.seed,
                                      log=metrics, progress=cfg.run.progress, long_warmup=long_warmup, stop=stop,
                                      **_resumable(cfg, point, state, policy, out_dir)),
        phase="ei", policy=policy, out=out_dir / "policy", log=metrics, evaluation="eval_accuracy", resume=point)
    policy.save(out_dir / "policy", step=len(history))
    point.discard()
    return 0


def grpo_command(argv: list[str]) -> int:
    """``scratchlm grpo [config] [--section.key=value ...]``."""
    from scratchlm.align.config import GRPORunConfig
    from scratchlm.align.grpo import check_train_examples, grpo_train, grpo_updates
    from scratchlm.align.resume import ResumePoint
    from scratchlm.align.interrupt import run_interruptible
    from scratchlm.align.sft import fit_warmup

    cfg, long_warmup, resume = _parse("grpo", argv, GRPORunConfig, "align-grpo", "GRPO with verifiable rewards.")
    template, reward_fn, train, evals = _inputs(cfg)
    check_train_examples(train, cfg.grpo)
    if not cfg.grpo.max_seconds:  # a time-limited run's length is not known in advance
        cfg.optim = fit_warmup(cfg.optim, *grpo_updates(cfg.grpo), long_warmup=long_warmup)
    point = ResumePoint(cfg.run.out_dir, command="grpo", config=cfg, data=train, argv=argv)
    state = point.read() if resume else None
    policy, out_dir, state = _start(cfg, _check_prompts_fit(cfg, template, train, evals), point=point, state=state)
    metrics = MetricsWriter(out_dir, resumed_at=None if state is None else state.step)
    evaluate = _evaluator(policy, cfg, template, evals, out_dir)
    history = run_interruptible(
        lambda stop: grpo_train(policy, train, template=template, reward_fn=reward_fn, grpo=cfg.grpo, optim=cfg.optim,
                                sampling=cfg.sampling, evaluate=evaluate, seed=cfg.run.seed, log=metrics,
                                progress=cfg.run.progress, long_warmup=long_warmup, stop=stop,
                                **_resumable(cfg, point, state, policy, out_dir)),
        phase="grpo", policy=policy, out=out_dir / "policy", log=metrics, evaluation="eval_accuracy", resume=point)
    policy.save(out_dir / "policy", step=len(history))
    point.discard()
    return 0


def preference_pairs(cfg: Any) -> tuple[list[Any], list[Any]]:
    """(training, held-out) preference pairs of a `DPORunConfig`'s data section."""
    from scratchlm.align.preferences import hold_out, load_preference_pairs

    data, seed = cfg.data, cfg.run.seed
    if not data.train_path:
        raise UserError("set the preference pairs with --data.train_path=PAIRS.jsonl (or arith[:D])")
    train = load_preference_pairs(data.train_path, split="train", limit=data.limit or None, seed=seed,
                                  template=data.template)
    if data.eval_path:
        held_out = load_preference_pairs(data.eval_path, split="test", limit=data.eval_limit or None, seed=seed,
                                         template=data.template)
    else:
        train, held_out = hold_out(train, data.eval_fraction, seed)
        held_out = held_out[: data.eval_limit or None]
    if not train:
        raise UserError(f"{data.train_path} leaves no training pairs after the held-out share; "
                        f"lower data.eval_fraction or add pairs")
    return train, held_out


def dpo_command(argv: list[str]) -> int:
    """``scratchlm dpo [config] [--section.key=value ...]``: DPO on preference pairs."""
    from scratchlm.align.config import DPORunConfig
    from scratchlm.align.dpo import dpo_train
    from scratchlm.align.resume import ResumePoint
    from scratchlm.align.interrupt import run_interruptible
    from scratchlm.align.sft import fit_warmup, schedule_length

    cfg, long_warmup, resume = _parse("dpo", argv, DPORunConfig, "dpo",
                                      "Direct preference optimisation on preference pairs.")
    _require_policy_path(cfg)
    train, held_out = preference_pairs(cfg)  # read before anything is written, so bad data fails first
    # Checked now on the pairs' count (pairs too long for the context only shorten the run; dpo_train checks again).
    dpo = cfg.dpo
    cfg.optim = fit_warmup(cfg.optim, *schedule_length(dpo.max_steps, dpo.num_epochs, len(train),
                                                       dpo.micro_batch_size * dpo.grad_accum_steps, section="dpo"),
                           long_warmup=long_warmup)
    point = ResumePoint(cfg.run.out_dir, command="dpo", config=cfg, data=train, argv=argv)
    state = point.read() if resume else None
    # The reference is the starting policy: copied from the policy when the run starts, read again when it resumes.
    reference = None if state is None else _dpo_reference(cfg, state)
    policy, out_dir, state = _start(cfg, point=point, state=state)
    metrics = MetricsWriter(out_dir, resumed_at=None if state is None else state.step)
    history = run_interruptible(
        lambda stop: dpo_train(policy, train, dpo=cfg.dpo, optim=cfg.optim, eval_pairs=held_out, reference=reference,
                               save=lambda step: policy.save(out_dir / "policy", step=step), seed=cfg.run.seed,
                               log=metrics, progress=cfg.run.progress, report=print, long_warmup=long_warmup,
                               stop=stop, **_resumable(cfg, point, state, policy, out_dir)),
        phase="dpo", policy=policy, out=out_dir / "policy", log=metrics, evaluation="eval_loss" if held_out else None,
        resume=point)
    policy.save(out_dir / "policy", step=history[-1]["step"])
    point.discard()
    return 0


def _dpo_reference(cfg: Any, state: Any) -> Any:
    """The frozen starting policy (policy.path) of a resumed DPO run, checked to be the reference it trained against."""
    from scratchlm.align.dpo import freeze
    from scratchlm.align.policy import load_policy
    from scratchlm.align.resume import weights_digest
    from scratchlm.device import resolve_device

    reference = freeze(load_policy(cfg.policy.path, resolve_device(cfg.policy.device)).model)
    if weights_digest(reference) != state.loop["reference"]:
        raise UserError(f"--resume: policy.path {cfg.policy.path} is no longer the model the run started from (its "
                        "DPO reference): its weights changed since; resume with the starting model as it was, or "
                        "start the run afresh with --overwrite instead of --resume")
    return reference


def _examples_with_room(policy: Any, examples: list, template: Any, *, skip: bool) -> tuple[list, int]:
    """The examples whose prompt leaves the policy room for at least one new token, and how
    many do not. Without `skip` any that do not are an error now, not once the evaluation
    reaches their batch."""
    ctx = policy.context_length
    lengths = _prompt_lengths(policy, examples, template)
    fit = [ex for ex, n in zip(examples, lengths) if n < ctx]
    skipped = len(examples) - len(fit)
    if not fit:
        raise UserError(f"no prompt leaves room for an answer in the model's context of {ctx} tokens "
                        f"(the shortest has {min(lengths)})")
    if skipped and not skip:
        raise UserError(f"{skipped} of {len(examples)} prompts leave no room for an answer in the model's context of "
                        f"{ctx} tokens (the longest has {max(lengths)}); pass --skip-long to grade the "
                        f"{len(fit)} that fit")
    return fit, skipped


SUMMARY_SUFFIX = ".summary.json"  # eval-math's summary, beside its --out
_RECORD_KEYS = {"index", "question", "ground_truth", "prompt", "response"}  # of every eval-math results line
_SUMMARY_KEYS = {"model", "dataset", "split", "template", "reward"}


def _check_out_spares_models(out: Path, model: str) -> None:
    """UserError when --out, or the summary written beside it, would replace a file of a model: an
    existing file inside the evaluated MODEL (a directory, or the checkpoint file itself), or
    inside any scratchlm run or step directory (config.toml, metrics.jsonl, checkpoints/,
    tokenizer/ ...). An earlier eval-math output there may be replaced."""
    model_path = resolve_path(Path(model), f"model {model}")
    for path, what in ((out, ""), (out.with_suffix(SUMMARY_SUFFIX), "its summary ")):
        target = resolve_path(path, f"--out {out}")
        if not target.is_file():
            continue
        if target == model_path or model_path in target.parents:
            where = f"a file of the model {model}"
        else:
            home = next((d for d in target.parents
                         if (d / "checkpoints").is_dir() or (d / "model.safetensors").is_file()), None)
            if home is None:
                continue
            where = f"a file of the model in {home}"
        if not _is_eval_math_output(target):
            raise UserError(f"--out {out} would overwrite {what}{target}, {where} (not an earlier eval-math output); "
                            "give a file name outside the model's directory")


def _is_eval_math_output(path: Path, limit: int = 1 << 20) -> bool:
    """Whether `path` is the results JSONL (its first line a record) or the summary of an earlier
    eval-math; at most `limit` bytes are read."""
    try:
        with path.open("rb") as f:
            head = f.read(limit)
    except OSError:
        return False
    for text, keys in ((head.split(b"\n", 1)[0], _RECORD_KEYS), (head, _SUMMARY_KEYS)):
        try:
            data = json.loads(text)
        except ValueError:
            continue
        if isinstance(data, dict) and keys <= data.keys():
            return True
    return False


def eval_math_command(argv: list[str]) -> int:
    """``scratchlm eval-math MODEL --dataset gsm8k|math|math500 [--split test] [--limit N] [--out F]``."""
    parser = argparse.ArgumentParser(prog="scratchlm eval-math",
                                     description="Generate answers to math problems and grade them.")
    parser.add_argument("model", help="scratchlm run/step directory or checkpoint, or a local HF model directory")
    parser.add_argument("--dataset", default="gsm8k", help="gsm8k, math, math500, arith[:D], or a .jsonl file")
    parser.add_argument("--split", default=None, help="split of a named dataset (default test); not for a .jsonl file")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N examples only")
    parser.add_argument("--out", default=None, help="per-example results JSONL (summary beside it)")
    parser.add_argument("--template", default="r1_zero", help="prompt format: r1_zero or question_only")
    parser.add_argument("--reward", default="",
                        help="how answers are graded: a name in align.reward_registry.REWARDS (gsm8k_last_number: "
                             "the last number of free text; multiple_choice: 'The correct answer is X'); "
                             "default: the template's own")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per generator call")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--device", default="auto", help="auto (cuda, else mps, else cpu), cpu, cuda, cuda:1, mps ...")
    parser.add_argument("--data-dir", default=None, help="folder holding gsm8k/ and math/")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of sampled answers (--temperature > 0) and of the arith problems")
    parser.add_argument("--skip-long", action="store_true",
                        help="grade only the problems whose prompt leaves room for an answer in the model's context "
                             "(by default such a prompt is an error, before any evaluation)")
    args = parser.parse_args(argv)
    from scratchlm.align.datasets import is_file_dataset

    if args.limit is not None and args.limit <= 0:
        raise UserError(f"--limit must be positive, got {args.limit}")
    if args.split is not None and is_file_dataset(args.dataset):
        raise UserError(f"--split {args.split} does not apply to the --dataset file {args.dataset}, which is read "
                        "whole; leave --split out")
    if args.split is None:
        args.split = "test"
    if args.batch_size <= 0:
        raise UserError(f"--batch-size must be positive, got {args.batch_size}")
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not 0 <= args.temperature < float("inf"):
        raise UserError(f"--temperature must be a number >= 0 (0 = greedy), got {args.temperature}")
    if not 0 <= args.seed < 2**32:
        raise UserError(f"--seed must be in [0, 2**32), got {args.seed}")
    if not (args.dataset == "arith" or args.dataset.startswith("arith:")):  # (arith draws its problems from --seed)
        from scratchlm.cli.infer import note_if_greedy

        note_if_greedy(args, parser, ("seed",))
    if args.out:
        # Checked now, not after the whole evaluation has run.
        out = Path(args.out)
        if out.is_dir():
            raise UserError(f"--out {out} is a directory; give a file name such as {out / 'results.jsonl'}")
        if resolve_path(out, f"--out {out}") == resolve_path(Path(args.dataset), f"--dataset {args.dataset}"):
            raise UserError(f"--out {out} would overwrite the --dataset file; give another file name")
        if out.with_suffix(SUMMARY_SUFFIX).is_dir():  # (found only when writing it, after the evaluation)
            raise UserError(f"--out {out}: its summary {out.with_suffix(SUMMARY_SUFFIX)} is a directory; "
                            "give another file name")
        _check_out_spares_models(out, args.model)
        check_writable_dir(out.parent, f"--out {out}")  # (also refuses a file where a folder should be)
        out.parent.mkdir(parents=True, exist_ok=True)

    from scratchlm.align.datasets import load_examples
    from scratchlm.align.evaluate import evaluate_policy, format_summary, write_jsonl
    from scratchlm.align.policy import load_policy
    from scratchlm.align.prompts import get_template
    from scratchlm.align.reward_registry import select_reward
    from scratchlm.device import resolve_device
    from scratchlm.fileio import write_text_atomic

    template = get_template(args.template)
    reward_fn = select_reward(args.reward, template=args.template, dataset=args.dataset)
    examples = load_examples(args.dataset, args.split, data_dir=args.data_dir, limit=args.limit, seed=args.seed)
    if not examples:
        raise UserError(f"{args.dataset}/{args.split} has no examples")
    policy = load_policy(args.model, resolve_device(args.device))
    examples, skipped = _examples_with_room(policy, examples, template, skip=args.skip_long)
    records, summary = evaluate_policy(policy, examples, template=template, reward_fn=reward_fn,
                                       max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                       temperature=args.temperature, seed=args.seed, progress=True)
    if args.skip_long:
        summary["skipped_too_long"] = skipped
        print(f"skipped {skipped} problem(s) whose prompt leaves no room in the context of "
              f"{policy.context_length} tokens")
    print(format_summary(summary, title=f"{args.dataset}/{args.split} ({args.template})"))
    if args.out:
        write_jsonl(records, args.out)
        summary_path = Path(args.out).with_suffix(SUMMARY_SUFFIX)
        write_text_atomic(summary_path, json.dumps({"model": str(args.model), "dataset": args.dataset,
                                                    "split": args.split, "template": args.template,
                                                    "reward": args.reward or "(template's own)", **summary},
                                                   indent=2) + "\n")
    return 0
