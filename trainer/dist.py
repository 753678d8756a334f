"""Data-parallel primitives the PPO parts use: who this rank is (`DistInfo`), decisions taken together
(`any_rank`), sums and means over ranks. Each is a no-op for one process. Every rank must call them at
the same points with the same shapes: a rank that skips one leaves the others waiting in a collective.
A leaf module (torch.distributed only), so the PPO parts depend on it and never on trainer/run/.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainer.ppo import Comm

_T = TypeVar("_T")


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = ""  # the process group's backend ("nccl", "gloo"); "" = one process
    local_world_size: int = 0  # processes on this node (torchrun's LOCAL_WORLD_SIZE); 0 = all of them

    @property
    def nodes(self) -> int:
        """Nodes the job spans (torchrun starts the same number of processes on each)."""
        return max(1, self.world_size // (self.local_world_size or self.world_size))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        """Where the tensors of our own small collectives (decisions, metric means) live: the rank's GPU
        under NCCL, which takes CUDA tensors only; the CPU under gloo, also when the models are on a GPU."""
        if self.device.type == "cuda" and (self.backend in ("", "nccl") or "cuda:nccl" in self.backend):
            return self.device
        return torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank if it is true on any: decisions such as early stop or skipping a
    non-finite step must be taken together, or one rank would wait forever in a collective."""
    if not info.enabled:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=info.comm_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


@dataclass(frozen=True)
class Deadline:
    """When the rank-local block running now must be done: the other ranks wait for this one in the collective at
    its end, and past `budget_s` (`flag` less a margin) that wait ends the run in the process group's watchdog
    instead of with one line. Waits on something outside the process (a rollout engine) take what is left."""

    at: float  # time.monotonic()
    budget_s: float
    flag: str  # what bounds it, for messages: "--ddp_timeout 1800"

    def left(self) -> float:
        return self.at - time.monotonic()


_DEADLINE: list[Deadline] = []  # the outermost rank-local block's (empty: none, e.g. one process)


def deadline() -> Deadline | None:
    """The deadline of the rank-local block running now (None: none, e.g. one process). Read from any thread."""
    return _DEADLINE[0] if _DEADLINE else None


@contextlib.contextmanager
def rank_local_deadline(budget_s: float | None, flag: str) -> Iterator[None]:
    """A rank-local block that must end within `budget_s` seconds (None: unbounded); a nested block keeps the
    outer one's deadline when that is sooner."""
    outer = deadline()
    if budget_s is None or (outer is not None and outer.left() <= budget_s):
        yield
        return
    _DEADLINE[:] = [Deadline(time.monotonic() + budget_s, budget_s, flag)]
    try:
        yield
    finally:
        _DEADLINE[:] = [outer] if outer is not None else []


def reduce_mean(values: dict[str, float], info: DistInfo, weights: dict[str, float] | None = None) -> dict[str, float]:
    """Global mean of each scalar: sum over ranks of value x weight / sum of weights.

    `weights[k]` is what this rank's value of k is a mean over (its token count for a per-token
    mean, its count of non-NaN entries for a NaN-aware mean); keys without one weigh 1, which is
    exact for per-sample means since every rank holds the same number of samples. NaN entries
    (e.g. accuracy with no reference on a rank) are left out, with their weight."""
    if not info.enabled:
        return dict(values)
    keys = sorted(values)
    _check_same_keys(keys, info)
    weights = weights or {}
    vals = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=info.comm_device)
    w = torch.tensor([float(weights.get(k, 1.0)) for k in keys], dtype=torch.float64, device=info.comm_device)
    w = torch.where(torch.isfinite(vals), w, torch.zeros_like(w))
    stacked = torch.stack([torch.where(w > 0, vals * w, torch.zeros_like(vals)), w])
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
    means = stacked[0] / stacked[1].clamp(min=1e-12)
    means = torch.where(stacked[1] > 0, means, torch.full_like(means, float("nan")))
    return {k: float(v) for k, v in zip(keys, means.tolist())}


