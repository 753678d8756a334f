"""trainer/sandbox.py: a worker running code the run does not trust stays bounded, tested as that code would act:
it loops, allocates, forks, floods, lies on the reply channel, and reads the environment. The worker here is the
tool worker (trainer/tool_worker.py) loading plain Python functions, so no optional package is needed."""

from __future__ import annotations

import os
import stat
import time

import pytest

from tests.helpers import ROOT
from trainer import dist, sandbox
from trainer.sandbox import Limits, Worker

VERIFIERS = '''
import os
import time


def forever() -> str:
    """Loop."""
    while True:
        pass


def allocate(gib: int) -> str:
    """Allocate.

    Args:
        gib: how much
    """
    return str(len(bytearray(gib << 30)))


def burn(seconds: float) -> str:
    """Use CPU time, then answer.

    Args:
        seconds: how long
    """
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return "done"


def where() -> dict:
    """What the worker sees."""
    return {"cwd": os.getcwd(), "env": dict(os.environ), "pid": os.getpid()}


def lie(fd_bytes: int, partial: bool) -> str:
    """Write to every other descriptor (the reply channel among them), then hang.

    Args:
        fd_bytes: how much to write to each
        partial: write a line's start without its end instead
    """
    for fd in range(3, 32):
        try:
            os.write(fd, b'{"ok": tr' if partial else b"x" * fd_bytes)
        except OSError:
            pass
    time.sleep(60)
    return "never"
'''


@pytest.fixture()
def module(tmp_path):
    p = tmp_path / "verifiers.py"
    p.write_text(VERIFIERS)
    return p


def worker(module, timeout: float = 1.0, **kw) -> Worker:
    return Worker("trainer.tool_worker", [str(module)], timeout=timeout, noun="verifier process", **kw)


def run(w: Worker, name: str, **arguments) -> sandbox.Outcome:
    return w.call({"name": name, "arguments": arguments})


def test_a_verifier_that_loops_forever_is_killed_at_its_timeout_and_the_next_call_gets_a_fresh_worker(module):
    w = worker(module)
    try:
        assert run(w, "where").reply["ok"]
        first = w.pid
        t0 = time.monotonic()
        out = run(w, "forever")
        assert out.timed_out and out.failure == "timed out after 1 s" and time.monotonic() - t0 < 3
        assert w.pid is None and not _alive(first)
        assert run(w, "where").reply["ok"] and w.pid != first
    finally:
        w.close()


def test_an_allocation_past_the_address_space_limit_is_a_memory_error_not_the_machines_memory(module):
    w = worker(module, timeout=10.0)  # the default limits: 4 GiB of address space
    try:
        out = run(w, "allocate", gib=50)
        assert out.reply == {"ok": False, "content": "MemoryError: "}
        assert run(w, "where").reply["ok"]  # the same worker goes on
    finally:
        w.close()


def test_the_worker_runs_in_its_own_session_with_its_limits_in_a_private_folder_removed_after(module, monkeypatch):
    assert sandbox._uid_tasks() >= len(os.listdir("/proc/self/task"))  # this process's threads are the uid's
    monkeypatch.setattr(sandbox, "_uid_tasks", lambda: 1000)
    w = worker(module, limits=Limits(cpu_s=77, memory_bytes=3 << 30, file_bytes=5 << 20, nproc_headroom=9))
    try:
        seen = __import__("json").loads(run(w, "where").reply["content"])
        pid = w.pid
        assert seen["pid"] == pid and os.getsid(pid) == pid and os.getpgid(pid) == pid != os.getpgid(0)
        limits = {line[:26].strip(): line[26:].split()[:2] for line in open(f"/proc/{pid}/limits").read().splitlines()[1:]}
        assert limits["Max cpu time"] == ["77", "77"]
        assert limits["Max address space"] == [str(3 << 30)] * 2
        assert limits["Max file size"] == [str(5 << 20)] * 2 and limits["Max core file size"] == ["0", "0"]
        # RLIMIT_NPROC counts the uid's processes and threads: what it ran at the start plus the headroom.
        assert limits["Max processes"] == ["1009", "1009"]
        folder = seen["cwd"]
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and seen["env"]["HOME"] == seen["env"]["TMPDIR"] == folder
    finally:
        w.close()
    assert not os.path.exists(folder)


