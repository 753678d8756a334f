"""Verifiers that parse the policy's text, run bounded: --reasoning_gym's score_answer (dataset/rgym.py `score`: some
tasks hand the <answer> to sympy's parse_expr, an eval, where `9**9**9**9` runs for hours) scores each reply in a
worker process (trainer/verifier_worker.py, bounded by trainer/sandbox.py) with --verifier_timeout seconds per reply.

    verifier.configure(cfg.verifier_timeout)   # once, at setup (the default is RewardArgs.verifier_timeout's 10 s)
    verifier.score(reply, row)                 # row: a reasoning-gym row's `rg`; a float, never raises
    verifier.timeouts()                        # replies that ran over so far (scored 0): reward/verifier_timeouts

A reply that runs over its time (or past the rank's deadline, --ddp_timeout) scores 0 and is counted; the worker is
killed with everything it started and a fresh one, which imports reasoning-gym again (not counted in any reply's
time; docs/reasoning_gym.md says how long), scores the next reply. A reply that takes the worker down otherwise (a crash, a reply over the
size cap) scores 0 and counts in `failures()`. Only a worker that never starts is the run's error (VerifierError,
one line): every reward would be 0.

The row travels to the worker pickled (reasoning-gym's entries hold tuples and int keys that JSON would change, and
a task's verifier may compare them): only the trainer writes it and only the worker reads it; the policy's reply
travels as a JSON string and the score comes back as JSON, so nothing the worker sends runs code here.
"""

from __future__ import annotations

import base64
import math
import pickle
import sys
import threading

from trainer.sandbox import Limits, Worker

_WORKER_MODULE = "trainer.verifier_worker"
DEFAULT_TIMEOUT = 10.0  # RewardArgs.verifier_timeout's default


class VerifierError(RuntimeError):
    """The verifier's worker could not start at all: the message is one line, without "error: "."""


class Verifier:
    """reasoning-gym's score_answer in a bounded worker (started on first use, again after a reply killed it), each
    reply with `timeout` seconds. `timeouts` and `failures` count the replies that scored 0 for running over or for
    taking the worker down."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, limits: Limits | None = None) -> None:
        self.timeout = float(timeout)
        self.worker = Worker(_WORKER_MODULE, timeout=self.timeout, noun="verifier process",
                             start_timeout=max(60.0, self.timeout), limits=limits)  # room for reasoning-gym's import
        self.timeouts = 0
        self.failures = 0
        self._started = False  # a reply ever came back

    def score(self, reply: str, row: dict) -> float:
        """The task's score of `reply` for the reasoning-gym row `row` (its `rg`: task, config, entry); 0 when it ran
        over --verifier_timeout or took the worker down (counted)."""
        blob = base64.b64encode(pickle.dumps(row, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
        out = self.worker.call({"reply": reply, "row": blob})
        self._started = self._started or out.reply is not None
        value = out.reply.get("score") if out.reply is not None else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if out.timed_out:
            self.timeouts += 1
            return 0.0
        if out.kind == "start" and not self._started:
            raise VerifierError(f"--reasoning_gym: {out.failure}; check that reasoning-gym imports with only PATH and "
                                f"the locale set: env -i PATH=\"$PATH\" {sys.executable} -c 'import reasoning_gym'")
        self.failures += 1
        return 0.0

    def close(self) -> None:
        self.worker.close()


_shared: list[Verifier] = []  # the process's verifier (one worker per trainer process), made on first use
_lock = threading.Lock()


def configure(timeout: float) -> None:
    """Set the per-reply time of the process's verifier (--verifier_timeout): a new verifier (and worker) when it
    differs from the one in use."""
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"--verifier_timeout {timeout} must be a number of seconds > 0")
    with _lock:
        if _shared and _shared[0].timeout == float(timeout):
            return
        for v in _shared:
            v.close()
        _shared[:] = [Verifier(timeout)]


def shared() -> Verifier:
    """The process's verifier (DEFAULT_TIMEOUT until `configure` sets another)."""
    with _lock:
        if not _shared:
            _shared.append(Verifier())
        return _shared[0]


def score(reply: str, row: dict) -> float:
    """The process's verifier's score of `reply` (Verifier.score)."""
    return shared().score(reply, row)


def timeouts() -> int:
    """The replies the process's verifier scored 0 for running over, so far (log the difference per step)."""
    return shared().timeouts if _shared else 0


def failures() -> int:
    """The replies that took the process's verifier down otherwise (a crash, an overlong reply), so far."""
    return shared().failures if _shared else 0