@contextlib.contextmanager
def no_sync(*models: torch.nn.Module | None) -> Iterator[None]:
    """Gradient accumulation without a gradient reduction per micro-batch: DDP's no_sync on every wrapped model.
    FSDP2-sharded models keep reducing: with their sync off (set_requires_gradient_sync(False)) every rank would
    hold whole, unsharded fp32 gradients between micro-batches (+4 bytes per parameter per model), what sharding is
    there to avoid; reduce-scattering each micro-batch keeps only the rank's gradient shard."""
    with contextlib.ExitStack() as stack:
        for model in models:
            if model is not None and hasattr(model, "no_sync") and not isinstance(model, FSDPModule):
                stack.enter_context(model.no_sync())
        yield


def fsdp_modules(model: torch.nn.Module | None) -> list[FSDPModule]:
    """Every FSDP2-sharded module in `model` (empty for a plain or DDP model)."""
    return [] if model is None else [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def unsharded(*models: torch.nn.Module | None) -> Iterator[None]:
    """Within the block, FSDP2-sharded models hold their whole parameters on every rank, so their forwards run
    no collective: sampling, where each rank stops at its own EOS (a per-layer all-gather per decoded token
    would leave ranks waiting on each other), and rank-local scoring. Entering all-gathers every layer (a
    collective: every rank enters together, outside rank-local blocks); leaving frees the gathered copies.
    Plain and DDP models pass through."""
    mods = [(m, m is not model) for model in models for m in fsdp_modules(model)]  # (module, not the root)
    for m, _ in mods:
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m, inner in mods:  # back to fully_shard's default: layers free their parameters after the forward,
            m.reshard()        # the root keeps its own for the backward that follows
            m.set_reshard_after_forward(inner)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (an FSDP2 DTensor parameter or gradient); the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """The full value of a DTensor (a collective for a sharded one; a replicated one is read locally), or `t`."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_same_keys(keys: list[str], info: DistInfo) -> None:
    """ValueError on every rank, naming the keys, when ranks would all-reduce different metric keys
    (gloo aborts on the size mismatch; NCCL hangs or reads past the buffer)."""
    crc = zlib.crc32("\n".join(keys).encode())
    t = torch.tensor([crc, -crc], dtype=torch.int64, device=info.comm_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    highest, neg_lowest = t.tolist()
    if highest == -neg_lowest:  # max == min: every rank has the same keys
        return
    per_rank = all_gather_objects(keys, info)
    common = set.intersection(*map(set, per_rank))
    diff = {r: sorted(set(k) - common) for r, k in enumerate(per_rank) if set(k) - common}
    raise ValueError(f"ranks logged different metric keys (beyond the common ones: {diff}); every rank must log the same keys")


def all_gather_objects(obj: _T, info: DistInfo) -> list[_T]:
    """Every rank's `obj` (e.g. RNG states for the resume file), in rank order."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: _T, info: DistInfo, src: int = 0) -> _T:
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def sum_global(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of a scalar tensor over ranks (a copy; the input is untouched)."""
    x = x.detach().float().clone()
    if info.enabled:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def rank_sum(info: DistInfo) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The `reduce` of trainer.ppo's batch statistics: sums a tensor over ranks (None for one process),
    so whitening and explained variance see every rank's tokens."""
    if not info.enabled:
        return None

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t
    return reduce


def comm(info: DistInfo) -> Comm | None:
    """The collectives of a policy loss over every rank's tokens (trainer.ppo.Comm); None for one process."""
    reduce = rank_sum(info)
    if reduce is None:
        return None

    def gather(t: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(t) for _ in range(info.world_size)]
        dist.all_gather(out, t.contiguous())
        return torch.cat(out)
    return Comm(sum=reduce, gather=gather, rank=info.rank)
