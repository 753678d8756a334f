"""--async_rollouts K: the rollout engine samples the next K batches while the trainer scores and updates (verl's
one-step off-policy trainer for K = 1, prime-rl's --async-level K).

    ahead = SampledAhead(cfg, m, rt, run, sample)   # after the engine serves the start weights (version run.step)
    for batch in ahead.batches():                   # the same batches, in the same order, as run.batches()
        ro = ahead.take(phase)                      # batch t's samples; pushes the weights of t updates; asks for t+K
        ...score and update on ro...

Timeline (K = 1, --engine_sync_interval 1): before step 0 the engine is asked for batch 0 (weights 0); at step t the
trainer waits for batch t, pushes its weights (t updates: the engine is idle then, nothing is in flight), asks for
batch t+1 and scores and updates on batch t while the engine samples batch t+1. A step takes about the longer of
sampling and scoring + updating (+ the push), not their sum. Batch t is sampled by weights t-1 and trained from
weights t: one update behind, which the truncated importance weights (--rollout_is: the trainer's forward over the
engine's log-probs, the behaviour policy's) correct. In general a batch trained at step t was asked for at step t-K,
after that step's push: it is at most K + I - 1 updates behind (I = --engine_sync_interval: the engine misses up to
I - 1 updates between pushes), and a batch found staler than that (its weight version: every response carries it) is
refused with one line.

Who does what: one daemon thread per rank sends this rank's requests to its engine, in order; the trainer's thread
does everything else, every collective included, in the same order on every rank (the wait for a batch is a rank-local
block, bounded by the rank-local deadline under torchrun; the push is push_weights, as in the synchronous loop).

Prompts are drawn in the synchronous loop's order (Run.next_batch); each batch's seeds come from its own generator
(--seed, rank, step), not torch's default stream, so sampling ahead draws nothing the update would otherwise draw.
Resume: the resume file holds the data position after the last trained batch and the samples of the batches in
flight that are done (this rank's, per rank): a resumed run trains on those same samples, so it equals the
uninterrupted run (with the same world size; with another one they are sampled again, by the resumed weights). A save
waits for them within the rank-local block's deadline; a save at a stop signal (preemption: it must fit in the
signal's lead time) at most PREEMPT_WAIT_S. A batch not done by then, or failed (the engine may be what failed), is
left out: the resumed run samples it again from the saved data position, by the resumed weights (its figures then
differ from an uninterrupted run's; no prompt is repeated or skipped).
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field

import torch

from trainer import dist as D
from trainer.config import Config
from trainer.engine import EngineError, EngineUnreachable, exits_on_engine_error, sampling_ahead
from trainer.rollout import Rollout
from trainer.run.distributed import failing_together
from trainer.run.engine_sync import push_weights
from trainer.run.lifecycle import Run
from trainer.runtime import Models, Phase, Runtime

# train_ppo.sample_rollout(cfg, batch, m, rt, tools, generator=..., oldest_version=...) -> (the batch's rollout, None)
Sample = Callable[..., tuple[Rollout, object]]
_SAVED = ("sequences", "attention_mask", "response_mask", "has_eos", "rollout_logprobs")
PREEMPT_WAIT_S = 10.0  # the longest a save at a stop signal waits for the batches in flight, all of them together


@dataclass
class Pending:
    """A batch asked for ahead: the step that trains on it, its prompts, the run's data position after drawing it,
    and its samples (a future; done already when restored from a resume file)."""

    index: int
    batch: dict
    position: tuple[int, int]  # (epoch, consumed) after this batch: what a save after its step records
    future: Future = field(default_factory=Future)


class Worker:
    """One daemon thread running jobs in order (a dead trainer never waits for it to end)."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name="sample-ahead", daemon=True).start()

    def _loop(self) -> None:
        sampling_ahead()
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the trainer's thread re-raises it where it waits
                fut.set_exception(e)

    def submit(self, fn: Callable[[], Rollout], fut: Future) -> None:
        self.jobs.put((fn, fut))

    def stop(self) -> None:
        self.jobs.put(None)


def max_lag(cfg: Config) -> int:
    """The most updates a batch's sampling weights may be behind the weights it trains (K + I - 1)."""
    return cfg.async_rollouts + cfg.engine_sync_interval - 1


def check_lag(ro: Rollout, step: int, cfg: Config, url: str) -> int:
    """The batch trained at `step`: how many updates behind its sampling weights are; EngineError beyond max_lag."""
    if ro.weight_version is None:
        raise EngineError(f"the engine at {url} did not say which weights sampled the batch of step {step + 1}; "
                          f"--async_rollouts needs the weight version of every batch")
    lag = step - ro.weight_version
    if lag < 0 or lag > max_lag(cfg):
        raise EngineError(
            f"the batch of step {step + 1} was sampled by weight version {ro.weight_version}, {lag} updates behind the "
            f"trainer's {step}: --async_rollouts {cfg.async_rollouts} with --engine_sync_interval "
            f"{cfg.engine_sync_interval} allows 0 to {max_lag(cfg)}; refused (is another run pushing to the engine, or was "
            f"it restarted?); restart the engine, then continue with --from_resume 1")
    return lag


def batch_seed(seed: int, rank: int, index: int) -> torch.Generator:
    """The generator of the sampling seeds of batch `index` on `rank`: a function of them alone."""
    return torch.Generator().manual_seed(zlib.crc32(f"minippo-ahead/{seed}/{rank}/{index}".encode()))


