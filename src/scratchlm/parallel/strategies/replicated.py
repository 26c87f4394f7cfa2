"""The shared behaviour of the strategies that keep the whole model on every rank."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import ClassVar

from torch import nn

from scratchlm.parallel.strategy import DistributedStrategy


class ReplicatedStrategy(DistributedStrategy):
    """Every rank holds all weights and optimizer state; gradients are averaged across ranks.

    Subclasses implement `wrap`, which puts the gradient-averaging wrapper around the model
    (already on this rank's device). Weights and optimizer state are checkpointed from rank 0.
    """

    # Whether the wrapper communicates during backward and has a `no_sync()` that defers it.
    overlaps_backward: ClassVar[bool] = False

    def wrap(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return self.wrap(model.to(self.device))

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        inner = getattr(model, "no_sync", None)
        if self.overlaps_backward and inner is not None:
            with inner():
                yield
        else:
            yield

    def sync_gradients(self, model: nn.Module) -> None:
        finish = getattr(model, "finish_gradient_synchronization", None)
        if finish is not None:
            finish()
