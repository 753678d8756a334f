"""CUDA graphs of the static decode step (`model/generation.py` StaticDecode), kept across rollouts.

A graph replays fixed addresses, so everything the step reads lives in buffers that outlive a rollout. Per device
this module keeps one capture stream (cuBLAS keeps a workspace per stream: one stream, one workspace), one memory
pool shared by every graph (only the step's temporaries live in it: no tensor made inside the step outlives it, so
graphs replayed one after another in any order cannot clobber each other; a new pool only after a failed capture,
see Backend.clean_up), one generator of its own (registered with
each graph; see `DeviceGraphs.drawing_from`), one copy of the decode weights (refreshed in place when a new decoder
comes: `_WeightSlot`), one K/V buffer the size of the largest shape asked for (each graph's K/V are views of it; a
rollout loads its prompt's K/V into them), and up to GRAPH_CAP graphs, least recently used dropped first, one per
shape bucket (`graph_shape`: rows and cache length rounded up), each with its small input/output buffers.

So a steady run captures once per bucket (a PPO run's fixed batch and varying prompt lengths: a handful), not once per
rollout, and reserved memory stops growing once every bucket has run. What stays allocated between
rollouts, through the update: the decode weights' copy (bf16: 2 bytes per parameter; fp32 weights used as they are
are read in place, not copied), the K/V buffer, the pool's temporaries and the graphs. `release_cuda_graphs()` frees
all of it; `--cuda_graphs 0` keeps none of it.

CPU tests play torch.cuda's part with a stand-in `Backend` (tests/test_decode_graphs.py); `BACKEND` is the real one.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .fast_decode import FastDecoder

GRAPH_CAP = 8  # graphs kept per device: a run's buckets fit; each is ~500 kernel nodes plus a few small buffers
ROW_BASE = 8  # rows: powers of two up to 8, then 8, 12, 16, 24, 32, 48, ...
LENGTH_BASE = 64  # cache length: powers of two up to 64, then 64, 96, 128, 192, 256, ...
_ALIGN = 256  # bytes: each view into the K/V buffer starts on this boundary


def shape_bucket(n: int, base: int) -> int:
    """n rounded up to a bucket: powers of two up to `base` (a power of two), then base x 2^k and 1.5 x base x 2^k,
    so a bucket above `base` is at most a third padding and a range of sizes maps to two buckets per doubling."""
    if n < 1:
        raise ValueError(f"shape_bucket: n must be >= 1, got {n}")
    if n <= base:
        return 1 << (n - 1).bit_length()
    b = base
    while n > b:
        if n <= b + b // 2:
            return b + b // 2
        b *= 2
    return b


def graph_shape(rows: int, length: int) -> tuple[int, int]:
    """(rows, cache length) of the graph a batch of `rows` rows decoding up to `length` positions (prompt + new
    tokens) runs in. Padded rows and positions are masked: they change no real row's tokens."""
    return shape_bucket(rows, ROW_BASE), shape_bucket(length, LENGTH_BASE)


# ------------------------------------------------------------------------------------------------ the decoder's tensors
def decoder_signature(fast: FastDecoder, model_ptrs: frozenset[int]) -> tuple:
    """What a graph of `fast`'s step bakes in besides the values it reads: its tensors' shapes and dtypes (and, for
    one that is a model parameter itself, its address), the LoRA scales, the compute dtype and layout choices."""
    shapes = tuple((tuple(t.shape), t.dtype, t.data_ptr() if t.data_ptr() in model_ptrs else 0) for t in fast.tensors())
    return shapes, fast.lora_scales(), fast.compute_dtype, fast.pack_gqa, fast.linear


