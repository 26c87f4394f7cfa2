"""Continuing an interrupted post-training run as if it had never stopped (``--resume``).

When `scratchlm sft | expert-iteration | grpo | dpo` stops on Ctrl-C or SIGTERM
(`scratchlm.align.interrupt`), its loop hands over (through its ``on_stop``) what it needs to go
on identically: the optimizer state; the step reached, which fixes the position in the
learning-rate schedule and how far the data order has gone (the loops draw their batches from
seeded generators, which a resumed loop replays that far); its own random generator; the
Python, NumPy, torch and CUDA generator states; the metrics rows of the steps done; and, for a
GRPO step stopped between two of its updates, the rollouts and the update in progress. After
the policy is saved, `ResumePoint.write` puts that state into ``run.out_dir/resume/``::

    RUN/resume/state.pt        command, resolved config, step, digests of the data and the policy
               loop.pt         the loop's state (optimizer state included)
               checksums.json  sha256 of both

The folder is filled under a temporary name and swapped in whole (`fileio.replacing_tree`): a
process killed while writing it leaves the previous state or none, never part of one.

With ``run.resume_every`` the loops also hand their state over every N steps while they run
(their ``on_checkpoint``), so that a run killed outright (SIGKILL, the OOM killer, a preempted
machine) resumes from its last such step. `ResumePoint.save` writes that pair, the policy and
its state, the way a signal does, and keeps a pair on disk that belongs together all along: the
state before is moved to ``resume.previous/`` while the new one is written, then the policy is
swapped in whole, then the old state goes. A process killed at any moment leaves ``policy/``
with the state it was saved with, in ``resume/`` or in ``resume.previous/``; ``--resume`` takes
whichever matches the policy (`SavedState.check_policy`).

``--resume`` trusts a state only for the run it belongs to. `ResumePoint.read` refuses, with one
line: no state (the run finished, or a second signal stopped it before anything was saved); a
damaged file (its checksum); the state of another command; a config that differs in a setting
the training depends on (each named; `MAY_CHANGE` lists those that only change how the run
executes or what it shows); other training data (their digest). `SavedState.check_policy` then
refuses a policy in ``policy/`` other than the one saved with the state (the weights' digest: a
policy saved since), unless it is the one saved with the state before (``resume.previous/``: a
process killed while saving the new policy).
"""

from __future__ import annotations

import hashlib
import logging
import random
import shlex
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scratchlm.errors import UserError

__all__ = ["MAY_CHANGE", "ResumePoint", "SavedState", "config_differences", "restore_random", "weights_digest"]

RESUME_DIR = "resume"
PREVIOUS_DIR = "resume.previous"  # the state before, kept while `ResumePoint.save` writes the next one
STATE = "state.pt"
LOOP = "loop.pt"
FORMAT = 1  # of state.pt, for a later change of layout to recognise
# Settings a resumed run may change: they choose the device and the kernels, what is shown or
# logged, the evaluations and when the policy and the state are saved, none of the training stream.
MAY_CHANGE = frozenset({
    "run.progress", "run.resume_every", "policy.device", "sft.compile", "grpo.compile", "grpo.max_seconds",
    "grpo.eval_every", "dpo.eval_every", "dpo.save_every", "sft.log_every", "dpo.log_every", "data.eval_limit",
    "sampling.eval_max_new_tokens",
})
log = logging.getLogger("scratchlm.align")


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of a model's state dict: names, dtypes, shapes and every byte of the tensors."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}:{t.dtype}:{tuple(tensor.shape)};".encode())
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


