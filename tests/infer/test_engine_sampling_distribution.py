"""The engine's sampled tokens follow the model's softmax: many draws against the exact probabilities.

GRPO learns from what the rollouts sample, so the engine (refills, compaction, prompts prefilled
in length order, one random stream for all slots) must draw each row's tokens from the model's
distribution at that row's own prefix, independently of the other rows. These tests count tokens
over thousands of rows and compare the counts with the model's probabilities by a chi-square
statistic: of the first token, of two-token continuations (p(t1) p(t2 | t1)), per prompt when
prompts of different lengths share the batch, and of the first tokens of two rows of one group
(independent draws: p(a) p(b)). The test is seeded, so it is deterministic; the bound (5 standard
deviations of the chi-square above its mean) leaves a correct sampler far below it.
"""

import math

import pytest
import torch

from scratchlm.infer.engine import DecodeEngine
from scratchlm.model.transformer import TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")

V = 16
PROMPTS = ([3, 7, 1, 9, 4], [5, 2, 11, 6, 0, 8, 13, 2, 9])  # two lengths: prefill reorders the rows
STOP = 15  # a token of some probability after both prompts: rows finish early and slots are refilled


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = TransformerLM(vocab_size=V, context_length=32, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                      rope_theta=10_000.0, dtype=torch.float32)
    with torch.no_grad():
        m.lm_head.weight.mul_(3)  # peaked but not degenerate, like a trained policy's next token
    return m.eval()


def _probs(model, prefix, temperature=1.0):
    with torch.no_grad():
        return torch.softmax(model(torch.tensor([prefix]))[0, -1].double() / temperature, -1)


def _chi2_z(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """(chi-square - dof) / sqrt(2 dof), cells expecting fewer than 5 counts pooled into one."""
    small = expected < 5
    c = torch.cat([counts[~small], counts[small].sum()[None]])
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    if e[-1] == 0:
        c, e = c[:-1], e[:-1]
    k = len(e) - 1
    return (float(((c - e) ** 2 / e).sum()) - k) / math.sqrt(2 * k)


def _sample(model, n_rows: int, temperature: float = 1.0, seed: int = 0) -> list[list[int]]:
    """Two tokens (or one ending on STOP) for n_rows rows alternating the two prompts, each prompt
    twice in a row (a group), through 24 slots refilled as rows finish."""
    prompts = [PROMPTS[(i // 2) % 2] for i in range(n_rows)]
    engine = DecodeEngine(model, 24, 32, check_every=2)
    outs = engine.run(prompts, [2] * n_rows, temperature=temperature, stop_ids=[STOP],
                      generator=torch.Generator().manual_seed(seed))
    assert all(len(o) == (1 if o[0] == STOP else 2) for o in outs)
    return outs


def _z_scores(model, outs: list[list[int]]) -> dict[str, float]:
    z = {}
    for j, prompt in enumerate(PROMPTS):
        rows = [o for i, o in enumerate(outs) if (i // 2) % 2 == j]
        p1 = _probs(model, prompt)
        first = torch.tensor([o[0] for o in rows])
        z[f"first token, prompt {j}"] = _chi2_z(torch.bincount(first, minlength=V).double(), len(rows) * p1)
        # two-token continuations; a row that stopped on its first token is the cell (STOP, -)
        joint = torch.stack([p1[a] * _probs(model, prompt + [a]) for a in range(V)])  # (V, V)
        joint[STOP] = 0
        expected = torch.cat([joint.flatten(), p1[STOP][None]]) * len(rows)
        cells = torch.tensor([o[0] * V + o[1] if len(o) == 2 else V * V for o in rows])
        z[f"two tokens, prompt {j}"] = _chi2_z(torch.bincount(cells, minlength=V * V + 1).double(), expected)
        # the two rows of each group: independent draws
        a, b = first[0::2], first[1::2]
        pair = torch.outer(p1, p1).flatten() * len(a)
        z[f"group pairs, prompt {j}"] = _chi2_z(torch.bincount(a * V + b, minlength=V * V).double(), pair)
    return z


def test_engine_samples_follow_the_model_distribution(model):
    z = _z_scores(model, _sample(model, 6000))
    assert max(z.values()) < 5, z


def test_the_distribution_check_sees_a_wrong_temperature(model):
    # the same check fails for draws from another distribution (temperature 1.3 against 1.0)
    z = _z_scores(model, _sample(model, 6000, temperature=1.3))
    assert max(z.values()) > 5, z