class _WeightSlot:
    """The decode weights at fixed addresses: filled from each new FastDecoder (one device-to-device copy per new
    decoder: per rollout, or per step under reuse_decoder). A tensor that is a model parameter itself (an fp32 weight
    used as it is: detach() shares its storage) is not copied: graphs read it where it lies, and its address is in
    the signature."""

    def __init__(self, fast: FastDecoder, signature: tuple) -> None:
        self.signature = signature
        self.buffers = [None if ptr else torch.empty_like(t)
                        for t, (_s, _d, ptr) in zip(fast.tensors(), signature[0], strict=True)]
        self.source: weakref.ref | None = None  # the decoder last copied in

    def decoder_for(self, fast: FastDecoder) -> FastDecoder:
        tensors = fast.tensors()
        if self.source is None or self.source() is not fast:
            for buf, t in zip(self.buffers, tensors, strict=True):
                if buf is not None:
                    buf.copy_(t)
            self.source = weakref.ref(fast)
        return fast.reading([t if buf is None else buf for buf, t in zip(self.buffers, tensors, strict=True)])


# ------------------------------------------------------------------------------------------------ torch.cuda, in one place
class CaptureFailed(RuntimeError):
    """A capture that did not give a graph; `graph` is the CUDAGraph it began (for Backend.clean_up)."""

    def __init__(self, message: str, graph: Any) -> None:
        super().__init__(message)
        self.graph = graph


class Backend:
    """The torch.cuda calls the graph cache makes. CPU tests substitute a stand-in (tests/test_decode_graphs.py)."""

    def applies(self, device: torch.device) -> bool:
        """Whether sample()'s static step on `device` runs in bucketed shapes (graphs or not): CUDA only, so a
        CPU keeps its exact shapes, numbers and random stream."""
        return device.type == "cuda"

    def canonical(self, device: torch.device) -> torch.device:
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())

    def stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def pool(self, device: torch.device) -> Any:
        with torch.cuda.device(device):
            return torch.cuda.graph_pool_handle()

    def generator(self, device: torch.device) -> torch.Generator:
        return torch.Generator(device)

    def default_generator(self, device: torch.device) -> torch.Generator:
        return torch.cuda.default_generators[self.canonical(device).index]

    @contextlib.contextmanager
    def side_stream(self, stream: Any, device: torch.device) -> Iterator[None]:
        """Work queued inside runs on `stream`, after what the current stream queued before and before what it
        queues next."""
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                yield
        finally:
            current.wait_stream(stream)

    @contextlib.contextmanager
    def no_host_syncs(self) -> Iterator[None]:
        """Inside, an op that waits for the GPU (a .item(), a bool of a device tensor, a copy to the host) raises
        (torch.cuda.set_sync_debug_mode("error")) instead of running: such an op would invalidate a capture. The
        mode is process-wide, so it is held for one eager step only and the previous mode put back."""
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def capture(self, fn: Callable[[], None], stream: Any, pool: Any, device: torch.device, generator: torch.Generator) -> Any:
        """fn's CUDA work recorded in a CUDAGraph (nothing runs) on `stream`, its temporaries in `pool`, its draws
        from `generator` registered with it. torch.cuda.graph's context without its synchronize + empty_cache (a
        capture is rare here, but those would stall the rollout that pays for it) and with its failure handled:
        the stream's capture is always ended (torch's __exit__ does that too, raising capture_end's error, which says
        less than fn's). Raises CaptureFailed carrying the graph for clean_up."""
        graph = torch.cuda.CUDAGraph()
        try:
            graph.register_generator_state(generator)
            with self.side_stream(stream, device):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    fn()
                except Exception:
                    with contextlib.suppress(RuntimeError):
                        graph.capture_end()
                    raise
                graph.capture_end()
        except Exception as e:
            raise CaptureFailed(str(e).splitlines()[0] if str(e) else type(e).__name__, graph) from e
        return graph

    def replay(self, graph: Any) -> None:
        graph.replay()

    def clean_up(self, graph: Any, device: torch.device, pool: Any, generators: list[torch.Generator]) -> bool:
        """What a failed capture leaves behind, undone (read in torch 2.11-2.13's CUDAGraph.cpp and
        CUDAGeneratorImpl.cpp: capture_end raises at cudaStreamEndCapture before its own bookkeeping):
        - the caching allocator still routes the capture's allocations to the pool: ended here (torch 2.13's host
          allocator does too, and nothing in Python ends that: the caller moves on to a new pool, as a capture into
          the old one would be refused, and keeps the graph: FAILED_GRAPHS);
        - the graph still counts as capturing and holds per-capture generator state: reset() drops both;
        - torch <= 2.12 keeps a "capturing" flag on each registered generator's state that only a successful
          capture_end clears, so the next eager draw raises ("Offset increment outside graph capture"): a generator
          that cannot draw gets a fresh copy of its state (same seed and offset; graphsafe_set_state). torch 2.13
          keys that state by capture id instead, so eager draws are unaffected there and nothing is replaced.
        Returns True where a generator's state was replaced: graphs registered with the old one must go."""
        with contextlib.suppress(RuntimeError):
            torch._C._cuda_endAllocateToPool(self.canonical(device).index, pool)
        with contextlib.suppress(RuntimeError):
            graph.reset()
        replaced = False
        for gen in generators:
            if not _draws(gen):
                rng = gen.get_state()
                gen.graphsafe_set_state(gen.clone_state())
                gen.set_state(rng)
                replaced = True
        return replaced