def _saved(ro: Rollout, index: int) -> dict:
    return {"index": index, "prompt_len": ro.prompt_len, "weight_version": ro.weight_version,
            **{k: getattr(ro, k).detach().cpu() for k in _SAVED}}


def _restored(d: dict, device: torch.device) -> Rollout:
    return Rollout(prompt_len=int(d["prompt_len"]), weight_version=d["weight_version"],
                   **{k: d[k].to(device) for k in _SAVED})


class SampledAhead:
    """The batches of a run with --async_rollouts K, each asked for K steps before it is trained (module docstring)."""

    def __init__(self, cfg: Config, m: Models, rt: Runtime, run: Run, sample: Sample) -> None:
        assert m.engine is not None and cfg.async_rollouts > 0
        self.cfg, self.m, self.rt, self.run, self.sample = cfg, m, rt, run, sample
        self.queue: deque[Pending] = deque()
        self.next_index = run.step
        self.exhausted = False
        self.worker = Worker()
        self.restored = {int(d["index"]): d for d in (run.resumed_ahead or [])}
        run.sampled_ahead = self.in_flight

    # ---- the trainer's thread
    def batches(self) -> Iterator[dict]:
        """run.batches(), drawn ahead: this rank's prompt batches in order until the last step or a stop signal."""
        try:
            while self.run.step < self.run.rt.total_steps:
                self._ask(self.run.step + self.cfg.async_rollouts - 1)
                if not self.queue:
                    return
                yield self.queue[0].batch
                if self.run.step >= self.run.rt.total_steps or self.run.stopped_by:
                    return
        finally:
            self.worker.stop()  # what is in flight is dropped (a resume file holds what a resumed run needs)

    def take(self, phase: Phase) -> Rollout:
        """Batch t's samples (t = run.step), waited for in a rank-local block; then the push of the weights of t updates
        where one is due (every --engine_sync_interval), then the request for batch t+K."""
        step, engine = self.run.step, self.m.engine
        assert engine is not None
        head = self.queue.popleft()
        assert head.index == step, (head.index, step)
        with phase("generate", autocast=False, rank_local=True), exits_on_engine_error():
            ro = self._wait(head)
            ro = dataclasses.replace(ro, staleness=check_lag(ro, step, self.cfg, engine.url))
        self.run.trained_pos = head.position
        if step % self.cfg.engine_sync_interval == 0 and engine.version != step:
            with phase("engine_sync", autocast=False):
                push_weights(self.cfg, self.m, self.rt, version=step)
        self._ask(step + self.cfg.async_rollouts)
        return ro

    def in_flight(self) -> list[dict]:
        """For a save: the samples of the batches asked for that are done, as the resume file keeps them. Waited for
        (rank-local) until the block's deadline, at a stop signal at most PREEMPT_WAIT_S: a preempted run must save
        within the signal's lead time whatever the engine does. A batch not done by then or failed is left out (the
        resumed run samples it again; a failure is raised where the step waits for it, `take`)."""
        with failing_together(self.rt.info):
            due = D.deadline()
            bound = None if due is None else max(due.left(), 0.0)
            if self.run.stopped_by:
                bound = PREEMPT_WAIT_S if bound is None else min(bound, PREEMPT_WAIT_S)
            wait_for([p.future for p in self.queue], timeout=bound)
            kept = [_saved(p.future.result(), p.index) for p in self.queue
                    if p.future.done() and not p.future.cancelled() and p.future.exception() is None]
        if len(kept) < len(self.queue):
            print(f"warning: rank {self.rt.info.rank}: the save after step {self.run.step} keeps {len(kept)} of the "
                  f"{len(self.queue)} batches sampled ahead (the others were not done in time or failed); a resumed "
                  f"run samples those again", file=sys.stderr, flush=True)
        return kept

    def _wait(self, p: Pending) -> Rollout:
        due = D.deadline()
        try:
            return p.future.result(timeout=None if due is None else max(due.left(), 0.0))
        except FutureTimeout:
            assert due is not None and self.m.engine is not None
            raise EngineUnreachable(self.m.engine._too_slow(due, f"the batch of step {p.index + 1} (asked for ahead)")) from None

    def _ask(self, last: int) -> None:
        """Draw the batches up to step `last` (not past the run's last step) and ask the engine for each, in order."""
        last = min(last, self.run.rt.total_steps - 1)
        engine = self.m.engine
        assert engine is not None
        while self.next_index <= last and not self.exhausted:
            batch = self.run.next_batch()
            if batch is None:  # the prompt data ran out (the same on every rank)
                self.exhausted = True
                return
            pos = self.run.pos
            p = Pending(self.next_index, batch, (pos.epoch, pos.consumed))
            saved = self.restored.pop(p.index, None)
            ro = None if saved is None else _restored(saved, self.rt.device)
            n = self.cfg.num_generations
            if ro is not None and torch.equal(ro.sequences[::n, :ro.prompt_len].cpu(), batch["input_ids"].cpu()):
                p.future.set_result(ro)  # sampled before the resume: the same samples as the uninterrupted run
            else:
                oldest, gen = engine.version, batch_seed(self.cfg.seed, self.rt.info.rank, p.index)
                assert oldest is not None
                self.worker.submit(lambda b=batch, g=gen, v=oldest: self.sample(self.cfg, b, self.m, self.rt, None, generator=g,
                                                                                oldest_version=v)[0], p.future)
            self.queue.append(p)
            self.next_index += 1
