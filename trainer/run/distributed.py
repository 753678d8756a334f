"""The run's process group: torchrun detection, device choice, the way out, failures agreed across ranks, data
sharding. The collectives PPO's parts use (DistInfo, any_rank, reduce_mean, ...) are trainer/dist.py's: import
them from there (`from trainer import dist as D`), this module as `from trainer.run import distributed`.

`python train_ppo.py` is one process; `torchrun --nproc_per_node N train_ppo.py` sets RANK,
LOCAL_RANK and WORLD_SIZE, and we initialise from them: NCCL on CUDA, gloo on CPU (so several
CPU processes work, which is how CI tests DDP here). `LOCAL_RANK` picks the device,
`RANK`/`WORLD_SIZE` pick the data shard and who logs.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from trainer import dist as D  # the primitives (DistInfo, any_rank, ...): callers import them from there

T = TypeVar("T")


def resolve_device(flag: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """`--device auto|cpu|cuda|cuda:N`: auto takes the local GPU when there is one.
    Under torchrun each process takes cuda:LOCAL_RANK; a fixed `cuda:N` would put every rank on one GPU."""
    if flag == "auto":
        flag = "cuda" if torch.cuda.is_available() else "cpu"
    if flag.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit(f"error: --device {flag}: CUDA is not available on this machine; use --device cpu")
        if flag != "cuda" and world_size > 1:
            raise SystemExit(f"error: --device {flag}: with {world_size} processes use --device cuda "
                             f"(each process takes cuda:LOCAL_RANK) or CUDA_VISIBLE_DEVICES")
        if flag == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise SystemExit(f"error: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible: "
                                 f"lower torchrun's --nproc_per_node")
            return torch.device("cuda", local_rank)
    return torch.device(flag)


def gpu_identity(device: torch.device) -> str:
    """Which physical GPU `device` is, comparable across processes and hosts: its UUID. Device names are
    not: on two nodes every rank's first GPU is cuda:0, and under per-process CUDA_VISIBLE_DEVICES (SLURM's
    --gpus-per-task) cuda:0 of two processes on one host are two GPUs. Without a UUID: host name and
    the physical index CUDA_VISIBLE_DEVICES maps the device to."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid:
        return f"GPU-{uuid}" if not str(uuid).startswith("GPU-") else str(uuid)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return f"{socket.gethostname()}:{visible[index] if index < len(visible) else index}"


_WAIT_GROUP: list = []  # the gloo group that waits for rank 0's writes (init_distributed makes it)
_TIMEOUTS: dict[str, int] = {}  # init_distributed's: "ddp" (the training group's collectives), "save" (_WAIT_GROUP's)


