"""A policy: a causal LM with its tokenizer, seen the same way whoever wrote the model.

Post-training needs four things from a model: encode/decode text, sample completions of a
batch of prompts, produce logits for log-probabilities, and save itself. `ScratchPolicy` wraps
a scratchlm `TransformerLM` + `Tokenizer` and samples with the project's batched KV-cache
generator (`scratchlm.infer.generate.generate`); `HFPolicy` wraps a Hugging Face
`AutoModelForCausalLM` + `AutoTokenizer` loaded from a local directory and samples with its
own `generate`. Neither generator knows stop strings, so completions are decoded and cut
just after the first stop string (``</answer>``); SFT targets end with the end-of-text token,
so a trained policy also stops by itself.

`load_policy(path)` picks the kind: a directory with ``config.json`` and no ``checkpoints/``
is a Hugging Face model, anything else goes to `scratchlm.train.checkpoint.load_trained_model`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from scratchlm.align.prompts import truncate_at_stop
from scratchlm.errors import UserError


@dataclass
class Completion:
    """One sampled response: its text (cut after a stop string) and the tokens it took."""

    text: str
    num_tokens: int  # tokens the generator produced for it (the decoding cost)
    stopped: bool  # ended by a stop string or the end-of-text token, not the token budget
    # The sampled token ids behind `text` (through the token that completes the stop string,
    # plus the end-of-text id when the row ended on it there); None when unknown. Re-encoding
    # `text` need not give them back: a sampled split of "70" into "7", "0" encodes as "70".
    token_ids: list[int] | None = None


class Policy(Protocol):
    """What the post-training loops use of a model."""

    model: nn.Module
    device: torch.device
    pad_id: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def generate(self, prompts: list[str], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float | None = None, top_k: int | None = None, stop: tuple[str, ...] = (),
                 seed: int | None = None, batch_size: int = 64) -> list[Completion]: ...

    def save(self, out: str | os.PathLike, *, step: int = 0) -> Path: ...


def autocast_context(device: torch.device) -> contextlib.AbstractContextManager:
    """bfloat16 autocast on CUDA (where it is what makes the model fast), nothing elsewhere."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def finish_completion(ids: list[int], eos_id: int | None, stop: tuple[str, ...], decode: Any) -> Completion:
    """A Completion from the new token ids of one row (ending with `eos_id` when it stopped on it).

    The text is cut just after the first stop string; the token ids are cut after the first
    token whose text completes it, and keep the end-of-text id only when nothing was cut.
    """
    hit_eos = bool(ids) and eos_id is not None and ids[-1] == eos_id
    body = ids[:-1] if hit_eos else list(ids)
    full = decode(body)
    text, found = truncate_at_stop(full, stop)
    if found and len(text) < len(full):
        # The row went on after the stop string: keep the shortest prefix of tokens holding it.
        k = next(k for k in range(1, len(body) + 1) if truncate_at_stop(decode(body[:k]), stop)[1])
        body, hit_eos = body[:k], False
    return Completion(text, len(ids), found or hit_eos, body + ([eos_id] if hit_eos else []))


