"""Models, data and training loops shared by the distributed tests (run inside spawned workers).

Everything here is a module-level function so `scratchlm.parallel.launch.spawn` can pickle it.
The single-process reference back-propagates the mean of the per-rank halves' losses, each
half through its own forward pass: the exact computation whose gradient the data-parallel
strategies reproduce bit for bit with two ranks (see scratchlm.parallel.ddp).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB, CONTEXT, BATCH_PER_RANK = 61, 8, 2  # 61 rows: FSDP must pad vocab-sized weights


class ToyNet(nn.Module):
    """A stand-in built from torch primitives: tied weights, a frozen and an unused parameter."""

    def __init__(self, vocab: int = VOCAB, d: int = 16, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, 4 * d, bias=True)
        self.down = nn.Linear(4 * d, d, bias=False)
        self.frozen = nn.Parameter(torch.randn(d), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(3, 3))
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.frozen
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(h)


def build(kind: str, seed: int = 0) -> nn.Module:
    """A small model of the given kind: 'toy', 'lm' (tiny TransformerLM) or 'lm_tied'."""
    torch.manual_seed(seed)
    if kind == "toy":
        return ToyNet()
    from scratchlm.model.transformer import TransformerLM

    return TransformerLM(VOCAB, CONTEXT, d_model=16, num_layers=2, num_heads=2, d_ff=40,
                         tie_embeddings=(kind == "lm_tied"))


def batches(steps: int, world: int, seed: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """steps x world (inputs, targets) slices of each global batch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (world * BATCH_PER_RANK, CONTEXT + 1), generator=g)
        out.append([(t[:, :-1], t[:, 1:]) for t in tokens.chunk(world)])
    return out


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_optimizer(params, name: str):
    from scratchlm.optim.adamw import AdamW

    if name == "adamw":
        return AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    raise ValueError(name)


def named_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.named_parameters()}


def train_reference(kind: str, steps: int, world: int, optimizer: str = "adamw", clip: float = 0.0,
                    joint: bool = True, device: str = "cpu") -> dict[str, Any]:
    """One process over the same global batches: loss = mean over ranks' halves, one step each.

    `joint=True` back-propagates the mean of the halves' losses in one backward. That equals the
    two-rank result bit for bit unless a weight is tied: then autograd sums the four uses
    (two halves x two modules) in arrival order, while the ranks add their two uses first and
    the reduction adds the ranks' sums. `joint=False` does what the ranks do: one backward per
    half of loss / world, gradients accumulated half by half.
    """
    torch.use_deterministic_algorithms(True)
    model = build(kind).to(device)
    opt = make_optimizer(model.parameters(), optimizer)
    losses, norms = [], []
    for step in batches(steps, world):
        step = [(x.to(device), y.to(device)) for x, y in step]
        opt.zero_grad(set_to_none=True)
        if joint:
            loss = sum(loss_fn(model, x, y) for x, y in step) / world
            loss.backward()
        else:
            loss = 0.0
            for x, y in step:
                half = loss_fn(model, x, y) / world
                half.backward()
                loss = loss + half.detach()
        if clip:
            from scratchlm.optim.clip import clip_grad_norm

            norms.append(float(clip_grad_norm(model.parameters(), clip)))
        opt.step()
        losses.append(loss.item())
    return {"params": named_params(model), "losses": losses, "norms": norms}


def train_world_of_one(model: nn.Module, steps: int) -> None:
    """Train a DDP/FSDP-wrapped model `steps` AdamW steps in a process group of one rank, on the
    batches of `train_reference(kind, steps, 1)`."""
    opt = make_optimizer(model.parameters(), "adamw")
    for step in batches(steps, 1):
        (x, y), = step
        opt.zero_grad(set_to_none=True)
        loss_fn(model, x, y).backward()
        model.finish_gradient_synchronization()
        opt.step()