def init_distributed(device_flag: str = "auto", timeout_s: int = 1800, cpu_collectives: bool = False,
                     group_of_one: bool = False, wait_timeout_s: int = 7200) -> D.DistInfo:
    """Initialise from torchrun's environment, or return a single-process DistInfo. `cpu_collectives`: on GPUs,
    a gloo backend beside NCCL for collectives on host tensors (FSDP2's --cpu_offload reduces and gathers its
    host-memory shards: gradient-norm and whole-state-dict collectives). `group_of_one`: one process without
    torchrun still gets a process group (FSDP2 shards over one; our own collectives stay no-ops)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if world_size % local_world_size:  # before any collective: every rank reads the same environment
        raise SystemExit(f"error: WORLD_SIZE {world_size} is not a multiple of LOCAL_WORLD_SIZE {local_world_size}: start the "
                         f"same number of processes on every node (torchrun --nproc_per_node)")
    device = resolve_device(device_flag, local_rank, world_size)
    backend = ""
    if (world_size > 1 or group_of_one) and device.type == "cuda" and not dist.is_initialized():
        # FSDP2 and NCCL work on the current device: it must be this process's own (a group of one on --device cuda:1
        # would otherwise shard onto cuda:0 while sampling on cuda:1).
        torch.cuda.set_device(device)
    if world_size > 1:
        if not dist.is_initialized():
            backend = ("cuda:nccl,cpu:gloo" if cpu_collectives else "nccl") if device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
            # Every rank creates it, at the same point: what main_writes waits on (gloo: NCCL's watchdog never sees it).
            _WAIT_GROUP[:] = [dist.new_group(backend="gloo", timeout=timedelta(seconds=wait_timeout_s))]
            _TIMEOUTS.update(ddp=timeout_s, save=wait_timeout_s)
        backend = str(dist.get_backend())
    elif group_of_one and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, timeout=timedelta(seconds=timeout_s))
    return D.DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device, backend=backend,
                      local_world_size=local_world_size)


_KEPT: list = []  # freed by os._exit, never by Python: see exit_after


def keep_until_exit(obj: object) -> None:
    """Keep `obj` (the built models, an exception's traceback) alive until a torchrun process leaves
    through exit_after's os._exit. Freeing a DDP module frees its reducer's gloo group, whose destructor
    joins a worker thread that needs the GIL the freeing thread holds: a hang at exit."""
    _KEPT.append(obj)


def exit_after(main: Callable[[], None]) -> None:
    """The script's entry point. A run under torchrun leaves with os._exit once its own clean-up has run
    (the final barrier, the process group destroyed, logs closed), however it ends: finished, stopped (an
    error agreed by every rank, a non-finite stop, a signal) or crashed. Interpreter shutdown is where
    torch's gloo group can hang or abort: the DDP reducer's destructor joins a worker thread, holding
    the GIL that thread needs to free the last collective's tensors ("terminate called without an
    active exception", or a hang about 1 run in 10 seen here). The same deadlock waits for any rank that
    frees a DDP module before os._exit (its reducer owns the group): so an exception, whose traceback holds
    the frames that hold the models, is kept to the end, and so is what `keep_until_exit` was given.
    One process exits normally."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        main()
        return
    code: int = 0
    try:
        main()
    except BaseException as e:  # noqa: BLE001 - every way out leaves by os._exit
        keep_until_exit(e)
        if isinstance(e, SystemExit):
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        else:  # a crash, or a second Ctrl-C (the run has marked itself interrupted on the way out): its traceback
            traceback.print_exc()
            code = 130 if isinstance(e, KeyboardInterrupt) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier(info: D.DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        if info.comm_device.type == "cuda":  # NCCL would otherwise guess each rank's device (and warn)
            dist.barrier(device_ids=[info.device.index])
        else:
            dist.barrier()


def cleanup(info: D.DistInfo) -> None:
    """Wait for every rank (rank 0 may still be writing a checkpoint), then shut down cleanly."""
    if info.enabled and dist.is_initialized():
        barrier(info)
        dist.destroy_process_group()


def one_line(e: BaseException) -> str:
    """An exception as one line: our own errors (SystemExit lines, this project's error classes, whose
    messages are written for users) as they are, others as `Type: first line`."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, SystemExit):
        text = str(e.code) if e.code is not None else "exit"
    elif type(e).__module__.split(".")[0] in ("trainer", "model", "dataset") and first:
        text = first
    else:
        text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return text.removeprefix("error: ")


def stop_all(error: str | None, info: D.DistInfo) -> None:
    """Every rank calls this at the same point. If any rank brings an error, every rank stops: rank 0
    with the first failing rank's one line, the others quietly (not one traceback per rank)."""
    if not D.any_rank(error is not None, info):
        return
    errors = D.all_gather_objects(error, info)
    rank, msg = next((r, e) for r, e in enumerate(errors) if e is not None)
    cleanup(info)  # every rank is here: leave together (rank 0 hosts the store the others would wait on)
    raise SystemExit(f"error: {'rank ' + str(rank) + ': ' if info.enabled else ''}{msg}" if info.is_main else 1)


def block_budget(kind: str = "ddp") -> tuple[float | None, str]:
    """How long a rank-local block may run under torchrun before the others' wait for it in the collective at its
    end reaches the process group's timeout (`kind` "ddp": --ddp_timeout; "save": --save_timeout, the wait group's),
    less a margin (a tenth, at least 5 s, at most half) for the work around it; None where there is no such wait."""
    t = _TIMEOUTS.get(kind)
    return (None, "") if t is None else (t - min(max(5.0, 0.1 * t), 0.5 * t), f"--{kind}_timeout {t}")


@contextlib.contextmanager
def failing_together(info: D.DistInfo, kind: str = "ddp") -> Iterator[None]:
    """Around rank-local work that can fail on some ranks only (a bad file on one node, a reward
    function that throws, OOM): the failure is agreed on at the end of the block, so no rank is left
    waiting in a collective the failed rank never reaches (NCCL would wait for its timeout). The block
    must not run collectives itself. One process: exceptions pass through unchanged. Under torchrun the
    block also has a deadline (`block_budget(kind)`, trainer.dist.deadline()): what waits on something
    outside the process (a rollout engine's requests) gives up in time to end the run with one line."""
    error = None
    try:
        with D.rank_local_deadline(*block_budget(kind)) if info.enabled else contextlib.nullcontext():
            yield
    except (Exception, SystemExit) as e:  # KeyboardInterrupt passes: a second Ctrl-C exits at once
        if not info.enabled:
            raise
        error = one_line(e)
    if info.enabled:
        stop_all(error, info)


def in_turn(fn: Callable[[], None], info: D.DistInfo, mine: bool) -> None:
    """fn() on the ranks whose turn it is (`mine`) while the others wait on a barrier of their own gloo group, whose
    timeout is --save_timeout: not in a collective of the training group, which the NCCL watchdog (or gloo's own
    timeout) would end at --ddp_timeout. Every rank reaches the barrier, also after a failure, which then reaches
    every rank as in failing_together."""
    with failing_together(info, "save"):
        try:
            if mine:
                fn()
        finally:
            if info.enabled and _WAIT_GROUP:
                dist.barrier(group=_WAIT_GROUP[0])


def main_writes(fn: Callable[[], None], info: D.DistInfo) -> None:
    """fn() on rank 0 only (the resume file: 16-20 bytes per parameter, which on a slow shared filesystem can take
    longer than --ddp_timeout), the other ranks waiting outside the training group (`in_turn`)."""
    in_turn(fn, info, info.is_main)


def on_main(fn: Callable[[], T], info: D.DistInfo) -> T:
    """fn() on rank 0 only (file checks, hashing, choosing a resume file); its result, or its error,
    reaches every rank."""
    if not info.enabled:
        return fn()
    result: T | None = None  # on the other ranks, the slot rank 0's result is broadcast into
    error = None
    if info.is_main:
        try:
            result = fn()
        except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever fn() raises, every rank stops with its one line
            error = one_line(e)
    stop_all(error, info)  # past it, rank 0's fn() returned: what every rank receives is a T
    return cast(T, D.broadcast_object(result, info))


def shard_batches(n: int, seed: int, epoch: int, start: int, rank: int, world: int, batch: int) -> list[list[int]]:
    """This rank's batches for one epoch of the global sample stream, from global position `start`.

    Like DistributedSampler (a permutation reseeded per epoch, rank r taking every world-th
    sample) but resumable at any global position, also under a different world size. The
    tail that cannot fill a batch on every rank is dropped, so all ranks run the same number of
    steps and none waits in a collective at the end of an epoch."""
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    stream = torch.randperm(n, generator=g).tolist()[start:]
    per_step = batch * world
    steps = len(stream) // per_step
    return [stream[s * per_step + rank : (s + 1) * per_step : world] for s in range(steps)]