class ScratchPolicy:
    """A scratchlm TransformerLM and Tokenizer; samples with scratchlm.infer.generate."""

    def __init__(self, model: nn.Module, tokenizer: Any, model_config: Any = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.device = next(model.parameters()).device
        self.eos_id = tokenizer.eot_id
        self.pad_id = self.eos_id if self.eos_id is not None else 0

    @property
    def context_length(self) -> int:
        return self.model.context_length

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def generate(self, prompts: list[str], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float | None = None, top_k: int | None = None, stop: tuple[str, ...] = (),
                 seed: int | None = None, batch_size: int = 64) -> list[Completion]:
        """Sample one completion per prompt, `batch_size` prompts per generator call."""
        from scratchlm.infer.generate import generate

        out: list[Completion] = []
        for start in range(0, len(prompts), batch_size):
            chunk = [self.encode(p) for p in prompts[start:start + batch_size]]
            budget = min(max_new_tokens, self.context_length - max(len(c) for c in chunk))
            if budget <= 0:
                raise UserError(f"a prompt of {max(len(c) for c in chunk)} tokens leaves no room for a "
                                f"response within context_length={self.context_length}")
            with autocast_context(self.device):
                new = generate(self.model, chunk, budget, temperature=temperature, top_k=top_k, top_p=top_p,
                               eos_id=self.eos_id, use_kv_cache=True,
                               seed=None if seed is None else seed + start)
            out.extend(finish_completion(ids, self.eos_id, stop, self.decode) for ids in new)
        return out

    def save(self, out: str | os.PathLike, *, step: int = 0) -> Path:
        """Write a run directory (config.toml, tokenizer/, checkpoints/step_N) that
        `load_trained_model` and every scratchlm command read back."""
        from scratchlm.config import config_to_toml
        from scratchlm.train.checkpoint import save_run_checkpoint, unwrapped_state_dict

        if self.model_config is None:
            raise ValueError("saving a ScratchPolicy needs its ModelConfig")
        run = Path(out)
        run.mkdir(parents=True, exist_ok=True)
        config_text = "[model]\n" + config_to_toml(self.model_config)
        (run / "config.toml").write_text(config_text, encoding="utf-8")
        self.tokenizer.save(run / "tokenizer")
        state = {k: v.detach().float() if v.is_floating_point() else v
                 for k, v in unwrapped_state_dict(self.model).items()}
        return save_run_checkpoint(run, step, model_state=state, optimizer_state=None,
                                   state={"step": step}, config_text=config_text, keep=1)


class HFPolicy:
    """A Hugging Face causal LM and tokenizer from a local directory; samples with HF generate."""

    def __init__(self, model: nn.Module, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.eos_id = tokenizer.eos_token_id
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.tokenizer.padding_side = "left"

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def generate(self, prompts: list[str], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float | None = None, top_k: int | None = None, stop: tuple[str, ...] = (),
                 seed: int | None = None, batch_size: int = 64) -> list[Completion]:
        """Sample one completion per prompt with `model.generate` (left padding, KV cache)."""
        out: list[Completion] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(prompts), batch_size):
                rows = [self.encode(p) for p in prompts[start:start + batch_size]]
                width = max(len(r) for r in rows)
                ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows], device=self.device)
                mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
                if seed is not None:
                    torch.manual_seed(seed + start)
                sampling = {"do_sample": False} if temperature == 0 else {
                    "do_sample": True, "temperature": temperature, "top_p": top_p or 1.0, "top_k": top_k or 0}
                with torch.inference_mode(), autocast_context(self.device):
                    seqs = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                               eos_token_id=self.eos_id, pad_token_id=self.pad_id, **sampling)
                for row in seqs[:, width:].tolist():
                    if self.eos_id is not None and self.eos_id in row:
                        row = row[: row.index(self.eos_id) + 1]
                    out.append(finish_completion(row, self.eos_id, stop, self.decode))
        finally:
            self.model.train(was_training)
        return out

    def save(self, out: str | os.PathLike, *, step: int = 0) -> Path:
        """`save_pretrained` of the model and tokenizer into `out`."""
        path = Path(out)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return path


def is_hf_directory(path: str | os.PathLike) -> bool:
    """A Hugging Face model directory: config.json and no scratchlm checkpoints/."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and not (p / "checkpoints").is_dir()


def load_policy(path: str | os.PathLike, device: str | torch.device = "cpu") -> ScratchPolicy | HFPolicy:
    """A policy from a scratchlm run/step directory or checkpoint file, or a local HF model directory."""
    device = torch.device(device)
    if is_hf_directory(path):
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError:
            raise UserError(f"{path} is a Hugging Face model directory, which needs the 'transformers' package")
        model = AutoModelForCausalLM.from_pretrained(path).to(device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return HFPolicy(model, tokenizer)
    from scratchlm.train.checkpoint import load_trained_model

    model, cfg, tokenizer = load_trained_model(path, device)
    if tokenizer is None:
        raise UserError(f"{path} has no tokenizer/ directory; post-training needs the model's tokenizer")
    return ScratchPolicy(model, tokenizer, cfg)
