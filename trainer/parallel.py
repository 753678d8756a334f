"""Run independent pieces of work side by side on a CPU, one core each.

Why: at PPO's update shapes on a CPU (a few thousand tokens, hidden ~512) most ops are small
elementwise kernels, and splitting each across two cores barely pays (docs/speed-and-memory.md). The
actor's and the critic's forward/backward share no tensor, so instead each runs whole on its own core.

Each worker thread runs its ops single-threaded (torch's thread count is per thread under
OpenMP), so results do not depend on scheduling: a run is as deterministic as a sequential one.
They differ from a two-thread sequential run only in the rounding of the kernels' reductions.
Autocast and grad mode are thread-local, so each piece enters its own contexts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


def _one_thread() -> None:
    torch.set_num_threads(1)


def run_side_by_side(fns: Sequence[Callable[[], Any]], parallel: bool) -> list[Any]:
    """fns() -> their results, in order. parallel: each on its own single-threaded worker;
    else one after the other in the calling thread. An exception in any piece is re-raised here."""
    if not parallel or len(fns) < 2:
        return [fn() for fn in fns]
    threads = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(max_workers=len(fns), initializer=_one_thread) as pool:
            futures = [pool.submit(fn) for fn in fns]
            return [f.result() for f in futures]
    finally:
        # torch also keeps the last count set by any thread as the default for threads it starts later.
        torch.set_num_threads(threads)
