"""A policy: a causal LM with its tokenizer, seen the same way whoever wrote the model.

Post-training needs four things from a model: encode/decode text, sample completions of a
batch of prompts, produce logits for log-probabilities, and save itself. `ScratchPolicy` wraps
a scratchlm `TransformerLM` + `Tokenizer` and samples with the project's decoding engine
(`scratchlm.infer.generate.generate`: static KV cache, CUDA-graph decode steps, finished rows'
slots refilled); `HFPolicy` wraps a Hugging Face `AutoModelForCausalLM` + `AutoTokenizer`
loaded from a local directory and samples with the same engine through a scratchlm twin when
the model is a Llama or Qwen2 the bridge converts, else with its own `generate`. Neither generator knows stop strings, so completions are decoded and cut
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
from scratchlm.fileio import replacing_tree, write_text_atomic


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


def engine_completions(model: nn.Module, rows: list[list[int]], *, max_new_tokens: int, temperature: float,
                       top_p: float | None, top_k: int | None, stop: tuple[str, ...], seed: int | None,
                       batch_size: int, eos_id: int | None, decode: Any) -> list[Completion]:
    """Completions of token-id prompts by the scratchlm decoding engine (`infer.generate`)."""
    from scratchlm.infer.generate import generate

    if not rows:
        return []
    ctx = model.context_length
    longest = max(len(r) for r in rows)
    if longest >= ctx and max_new_tokens > 0:
        raise UserError(f"a prompt of {longest} tokens leaves no room for a response within context_length={ctx}")
    device = next(model.parameters()).device
    with autocast_context(device):
        new = generate(model, rows, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       eos_id=eos_id, use_kv_cache=True, seed=seed, max_batch=batch_size)
    return [finish_completion(ids, eos_id, stop, decode) for ids in new]


def refresh_weights(model: nn.Module, state: dict[str, torch.Tensor], *, shareable: Any = ()) -> bool:
    """Bring `model`'s weights to `state`, copying each at most once; True when one moved to other memory.

    A weight of the same dtype, shape and device as its source, when that source is a contiguous
    view of one of the `shareable` tensors (a Hugging Face model's own, not a converted copy),
    shares its memory instead: nothing is copied, now or later, while the source is updated in
    place (as optimizers do). The others are copied into memory of the model's own, which keeps
    its address from one call to the next.
    """
    # every name a tensor has (a tied lm_head.weight too), as load_state_dict accepts
    targets = {**dict(model.named_parameters(remove_duplicate=False)),
               **dict(model.named_buffers(remove_duplicate=False))}
    wrong = (model.state_dict().keys() - state.keys()) | (state.keys() - targets.keys())
    if wrong:
        raise ValueError(f"weights missing or unexpected: {sorted(wrong)}")
    storages = {t.untyped_storage().data_ptr() for t in shareable}
    moved = False
    for name, src in state.items():
        dst = targets[name]
        if (dst.data_ptr(), dst.shape, dst.stride(), dst.dtype, dst.device) == \
                (src.data_ptr(), src.shape, src.stride(), src.dtype, src.device):
            continue  # already its memory
        if (src.untyped_storage().data_ptr() in storages and src.is_contiguous()
                and (src.shape, src.dtype, src.device) == (dst.shape, dst.dtype, dst.device)):
            dst.data, moved = src, True
            continue
        if dst.untyped_storage().data_ptr() in storages:  # shared before: never write into the source's memory
            dst.data, moved = torch.empty_like(dst), True
        dst.copy_(src)
    return moved


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
        """Sample one completion per prompt; at most `batch_size` rows decode at once (the
        engine refills a finished row's slot with the next waiting prompt)."""
        rows = [self.encode(p) for p in prompts]
        return engine_completions(self.model, rows, max_new_tokens=max_new_tokens, temperature=temperature,
                                  top_p=top_p, top_k=top_k, stop=stop, seed=seed, batch_size=batch_size,
                                  eos_id=self.eos_id, decode=self.decode)

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
        write_text_atomic(run / "config.toml", config_text)
        self.tokenizer.save(run / "tokenizer")
        state = {k: v.detach().float() if v.is_floating_point() else v
                 for k, v in unwrapped_state_dict(self.model).items()}
        return save_run_checkpoint(run, step, model_state=state, optimizer_state=None,
                                   state={"step": step}, config_text=config_text, keep=1)


class HFPolicy:
    """A Hugging Face causal LM and tokenizer from a local directory.

    A Llama, Qwen2, Mixtral or Qwen2-MoE that `scratchlm.model.hf` can express (grouped-query
    attention, Qwen2's q/k/v biases and an all-layer sliding window included; no RoPE scaling)
    samples with the scratchlm decoding engine, through a scratchlm twin of the model whose
    weights share the Hugging Face model's memory where their layout allows and are copied from
    it once at every call otherwise (so they follow training; `refresh_weights`);
    other models, and weights the bridge refuses, sample with their own `generate`.
    `use_engine=False` forces the latter.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, *, use_engine: bool = True) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.use_engine = use_engine
        self._twin: Any = None  # (scratchlm model, its config), False when the bridge cannot express the model
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
        """Sample one completion per prompt: with the scratchlm engine when the model converts,
        else with `model.generate` (left padding, KV cache), `batch_size` prompts a call."""
        twin = self._engine_twin() if self.use_engine else None
        if twin is not None:
            return engine_completions(twin, [self.encode(p) for p in prompts], max_new_tokens=max_new_tokens,
                                      temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed,
                                      batch_size=batch_size, eos_id=self.eos_id, decode=self.decode)
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

    def _engine_twin(self) -> nn.Module | None:
        """The scratchlm model with this model's current weights, or None when it cannot be one."""
        from scratchlm.model.hf import from_hf_state_dict, model_config_from_hf
        from scratchlm.model.transformer import build_model

        if self._twin is False:
            return None
        if self._twin is None:
            try:
                cfg = model_config_from_hf(self.model.config.to_dict())
            except (UserError, KeyError, TypeError):
                self._twin = False
                return None
            dtype = next(self.model.parameters()).dtype
            self._twin = (build_model(cfg, device=self.device, dtype=dtype).eval(), cfg)
        twin, cfg = self._twin
        with torch.no_grad():
            hf_state = self.model.state_dict()
            try:
                state = from_hf_state_dict(hf_state, cfg, copy=False)
            except UserError:  # weights the twin cannot hold exactly (a Qwen2-MoE shared-expert gate that trained)
                self._twin = False
                return None
            if refresh_weights(twin, state, shareable=hf_state.values()):
                from scratchlm.infer.generate import release_engines

                release_engines(twin)  # its captured decode steps read the weights' old addresses
        return twin

    def save(self, out: str | os.PathLike, *, step: int = 0) -> Path:
        """`save_pretrained` of the model and tokenizer into `out`, which is replaced whole
        (`scratchlm.fileio.replacing_tree`): a save cut off (Ctrl-C, a full disk, a killed
        process) leaves the policy saved there before, never a truncated one."""
        path = Path(out)
        with replacing_tree(path) as staging:
            self.model.save_pretrained(staging)
            self.tokenizer.save_pretrained(staging)
        return path


def is_hf_directory(path: str | os.PathLike) -> bool:
    """A Hugging Face model directory: config.json and no scratchlm checkpoints/."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and not (p / "checkpoints").is_dir()


def _load_hf(auto_class: Any, path: str | os.PathLike, what: str) -> Any:
    """`auto_class.from_pretrained(path)`; a directory transformers cannot read (a damaged
    config.json or weights, an unknown model type, no tokenizer files) is a UserError."""
    from safetensors import SafetensorError

    try:
        return auto_class.from_pretrained(path)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise UserError(f"{path}: transformers cannot load the {what} of this Hugging Face directory "
                        f"({type(exc).__name__}: {lines[0] if lines else 'no message'})") from exc


def load_policy(path: str | os.PathLike, device: str | torch.device = "cpu") -> ScratchPolicy | HFPolicy:
    """A policy from a scratchlm run/step directory or checkpoint file, or a local HF model directory."""
    device = torch.device(device)
    if is_hf_directory(path):
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError:
            raise UserError(f"{path} is a Hugging Face model directory, which needs the 'transformers' package")
        model = _load_hf(AutoModelForCausalLM, path, "model").to(device)
        return HFPolicy(model, _load_hf(AutoTokenizer, path, "tokenizer"))
    from scratchlm.train.checkpoint import load_trained_model

    model, cfg, tokenizer = load_trained_model(path, device)
    if tokenizer is None:
        raise UserError(f"{path} has no tokenizer/ directory; post-training needs the model's tokenizer")
    return ScratchPolicy(model, tokenizer, cfg)
