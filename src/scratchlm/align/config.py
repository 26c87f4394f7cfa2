"""Typed configs of the post-training commands (sections of configs/align-*.toml).

Each loop receives only the sections it uses; the root dataclasses (`SFTRunConfig`,
`ExpertIterationRunConfig`, `GRPORunConfig`) compose them for the commands, on the sections
all of them share (`AlignRunConfig`). `DPORunConfig` trains on fixed preference pairs and
samples nothing, so it has its own data section and no sampling one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from scratchlm.config import changed_fields, settings_text


def _check_finite(section: str, config: object) -> None:
    """ValueError naming the first float field of `config` that is infinite (an infinite rate
    or epoch count trains to NaN or never ends; NaN is refused when the config is read)."""
    for f in fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{section}.{f.name} must be a finite number, got {value}")


def _check_at_least(section: str, minimum: int, **values: int) -> None:
    """ValueError naming the first of `values` below `minimum` (e.g. a negative limit)."""
    for name, value in values.items():
        if value < minimum:
            raise ValueError(f"{section}.{name} must be >= {minimum}, got {value}")


def _pack_length_note(sft: "SFTConfig") -> list[str]:
    if changed_fields(sft, ("pack_length",)) and not sft.packed:
        return [f"{settings_text('sft', sft, ['pack_length'])} no effect (sft.packed=false: the pairs are padded, "
                "not packed)"]
    return []


def _check_positive(section: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{section}.{name} must be positive, got {value}")


@dataclass
class PolicyConfig:
    """Which model to start from."""

    path: str = ""  # scratchlm run/step directory or checkpoint file, or a local HF model directory
    device: str = "auto"  # "auto" (cuda, else mps, else cpu), "cpu", "cuda", "cuda:1", ...


@dataclass
class DataConfig:
    """Training questions, prompt format, and the held-out set used for evaluation."""

    dataset: str = "gsm8k"  # gsm8k, math, math500, arith[:difficulty], or a .jsonl path
    split: str = "train"
    data_dir: str = ""  # folder holding gsm8k/ and math/ ("" = shared/data beside the repository)
    limit: int = 0  # use only the first N training examples (0 = all)
    template: str = "r1_zero"  # prompt format: r1_zero or question_only
    reward: str = ""  # a name in reward_registry.REWARDS; "" = the template's own (arithmetic for arith with r1_zero)
    eval_dataset: str = ""  # "" = same as dataset
    eval_split: str = "test"
    eval_limit: int = 200  # held-out examples per evaluation (0 = all)

    def __post_init__(self) -> None:
        from scratchlm.align.reward_registry import REWARDS

        if self.reward and self.reward not in REWARDS:
            raise ValueError(f"data.reward must be one of {', '.join(sorted(REWARDS))} (or \"\" for the "
                             f"template's own), got {self.reward!r}")
        _check_at_least("data", 0, limit=self.limit, eval_limit=self.eval_limit)


@dataclass
class OptimConfig:
    """AdamW, cosine schedule with warm-up, global-norm clipping."""

    lr: float = 1e-5
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 0  # updates over which the rate rises linearly to lr (shorter than the run)
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8  # AdamW's denominator epsilon (> 0)
    max_grad_norm: float = 1.0  # 0 disables clipping

    def __post_init__(self) -> None:
        _check_finite("optim", self)
        for name in ("lr", "weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise ValueError(f"optim.{name} must be >= 0, got {getattr(self, name)}")
        # AdamW's m / (sqrt(v) + eps) is 0 / 0 for a weight whose gradients were all 0 (the
        # embedding of a token no batch holds): NaN weights, saved as the trained policy.
        _check_positive("optim", eps=self.eps)
        _check_at_least("optim", 0, warmup_steps=self.warmup_steps)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optim.beta1 and optim.beta2 must be in [0, 1), got {self.beta1} and {self.beta2}")


@dataclass
class SFTConfig:
    """Supervised fine-tuning on prompt/response pairs (response tokens only)."""

    micro_batch_size: int = 4  # sequences per forward/backward
    grad_accum_steps: int = 8  # microbatches per optimizer step
    num_epochs: float = 1.0  # passes over the training pairs (fractions allowed)
    max_steps: int = 0  # stop after this many optimizer steps (0 = by epochs)
    normalize_constant: float = 0.0  # 0: mean NLL per response token; >0: sum / constant per sequence
    log_every: int = 10  # optimizer steps between metric lines
    packed: bool = False  # pack the pairs end to end (EOS between them) into full windows, no padding (packed.py)
    # packed: tokens per window input; 0 = the longest pair (prompt, response, EOS) rounded up to a
    # multiple of 64, at most the model's context length (a Hugging Face model's is its largest
    # position, far longer than SFT pairs need)
    pack_length: int = 0
    mask_prompt: bool = True  # packed: no loss on prompt tokens; false trains on every token (plain LM)
    # torch.compile the policy's log-probabilities as grpo.compile does (one graph shared by the
    # blocks); a GRPO run after it in the same process reuses the graphs instead of compiling
    compile: bool = False

    def __post_init__(self) -> None:
        _check_finite("sft", self)
        if not self.packed and not self.mask_prompt:
            raise ValueError("sft.mask_prompt = false needs sft.packed = true (unpacked SFT always masks the prompt)")
        if self.pack_length < 0:
            raise ValueError(f"sft.pack_length must be >= 0, got {self.pack_length}")
        _check_at_least("sft", 1, micro_batch_size=self.micro_batch_size, grad_accum_steps=self.grad_accum_steps,
                        log_every=self.log_every)
        _check_at_least("sft", 0, max_steps=self.max_steps)
        _check_positive("sft", num_epochs=self.num_epochs)
        if self.normalize_constant < 0:
            raise ValueError(f"sft.normalize_constant must be >= 0, got {self.normalize_constant}")


@dataclass
class SamplingConfig:
    """Decoding of rollouts and evaluations."""

    temperature: float = 1.0  # rollouts (> 0 when a group has several responses); evaluation is greedy
    top_p: float = 1.0
    max_new_tokens: int = 512
    batch_size: int = 64  # prompts per generator call
    eval_max_new_tokens: int = 512

    def __post_init__(self) -> None:
        _check_finite("sampling", self)
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        _check_at_least("sampling", 1, batch_size=self.batch_size)
        _check_at_least("sampling", 0, max_new_tokens=self.max_new_tokens,
                        eval_max_new_tokens=self.eval_max_new_tokens)


@dataclass
class ExpertIterationConfig:
    """Sample G responses per question, keep the rewarded ones, SFT on them, repeat."""

    n_ei_steps: int = 5
    questions_per_step: int = 512  # questions sampled per EI step
    group_size: int = 4  # responses per question (G)
    sft_epochs: float = 1.0  # SFT epochs over each step's kept responses

    def __post_init__(self) -> None:
        _check_finite("ei", self)
        _check_at_least("ei", 0, n_ei_steps=self.n_ei_steps)
        _check_at_least("ei", 1, questions_per_step=self.questions_per_step, group_size=self.group_size)
        _check_positive("ei", sft_epochs=self.sft_epochs)


@dataclass
class GRPOConfig:
    """Group-relative policy optimisation (see grpo.py)."""

    n_grpo_steps: int = 200
    rollout_batch_size: int = 256  # responses per rollout batch (questions x group_size)
    group_size: int = 8
    train_batch_size: int = 256  # responses per optimizer step (a divisor of rollout_batch_size)
    grad_accum_steps: int = 128  # microbatches per optimizer step
    epochs_per_rollout_batch: int = 1  # > 1 reuses rollouts off-policy (use grpo_clip)
    loss_type: str = "reinforce_with_baseline"  # no_baseline, reinforce_with_baseline, grpo_clip
    advantage_eps: float = 1e-6
    normalize_by_std: bool = True  # divide advantages by the group's std (False: Dr. GRPO)
    length_normalization: str = "mean"  # "mean" per response, or "constant" (sum / normalize_constant)
    normalize_constant: float = 0.0  # for "constant" (0 = sampling.max_new_tokens)
    cliprange: float = 0.2  # grpo_clip epsilon
    eval_every: int = 10  # GRPO steps between evaluations (0 = only at the start and the end)
    max_seconds: float = 0.0  # stop after the step that passes this much wall time (0 = no limit)
    # torch.compile the policy's log-probabilities (model forward, log-softmax, entropy) for the
    # updates, with dynamic shapes (rollout lengths vary), one graph shared by the blocks of a
    # scratchlm policy: fewer kernels a microbatch, no (B, T, V) float32 log-softmax held for
    # the backward; compilation costs time once
    compile: bool = False

    def __post_init__(self) -> None:
        _check_finite("grpo", self)
        if self.loss_type not in ("no_baseline", "reinforce_with_baseline", "grpo_clip"):
            raise ValueError(f"grpo.loss_type must be no_baseline, reinforce_with_baseline or grpo_clip, "
                             f"got {self.loss_type!r}")
        if self.length_normalization not in ("mean", "constant"):
            raise ValueError(f"grpo.length_normalization must be 'mean' or 'constant', got {self.length_normalization!r}")
        _check_at_least("grpo", 0, n_grpo_steps=self.n_grpo_steps, eval_every=self.eval_every)
        _check_at_least("grpo", 1, rollout_batch_size=self.rollout_batch_size, group_size=self.group_size,
                        train_batch_size=self.train_batch_size, grad_accum_steps=self.grad_accum_steps,
                        epochs_per_rollout_batch=self.epochs_per_rollout_batch)
        if self.group_size == 1 and self.loss_type != "no_baseline":
            # The group's mean is its one reward: every advantage is 0 (NaN when divided by the std).
            raise ValueError(f"grpo.group_size must be >= 2 for grpo.loss_type = {self.loss_type!r}, which "
                             "compares the responses of a group; use group_size >= 2 or loss_type = no_baseline")
        for name in ("advantage_eps", "normalize_constant", "cliprange", "max_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"grpo.{name} must be >= 0, got {getattr(self, name)}")
        if self.normalize_by_std and self.advantage_eps == 0 and self.loss_type != "no_baseline":
            # A group whose rewards are all equal has std 0: its advantages were 0 / 0, NaN loss and weights.
            raise ValueError("grpo.advantage_eps must be > 0 with grpo.normalize_by_std = true (a group of equal "
                             "rewards divides 0 by its std of 0), got 0")
        if self.rollout_batch_size % self.group_size:
            raise ValueError("grpo.rollout_batch_size must be a multiple of grpo.group_size")
        if self.rollout_batch_size % self.train_batch_size:
            raise ValueError("grpo.train_batch_size must divide grpo.rollout_batch_size")
        if self.train_batch_size % self.grad_accum_steps:
            raise ValueError("grpo.grad_accum_steps must divide grpo.train_batch_size")


@dataclass
class PreferenceDataConfig:
    """Preference pairs for DPO (see preferences.py): JSONL rows {prompt, chosen, rejected}."""

    train_path: str = ""  # a .jsonl file of pairs, or arith[:D] for synthetic arithmetic pairs
    eval_path: str = ""  # held-out pairs ("" = hold out eval_fraction of the training pairs)
    eval_fraction: float = 0.1  # share of the training pairs held out when eval_path is "" (0 = none)
    limit: int = 0  # use only the first N training pairs (0 = all; arith generates 1000)
    eval_limit: int = 200  # held-out pairs per evaluation (0 = all)
    template: str = "r1_zero"  # prompt format of the arith pairs (JSONL prompts are used verbatim)

    def __post_init__(self) -> None:
        _check_finite("data", self)
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        _check_at_least("data", 0, limit=self.limit, eval_limit=self.eval_limit)


@dataclass
class DPOConfig:
    """Direct preference optimisation against a frozen copy of the starting policy (see dpo.py)."""

    beta: float = 0.1  # how strongly the policy is tied to the reference (the implicit reward's scale)
    micro_batch_size: int = 4  # preference pairs per forward/backward (twice as many rows)
    grad_accum_steps: int = 8  # microbatches per optimizer step
    num_epochs: float = 1.0  # passes over the training pairs (fractions allowed)
    max_steps: int = 0  # stop after this many optimizer steps (0 = by epochs)
    eval_every: int = 20  # optimizer steps between held-out evaluations (0 = only at the start and the end)
    save_every: int = 0  # optimizer steps between saves of the policy (0 = only the final one)
    log_every: int = 10  # optimizer steps between metric lines

    def __post_init__(self) -> None:
        _check_finite("dpo", self)
        if self.beta <= 0:
            raise ValueError(f"dpo.beta must be positive, got {self.beta}")
        if self.micro_batch_size < 1 or self.grad_accum_steps < 1:
            raise ValueError("dpo.micro_batch_size and dpo.grad_accum_steps must be positive")
        _check_at_least("dpo", 0, max_steps=self.max_steps, eval_every=self.eval_every, save_every=self.save_every)
        _check_at_least("dpo", 1, log_every=self.log_every)
        _check_positive("dpo", num_epochs=self.num_epochs)


@dataclass
class RunConfig:
    """Where results go and how the run is seeded."""

    out_dir: str = "runs/align"  # metrics.jsonl, eval JSONL files and the final policy
    seed: int = 0
    progress: bool = True  # tqdm bars
    # Steps (those of the metrics rows: optimizer steps of sft and dpo, grpo and expert-iteration
    # steps) between saves of the policy and the training state that --resume continues from, as a
    # Ctrl-C saves them, so that a run killed outright (SIGKILL, the OOM killer, a preempted
    # machine) loses at most that many steps; 0 = only on a signal. Off here: a save writes the
    # policy and the optimizer state (three times the weights in float32), and a step costs a
    # second of SFT or minutes of GRPO, so no one interval suits every command; the presets
    # (configs/align-*.toml, dpo.toml) set one fitted to theirs.
    resume_every: int = 0

    def __post_init__(self) -> None:
        _check_at_least("run", 0, resume_every=self.resume_every)
        if not self.out_dir.strip():  # (an unset variable) wrote config.toml, metrics.jsonl into the working directory
            raise ValueError(f"run.out_dir must name a folder (\".\" for the working directory), got {self.out_dir!r}")
        if not 0 <= self.seed < 2**32:  # numpy's range, as the other commands' seeds
            raise ValueError(f"run.seed must be in [0, 2**32), got {self.seed}")


def _check_rollouts(sampling: SamplingConfig, group_size: int, section: str) -> None:
    """Rollouts of no tokens earn no reward and give no gradient: the run would change nothing.
    Greedy rollouts (temperature 0) make the `group_size` responses to a question one and the
    same: GRPO's advantages are all 0, expert iteration keeps one of each group."""
    if sampling.max_new_tokens < 1:
        raise ValueError(f"sampling.max_new_tokens must be >= 1 for rollouts, got {sampling.max_new_tokens}")
    if sampling.temperature == 0 and group_size > 1:
        raise ValueError(f"sampling.temperature must be > 0 for rollouts of {section}.group_size={group_size} "
                         "responses to a question (0 is greedy: every response of a group would be the same)")


