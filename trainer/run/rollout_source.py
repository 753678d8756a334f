"""Where a run's rollouts come from: the one owner of the prompt batches of each step, their samples (the actor's in
this process or a rollout engine's; single turns, or --tools episodes), the further samples a step asks for (DAPO's
extra prompts, ReMax's greedy replies), when the engine gets the updated weights, and what a resume file keeps of it.

    source = make_rollout_source(cfg, m, rt, tools)    # TakingTurns, or SampledAhead with --async_rollouts K
    with Run(cfg, built, source) as run:               # a resumed run hands the source its saved state (`restore`)
        for batch in source.batches(run):              # the run's prompt batches, in order
            ro, episodes = source.rollout(batch, phase)  # batch t's samples (in train_ppo.make_experience)
            ...                                        # reward, score, update t
            source.after_update(run.step, phase)       # the engine gets the updated weights when due
            run.end_step(metrics, samples)             # a save asks the source for its state (`state`)

Two kinds:
- TakingTurns (--async_rollouts 0, the default): step t samples batch t by the weights of t updates (the actor's, or
  the engine's, which got them after update t-1), then scores and updates on it: sampling and training take turns.
- SampledAhead (--async_rollouts K): the engine samples the next K batches while the trainer scores and updates
  (verl's one-step off-policy trainer for K = 1, prime-rl's --async-level K).

Weight pushes: trainer/run/engine_sync.py start_engine pushes the weights the run starts from, once, before the first
rollout; after that `_sync_weights` alone calls push_weights, by one rule: the engine gets the weights of v updates
when v is a multiple of I = --engine_sync_interval. Taking turns, right after the update that makes them
(`after_update`): the next batch is sampled by them. Sampling ahead, at step v once batch v has arrived (`rollout`):
for K = 1 nothing is in flight then.

Timeline of sampling ahead (K = 1, I = 1): before step 0 the engine is asked for batch 0 (weights 0); at step t the
trainer waits for batch t, pushes its weights (t updates: the engine is idle then, nothing is in flight), asks for
batch t+1 and scores and updates on batch t while the engine samples batch t+1. A step takes about the longer of
sampling and scoring + updating (+ the push), not their sum. Batch t is sampled by weights t-1 and trained from
weights t: one update behind, which the truncated importance weights (--rollout_is: the trainer's forward over the
engine's log-probs, the behaviour policy's) correct. In general a batch trained at step t was asked for at step t-K,
after that step's push: it is at most K + I - 1 updates behind (the engine misses up to I - 1 updates between pushes),
and a batch found staler than that (its weight version: every response carries it) is refused with one line.

Who does what, sampling ahead: one daemon thread per rank sends this rank's requests to its engine, in order; it is in
no rank-local block, so its requests keep to no rank-local deadline (deadline=None: --engine_timeout alone). The
trainer's thread does everything else, every collective included, in the same order on every rank; its wait for a
batch is a rank-local block, bounded by the rank-local deadline under torchrun. Prompts are drawn in the order taking
turns draws them (Run.next_batch); each batch's seeds come from its own generator (--seed, rank, step), not torch's
default stream, so sampling ahead draws nothing the update would otherwise draw.

Resume (`state` / `restore`): sampling ahead, a resume file holds the data position after the last trained batch and
the samples of the batches in flight that are done (this rank's, per rank): a resumed run trains on those same
samples, so it equals the uninterrupted run (with the same world size; with another one they are sampled again, by the
resumed weights). A save waits for them within the rank-local block's deadline; a save at a stop signal (preemption:
it must fit in the signal's lead time) at most PREEMPT_WAIT_S. A batch not done by then, or failed (the engine may be
what failed), is left out: the resumed run samples it again from the saved data position, by the resumed weights (its
figures then differ from an uninterrupted run's; no prompt is repeated or skipped). Taking turns keeps nothing: the
run's own data position is the one after the last trained batch.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
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
from typing import Any, Protocol

import torch

from trainer import dist as D
from trainer.config import Config
from trainer.engine import IN_BLOCK, EngineError, EngineUnreachable, RequestDeadline, exits_on_engine_error
from trainer.multiturn import Episode, generate_episodes
from trainer.rollout import Rollout, generate_rollout
from trainer.run.distributed import failing_together
from trainer.run.engine_sync import push_weights
from trainer.runtime import Models, Phase, Runtime
from trainer.tools import ToolRunner

Sampling = tuple[Rollout, list[Episode] | None]  # a batch's samples, and with --tools their episodes (else None)
_SAVED = ("sequences", "attention_mask", "response_mask", "has_eos", "rollout_logprobs")
PREEMPT_WAIT_S = 10.0  # the longest a save at a stop signal waits for the batches in flight, all of them together


class PromptStream(Protocol):
    """What a rollout source draws from: the run's prompt batches in order, and where the run stands
    (trainer/run/lifecycle.py Run)."""

    stopped_by: str | None  # the signal that stopped the run (None: none)

    @property
    def step(self) -> int:
        """PPO steps done."""
        ...

    @property
    def data_position(self) -> tuple[int, int]:
        """(epoch, consumed) after the batches drawn so far."""
        ...

    def batches(self) -> Iterator[dict]:
        """One batch per step until the last step, the end of the data or a stop signal."""
        ...

    def next_batch(self) -> dict | None:
        """The next batch of the global prompt stream (None: the data ran out)."""
        ...


@dataclass(frozen=True)
class RolloutState:
    """What a save keeps of a rollout source, on this rank."""

    position: tuple[int, int] | None  # (epoch, consumed) after the last trained batch (None: the run's own position)
    in_flight: list[dict] | None  # the samples of the batches asked for ahead that are done (None: nothing kept)


class RolloutSource(abc.ABC):
    """A run's rollouts (module docstring). The trainer asks it for the run's batches (`batches`), a batch's samples
    (`rollout`), a step's further prompts and greedy replies (`more_prompts`, `greedy`), and tells it when an update is
    done (`after_update`); Run asks it what a save keeps (`state`) and hands that back to a resumed run (`restore`)."""

    def __init__(self, cfg: Config, m: Models, rt: Runtime, tools: ToolRunner | None = None) -> None:
        self.cfg, self.m, self.rt, self.tools = cfg, m, rt, tools  # tools: --tools episodes (None: single turns)
        self.run: PromptStream | None = None  # the run's prompt stream, from `batches` on

    @abc.abstractmethod
    def batches(self, run: PromptStream) -> Iterator[dict]:
        """This rank's prompt batches of `run`, one per step, in the run's order."""

    @abc.abstractmethod
    def rollout(self, batch: dict, phase: Phase) -> Sampling:
        """The samples of `batch`, a batch this source gave (`batches`, `more_prompts`)."""

    @abc.abstractmethod
    def after_update(self, step: int, phase: Phase) -> None:
        """Update `step` is done: the actor holds the weights of step + 1 updates."""

    def more_prompts(self) -> dict | None:
        """DAPO's dynamic sampling (--filter_groups): the next prompt batch for the step under way (None: none)."""
        return None

    def greedy(self, prompts: dict, phase: Phase) -> Sampling:
        """One greedy reply per prompt of `prompts` (ReMax's baseline), sampled now, rank-local like any sampling."""
        return self._sampled_now(prompts, phase, greedy=True)

    def state(self, step: int, stopping: bool) -> RolloutState:
        """What the save after `step` keeps (`stopping`: a save at a stop signal). By default nothing: the run's own
        data position is the one after the last trained batch."""
        return RolloutState(position=None, in_flight=None)

    def restore(self, in_flight: list[dict] | None) -> None:
        """A resumed run: the batches in flight its save kept (this rank's; None: none). By default they are sampled
        again, from the saved data position."""

    def sample(self, batch: dict, greedy: bool = False, generator: torch.Generator | None = None,
               oldest_version: int | None = None, deadline: RequestDeadline = IN_BLOCK) -> Sampling:
        """Responses to the batch's prompts (one greedy one per prompt with `greedy`, for ReMax's baseline) from the
        actor or the rollout engine: single turns, or with --tools multi-turn episodes, whose old log-probs are then
        scored by a forward (tool replies sit between the sampled tokens). A batch sampled ahead gives its seeds'
        `generator`, the weight version it was asked for at and the rank-local deadline its requests keep to (none)."""
        s, m = self.cfg.sampling, self.m
        n = 1 if greedy else s.num_generations
        sampling: dict[str, Any] = {"cuda_graphs": bool(s.cuda_graphs), **(
            dict(temperature=1.0, top_k=0, top_p=1.0, greedy=True) if greedy else
            dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, greedy=bool(s.greedy),
                 suppress_eos=bool(s.suppress_eos)))}
        eos, policy = m.eos_ids or m.tok.eos_token_id, m.engine or m.actor
        if self.tools is not None:
            return generate_episodes(policy, m.tok, self.tools, batch, max_turns=s.max_turns, max_total_len=s.max_total_len,
                                     max_new_tokens=s.max_gen_len, eos_token_id=eos, pad_token_id=m.tok.pad_token_id,
                                     num_generations=n, device=self.rt.device, fast_decode=bool(s.fast_decode), **sampling)
        ro = generate_rollout(
            policy, batch["input_ids"].to(self.rt.device), batch["attention_mask"].to(self.rt.device),
            max_new_tokens=s.max_gen_len, eos_token_id=eos, pad_token_id=m.tok.pad_token_id, num_generations=n,
            fast_decode=bool(s.fast_decode), return_logprobs=bool(s.rollout_logprobs) and m.old_actor is None and not greedy,
            generator=generator, oldest_version=oldest_version, deadline=deadline, **sampling)
        return ro, None

    def _sampled_now(self, batch: dict, phase: Phase, greedy: bool = False) -> Sampling:
        """`sample` on the trainer's thread, in the step's rank-local generate phase (--strategy fsdp2: the actor's
        whole weights gathered first, not a collective per token)."""
        with D.unsharded(None if self.m.engine else self.m.actor), phase("generate", rank_local=True):
            return self.sample(batch, greedy=greedy)

    def _sync_weights(self, version: int, phase: Phase) -> None:
        """The weight-push schedule of both kinds (module docstring): the engine gets the weights of `version` updates
        when `version` is a multiple of --engine_sync_interval and it does not serve them already."""
        engine = self.m.engine
        if engine is None or version % self.cfg.engine_sync_interval or engine.version == version:
            return
        with phase("engine_sync", autocast=False):
            push_weights(self.cfg, self.m, self.rt, version=version)


