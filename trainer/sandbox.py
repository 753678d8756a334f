"""Bounded execution of code the run does not trust: the --tools module's functions (trainer/tools.py) and the
verifiers that parse the policy's text (trainer/verifier.py) run in a persistent worker process speaking JSON lines.

    worker = Worker("trainer.tool_worker", ["TOOLS.py"], timeout=5.0, noun="tool process")
    out = worker.call({"name": ..., "arguments": {...}})  # Outcome: .reply (the worker's dict) or .failure; never raises
    worker.close()

The worker module's __main__ calls `serve(start)`: `start(args)` imports what it was given and returns the handler
that turns one request dict into one reply dict. A worker is started on first use and again after any failure, and
each start is bounded:

- its own session and process group (start_new_session): a timeout, an overlong or garbled reply kill the group,
  so a tool's children and grandchildren go with it;
- rlimits it sets on itself before it imports anything it was given: CPU seconds (RLIMIT_CPU; a cap on each
  process's life, and the worker is replaced before it gets near it), address space (RLIMIT_AS), the largest file it
  may write (RLIMIT_FSIZE), no core files, and processes (RLIMIT_NPROC counts every process and thread of the uid,
  so the limit is the uid's count at the start plus a headroom; root with CAP_SYS_RESOURCE is not held to it);
- a wall clock per call: the caller's timeout, or less when the rank's deadline (trainer/dist.py, --ddp_timeout)
  comes sooner;
- a scrubbed environment (an allow-list: no tokens, no keys, no HF_ / WANDB_ / SWANLAB_ settings) and a private
  working directory (0700; also its HOME and TMPDIR; its stderr goes to a file there), removed when it goes;
- bounded reads: a reply is one line of at most `max_reply_bytes`, read with os.read into a capped buffer.

Not isolated: the filesystem and the network (the worker runs as the trainer's uid, in its namespaces), other
processes of the uid; a process that leaves the group (setsid) survives the kill, bounded by its rlimits alone.

Standard library only at import: the workers import this module for `serve` and must start without torch.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import math
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
# What a worker's environment keeps of the trainer's (everything else, tokens and keys first, stays out).
_ENV_KEEP = ("PATH", "LANG", "LANGUAGE", "TZ")
_STDERR = "stderr.log"
_LIVE: weakref.WeakSet[Worker] = weakref.WeakSet()  # closed at exit: no worker outlives the trainer, no folder stays


@dataclass(frozen=True)
class Limits:
    """What each process of a worker may use (rlimits)."""

    cpu_s: int = 300  # CPU seconds in a process's life (RLIMIT_CPU); raised to twice the call timeout where that is more
    memory_bytes: int = 4 << 30  # address space (RLIMIT_AS): an allocation past it is a MemoryError
    file_bytes: int = 64 << 20  # the largest file it may write (RLIMIT_FSIZE), its stderr log included
    nproc_headroom: int = 128  # processes and threads beyond what the uid runs at the start (RLIMIT_NPROC)


@dataclass(frozen=True)
class Outcome:
    """A call's result: the worker's reply, or why there is none: `failure` a phrase ("timed out after 5 s"), `kind`
    one of "timeout" (its time or the rank's deadline ran out), "start" (no worker could be started), "send" (the
    request could not be encoded), "crash", "overlong", "garbled" (the worker's reply)."""

    reply: dict | None = None
    failure: str = ""
    kind: str = ""

    @property
    def timed_out(self) -> bool:
        return self.kind == "timeout"


def time_left(timeout: float) -> tuple[float, str]:
    """The seconds a call may take: `timeout`, or what is left before the rank's deadline when that is sooner (then
    with the flag that sets it, for messages; "" otherwise)."""
    from trainer import dist  # here, not at the top: torch is the parent's side only (workers import this module too)

    d = dist.deadline()
    if d is None or d.left() >= timeout:
        return timeout, ""
    return max(0.0, d.left()), d.flag


def scrubbed_env(home: str) -> dict[str, str]:
    """A worker's environment: an allow-list of the trainer's (PATH, the locale), the private folder as HOME and
    TMPDIR, the repository root first on PYTHONPATH (then the trainer's PYTHONPATH and working folder), and one
    thread per math library."""
    env = {k: v for k, v in os.environ.items() if k in _ENV_KEEP or k.startswith("LC_")}
    # The trainer's own PYTHONPATH and working folder stay importable (a tool module may import from them, as it
    # could in the trainer), made absolute: the worker's own folder is its cwd.
    path = [_ROOT, *(os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p), os.getcwd()]
    env.update(HOME=home, TMPDIR=home, PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1",
               PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    return env


def _uid_tasks() -> int:
    """Processes and threads of this uid now (what RLIMIT_NPROC counts); 0 where /proc cannot tell."""
    uid, n = os.getuid(), 0
    with contextlib.suppress(OSError):
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                with contextlib.suppress(OSError):
                    if os.stat(f"/proc/{pid}").st_uid == uid:
                        n += len(os.listdir(f"/proc/{pid}/task"))
    return n


def _cpu_seconds(pid: int) -> float | None:
    """The CPU time a live process has used (/proc; None where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def _decode(line: bytes) -> dict | None:
    """A reply line as a dict; None for anything else (a tool may write to the reply channel itself)."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):  # JSONDecodeError, bad UTF-8, a 5,000-digit integer; 1,000 nested [
        return None
    return obj if isinstance(obj, dict) else None


class Worker:
    """A persistent worker process, `python -m module *args`, bounded as the module docstring says. `call` sends one
    request and waits for one reply; it never raises, and a failure (timeout, crash, overlong or garbled reply,
    a start that failed) is an Outcome with `failure` set, after which the next call starts a fresh worker.
    Thread-safe: calls take turns."""

    def __init__(self, module: str, args: Sequence[str] = (), *, timeout: float, noun: str = "worker process",
                 start_timeout: float = 30.0, limits: Limits | None = None, max_reply_bytes: int = 1 << 16) -> None:
        self.module, self.args, self.timeout, self.noun = module, list(args), float(timeout), noun
        self.start_timeout, self.limits, self.max_reply_bytes = float(start_timeout), limits or Limits(), max_reply_bytes
        # A process's CPU cap must leave room for a call that uses all of its wall clock.
        self.cpu_cap = max(self.limits.cpu_s, math.ceil(2 * self.timeout) + 1)
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None
        self._buf = bytearray()
        self._lock = threading.Lock()
        self._owner = os.getpid()  # a forked copy of this object (a DataLoader worker) must not kill the worker
        _LIVE.add(self)

    @property
    def pid(self) -> int | None:
        """The running worker's pid (its process group's id too); None when there is none."""
        return self._proc.pid if self._proc is not None else None

    # ---- the process
    def _start(self) -> Outcome | None:
        """Start a worker and wait for its ready line; None when it is ready, else the failure (it is gone again)."""
        budget, flag = time_left(self.start_timeout)
        if budget <= 0:
            return Outcome(failure=f"timed out: no time is left before the rank's deadline ({flag})", kind="timeout")
        self._dir = tempfile.mkdtemp(prefix="minippo-sandbox-")  # 0700
        settings = {**asdict(self.limits), "cpu_s": self.cpu_cap, "parent": os.getpid(),
                    "nproc": _uid_tasks() + self.limits.nproc_headroom}
        err = os.open(os.path.join(self._dir, _STDERR), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", self.module, json.dumps(settings), *self.args],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=self._dir,
                                          env=scrubbed_env(self._dir), start_new_session=True)
        except OSError as e:
            self._kill()
            return Outcome(failure=f"could not start the {self.noun} ({e})", kind="start")
        finally:
            os.close(err)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        os.set_blocking(self._proc.stdin.fileno(), False)
        os.set_blocking(self._proc.stdout.fileno(), False)
        ready = self._read(time.monotonic() + budget)
        if isinstance(ready, dict) and ready.get("ready") is True:
            return None
        if isinstance(ready, dict):
            why = str(ready.get("error", "it did not say why"))[:500]
        else:
            why = {"hung": f"no answer within {budget:g} s", "died": "it exited"}.get(ready, ready)
            tail = self._stderr_tail()
            why += f"; its stderr ends: {tail}" if tail else ""
        self._kill()
        return Outcome(failure=f"could not start the {self.noun} ({why})", kind="start")

    def _stderr_tail(self, n: int = 300) -> str:
        try:
            with open(os.path.join(self._dir or "", _STDERR), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - n))
                return " ".join(f.read().decode("utf-8", "replace").split())
        except OSError:
            return ""

    def _kill(self) -> None:
        """Kill the worker's whole process group, reap it, and remove its folder."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its session's group: the tool's children too
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._buf = bytearray()

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __del__(self) -> None:
        if os.getpid() == self._owner:
            with contextlib.suppress(Exception):  # interpreter shutdown
                self._kill()

    # ---- the channel
    def _write(self, data: bytes, end: float) -> str:
        """Send `data` before `end`; "" when sent, else "hung" or "died"."""
        assert self._proc is not None and self._proc.stdin is not None
        fd, view = self._proc.stdin.fileno(), memoryview(data)
        while view:
            left = end - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                return "hung"
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                continue
            except OSError:  # EPIPE: the worker is gone
                return "died"
        return ""

    def _read(self, end: float) -> dict | str:
        """One reply line before `end`: its dict, else "hung", "died", "overlong" or "garbled"."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line = bytes(self._buf[:nl])
                del self._buf[:nl + 1]
                reply = _decode(line)
                return "garbled" if reply is None else reply
            if len(self._buf) > self.max_reply_bytes:
                return "overlong"
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return "hung"
            try:
                chunk = os.read(fd, self.max_reply_bytes + 1 - len(self._buf))  # never more than the cap
            except BlockingIOError:
                continue
            except OSError:
                return "died"
            if not chunk:
                return "died"
            self._buf += chunk

    def _worn_out(self) -> bool:
        """Whether the worker is gone, or its CPU time so far leaves no room for a whole call under its cap."""
        assert self._proc is not None
        if self._proc.poll() is not None:
            return True
        used = _cpu_seconds(self._proc.pid)
        return used is not None and used + self.timeout + 1 > self.cpu_cap  # a call's CPU time is about its wall time

    # ---- calls
    def call(self, request: dict, timeout: float | None = None) -> Outcome:
        """The worker's reply to `request` within `timeout` seconds (default: the worker's; less when the rank's
        deadline is sooner)."""
        with self._lock:
            if self._proc is not None and self._worn_out():
                self._kill()
            if self._proc is None:
                failed = self._start()
                if failed is not None:
                    return failed
            try:
                data = json.dumps(request).encode() + b"\n"  # ASCII: a lone surrogate travels as its escape
            except (TypeError, ValueError, RecursionError) as e:
                return Outcome(failure=f"could not be sent to the {self.noun} ({type(e).__name__}: {e})", kind="send")
            budget, flag = time_left(self.timeout if timeout is None else float(timeout))
            end = time.monotonic() + budget
            reply = self._write(data, end) or self._read(end)
            if isinstance(reply, dict):
                if self._buf:  # more than one reply to one request: a worker out of step is replaced
                    self._kill()
                return Outcome(reply=reply)
            self._kill()
            if reply == "hung":
                why = f" (the rank's deadline, {flag})" if flag else ""
                return Outcome(failure=f"timed out after {budget:g} s{why}", kind="timeout")
            kind = {"died": "crash"}.get(reply, reply)
            return Outcome(failure={
                "crash": f"crashed the {self.noun}",
                "overlong": f"sent a reply over {self.max_reply_bytes} bytes",
                "garbled": f"garbled the {self.noun}'s reply",
            }[kind], kind=kind)


@atexit.register
def _close_all() -> None:
    for w in list(_LIVE):
        w.__del__()


# ---------------------------------------------------------------- the worker's side
def _limit_self(settings: dict) -> None:
    """Apply the rlimits (never above a hard limit already set)."""
    for which, value in ((resource.RLIMIT_CPU, settings["cpu_s"]), (resource.RLIMIT_AS, settings["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, settings["file_bytes"]), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NPROC, settings["nproc"])):
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))


def serve(start: Callable[[list[str]], Callable[[dict], dict]]) -> None:
    """A worker's main: argv is [settings JSON, *args] (Worker writes it). Sets the limits, dies with the trainer,
    leaves SIGINT and SIGTERM to the trainer, moves stdout onto stderr (a print cannot garble the replies), then
    replies {"ready": true} once `start(args)` returned its handler ({"ready": false, "error": ...} when it raised)
    and one line per request line."""
    settings = json.loads(sys.argv[1])
    _limit_self(settings)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    if os.getppid() != settings["parent"]:  # the trainer died before the line above
        return
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")  # the reply channel
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # A write past RLIMIT_FSIZE fails with an OSError (the tool's error) instead of killing the worker.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # A scheduler's SIGTERM (Slurm signals every process of the step) and a Ctrl-C are the trainer's to handle: it
    # finishes its step, whose calls must still run, then stops the worker (SIGKILL, which this does not stop).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj, default=str) + "\n")  # ASCII, whatever the tool returned

    try:
        handle = start(sys.argv[2:])
    except BaseException as e:  # noqa: BLE001 - the module's import: a SyntaxError, an ImportError, even SystemExit
        reply({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return
    reply({"ready": True})
    for line in sys.stdin:
        try:
            reply(handle(json.loads(line)))
        except BaseException as e:  # noqa: BLE001 - a handler's own failure is a reply too
            reply({"error": f"{type(e).__name__}: {e}"})
