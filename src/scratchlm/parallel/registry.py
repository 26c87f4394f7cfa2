"""Every parallel strategy by its `parallel.strategy` name: the one list to extend.

A new strategy is one module in `scratchlm/parallel/strategies/` with a `Strategy` subclass,
plus one line here (docs/extending.md, "A parallel strategy", walks through an example).
"""

from __future__ import annotations

from scratchlm.parallel.strategies.ddp import DDPStrategy
from scratchlm.parallel.strategies.ddp_bucketed import BucketedDDPStrategy
from scratchlm.parallel.strategies.flat_ddp import FlatDDPStrategy
from scratchlm.parallel.strategies.fsdp import FSDPStrategy
from scratchlm.parallel.strategies.naive_ddp import NaiveDDPStrategy
from scratchlm.parallel.strategies.single import SingleProcess
from scratchlm.parallel.strategies.torch_ddp import TorchDDPStrategy
from scratchlm.parallel.strategies.torch_fsdp2 import TorchFSDP2Strategy
from scratchlm.parallel.strategies.zero1 import Zero1Strategy
from scratchlm.parallel.strategy import Strategy

STRATEGIES: dict[str, type[Strategy]] = {
    "none": SingleProcess,
    "ddp": DDPStrategy,
    "ddp_bucketed": BucketedDDPStrategy,
    "naive_ddp": NaiveDDPStrategy,
    "flat_ddp": FlatDDPStrategy,
    "zero1": Zero1Strategy,
    "fsdp": FSDPStrategy,
    "torch_ddp": TorchDDPStrategy,
    "torch_fsdp2": TorchFSDP2Strategy,
}