@dataclass
class AlignRunConfig:
    """The sections every post-training command reads; each command's root config adds its own."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    run: RunConfig = field(default_factory=RunConfig)


@dataclass
class SFTRunConfig(AlignRunConfig):
    """`scratchlm sft`."""

    sft: SFTConfig = field(default_factory=SFTConfig)

    def ignored_options(self) -> list[str]:
        """One line for each group of options set away from their defaults that `scratchlm sft`
        never reads, for the command to print instead of ignoring them silently."""
        rollouts = changed_fields(self.sampling, ("temperature", "top_p", "max_new_tokens"))
        notes = [f"{settings_text('sampling', self.sampling, rollouts)} no effect (scratchlm sft draws no rollouts; "
                 "its evaluations decode greedily up to sampling.eval_max_new_tokens)"] if rollouts else []
        return notes + _pack_length_note(self.sft)


@dataclass
class ExpertIterationRunConfig(SFTRunConfig):
    """`scratchlm expert-iteration`: SFT rounds on the policy's own correct samples."""

    ei: ExpertIterationConfig = field(default_factory=ExpertIterationConfig)

    def __post_init__(self) -> None:
        _check_rollouts(self.sampling, self.ei.group_size, "ei")

    def ignored_options(self) -> list[str]:
        """As `SFTRunConfig.ignored_options`, for `scratchlm expert-iteration`: the SFT of each step
        runs ei.sft_epochs epochs over that step's kept responses."""
        length = changed_fields(self.sft, ("num_epochs", "max_steps"))
        notes = [f"{settings_text('sft', self.sft, length)} no effect (each expert-iteration step fine-tunes for "
                 "ei.sft_epochs epochs over its kept responses)"] if length else []
        return notes + _pack_length_note(self.sft)


