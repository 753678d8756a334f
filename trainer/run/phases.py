"""The `phase(...)` context the PPO steps run their work in (trainer/runtime.py `Phase`): one `with` for the
phase's timer, its autocast and, for rank-local work, the agreement on a failure that happened on some
ranks only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from trainer.run.distributed import failing_together
from trainer.run.timing import PhaseTimer
from trainer.runtime import Phase, Runtime


def phases(timer: PhaseTimer, rt: Runtime) -> Phase:
    """A Phase timing into `timer`, with `rt`'s autocast and process group."""
    @contextlib.contextmanager
    def phase(name: str, *, device: torch.device | None = None, autocast: bool = True,
              rank_local: bool = False) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if rank_local:  # outermost: a failure anywhere inside is agreed on by every rank
                stack.enter_context(failing_together(rt.info))
            stack.enter_context(timer(name))
            if autocast:
                stack.enter_context(rt.autocast(device))
            yield
    return phase