def test_the_environment_is_an_allow_list(module, monkeypatch):
    secrets = {"HF_TOKEN": "hf_x", "WANDB_API_KEY": "w", "SWANLAB_API_KEY": "s", "GITHUB_TOKEN": "g", "OPENAI_API_KEY": "o",
               "AWS_SECRET_ACCESS_KEY": "a", "HF_HOME": "/h", "MY_SERVICE_PASSWORD": "p", "LC_ALL": "C.UTF-8"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    w = worker(module)
    try:
        env = __import__("json").loads(run(w, "where").reply["content"])["env"]
    finally:
        w.close()
    assert not set(secrets) - {"LC_ALL"} & set(env)
    assert env["LC_ALL"] == "C.UTF-8" and env["OMP_NUM_THREADS"] == "1" and env["PATH"] == os.environ["PATH"]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_a_reply_channel_flood_is_cut_at_the_cap_and_the_worker_killed(module):
    w = worker(module, timeout=5.0)
    try:
        t0 = time.monotonic()
        out = run(w, "lie", fd_bytes=10 << 20, partial=False)  # 10 MB at every descriptor: more than the 64 KiB cap
        assert out.kind == "overlong" and "over 65536 bytes" in out.failure and time.monotonic() - t0 < 4
        assert w.pid is None
    finally:
        w.close()


def test_a_partial_line_does_not_block_the_read(module):
    w = worker(module)
    try:
        t0 = time.monotonic()
        out = run(w, "lie", fd_bytes=0, partial=True)  # half a reply, then nothing: readline() would wait forever
        assert out.timed_out and time.monotonic() - t0 < 3
    finally:
        w.close()


def test_the_rank_deadline_shortens_a_calls_time(module):
    w = worker(module, timeout=30.0)
    try:
        assert run(w, "where").reply["ok"]
        t0 = time.monotonic()
        with dist.rank_local_deadline(1.0, "--ddp_timeout 9"):
            out = run(w, "forever")
        assert out.timed_out and "(the rank's deadline, --ddp_timeout 9)" in out.failure and time.monotonic() - t0 < 3
        with dist.rank_local_deadline(0.5, "--ddp_timeout 9"):
            time.sleep(0.6)
            late = run(w, "where")  # none left: not even started
        assert late.timed_out and "no time is left" in late.failure and w.pid is None
    finally:
        w.close()


def test_a_worker_that_cannot_start_is_an_outcome_and_is_tried_again(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('not today')\n")
    w = worker(bad)
    try:
        for _ in range(2):  # each call tries a fresh start
            out = run(w, "where")
            assert out.kind == "start" and out.reply is None
            assert out.failure == "could not start the verifier process (RuntimeError: not today)"
    finally:
        w.close()


def test_a_worker_is_replaced_before_its_cpu_cap(module, monkeypatch):
    w = worker(module, limits=Limits(cpu_s=300))
    try:
        assert run(w, "burn", seconds=0.1).reply["content"] == "done"
        first = w.pid
        assert run(w, "where").reply["ok"] and w.pid == first
        assert 0 < sandbox._cpu_seconds(os.getpid()) < time.process_time() + 1  # /proc reads what the process used
        monkeypatch.setattr(sandbox, "_cpu_seconds", lambda pid: 298.5)  # a call of 1 s might not fit under 300 s
        assert run(w, "where").reply["ok"] and w.pid != first and not _alive(first)
    finally:
        w.close()


def _alive(pid: int | None) -> bool:
    """Whether `pid` is a process that has not exited (a zombie waiting for a parent that never reaps is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