def data_digest(items: Sequence[Any]) -> str:
    """sha256 of the training items (pairs, examples) as Python writes them out."""
    return hashlib.sha256(repr(list(items)).encode("utf-8")).hexdigest()


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for every dotted key outside `MAY_CHANGE` whose values differ.

    >>> config_differences({"sft": {"max_steps": 10, "log_every": 1}}, {"sft": {"max_steps": 20, "log_every": 5}})
    [('sft.max_steps', 10, 20)]
    """
    old, new = _flatten(saved), _flatten(current)
    return [(k, old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys())
            if k not in MAY_CHANGE and old.get(k) != new.get(k)]


def restore_random(rng: random.Random, state: Any) -> None:
    """``rng.setstate(state)`` for a state that went through torch.save (tuples may come back as lists)."""
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


@dataclass
class SavedState:
    """A resume state read back by `ResumePoint.read`: the step it stopped at, the loop's state
    (``resume=`` of the loops) and the digest of the policy saved with it."""

    path: Path
    step: int
    loop: dict[str, Any]
    policy_digest: str
    before: SavedState | None = None  # the state in resume.previous/, when both are on disk

    def check_policy(self, policy: Any, where: Path) -> SavedState:
        """The state `policy` (loaded from `where`) was saved with: this one, or the one before it (a
        process killed while it saved the policy of this one); UserError when neither."""
        digest = weights_digest(policy.model)
        for state in (self, self.before):
            if state is not None and state.policy_digest == digest:
                return state
        raise UserError(f"--resume: {where} is not the policy saved with the training state in {self.path} (step "
                        f"{self.step}): the run was stopped again while saving, or another policy was saved "
                        f"there since; start a new run from it (--policy.path={shlex.quote(str(where))} with "
                        "another run.out_dir)")


class ResumePoint:
    """Where `command`'s training state lives in `out_dir`, and what it must match.

    A loop's ``on_stop`` is `keep`; `scratchlm.align.interrupt.run_interruptible` then `write`s what
    it kept. `config` is the run's resolved config, `data` its training items, `argv` the command's
    arguments (for `command_line`, the command that resumes it).
    """

    def __init__(self, out_dir: str | Path, *, command: str, config: Any, data: Sequence[Any],
                 argv: Sequence[str]) -> None:
        from scratchlm.config import config_to_dict

        self.out_dir = Path(out_dir)
        self.dir = self.out_dir / RESUME_DIR
        self.previous = self.out_dir / PREVIOUS_DIR
        self.command = command
        self.config = config_to_dict(config)
        self.data = data_digest(data)
        self.command_line = shlex.join(["scratchlm", command, *(a for a in argv if a != "--resume"), "--resume"])
        self.loop: dict[str, Any] | None = None

    def keep(self, loop_state: dict[str, Any]) -> None:
        """Hold the state a loop hands over as it stops (its ``on_stop``)."""
        self.loop = loop_state

    def write(self, step: int, policy: Any, loop: dict[str, Any] | None = None) -> Path:
        """Write `loop` (by default the kept loop state), at `step`, with the digest of `policy` as just
        saved; returns the folder."""
        from scratchlm.fileio import replacing_tree
        from scratchlm.train.checkpoint import write_checksums, write_torch

        loop = self.loop if loop is None else loop
        if loop is None:
            raise ValueError("no loop state was kept to write")
        state = {"format": FORMAT, "command": self.command, "config": self.config, "data": self.data,
                 "step": int(step), "policy": weights_digest(policy.model)}
        with replacing_tree(self.dir) as staging:
            write_torch(loop, staging / LOOP)
            write_torch(state, staging / STATE)
            write_checksums(staging)
        return self.dir

    def save(self, step: int, policy: Any, out: Path, loop: dict[str, Any] | None = None) -> Path:
        """Save `policy` to `out` and `loop` (by default the kept loop state) at `step` as one pair;
        returns the state's folder.

        ``resume/`` holds the state saved with the policy in `out` (or is missing, when this run has
        saved none, or `settle` left it in ``resume.previous/``). It becomes ``resume.previous/``, the
        new state is written, the policy is swapped in whole, and only then does the old state go: a
        process killed at any moment leaves the policy in `out` beside the state it was saved with.
        """
        from scratchlm.fileio import replacing_tree

        if self.dir.exists():
            if self.previous.exists():
                shutil.rmtree(self.previous)  # (a state of an older policy, left by a process killed)
            self.dir.rename(self.previous)
        self.write(step, policy, loop)
        with replacing_tree(out) as staging:
            policy.save(staging, step=step)
        if self.previous.exists():
            shutil.rmtree(self.previous)
        return self.dir

    def saver(self, policy: Any, out: Path) -> Callable[[dict[str, Any]], None]:
        """A loop's ``on_checkpoint``: `save` of the state it hands over, at its step, with `policy` to `out`."""

        def checkpoint(loop: dict[str, Any]) -> None:
            self.save(int(loop["step"]), policy, out, loop)

        return checkpoint

    def read(self) -> SavedState:
        """The state to resume from, checked against this run (see the module docstring); with the
        state before it, when ``resume.previous/`` still holds one (`SavedState.check_policy` picks)."""
        if not (self.dir / STATE).is_file():
            if (self.previous / STATE).is_file():  # (killed while the next state was being written)
                return self._read(self.previous)
            raise UserError(f"--resume: {self.out_dir} holds no training state to resume ({self.dir / STATE} is "
                            "missing): the run finished, was never interrupted, or a second signal stopped it "
                            "before saving; pass --overwrite instead of --resume to start it afresh")
        state = self._read(self.dir)
        if (self.previous / STATE).is_file():
            state.before = self._read(self.previous)
        return state

    @staticmethod
    def _load(folder: Path, name: str) -> Any:
        """`name` in `folder`, after its checksum; a damaged file is a UserError."""
        from scratchlm.train.checkpoint import DamagedCheckpoint, read_torch, verify_step_dir

        try:
            verify_step_dir(folder, (STATE, LOOP), only=(name,))
            return read_torch(folder / name)
        except DamagedCheckpoint as exc:
            raise UserError(f"--resume: {exc}; the run cannot be resumed; start it afresh with --overwrite instead "
                            "of --resume") from None

    def _read(self, folder: Path) -> SavedState:
        state = self._load(folder, STATE)
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise UserError(f"--resume: {folder / STATE} is not a training state this scratchlm writes")
        if state["command"] != self.command:
            raise UserError(f"--resume: {folder} is the training state of `scratchlm {state['command']}`, not "
                            f"`scratchlm {self.command}`; resume it with `scratchlm {state['command']} ... --resume`, "
                            "or choose another run.out_dir")
        changed = config_differences(state["config"], self.config)
        if changed:
            shown = "; ".join(f"{k}={old!r} then, {new!r} now" for k, old, new in changed)
            raise UserError(f"--resume: the run in {self.out_dir} trained with other settings ({shown}); resume "
                            "it with the settings it started with, or start it afresh with --overwrite instead of "
                            "--resume")
        if state["data"] != self.data:
            raise UserError(f"--resume: the training data are not those the run in {self.out_dir} trained on "
                            "(a dataset file changed since?); resume with the same data, or start it afresh with "
                            "--overwrite instead of --resume")
        return SavedState(folder, int(state["step"]), self._load(folder, LOOP), state["policy"])

    def settle(self, state: SavedState) -> None:
        """Leave on disk only `state`, the one the run resumes from (`SavedState.check_policy`'s
        choice), so that the next `save` keeps it while it writes the one after."""
        if state.path == self.previous:
            if self.dir.exists():
                shutil.rmtree(self.dir)  # (its policy was never saved whole)
        elif self.previous.exists():
            shutil.rmtree(self.previous)

    def discard(self, *, fresh_run: bool = False) -> None:
        """Remove the state (consumed by a finished run, or replaced by a fresh one: `fresh_run` says so
        on stderr)."""
        if not (self.dir.exists() or self.previous.exists()):
            return
        if fresh_run:
            log.warning("warning: %s held the training state of an interrupted run; this run starts afresh "
                        "(--overwrite) and discards it", self.dir)
        for folder in (self.dir, self.previous):
            if folder.exists():
                shutil.rmtree(folder)
