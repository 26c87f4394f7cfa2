"""The trainer's view of the data: token files opened and checked, the batch sampler, the
validation batches, and the validation loss."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from scratchlm.data.config import DataConfig
from scratchlm.errors import UserError
from scratchlm.model.config import ModelConfig
from scratchlm.model.functional import cross_entropy


def open_checked(path: str, model_cfg: ModelConfig, what: str, *, tokenizer_dir: str = "",
                 tokenizer_hash: str | None = None):
    """A token file as a memmap, checked against the model (and the run's tokenizer, if named:
    its hash, `tokenizer_hash(tokenizer_dir)`, computed once by the caller).

    See `scratchlm.data.token_file.open_checked` for what is refused.
    """
    from scratchlm.data.token_file import open_checked as open_token_file

    return open_token_file(path, vocab_size=model_cfg.vocab_size, context_length=model_cfg.context_length,
                           tokenizer_hash=tokenizer_hash, tokenizer_dir=tokenizer_dir or None, what=what)


def tokenizer_hash(tokenizer_dir: str) -> str | None:
    """The hash of the tokenizer in `tokenizer_dir` (None when the run names none)."""
    if not tokenizer_dir:
        return None
    if not Path(tokenizer_dir).is_dir():
        raise UserError(f"data.tokenizer_dir {tokenizer_dir} is not a directory")
    from scratchlm.tokenizer.tokenizer import Tokenizer

    return Tokenizer.load(tokenizer_dir).hash


def check_held_out(data_cfg: DataConfig) -> None:
    """Refuse a `data.val_path` that is `data.train_path` (the same file, however spelled): its
    validation loss would be a training loss, lower than any held-out one, under the name of one."""
    from scratchlm.fileio import resolve_path

    if data_cfg.val_path and data_cfg.train_path and (
            resolve_path(data_cfg.val_path, "data.val_path") == resolve_path(data_cfg.train_path, "data.train_path")):
        raise UserError(f"data.val_path {data_cfg.val_path} is the training file data.train_path: the validation "
                        "loss would score tokens the model trains on; give a held-out token file, or leave "
                        "data.val_path empty for no validation")


class TrainData:
    """Training batches from `data.train_path`, validation batches from `data.val_path`.

    `batch_size` is the global micro-batch; each rank gets its disjoint slice of it.
    """

    def __init__(self, data_cfg: DataConfig, model_cfg: ModelConfig, *, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1) -> None:
        from scratchlm.data.batch import BatchSampler

        if not data_cfg.train_path:
            raise UserError("data.train_path is not set (a .bin token file from `scratchlm encode`)")
        if batch_size % world_size:
            raise UserError(f"the micro-batch of {batch_size} sequences (trainer.batch_size / "
                            f"trainer.grad_accum_steps) does not split over {world_size} ranks")
        self.context_length = model_cfg.context_length
        self.batch_size = batch_size
        self.rank, self.world_size = rank, world_size
        # Checked before the run writes anything: bad data fails here, not at the first step.
        tok = {"tokenizer_dir": data_cfg.tokenizer_dir, "tokenizer_hash": tokenizer_hash(data_cfg.tokenizer_dir)}
        self.train_tokens = open_checked(data_cfg.train_path, model_cfg, "data.train_path", **tok)
        self.val_tokens = (open_checked(data_cfg.val_path, model_cfg, "data.val_path", **tok)
                           if data_cfg.val_path else None)
        check_held_out(data_cfg)
        self.sampler = BatchSampler(self.train_tokens, batch_size, self.context_length,
                                    seed=seed, rank=rank, world_size=world_size)

    @property
    def has_validation(self) -> bool:
        return self.val_tokens is not None

    def next_batch(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (x, y) of the next training micro-batch, each (B, T) int64."""
        return self.sampler.next_batch(device)

    def eval_batches(self, num_windows: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the first `num_windows` validation windows (the same every call,
        whatever the micro-batch size or number of ranks), a micro-batch at a time."""
        from scratchlm.data.batch import iterate_eval_batches

        batches = iterate_eval_batches(self.val_tokens, self.batch_size, self.context_length,
                                       max_windows=num_windows, device=device)
        for i, batch in enumerate(batches):
            if i % self.world_size == self.rank:
                yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


@torch.no_grad()
def evaluation_totals(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
                      ) -> tuple[float, int]:
    """(sum of per-token cross-entropies, number of tokens) of `model` over `batches`."""
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for x, y in batches:
        loss = cross_entropy(model(x), y)
        total += loss.double().cpu() * y.numel()
        count += y.numel()
    return float(total), count


def evaluate(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy per token of `model` over `batches` (weighted by their sizes)."""
    total, count = evaluation_totals(model, batches)
    if count == 0:
        raise UserError("the validation set yields no batch; is data.val_path shorter than one context?")
    return total / count