def train_strategy(rank: int, world: int, kind: str, strategy: str, steps: int,
                   optimizer: str = "adamw", options: dict | None = None) -> dict[str, Any]:
    """Train `steps` steps with one of the wrappers on this rank's half of each global batch."""
    from scratchlm.parallel.ddp import DDP, FlatDDP, NaiveDDP
    from scratchlm.parallel.fsdp import FSDP
    from scratchlm.parallel.sharded_optimizer import ShardedOptimizer

    options = options or {}
    torch.use_deterministic_algorithms(True)
    caught = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build(kind, seed=rank + 100)  # different init per rank: construction must broadcast
        if rank == 0:
            model.load_state_dict(build(kind).state_dict())
        if strategy == "naive":
            wrapped = NaiveDDP(model)
        elif strategy == "flat":
            wrapped = FlatDDP(model)
        elif strategy in ("ddp", "zero1"):
            wrapped = DDP(model)
        elif strategy == "ddp_bucketed":
            wrapped = DDP(model, bucket_size_mb=options.get("bucket_size_mb", 0.001))
        elif strategy == "fsdp":
            dtype = options.get("compute_dtype")
            wrapped = FSDP(model, compute_dtype=getattr(torch, dtype) if dtype else None)
        else:
            raise ValueError(strategy)
        if strategy == "zero1":
            from scratchlm.optim.adamw import AdamW

            opt = ShardedOptimizer(wrapped.parameters(), AdamW, lr=1e-2, betas=(0.9, 0.95),
                                   weight_decay=0.1, foreach=False)
        else:
            opt = make_optimizer(wrapped.parameters(), optimizer)
        losses = []
        for step in batches(steps, world):
            x, y = step[rank]
            opt.zero_grad(set_to_none=True)
            micro = options.get("micro_batches", 1)
            loss_value = 0.0
            for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
                loss = loss_fn(wrapped, xm, ym) / micro
                loss.backward()
                loss_value += loss.item()
            wrapped.finish_gradient_synchronization()
            opt.step()
            t = torch.tensor([loss_value])
            dist.all_reduce(t)
            losses.append((t / world).item())
        if strategy == "fsdp":
            params = {k: v.cpu() for k, v in wrapped.gather_full_params().items()}
            shapes = {k: tuple(p.shape) for k, p in wrapped.module.named_parameters()}
            grad_shapes = {k: tuple(p.grad.shape) for k, p in wrapped.module.named_parameters()
                           if p.grad is not None}
            grad_dtypes = {k: str(p.grad.dtype) for k, p in wrapped.module.named_parameters()
                           if p.grad is not None}
        else:
            params = named_params(wrapped.module)
            shapes = grad_shapes = grad_dtypes = {}
        result = {"params": params, "losses": losses, "shapes": shapes, "grad_shapes": grad_shapes,
                  "grad_dtypes": grad_dtypes}
        if strategy == "zero1":
            result["local_state_numel"] = sum(
                t.numel() for s in opt.local_optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return result


def run_many(rank: int, world: int, jobs: list[tuple]) -> list[dict[str, Any]]:
    """Run several `train_strategy` jobs in one process group (process start-up is the slow part)."""
    return [train_strategy(rank, world, *job) for job in jobs]


def _roundtrip(obj: Any) -> Any:
    """What a checkpoint file gives back: a deep copy through torch.save / torch.load."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=False)


def engine_job(rank: int, world: int, strategy: str, kind: str = "lm", steps: int = 3,
               optimizer_state: str = "full", compute_dtype: str = "none", clip: float = 1.0) -> dict[str, Any]:
    """Train through the engine seam, checkpoint before the last step, resume, redo the last step."""
    from scratchlm.optim.adamw import AdamW
    from scratchlm.parallel.config import ParallelConfig
    from scratchlm.parallel.engine import init_engine

    torch.use_deterministic_algorithms(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = ParallelConfig(strategy=strategy, optimizer_state=optimizer_state, compute_dtype=compute_dtype,
                             bucket_size_mb=0.01)
        engine = init_engine(cfg)

        def fresh():
            model = engine.wrap_model(build(kind))
            opt = engine.build_optimizer(model, AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
            return model, opt

        model, opt = fresh()
        data = batches(steps, world)

        def train_step(i: int) -> tuple[float, float]:
            x, y = (t.to(engine.device) for t in data[i][rank])
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, x, y)
            loss.backward()
            engine.sync_gradients(model)
            norm = engine.clip_grad_norm(model, clip)
            opt.step()
            return engine.all_reduce_mean(loss.item()), float(norm)

        losses, norms = [], []
        for i in range(steps - 1):
            loss, norm = train_step(i)
            losses.append(loss)
            norms.append(norm)
        weights = _roundtrip(engine.full_state_dict(model))
        optim = _roundtrip(engine.optimizer_state_dict(opt))
        loss, norm = train_step(steps - 1)
        losses.append(loss)
        norms.append(norm)
        final = engine.full_state_dict(model)
        model, opt = fresh()
        engine.load_full_state_dict(model, weights if rank == 0 else None)  # rank 0 only: broadcast path
        engine.load_optimizer_state_dict(opt, _roundtrip(optim))  # loading aliases the tensors it gets
        resumed_loss, _ = train_step(steps - 1)
        resumed = engine.full_state_dict(model)
        engine.barrier()
    return {"final": final, "resumed": resumed, "losses": losses, "norms": norms, "resumed_loss": resumed_loss,
            "optim": optim, "per_rank": engine.optimizer_state_per_rank,
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def run_engine_jobs(rank: int, world: int, jobs: list[tuple]) -> list[dict[str, Any]]:
    return [engine_job(rank, world, *job) for job in jobs]


def run_all(rank: int, world: int, wrapper_jobs: list[tuple], engine_jobs: list[tuple]) -> tuple[list, list]:
    """Both kinds of jobs in one process group."""
    return run_many(rank, world, wrapper_jobs), run_engine_jobs(rank, world, engine_jobs)


class LayersNet(nn.Module):
    """Only scratchlm's own layers (Embedding, RMSNorm, Linear): what FSDP shards or replicates."""

    def __init__(self, vocab: int = VOCAB, d: int = 16) -> None:
        super().__init__()
        from scratchlm.model.layers import Embedding, Linear, RMSNorm

        self.emb = Embedding(vocab, d)
        self.norm = RMSNorm(d)
        self.up = Linear(d, 40)
        self.down = Linear(40, d)
        self.head = Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(ids))
        return self.head(h + self.down(torch.relu(self.up(h))))


def sgd_batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch of (inputs, targets), world x BATCH_PER_RANK rows."""
    (step,) = batches(1, world, seed=5)
    return torch.cat([x for x, _ in step]), torch.cat([y for _, y in step])


def fsdp_sgd_step(rank: int, world: int, lr: float = 0.1) -> dict[str, torch.Tensor]:
    """One plain-SGD step of FSDP(LayersNet) in float32 on this rank's rows; the full parameters after it."""
    from scratchlm.model.functional import cross_entropy
    from scratchlm.parallel.fsdp import FSDP

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = FSDP(LayersNet())
    x, y = (t.chunk(world)[rank] for t in sgd_batch(world))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    cross_entropy(model(x), y).backward()
    model.finish_gradient_synchronization()
    opt.step()
    return {k: v.cpu() for k, v in model.gather_full_params().items()}