class TakingTurns(RolloutSource):
    """--async_rollouts 0: each step samples its batch now, by the weights of the updates so far, and the engine (if
    any) gets the new weights after the update. Keeps nothing for a resume."""

    def batches(self, run: PromptStream) -> Iterator[dict]:
        self.run = run
        return run.batches()

    def rollout(self, batch: dict, phase: Phase) -> Sampling:
        return self._sampled_now(batch, phase)

    def more_prompts(self) -> dict | None:
        """The run's next batch (the same extra batches on every rank: the prompt stream is global); a source that
        serves no run (a step run on its own) has none."""
        return None if self.run is None else self.run.next_batch()

    def after_update(self, step: int, phase: Phase) -> None:
        self._sync_weights(step + 1, phase)  # the next batch is sampled by the updated policy


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


class SampledAhead(RolloutSource):
    """--async_rollouts K: each batch asked for K steps before it is trained (module docstring)."""

    def __init__(self, cfg: Config, m: Models, rt: Runtime) -> None:
        assert m.engine is not None and cfg.async_rollouts > 0
        super().__init__(cfg, m, rt)
        self.queue: deque[Pending] = deque()  # asked for and not trained yet, in step order
        self.next_index = 0  # the step of the next batch to ask for
        self.exhausted = False  # the prompt data ran out
        self.restored: dict[int, dict] = {}  # a resumed run's batches in flight, by step
        self.trained_position: tuple[int, int] | None = None  # (epoch, consumed) after the last batch trained
        self.worker: Worker | None = None

    # ---- the trainer's thread
    def restore(self, in_flight: list[dict] | None) -> None:
        """Kept until the batch of the same step is drawn: trained on where its prompts are the same (the same world
        size draws the same ones), else sampled again."""
        self.restored = {int(d["index"]): d for d in (in_flight or [])}

    def batches(self, run: PromptStream) -> Iterator[dict]:
        """The run's batches, drawn ahead: the same batches, in the same order, as taking turns draws them."""
        self.run, self.next_index = run, run.step
        worker = self.worker = Worker()
        try:
            while run.step < self.rt.total_steps:
                self._ask(run.step + self.cfg.async_rollouts - 1)
                if not self.queue:
                    return
                yield self.queue[0].batch
                if run.step >= self.rt.total_steps or run.stopped_by:
                    return
        finally:
            worker.stop()  # what is in flight is dropped (a resume file holds what a resumed run needs)

    def rollout(self, batch: dict, phase: Phase) -> Sampling:
        """Batch t's samples (t = the run's step), waited for in a rank-local block; then the push of the weights of t
        updates where one is due, then the request for batch t+K."""
        run, engine = self.run, self.m.engine
        assert run is not None and engine is not None
        step, head = run.step, self.queue.popleft()
        assert head.index == step and head.batch is batch, (head.index, step)
        with phase("generate", autocast=False, rank_local=True), exits_on_engine_error():
            ro = self._wait(head)
            ro = dataclasses.replace(ro, staleness=check_lag(ro, step, self.cfg, engine.url))
        self.trained_position = head.position
        self._sync_weights(step, phase)
        self._ask(step + self.cfg.async_rollouts)
        return ro, None

    def after_update(self, step: int, phase: Phase) -> None:
        """Nothing: the weights go to the engine at the next step, once its batch has arrived (`rollout`)."""

    def state(self, step: int, stopping: bool) -> RolloutState:
        """The data position after the last trained batch, and the samples of the batches asked for that are done, as
        the resume file keeps them. Waited for (rank-local) until the block's deadline, at a stop signal at most
        PREEMPT_WAIT_S: a preempted run must save within the signal's lead time whatever the engine does. A batch not
        done by then or failed is left out (the resumed run samples it again; a failure is raised where the step waits
        for it, `rollout`)."""
        with failing_together(self.rt.info):
            due = D.deadline()
            bound = None if due is None else max(due.left(), 0.0)
            if stopping:
                bound = PREEMPT_WAIT_S if bound is None else min(bound, PREEMPT_WAIT_S)
            wait_for([p.future for p in self.queue], timeout=bound)
            kept = [_saved(p.future.result(), p.index) for p in self.queue
                    if p.future.done() and not p.future.cancelled() and p.future.exception() is None]
        if len(kept) < len(self.queue):
            print(f"warning: rank {self.rt.info.rank}: the save after step {step} keeps {len(kept)} of the "
                  f"{len(self.queue)} batches sampled ahead (the others were not done in time or failed); a resumed "
                  f"run samples those again", file=sys.stderr, flush=True)
        return RolloutState(position=self.trained_position, in_flight=kept)

    def _wait(self, p: Pending) -> Rollout:
        due = D.deadline()
        try:
            return p.future.result(timeout=None if due is None else max(due.left(), 0.0))
        except FutureTimeout:
            assert due is not None and self.m.engine is not None
            raise EngineUnreachable(self.m.engine.too_slow(due, f"the batch of step {p.index + 1} (asked for ahead)")) from None

    def _ask(self, last: int) -> None:
        """Draw the batches up to step `last` (not past the run's last step) and ask the engine for each, in order."""
        run, engine, worker = self.run, self.m.engine, self.worker
        assert run is not None and engine is not None and worker is not None
        last = min(last, self.rt.total_steps - 1)
        while self.next_index <= last and not self.exhausted:
            batch = run.next_batch()
            if batch is None:  # the prompt data ran out (the same on every rank)
                self.exhausted = True
                return
            p = Pending(self.next_index, batch, run.data_position)
            saved = self.restored.pop(p.index, None)
            ro = None if saved is None else _restored(saved, self.rt.device)
            n = self.cfg.num_generations
            if ro is not None and torch.equal(ro.sequences[::n, :ro.prompt_len].cpu(), batch["input_ids"].cpu()):
                p.future.set_result(ro)  # sampled before the resume: the same samples as the uninterrupted run
            else:
                oldest, gen = engine.version, batch_seed(self.cfg.seed, self.rt.info.rank, p.index)
                assert oldest is not None
                worker.submit(functools.partial(self._sample_ahead, batch, gen, oldest), p.future)
            self.queue.append(p)
            self.next_index += 1

    # ---- the worker's thread
    def _sample_ahead(self, batch: dict, generator: torch.Generator, oldest_version: int) -> Rollout:
        """A batch's samples from the engine, asked for at weight version `oldest_version`: in no rank-local block, so
        its requests keep to no rank-local deadline (the trainer's wait for them is bounded instead, `_wait`)."""
        return self.sample(batch, generator=generator, oldest_version=oldest_version, deadline=None)[0]


def make_rollout_source(cfg: Config, m: Models, rt: Runtime, tools: ToolRunner | None = None) -> RolloutSource:
    """The run's rollout source: the engine samples ahead with --async_rollouts K (which refuses --tools), else
    sampling and training take turns."""
    return SampledAhead(cfg, m, rt) if cfg.async_rollouts else TakingTurns(cfg, m, rt, tools)
