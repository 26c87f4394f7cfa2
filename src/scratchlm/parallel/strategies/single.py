"""One process, no communication: the strategy of `parallel.strategy = "none"`."""

from __future__ import annotations

from scratchlm.parallel.strategy import Strategy


class SingleProcess(Strategy):
    """Trains on one device: the base class's world of one, plus what only a plain model allows."""

    name = "none"
    supports_fused_lm_head = True
    eval_plain_model = True