@dataclass
class GRPORunConfig(AlignRunConfig):
    """`scratchlm grpo`."""

    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    def __post_init__(self) -> None:
        _check_rollouts(self.sampling, self.grpo.group_size, "grpo")

    def ignored_options(self) -> list[str]:
        """One line for each group of grpo options set away from their defaults that the chosen
        loss never reads, for the command to print instead of ignoring them silently."""
        grpo, notes = self.grpo, []
        loss = f"grpo.loss_type=\"{grpo.loss_type}\""
        if grpo.loss_type == "no_baseline":
            advantage = changed_fields(grpo, ("advantage_eps", "normalize_by_std"))
            if advantage:
                notes.append(f"{settings_text('grpo', grpo, advantage)} no effect ({loss} trains on the raw rewards, "
                             "not on advantages)")
        elif changed_fields(grpo, ("advantage_eps",)) and not grpo.normalize_by_std:
            notes.append(f"{settings_text('grpo', grpo, ['advantage_eps'])} no effect (grpo.normalize_by_std=false: "
                         "advantages are not divided by the group's std)")
        if changed_fields(grpo, ("cliprange",)) and grpo.loss_type != "grpo_clip":
            notes.append(f"{settings_text('grpo', grpo, ['cliprange'])} no effect (it clips grpo_clip's ratio; "
                         f"this run's is {loss})")
        if changed_fields(grpo, ("normalize_constant",)) and grpo.length_normalization != "constant":
            notes.append(f"{settings_text('grpo', grpo, ['normalize_constant'])} no effect "
                         f"(grpo.length_normalization=\"{grpo.length_normalization}\" averages over each response)")
        return notes


@dataclass
class DPORunConfig:
    """`scratchlm dpo`: no sampling, so no math dataset or sampling sections."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def ignored_options(self) -> list[str]:
        """One line for each option set away from its default that `scratchlm dpo` never reads."""
        if self.data.eval_path and changed_fields(self.data, ("eval_fraction",)):
            return [f"{settings_text('data', self.data, ['eval_fraction'])} no effect (data.eval_path is set: the "
                    "held-out pairs come from it, none from data.train_path)"]
        return []