def _draws(gen: torch.Generator) -> bool:
    """Whether an eager draw from `gen` works; its state is put back either way."""
    rng = gen.get_state()
    try:
        torch.empty(1, device=gen.device).uniform_(generator=gen)
        return True
    except RuntimeError:
        return False
    finally:
        gen.set_state(rng)


BACKEND: Backend = Backend()


# ------------------------------------------------------------------------------------------------ the per-device cache
@dataclass
class Entry:
    """One bucket's graph and the StaticDecode whose buffers it reads (created and filled by model/generation.py)."""

    dec: Any
    graph: Any = None


class DeviceGraphs:
    """The graphs of one device and what they read (see the module's docstring)."""

    def __init__(self, backend: Backend, device: torch.device) -> None:
        self.backend, self.device = backend, device
        self.stream = backend.stream(device)
        self.pool = backend.pool(device)
        self.generator = backend.generator(device)
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()
        self.refused: set[tuple] = set()  # keys whose step could not be captured: they run eagerly, unasked
        self.captures = self.failures = 0
        self.arena: torch.Tensor | None = None
        self.slot: _WeightSlot | None = None
        self.owner: tuple[weakref.ref, tuple[int, ...]] | None = None
        self.model_ptrs: frozenset[int] = frozenset()

    def bind(self, lm: nn.Module) -> None:
        """Graphs also read the model's own tensors (embeddings, norms, rotary tables) where they lie: another
        model, or parameters moved to new storage, drops every graph (and the weight copy)."""
        ptrs = tuple(t.data_ptr() for t in itertools.chain(lm.parameters(), lm.buffers()))
        if self.owner is None or self.owner[0]() is not lm or self.owner[1] != ptrs:
            self.entries.clear()
            self.slot = None
            self.owner, self.model_ptrs = (weakref.ref(lm), ptrs), frozenset(ptrs)

    def signature(self, fast: FastDecoder) -> tuple:
        return decoder_signature(fast, self.model_ptrs)

    def decoder(self, fast: FastDecoder, signature: tuple) -> FastDecoder:
        """`fast` reading the weight copy (refreshed from it if it is a new decoder)."""
        if self.slot is None or self.slot.signature != signature:
            self.entries.clear()  # they read the old copy
            self.slot = None
            self.slot = _WeightSlot(fast, signature)
        return self.slot.decoder_for(fast)

    def kv(self, layout: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Views [shape] of dtype into the one K/V buffer, one per (shape, dtype), each contiguous. The buffer grows
        to the largest layout asked for; growing drops every graph (they read the old one)."""
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in layout]
        total = sum(-(-n // _ALIGN) * _ALIGN for n in sizes)
        if self.arena is None or self.arena.numel() < total:
            if self.arena is not None:
                self.entries.clear()
                self.arena = None  # freed before the larger one is made
            self.arena = torch.empty(total, dtype=torch.uint8, device=self.device)
        views, offset = [], 0
        for (shape, dtype), n in zip(layout, sizes):
            views.append(self.arena[offset : offset + n].view(dtype).view(shape))
            offset += -(-n // _ALIGN) * _ALIGN
        return views

    def capture(self, fn: Callable[[], None], generator: torch.Generator) -> Any:
        """fn recorded as a graph of this device (its stream and pool, `generator` registered with it). A capture that
        fails raises CaptureFailed once what it left in torch is cleaned up (Backend.clean_up): the graph kept
        (FAILED_GRAPHS), the graphs registered with a generator state that had to be replaced dropped, and captures
        going on in a new pool (the old one may still be routed to)."""
        try:
            graph = self.backend.capture(fn, self.stream, self.pool, self.device, generator)
        except CaptureFailed as e:
            FAILED_GRAPHS.append(e.graph)
            self.failures += 1
            if self.backend.clean_up(e.graph, self.device, self.pool, [generator, self.backend.default_generator(self.device)]):
                self.entries.clear()
            self.pool = self.backend.pool(self.device)
            raise
        self.captures += 1
        return graph

    def refuse(self, key: tuple) -> None:
        """`key`'s step cannot be captured: it runs eagerly from now on, unasked."""
        self.refused.add(key)

    def get(self, key: tuple) -> Entry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def keep(self, key: tuple, entry: Entry) -> None:
        self.entries[key] = entry
        self.entries.move_to_end(key)
        while len(self.entries) > GRAPH_CAP:
            self.entries.popitem(last=False)

    @contextlib.contextmanager
    def drawing_from(self, source: torch.Generator) -> Iterator[torch.Generator]:
        """The graphs draw from this device's own generator, registered with each at capture (a caller's generator
        may be new every call: evaluation makes one per run). It takes `source`'s seed and offset first and hands
        them back after, advanced by the draws made: `source` moves on as eager draws from it would have moved it,
        and the draws are the same Philox numbers (same seed, offset and kernels)."""
        self.generator.set_state(source.get_state())
        try:
            yield self.generator
        finally:
            source.set_state(self.generator.get_state())


_DEVICES: dict[torch.device, DeviceGraphs] = {}
# Graphs whose capture failed, never freed: torch 2.13's host allocator keeps a filter that points at one (capture_end
# raised before ending it, and no Python call ends it). One per failed bucket, and a failed bucket is not tried again.
FAILED_GRAPHS: list[Any] = []


def device_graphs(device: torch.device) -> DeviceGraphs:
    """The graph cache of `device` (made on first use; made again if BACKEND was replaced, as tests do)."""
    device = BACKEND.canonical(device)
    dev = _DEVICES.get(device)
    if dev is None or dev.backend is not BACKEND:
        dev = _DEVICES[device] = DeviceGraphs(BACKEND, device)
    return dev


def release_cuda_graphs() -> None:
    """Drop every device's graphs, weight copy, K/V buffer, pool and stream (the next graphed sample() captures
    again). Memory returns to torch's caching allocator (torch.cuda.empty_cache() hands it to the driver)."""
    _DEVICES.clear()


def graph_stats(device: torch.device) -> dict[str, int]:
    """captures (successful, since the cache was made), failures (captures that failed), refused (shape buckets that
    run eagerly), graphs (kept now), kv_bytes (the K/V buffer) of `device`'s cache; zeros where it has none."""
    dev = _DEVICES.get(BACKEND.canonical(device))
    if dev is None:
        return {"captures": 0, "failures": 0, "refused": 0, "graphs": 0, "kv_bytes": 0}
    return {"captures": dev.captures, "failures": dev.failures, "refused": len(dev.refused), "graphs": len(dev.entries),
            "kv_bytes": 0 if dev.arena is None else dev.arena.numel()}
