"""Post-training end to end on the synthetic arithmetic task: SFT -> expert iteration / GRPO.

    python benchmarks/post_training.py --scale tiny            # CPU, a few minutes
    python benchmarks/post_training.py --scale small           # CPU, difficulty 2, ~10 minutes
    python benchmarks/post_training.py --scale full --device cuda \
        --json docs/benchmarks/post_training.json --plot docs/benchmarks/post_training.png
    python benchmarks/post_training.py --scale full --set grpo.max_seconds=120 sampling.temperature=1.2
    python benchmarks/post_training.py --replot results.json --plot curves.png

1. Data: multi-step arithmetic problems (scratchlm.align.task) at the scale's difficulty; a
   small set with worked solutions for SFT, a larger set of questions only for EI/GRPO, and a
   disjoint held-out set for evaluation.
2. Base policy: a BPE tokenizer trained on the SFT text and a Transformer trained from random
   initialisation by SFT on the limited worked solutions (r1_zero format, response tokens only).
3. Expert iteration and GRPO, each starting from a copy of that SFT policy; held-out accuracy
   (greedy) before, during and after.
4. Rollout throughput: the project's batched KV-cache generator against Hugging Face
   `LlamaForCausalLM.generate` on the same weights (the SFT model exported with
   scratchlm.model.hf.export_hf), same prompts, same number of new tokens, and whether their
   greedy outputs agree.

Prints a table and writes everything (settings, per-step metrics, figures) as JSON; --plot
draws held-out accuracy, rollout reward, token entropy and response length against the step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from scratchlm.align.config import ExpertIterationConfig, GRPOConfig, OptimConfig, SamplingConfig, SFTConfig
from scratchlm.align.evaluate import evaluate_policy
from scratchlm.align.expert_iteration import expert_iteration
from scratchlm.align.grpo import grpo_train
from scratchlm.align.policy import ScratchPolicy, autocast_context
from scratchlm.align.prompts import get_template
from scratchlm.align.sft import sft_train
from scratchlm.align.task import ArithmeticTask, arithmetic_reward
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import build_model


@dataclass
class Scale:
    """Sizes of one benchmark run."""

    difficulty: int
    max_operand: int
    max_value: int
    n_sft: int  # worked solutions for SFT (the "limited" supervision)
    n_rl: int  # questions (no solutions) for EI / GRPO
    n_eval: int  # held-out questions
    vocab_size: int
    model: dict
    sft: SFTConfig
    sft_optim: OptimConfig
    ei: ExpertIterationConfig
    ei_sft: SFTConfig
    ei_optim: OptimConfig
    grpo: GRPOConfig
    grpo_optim: OptimConfig
    sampling: SamplingConfig
    throughput_batch: int
    throughput_tokens: int
    threads: int = 0  # torch threads on CPU (0 = leave as is)
    notes: list[str] = field(default_factory=list)


SCALES = {
    "tiny": Scale(
        difficulty=1, max_operand=9, max_value=99, n_sft=150, n_rl=200, n_eval=80, vocab_size=700,
        model=dict(context_length=160, d_model=96, num_layers=2, num_heads=4, d_ff=256),
        sft=SFTConfig(micro_batch_size=16, grad_accum_steps=1, max_steps=300, log_every=50),
        sft_optim=OptimConfig(lr=3e-3, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.0),
        ei=ExpertIterationConfig(n_ei_steps=2, questions_per_step=48, group_size=4, sft_epochs=1.0),
        ei_sft=SFTConfig(micro_batch_size=16, grad_accum_steps=1),
        ei_optim=OptimConfig(lr=5e-4, min_lr_ratio=1.0),
        grpo=GRPOConfig(n_grpo_steps=12, rollout_batch_size=64, group_size=8, train_batch_size=64,
                        grad_accum_steps=4, eval_every=4),
        grpo_optim=OptimConfig(lr=5e-4, min_lr_ratio=1.0),
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=24, batch_size=64, eval_max_new_tokens=24),
        throughput_batch=32, throughput_tokens=32, threads=1,
    ),
    "small": Scale(
        difficulty=2, max_operand=9, max_value=30, n_sft=500, n_rl=4000, n_eval=200, vocab_size=800,
        model=dict(context_length=160, d_model=128, num_layers=3, num_heads=4, d_ff=384),
        sft=SFTConfig(micro_batch_size=16, grad_accum_steps=1, max_steps=250, log_every=50),
        sft_optim=OptimConfig(lr=2e-3, warmup_steps=15, min_lr_ratio=0.1, weight_decay=0.0),
        ei=ExpertIterationConfig(n_ei_steps=2, questions_per_step=96, group_size=4, sft_epochs=1.0),
        ei_sft=SFTConfig(micro_batch_size=16, grad_accum_steps=1),
        ei_optim=OptimConfig(lr=2e-4, min_lr_ratio=1.0),
        grpo=GRPOConfig(n_grpo_steps=30, rollout_batch_size=96, group_size=8, train_batch_size=96,
                        grad_accum_steps=2, eval_every=10),
        grpo_optim=OptimConfig(lr=5e-5, min_lr_ratio=1.0),
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=24, batch_size=96, eval_max_new_tokens=24),
        throughput_batch=32, throughput_tokens=32, threads=1,
    ),
    "full": Scale(
        difficulty=3, max_operand=9, max_value=99, n_sft=1000, n_rl=20000, n_eval=500, vocab_size=2000,
        model=dict(context_length=256, d_model=384, num_layers=6, num_heads=6, d_ff=1024),
        # About 19 epochs over the worked solutions. 120 steps (7.7 epochs) were tried to keep
        # more entropy for GRPO, but the start was much weaker (18.6% held out) and GRPO then
        # found too little reward to learn from (docs/benchmarks/post_training.md, "What did not work").
        sft=SFTConfig(micro_batch_size=64, grad_accum_steps=1, max_steps=300, log_every=20),
        sft_optim=OptimConfig(lr=1e-3, warmup_steps=12, min_lr_ratio=0.1, weight_decay=0.0),
        ei=ExpertIterationConfig(n_ei_steps=4, questions_per_step=512, group_size=4, sft_epochs=1.0),
        ei_sft=SFTConfig(micro_batch_size=64, grad_accum_steps=1),
        ei_optim=OptimConfig(lr=1e-4, min_lr_ratio=1.0),
        # 32 questions x 8 samples per step, one on-policy update per rollout batch at lr 1e-4
        # after a warm-up; as many steps as fit in 370 s of wall time (about 700 on one H200).
        grpo=GRPOConfig(n_grpo_steps=1000, rollout_batch_size=256, group_size=8, train_batch_size=256,
                        grad_accum_steps=2, loss_type="reinforce_with_baseline", eval_every=25,
                        max_seconds=370.0),
        grpo_optim=OptimConfig(lr=1e-4, warmup_steps=20, min_lr_ratio=1.0),
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=48, batch_size=512, eval_max_new_tokens=48),
        throughput_batch=256, throughput_tokens=64,
    ),
}


def apply_override(scale: Scale, assignment: str) -> None:
    """Set one field from ``section.key=value`` (or ``key=value`` for the scale's own fields),
    parsed with the type of the value it replaces; sections are checked once all are set.

    Example: ``grpo.group_size=16``, ``sampling.temperature=1.2``, ``model.num_layers=4``.
    """
    if "=" not in assignment:
        raise SystemExit(f"--set expects section.key=value, got {assignment!r}")
    path, text = assignment.split("=", 1)
    *parents, key = path.split(".")
    target = scale
    for name in parents:
        if not hasattr(target, name):
            raise SystemExit(f"--set: unknown section {name!r} in {path!r}")
        target = getattr(target, name)
    current = target.get(key) if isinstance(target, dict) else getattr(target, key, None)
    if current is None:
        raise SystemExit(f"--set: unknown key {path!r}")
    if isinstance(current, bool):
        value = text.lower() in ("1", "true", "yes")
    else:
        value = type(current)(text)
    if isinstance(target, dict):
        target[key] = value
    else:
        setattr(target, key, value)


def build_tokenizer(texts: list[str], vocab_size: int, work: Path):
    from scratchlm.tokenizer.tokenizer import Tokenizer
    from scratchlm.tokenizer.train import train_bpe

    corpus = work / "corpus.txt"
    corpus.write_text("\n".join(texts), encoding="utf-8")
    vocab, merges = train_bpe(corpus, vocab_size, ["<|endoftext|>"])
    return Tokenizer(vocab, merges, ["<|endoftext|>"])


def throughput(policy: ScratchPolicy, prompts: list[str], new_tokens: int, work: Path, repeats: int = 3) -> dict:
    """Generated tokens/s of scratchlm.infer.generate vs HF generate on the same weights."""
    from transformers import LlamaForCausalLM

    from scratchlm.infer.generate import generate
    from scratchlm.model.hf import export_hf

    export_hf(policy.model, policy.model_config, work / "hf", tokenizer=policy.tokenizer)
    hf = LlamaForCausalLM.from_pretrained(work / "hf").to(policy.device).eval()
    ids = [policy.encode(p) for p in prompts]
    width = max(len(r) for r in ids)
    pad = policy.pad_id
    hf_ids = torch.tensor([[pad] * (width - len(r)) + r for r in ids], device=policy.device)
    hf_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids], device=policy.device)

    def ours():
        with autocast_context(policy.device):
            return generate(policy.model, ids, new_tokens, temperature=0.0, eos_id=None)

    def theirs():
        with torch.inference_mode(), autocast_context(policy.device):
            out = hf.generate(input_ids=hf_ids, attention_mask=hf_mask, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad)
        return out[:, width:].tolist()

    def timed(fn):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            if policy.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            result = fn()
            if policy.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return result, statistics.median(times)

    a, t_ours = timed(ours)
    b, t_hf = timed(theirs)
    tokens = len(prompts) * new_tokens
    agree = sum(x == y for x, y in zip(a, b)) / len(a)
    return {"batch": len(prompts), "new_tokens": new_tokens, "prompt_tokens_max": width,
            "scratchlm_tokens_per_s": tokens / t_ours, "hf_tokens_per_s": tokens / t_hf,
            "ratio_scratchlm_over_hf": t_hf / t_ours, "greedy_rows_identical": agree}


def gsm8k_eval(policies: dict, limit: int, batch_size: int, new_tokens: int = 128) -> dict:
    """Each policy graded on the first ``limit`` GSM8K test problems as ``scratchlm eval-math``
    grades them (r1_zero prompt, greedy), on those whose prompt leaves ``new_tokens`` of room in
    the model's context; how many fit is part of the result (a model whose tokenizer never saw
    prose spends many tokens on a word problem)."""
    from scratchlm.align.datasets import load_examples
    from scratchlm.align.prompts import get_template
    from scratchlm.align.rewards import get_reward_fn

    template = get_template("r1_zero")
    examples = load_examples("gsm8k", "test", limit=limit)
    out = {}
    for name, pol in policies.items():
        lengths = [len(pol.encode(template.format(e.question))) for e in examples]
        fit = [e for e, n in zip(examples, lengths) if n + new_tokens <= pol.context_length]
        summary = {"problems": len(examples), "fit_in_context": len(fit),
                   "prompt_tokens_median": sorted(lengths)[len(lengths) // 2]}
        if fit:
            _, graded = evaluate_policy(pol, fit, template=template, reward_fn=get_reward_fn("r1_zero"),
                                        max_new_tokens=new_tokens, batch_size=batch_size)
            summary.update(graded)
        out[name] = summary
        print(f"GSM8K test, first {limit}, {name}: {len(fit)} prompts fit the context "
              f"(median prompt {summary['prompt_tokens_median']} tokens, context {pol.context_length}); "
              f"accuracy {100 * summary.get('accuracy', 0.0):.1f}%, format {100 * summary.get('format_rate', 0.0):.1f}%"
              + ("" if fit else " (nothing graded)"), flush=True)
    return out


def plot_curves(results: dict, path: Path) -> None:
    """Reward, held-out accuracy, token entropy and response length against the step, one PNG.

    GRPO's training curves are per step (a moving average of 10 drawn over the raw values);
    expert iteration's are per EI step, on its own top axis scale so both fit one panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(values: list[float], n: int = 10) -> list[float]:
        return [sum(values[max(0, i - n + 1):i + 1]) / len(values[max(0, i - n + 1):i + 1]) for i in range(len(values))]

    grpo = [h for h in results.get("grpo", {}).get("history", []) if h.get("step", 0) > 0]
    ei = [h for h in results.get("ei", {}).get("history", []) if h.get("step", 0) > 0]
    grpo_evals = [h for h in results.get("grpo", {}).get("history", []) if "eval_accuracy" in h]
    ei_evals = [h for h in results.get("ei", {}).get("history", []) if "eval_accuracy" in h]
    # EI's token entropy is that of its SFT on kept responses, not of its rollouts: not drawn.
    panels = [
        ("rollout reward (training questions)", "reward_mean", "rollout_reward"),
        ("token entropy of rollouts (nats per response token)", "token_entropy", None),
        ("response length (generated tokens)", "response_tokens_mean", "response_tokens_mean"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    if grpo_evals:
        ax.plot([h["step"] for h in grpo_evals], [100 * h["eval_accuracy"] for h in grpo_evals], "o-",
                label=f"GRPO ({results['settings']['grpo']['loss_type']})")
        ax.plot([h["step"] for h in grpo_evals], [100 * h["eval_format_rate"] for h in grpo_evals], ":",
                color="C0", alpha=0.6, label="GRPO format rate")
    ax.axhline(100 * results["sft"]["eval"]["accuracy"], color="gray", ls="--", label="SFT start")
    ax.set_title("held-out accuracy, greedy (%)")
    ax.set_xlabel("GRPO step")
    if ei_evals:
        top = ax.twiny()
        top.plot([h["step"] for h in ei_evals], [100 * h["eval_accuracy"] for h in ei_evals], "s-", color="C1",
                 label="expert iteration")
        top.set_xlabel("EI step", color="C1")
        top.xaxis.get_major_locator().set_params(integer=True)
        top.legend(loc="lower right")
    ax.set_ylim(0, 105)
    ax.legend(loc="center right")
    for ax, (title, key, ei_key) in zip([axes[0][1], axes[1][0], axes[1][1]], panels):
        if grpo:
            steps = [h["step"] for h in grpo]
            values = [h[key] for h in grpo]
            ax.plot(steps, values, color="C0", alpha=0.3)
            ax.plot(steps, smooth(values), color="C0", label="GRPO")
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        if ei and ei_key:
            top = ax.twiny()
            top.plot([h["step"] for h in ei], [h[ei_key] for h in ei], "s-", color="C1", label="expert iteration")
            top.set_xlabel("EI step", color="C1")
            top.xaxis.get_major_locator().set_params(integer=True)
            top.legend(loc="lower right")
        ax.legend(loc="upper left")
    fig.suptitle(f"post-training, {results['scale']} scale on {results['machine']['gpu'] or 'CPU'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PHASES = ("rollout_s", "score_s", "batch_s", "update_s", "eval_s")


def phase_seconds(history: list[dict]) -> dict[str, float]:
    """Mean wall seconds a GRPO step spent in each phase (evaluations spread over all steps)."""
    steps = [h for h in history if h.get("step", 0) > 0]
    return {k: sum(h.get(k, 0.0) for h in steps) / max(len(steps), 1) for k in PHASES}


@contextlib.contextmanager
def grpo_profiler(path: str | None, first: int = 21, count: int = 5):
    """Yields a per-step callback; with a path, GRPO steps first .. first + count - 1 run under
    torch.profiler (CPU and CUDA) and the table of their time by op and phase goes to path
    (nothing is written when the run stops before them)."""
    if path is None:
        yield lambda row: None
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = torch.cuda.is_available()

    def write(prof) -> None:
        sorts = ("cpu_time_total", "cuda_time_total") if cuda else ("cpu_time_total",)
        tables = [prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=80) for key in sorts]
        Path(path).write_text(f"GRPO steps {first}-{first + count - 1}\n\n" + "\n\n".join(tables), encoding="utf-8")
        print(tables[0][:6000], flush=True)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, on_trace_ready=write,
                 schedule=schedule(wait=first - 2, warmup=1, active=count, repeat=1)) as prof:
        def on_step(row: dict) -> None:
            if row.get("phase") == "grpo" and row.get("step", 0) > 0:
                prof.step()
        yield on_step


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--plot", default=None, help="write the training curves here (PNG)")
    parser.add_argument("--replot", default=None, metavar="JSON",
                        help="only draw --plot from the results of an earlier run, then exit")
    parser.add_argument("--skip", nargs="*", default=[], choices=["ei", "grpo", "throughput"])
    parser.add_argument("--save-policies", metavar="DIR", default=None,
                        help="save the SFT, EI and GRPO policies under DIR/{sft,ei,grpo} (scratchlm eval-math loads them)")
    parser.add_argument("--gsm8k", type=int, default=0, metavar="N",
                        help="also grade each policy on the first N GSM8K test problems (r1_zero prompt)")
    parser.add_argument("--difficulty", type=int, help="override the scale's task difficulty")
    parser.add_argument("--n-sft", type=int, help="override the number of worked solutions")
    parser.add_argument("--sft-steps", type=int, help="override the SFT optimizer steps")
    parser.add_argument("--grpo-steps", type=int, help="override the GRPO steps")
    parser.add_argument("--grpo-loss", choices=["no_baseline", "reinforce_with_baseline", "grpo_clip"])
    parser.add_argument("--grpo-lr", type=float, help="override the GRPO learning rate")
    parser.add_argument("--profile-grpo", metavar="PATH", default=None,
                        help="profile GRPO steps 21-25 (CPU and CUDA) and write the table of where they spend time here")
    parser.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any scale setting, e.g. grpo.group_size=16 sampling.temperature=1.2")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replot:
        plot_curves(json.loads(Path(args.replot).read_text(encoding="utf-8")), Path(args.plot or "curves.png"))
        return 0
    scale = copy.deepcopy(SCALES[args.scale])
    if args.difficulty:
        scale.difficulty = args.difficulty
    if args.n_sft:
        scale.n_sft = args.n_sft
    if args.sft_steps:
        scale.sft.max_steps = args.sft_steps
    if args.grpo_steps:
        scale.grpo.n_grpo_steps = args.grpo_steps
    if args.grpo_lr:
        scale.grpo_optim.lr = args.grpo_lr
    if args.grpo_loss:
        scale.grpo.loss_type = args.grpo_loss
    for assignment in args.set:
        apply_override(scale, assignment)
    for section in vars(scale).values():  # check the overridden sections as a whole
        if hasattr(section, "__post_init__"):
            section.__post_init__()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cpu" and scale.threads:
        torch.set_num_threads(scale.threads)  # tiny models: one thread beats a contended pool
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    results: dict = {"scale": args.scale, "device": str(device), "settings": asdict(scale),
                     "machine": {"python": platform.python_version(), "torch": torch.__version__,
                                 "cpu_threads": torch.get_num_threads(),
                                 "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}}

    template = get_template("r1_zero")
    task = ArithmeticTask(difficulty=scale.difficulty, max_operand=scale.max_operand, max_value=scale.max_value)
    train_all = task.examples(scale.n_sft + scale.n_rl, split="train", seed=args.seed)
    sft_examples, rl_examples = train_all[:scale.n_sft], train_all[scale.n_sft:]
    heldout = task.examples(scale.n_eval, split="test", seed=args.seed)
    pairs = [(template.format(e.question), template.response(e.reasoning, e.answer)) for e in sft_examples]

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokenizer = build_tokenizer([p + r for p, r in pairs], scale.vocab_size, work)
        cfg = ModelConfig(vocab_size=tokenizer.vocab_size, **scale.model)
        policy = ScratchPolicy(build_model(cfg, device=device), tokenizer, cfg)
        params = sum(p.numel() for p in policy.model.parameters())
        results["model"] = {**scale.model, "vocab_size": cfg.vocab_size, "parameters": params}
        print(f"[{args.scale}] {device}, model {params / 1e6:.2f}M params, difficulty {scale.difficulty}, "
              f"{len(pairs)} worked solutions, {len(rl_examples)} RL questions, {len(heldout)} held out", flush=True)

        def evaluator(pol):
            def evaluate(step):
                _, s = evaluate_policy(pol, heldout, template=template, reward_fn=arithmetic_reward,
                                       max_new_tokens=scale.sampling.eval_max_new_tokens,
                                       batch_size=scale.sampling.batch_size, seed=args.seed)
                return {k: s[k] for k in ("accuracy", "format_rate", "mean_response_tokens", "tokens_per_s")}
            return evaluate

        def log(row):
            keep = ("phase", "step", "loss", "rollout_reward", "reward_mean", "eval_accuracy", "eval_format_rate",
                    "kept", "token_entropy", "clip_fraction", "zero_std_groups", "response_tokens_mean",
                    "retokenized_fraction", "rollout_tokens_per_s", "rollout_s", "update_s")
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if k in keep}),
                  flush=True)

        t0 = time.perf_counter()
        sft_hist = sft_train(policy, pairs, sft=scale.sft, optim=scale.sft_optim, seed=args.seed, log=log)
        sft_eval = evaluator(policy)(0)
        results["sft"] = {"seconds": time.perf_counter() - t0, "final_loss": sft_hist[-1]["loss"],
                          "final_token_entropy": sft_hist[-1]["token_entropy"], "eval": sft_eval,
                          "history": sft_hist}
        print(f"SFT: held-out accuracy {100 * sft_eval['accuracy']:.1f}% (format {100 * sft_eval['format_rate']:.1f}%)",
              flush=True)
        sft_state = copy.deepcopy(policy.model.state_dict())
        finals = {"sft": policy}

        def fresh_policy():
            model = build_model(cfg, device=device)
            model.load_state_dict(sft_state)
            return ScratchPolicy(model, tokenizer, cfg)

        if "ei" not in args.skip:
            pol = fresh_policy()
            t0 = time.perf_counter()
            hist = expert_iteration(pol, rl_examples, template=template, reward_fn=arithmetic_reward, ei=scale.ei,
                                    sft=scale.ei_sft, optim=scale.ei_optim, sampling=scale.sampling,
                                    evaluate=evaluator(pol), seed=args.seed, log=log)
            finals["ei"] = pol
            results["ei"] = {"seconds": time.perf_counter() - t0, "history": hist,
                             "final_accuracy": hist[-1]["eval_accuracy"]}
        if "grpo" not in args.skip:
            pol = fresh_policy()
            t0 = time.perf_counter()
            with grpo_profiler(args.profile_grpo) as on_step:
                hist = grpo_train(pol, rl_examples, template=template, reward_fn=arithmetic_reward, grpo=scale.grpo,
                                  optim=scale.grpo_optim, sampling=scale.sampling, evaluate=evaluator(pol),
                                  seed=args.seed, log=lambda row: (log(row), on_step(row)))
            finals["grpo"] = pol
            evals = [h for h in hist if "eval_accuracy" in h]
            results["grpo"] = {"seconds": time.perf_counter() - t0, "history": hist, "steps": hist[-1]["step"],
                               "final_accuracy": evals[-1]["eval_accuracy"],
                               "best_accuracy": max(h["eval_accuracy"] for h in evals),
                               "phase_seconds_per_step": phase_seconds(hist)}
            print("GRPO seconds a step by phase:", json.dumps(results["grpo"]["phase_seconds_per_step"]), flush=True)
        if args.save_policies:
            for name, pol in finals.items():
                pol.save(Path(args.save_policies) / name)
        if args.gsm8k > 0:
            results["gsm8k"] = gsm8k_eval(finals, args.gsm8k, scale.sampling.batch_size)
        if "throughput" not in args.skip:
            prompts = [template.format(e.question) for e in heldout[:scale.throughput_batch]]
            prompts = (prompts * (scale.throughput_batch // max(len(prompts), 1) + 1))[:scale.throughput_batch]
            results["throughput"] = throughput(policy, prompts, scale.throughput_tokens, work)

    results["seconds"] = time.perf_counter() - started
    print()
    print(f"{'stage':<52}{'held-out accuracy':>18}{'format':>10}{'seconds':>10}")
    print(f"{'SFT (start)':<52}{100 * sft_eval['accuracy']:>17.1f}%{100 * sft_eval['format_rate']:>9.1f}%"
          f"{results['sft']['seconds']:>10.1f}")
    for name in ("ei", "grpo"):
        if name in results:
            last = [h for h in results[name]["history"] if "eval_accuracy" in h][-1]
            label = {"ei": f"expert iteration, {last['step']} steps",
                     "grpo": f"GRPO ({scale.grpo.loss_type}), {last['step']} steps"}[name]
            delta = 100 * (last["eval_accuracy"] - sft_eval["accuracy"])
            print(f"{label + f' ({delta:+.1f} pts)':<52}{100 * last['eval_accuracy']:>17.1f}%"
                  f"{100 * last['eval_format_rate']:>9.1f}%{results[name]['seconds']:>10.1f}")
    if "throughput" in results:
        t = results["throughput"]
        print(f"\nrollout throughput, batch {t['batch']} x {t['new_tokens']} new tokens (greedy, same weights):")
        print(f"  scratchlm generate   {t['scratchlm_tokens_per_s']:>10.1f} tokens/s")
        print(f"  HF generate          {t['hf_tokens_per_s']:>10.1f} tokens/s")
        print(f"  ratio                {t['ratio_scratchlm_over_hf']:>10.2f}x   identical greedy rows: "
              f"{100 * t['greedy_rows_identical']:.0f}%")
    print(f"total {results['seconds']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        try:
            plot_curves(results, Path(args.plot))
        except ImportError as e:  # the results are already written; --replot draws them later
            print(f"no plot ({e}); draw it with --replot {args.json or 'RESULTS.json'} --plot {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
