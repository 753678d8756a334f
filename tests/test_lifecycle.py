"""trainer/run/lifecycle.py: what a run promises about its folders, signals, and what it never saves."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.helpers import (
    ROOT,
    build_update_world,
    deep_equal,
    make_tiny_world,
    param_snapshot,
    read_metrics,
    resume_state,
    run_experience,
    run_main,
    run_update,
    sigkill_after,
    spawn_train,
    tiny_flags,
)
from tests.test_checkpoint import PREFIX, _name
from trainer.run import checkpoint as ckpt
from trainer.run.lock import FolderBusy, FolderLock
from trainer.run.signals import GRACE_S


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_tiny_world(tmp_path_factory.mktemp("lcworld"))


def _run_json(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


# ------------------------------------------------------------------ one run per folder
@pytest.mark.slow
def test_fresh_run_refuses_a_folder_with_another_runs_resume_files(world, tmp_path):
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=2))
    assert code is None, out[-2000:]
    first_id = _run_json(tmp_path / "run")["run_id"]
    assert first_id and ckpt.read_resume(tmp_path / "ckpt" / _name(2))["run_id"] == first_id
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").glob("*.pth")}
    metrics_before = (tmp_path / "run" / "metrics.jsonl").read_text()
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=1))
    assert isinstance(code, str) and code.startswith("error:") and "\n" not in code
    assert "holds resume files of an earlier run" in code and "--from_resume 1" in code and "another --save_weight" in code
    # Nothing of the first run was touched: files, logs, run.json.
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").glob("*.pth")} == before
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics_before
    assert _run_json(tmp_path / "run")["run_id"] == first_id
    # Continuing it is fine, and keeps its run id.
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=3, from_resume=1))
    assert code is None, out[-2000:]
    assert ckpt.read_resume(tmp_path / "ckpt" / _name(3))["run_id"] == first_id


@pytest.mark.slow
def test_resume_with_nothing_to_resume_is_an_error_and_wipes_nothing(world, tmp_path):
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=1))
    assert code is None, out[-2000:]
    run_json = (tmp_path / "run" / "run.json").read_text()
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=1, from_resume=1, checkpoint_dir=str(tmp_path / "ckpt_typo")))
    assert isinstance(code, str) and "nothing to resume" in code and "ckpt_typo" in code and "--from_resume 2" in code
    assert (tmp_path / "run" / "run.json").read_text() == run_json
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics
    # --from_resume 2: resume if possible, else start.
    code, out = run_main(tiny_flags(world, tmp_path / "b", max_steps=1, from_resume=2))
    assert code is None and "starting a new run" in out
    code, out = run_main(tiny_flags(world, tmp_path / "b", max_steps=2, from_resume=2))
    assert code is None and "resumed from" in out


@pytest.mark.slow
def test_folder_lock_refuses_a_second_holder_and_dies_with_its_process(tmp_path):
    lock = FolderLock(tmp_path, "--checkpoint_dir").acquire()
    with pytest.raises(FolderBusy, match=rf"--checkpoint_dir {tmp_path} is in use by another run \(pid {os.getpid()} on "):
        FolderLock(tmp_path, "--checkpoint_dir").acquire()
    lock.release()
    FolderLock(tmp_path, "--checkpoint_dir").acquire().release()
    # A holder killed with SIGKILL leaves the file but not the lock: the next run starts.
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); from trainer.run.lock import FolderLock; "
                               f"FolderLock({str(tmp_path)!r}, 'x').acquire(); print('held', flush=True); import time; time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(FolderBusy, match=f"pid {holder.pid}"):
        FolderLock(tmp_path, "--checkpoint_dir").acquire()
    holder.kill()
    holder.wait()
    FolderLock(tmp_path, "--checkpoint_dir").acquire().release()


def test_second_run_in_a_busy_folder_is_refused_at_start(world, tmp_path):
    busy = FolderLock(tmp_path / "ckpt", "--checkpoint_dir").acquire()
    try:
        code, out = run_main(tiny_flags(world, tmp_path, max_steps=1))
    finally:
        busy.release()
    assert isinstance(code, str) and "is in use by another run" in code and f"pid {os.getpid()}" in code
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before touching anything


def _save_dir(flags: list[str]) -> Path:
    """The --save_dir `flags` give (where the run's policy is exported)."""
    return Path(flags[flags.index("--save_dir") + 1])


def _one_line(code) -> str:
    assert isinstance(code, str) and code.startswith("error: ") and "\n" not in code, code
    return code


def test_a_new_run_over_another_runs_logs_or_policy_is_refused_and_touches_nothing(world, tmp_path):
    """Following the old advice ("another --checkpoint_dir") would have wiped the first run's metrics and samples
    and overwritten its policy; so would a sweep of runs with their own folders but one --save_weight."""
    flags = dict(max_steps=1, save_weight="twin")
    first = tiny_flags(world, tmp_path, **flags)
    code, out = run_main(first)
    assert code is None, out[-2000:]
    export, run = _save_dir(first) / "twin_64.pth", tmp_path / "run"
    kept = [export, run / "run.json", run / "metrics.jsonl", run / "samples.jsonl"]
    before = {p: p.read_bytes() for p in kept}
    code, _ = run_main(tiny_flags(world, tmp_path, **flags, checkpoint_dir=str(tmp_path / "ckpt2")))
    assert all(str(p) in _one_line(code) for p in kept) and "another --save_weight and --run_dir" in code
    code, _ = run_main(tiny_flags(world, tmp_path / "b", **flags, save_dir=str(_save_dir(first))))
    assert f"overwrite an earlier run's {export} " in _one_line(code) and "metrics" not in code
    assert {p: p.read_bytes() for p in kept} == before
    assert not list((tmp_path / "ckpt2").glob("*.pth")) and not (tmp_path / "b" / "run" / "run.json").exists()


@pytest.mark.slow
def test_a_save_weight_with_brackets_is_guarded_resumed_and_pruned(world, tmp_path):
    """--save_weight 'exp[lr3e-6]' was a glob pattern to the guard, resume and keep-K: a second fresh run started
    over, --from_resume 2 silently started over and no file was ever pruned."""
    name = "exp[lr3e-6]"
    prefix = ckpt.resume_prefix(name, world["hidden"], False)
    files = lambda: sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".pth")  # noqa: E731
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=2, save_weight=name, keep_checkpoints=1))
    assert code is None, out[-2000:]
    assert files() == [f"{prefix}_step00000002.pth"]
    code, _ = run_main(tiny_flags(world, tmp_path, max_steps=3, save_weight=name, keep_checkpoints=1))
    assert "holds resume files of an earlier run" in _one_line(code)
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=3, save_weight=name, keep_checkpoints=1, from_resume=2))
    assert code is None and "resumed from" in out and " at step 2 " in out, out[-2000:]
    assert files() == [f"{prefix}_step00000003.pth"]
    # The run's own earlier start (its run.json names these folders) that never saved may start over.
    for p in (tmp_path / "ckpt").iterdir():
        p.unlink()
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=1, save_weight=name, keep_checkpoints=1))
    assert code is None, out[-2000:]


def test_a_filesystem_without_flock_warns_and_runs(world, tmp_path):
    """Lustre's default mount answers flock with ENOLCK / ENOSYS: a warning each folder, not a traceback."""
    with mock.patch("trainer.run.lock.fcntl.flock", side_effect=OSError(errno.ENOLCK, "No locks available")):
        code, out = run_main(tiny_flags(world, tmp_path, max_steps=1, save_weight="nolock"))
    assert code is None, out[-2000:]
    warnings = [line for line in out.splitlines() if "without flock" in line]
    assert len(warnings) == 2 and "ENOLCK" in warnings[0] and "--checkpoint_dir" in warnings[0] and "--run_dir" in warnings[1]
    with mock.patch.object(FolderLock, "acquire", side_effect=PermissionError(errno.EACCES, "Permission denied")):
        code, _ = run_main(tiny_flags(world, tmp_path / "b", max_steps=1, save_weight="nolock"))
    want = f"error: --checkpoint_dir {tmp_path / 'b' / 'ckpt'}: cannot create its lock file .minippo.lock: Permission denied"
    assert _one_line(code) == want


# ------------------------------------------------------------------ exports: whole or not at all
def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _killed_in(fn) -> None:
    """`fn` in a forked child that dies inside it (os._exit(9), as SIGKILL would leave things)."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 9


def _die(*args, **kwargs):
    os._exit(9)


def test_a_kill_inside_the_hf_export_leaves_the_previous_export_whole(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.loader import load_tokenizer
    from trainer.config import Config
    from trainer.run.lifecycle import export_policy

    tok = load_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    cfg = Config().replace(actor_path=str(tmp_path / "start"))
    out = tmp_path / "out" / "ppo_actor_hf"
    export_policy(cfg, model, tok, out)
    before = _tree(out)

    def partial(self, path, **kwargs):  # the first bytes of the weights, then the kill
        (Path(path) / "model.safetensors").write_bytes(before["model.safetensors"][:100])
        _die()

    with mock.patch.object(LlamaForCausalLM, "save_pretrained", partial):
        _killed_in(lambda: export_policy(cfg, model, tok, out))
    assert _tree(out) == before

    def whole(self, path, **kwargs):  # a complete new export, no torch work in the forked child
        for name, data in before.items():
            (Path(path) / name).write_bytes(b"new " + data if name == "model.safetensors" else data)

    real_rename = os.rename
    renames: list[str] = []

    def rename_then_die(src, dst):  # killed between moving the old export aside and renaming the new one in
        renames.append(str(dst))
        if len(renames) == 2:
            _die()
        real_rename(src, dst)

    with mock.patch.object(LlamaForCausalLM, "save_pretrained", whole), mock.patch("os.rename", rename_then_die):
        _killed_in(lambda: export_policy(cfg, model, tok, out))
    aside = [p for p in out.parent.iterdir() if p.name != out.name]
    assert not out.exists() and len(aside) == 2 and {p.suffix for p in aside} == {".old", ".tmp"}
    assert _tree(next(p for p in aside if p.suffix == ".old")) == before  # the previous export, whole beside it
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    export_policy(cfg, model, tok, out)  # the next save puts things right and writes whole
    assert [p.name for p in out.parent.iterdir()] == [out.name]
    after = _tree(out)
    assert set(after) == set(before) and after["model.safetensors"] != before["model.safetensors"]


def test_an_error_inside_the_lora_export_leaves_the_previous_adapters_whole(tmp_path):
    from peft import PeftModelForCausalLM

    from model.loader import build_minimind, load_tokenizer
    from model.lora import add_lora
    from trainer.config import Config
    from trainer.run.lifecycle import adapter_dir, save_lora_outputs

    torch.manual_seed(0)
    policy, tok = add_lora(build_minimind(64, 2), 4, 8, 0.0, "all-linear"), load_tokenizer()
    cfg = Config().replace(lora_r=4, save_merged=1)
    out = tmp_path / "ppo_actor_64.pth"
    adapters = adapter_dir(out)
    save_lora_outputs(cfg, policy, tok, out)
    before = _tree(adapters)
    assert "base/config.json" in before and "adapter_model.safetensors" in before

    def partial(self, path, **kwargs):
        (Path(path) / "adapter_model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with mock.patch.object(PeftModelForCausalLM, "save_pretrained", partial), pytest.raises(OSError):
        save_lora_outputs(cfg, policy, tok, out)
    assert _tree(adapters) == before and sorted(p.name for p in tmp_path.iterdir()) == [out.name, adapters.name]
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)
    save_lora_outputs(cfg, policy, tok, out)  # a new adapter folder; the base carried over as hard links
    after = _tree(adapters)
    assert after["adapter_model.safetensors"] != before["adapter_model.safetensors"]
    assert {k: v for k, v in after.items() if k.startswith("base/")} == {k: v for k, v in before.items() if k.startswith("base/")}
    assert json.loads((adapters / "adapter_config.json").read_text())["base_model_name_or_path"] == str((adapters / "base").resolve())


# ------------------------------------------------------------------ never save diverged weights
def test_nonfinite_gradient_with_finite_loss_skips_the_step():
    """A NaN gradient under a finite loss (what --learning_rate 1e4 leads to): no optimizer moves, counted."""
    world = build_update_world()
    ro, _ = run_experience(world)
    actor0, critic0 = param_snapshot(world.actor), param_snapshot(world.critic)
    next(world.actor.parameters()).register_hook(lambda g: g * float("nan"))
    stats = run_update(world, ro)
    assert stats["nonfinite"] == 1.0 and stats["loss/policy"] == stats["loss/policy"]  # the loss itself was finite
    assert all(torch.equal(p, world.actor.state_dict()[n]) for n, p in actor0.items())
    assert all(torch.equal(p, world.critic.state_dict()[n]) for n, p in critic0.items())


@pytest.mark.slow
def test_diverged_run_never_saves_nonfinite_weights(world, tmp_path):
    flags = tiny_flags(world, tmp_path, max_steps=6, max_nonfinite=3, learning_rate=1e4, critic_learning_rate=1e4)
    code, out = run_main(flags)
    rows = read_metrics(tmp_path / "run")
    assert any(r["nonfinite"] for r in rows), out[-2000:]  # the huge LR made some gradients non-finite
    files = ckpt.list_resume_files(tmp_path / "ckpt", PREFIX)
    assert files, out[-2000:]
    for f in files:
        state = ckpt.read_resume(f)
        for key in ("actor", "critic"):
            assert all(torch.isfinite(t).all() for t in state[key].values()), f"{f.name}: non-finite {key} saved"
    saved = torch.load(_save_dir(flags) / f"ppo_actor_{world['hidden']}.pth", weights_only=True)
    assert all(torch.isfinite(t.float()).all() for t in saved.values())
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=7, max_nonfinite=3, learning_rate=1e4,
                                    critic_learning_rate=1e4, from_resume=1))
    assert "resumed from" in out


# ------------------------------------------------------------------ disk full
@pytest.mark.slow
def test_disk_full_while_saving_is_one_line_and_keeps_the_previous_file(world, tmp_path):
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=1))
    assert code is None
    good = (tmp_path / "ckpt" / _name(1)).read_bytes()
    real = ckpt.save_resume

    def full(state, checkpoint_dir, prefix, step, keep):
        raise OSError(errno.ENOSPC, "No space left on device")

    with mock.patch.object(ckpt, "save_resume", side_effect=full):
        code, out = run_main(tiny_flags(world, tmp_path, max_steps=3, from_resume=1))
    assert isinstance(code, str) and "\n" not in code
    assert code == f"error: no space left on {tmp_path / 'ckpt'} while saving step 2; the previous checkpoint is intact"
    assert (tmp_path / "ckpt" / _name(1)).read_bytes() == good
    assert _run_json(tmp_path / "run")["status"].startswith("stopped: no space left")
    assert ckpt.save_resume is real


def test_disk_full_while_writing_metrics_is_one_line(world, tmp_path):
    from trainer.run.run_logger import RunLogger

    with mock.patch.object(RunLogger, "log", side_effect=OSError(errno.ENOSPC, "No space left on device")):
        code, out = run_main(tiny_flags(world, tmp_path, max_steps=2))
    assert code == f"error: no space left on {tmp_path / 'run'} while writing the metrics of step 1"
    assert _run_json(tmp_path / "run")["status"].startswith("stopped: no space left")


def test_free_space_is_checked_before_writing(tmp_path):
    state = {"w": torch.zeros(1000)}
    with mock.patch("shutil.disk_usage", return_value=mock.Mock(free=100)):
        with pytest.raises(OSError, match="MB free") as e:
            ckpt.check_free_space(tmp_path, PREFIX, state)
    assert e.value.errno == errno.ENOSPC
    ckpt.check_free_space(tmp_path, PREFIX, state)  # this machine has room for 4 KB


# ------------------------------------------------------------------ signals
def _spawn_and_signal(world, tmp_path, sig, flags: dict, at_file: str) -> tuple[subprocess.Popen, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / f"log_{sig}.txt"
    p = spawn_train(tiny_flags(world, tmp_path, **flags), tmp_path, log)
    t_end = time.monotonic() + 240
    while not (tmp_path / "ckpt" / at_file).exists():
        assert p.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < t_end
        time.sleep(0.01)
    p.send_signal(sig)
    return p, log


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_exits_0_and_resume_is_bit_identical(world, tmp_path, sig):
    common = dict(max_steps=6, save_interval=100, sample_interval=0, reward_fn=[])
    a, b = tmp_path / "a", tmp_path / "b"
    code, out = run_main(tiny_flags(world, a, **common))  # never interrupted
    assert code is None, out[-2000:]
    # save_interval 100: the only saves are the signal's and the end's. Wait for the run to get going.
    p, log = _spawn_and_signal(world, b, sig, dict(common, save_interval=1), _name(1))
    assert p.wait(timeout=240) == 0, log.read_text()[-3000:]
    text = log.read_text()
    line = next(l for l in text.splitlines() if l.startswith("stopped by "))
    assert signal.Signals(sig).name in line and "--from_resume 1" in line
    assert "Traceback" not in text
    assert _run_json(b / "run")["status"] == f"stopped: {signal.Signals(sig).name}"
    stopped_at = ckpt.list_resume_files(b / "ckpt", PREFIX)[0]
    assert int(stopped_at.name[-12:-4]) < 6
    code, out = run_main(tiny_flags(world, b, **dict(common, save_interval=1), from_resume=1))
    assert code is None, out[-2000:]
    sa, sb = ckpt.read_resume(a / "ckpt" / _name(6)), ckpt.read_resume(b / "ckpt" / _name(6))
    assert not deep_equal({k: sa[k] for k in ("actor", "critic", "optim")}, {k: sb[k] for k in ("actor", "critic", "optim")})


@pytest.mark.slow
def test_second_ctrl_c_stops_at_once_and_loses_nothing(world, tmp_path):
    slow = tmp_path / "slow_reward.py"  # steps of ~4 s, so every signal lands inside one step
    slow.write_text("import time\n\ndef slow(prompt, reply, reference):\n    time.sleep(1.0)\n    return 0.0\n")
    p, log = _spawn_and_signal(world, tmp_path, signal.SIGINT, dict(max_steps=50, save_interval=1, reward_fn=[f"{slow}:slow"]),
                               _name(1))
    time.sleep(0.05)
    p.send_signal(signal.SIGINT)  # the same Ctrl-C forwarded by a launcher: absorbed
    time.sleep(GRACE_S + 0.5)
    p.send_signal(signal.SIGINT)  # a second Ctrl-C after the grace window stops at once
    rc = p.wait(timeout=120)
    assert rc != 0, log.read_text()[-2000:]
    files = ckpt.list_resume_files(tmp_path / "ckpt", PREFIX)
    assert files and all(ckpt.read_resume(f)["step"] >= 1 for f in files)  # every file complete and readable
    assert _run_json(tmp_path / "run")["status"] == "interrupted"


@pytest.mark.slow
def test_sigkill_leaves_no_lock_behind(world, tmp_path):
    log = tmp_path / "log.txt"
    p = spawn_train(tiny_flags(world, tmp_path, max_steps=50, save_interval=1), tmp_path, log)
    sigkill_after(p, tmp_path / "ckpt" / _name(1), delay=0.0)
    code, out = run_main(tiny_flags(world, tmp_path, max_steps=2, from_resume=1))
    assert code is None, out[-2000:]


def _start_ranks(flags: list[str], cwd: Path, world: int = 2) -> list[tuple[subprocess.Popen, Path]]:
    """`world` train_ppo.py processes started as torchrun starts its workers (gloo on CPU); their logs."""
    import socket
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = []
    for rank in range(world):
        log = cwd / f"rank{rank}.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", SWANLAB_MODE="disabled",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        with open(log, "w") as f:
            out.append((subprocess.Popen([sys.executable, str(ROOT / "train_ppo.py"), *flags], cwd=cwd, env=env,
                                         stdout=f, stderr=subprocess.STDOUT), log))
    return out


def _wait_ranks(procs, timeout: float = 240) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p, _ in procs]
    finally:
        for p, _ in procs:
            p.kill()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_preemption_under_a_scheduler_and_torchrun_saves_and_resumes_exactly(world, tmp_path, strategy):
    """SLURM signals every process of the step and torchrun forwards the same SIGTERM: each worker gets it
    twice, 50 ms apart. The repeat is absorbed: the step finishes, every rank agrees, rank 0 saves, all
    exit 0, and the resumed run ends with the weights of a run never interrupted. The same with sharded models."""
    common = dict(max_steps=5, save_interval=100, sample_interval=0, reward_fn=[], device="cpu", batch_size=2, mini_batch_size=2,
                  strategy=strategy)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert _wait_ranks(_start_ranks(tiny_flags(world, a, **common), a)) == [0, 0], (a / "rank0.log").read_text()[-3000:]
    procs = _start_ranks(tiny_flags(world, b, **dict(common, save_interval=1)), b)
    t_end = time.monotonic() + 240
    while not (b / "ckpt" / _name(1)).exists():
        assert all(p.poll() is None for p, _ in procs), (b / "rank0.log").read_text()[-3000:]
        assert time.monotonic() < t_end
        time.sleep(0.01)
    for _ in range(2):
        for p, _ in procs:
            p.send_signal(signal.SIGTERM)
        time.sleep(0.05)
    codes = _wait_ranks(procs)
    logs = [log.read_text() for _, log in procs]
    assert codes == [0, 0], [t[-3000:] for t in logs]
    assert all("Traceback" not in t and "KeyboardInterrupt" not in t for t in logs), [t[-3000:] for t in logs]
    assert any(l.startswith("stopped by SIGTERM") for l in logs[0].splitlines())
    stopped_at = ckpt.read_resume(ckpt.list_resume_files(b / "ckpt", PREFIX)[0])["step"]
    assert 1 <= stopped_at < 5
    assert _wait_ranks(_start_ranks(tiny_flags(world, b, **dict(common, save_interval=1), from_resume=1), b)) == [0, 0], \
        (b / "rank0.log").read_text()[-3000:]
    sa, sb = resume_state(a / "ckpt" / _name(5)), resume_state(b / "ckpt" / _name(5))
    parts = [k for k in sa if k in ("actor", "critic", "optim") or k.startswith("optim/")]
    assert not deep_equal({k: sa[k] for k in parts}, {k: sb[k] for k in parts})


@pytest.mark.slow
def test_sigkill_of_every_rank_during_sharded_saves_loses_nothing(world, tmp_path):
    """--strategy fsdp2 saves every step: every rank writes DCP shards, rank 0 renames the folder and then
    commits the step with its .pth. Both ranks are SIGKILLed at arbitrary moments after a save, twice (kills
    land in a step or inside a save); each resume picks the last committed step, leftovers are ignored and
    cleaned, and the run ends with the model and AdamW state of a run never killed, bit for bit."""
    import random

    common = dict(max_steps=6, save_interval=1, keep_checkpoints=2, sample_interval=0, reward_fn=[], device="cpu",
                  batch_size=2, mini_batch_size=2, strategy="fsdp2")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert _wait_ranks(_start_ranks(tiny_flags(world, a, **common), a)) == [0, 0], (a / "rank0.log").read_text()[-3000:]
    rng = random.Random()  # the kill moments are deliberately not reproducible
    for k, after in enumerate((1, 3)):
        procs = _start_ranks(tiny_flags(world, b, **common, from_resume=int(k > 0)), b)
        t_end = time.monotonic() + 240
        while not (b / "ckpt" / _name(after)).exists():
            assert all(p.poll() is None for p, _ in procs), (b / "rank0.log").read_text()[-3000:]
            assert time.monotonic() < t_end
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.3))
        assert all(p.poll() is None for p, _ in procs), "the run finished before the kill: it would test nothing"
        for p, _ in procs:
            p.send_signal(signal.SIGKILL)
        assert [p.wait(timeout=60) for p, _ in procs] == [-signal.SIGKILL] * 2
        assert ckpt.list_resume_files(b / "ckpt", PREFIX)  # a committed step is always there
    assert _wait_ranks(_start_ranks(tiny_flags(world, b, **common, from_resume=1), b)) == [0, 0], \
        (b / "rank0.log").read_text()[-3000:]
    files = ckpt.list_resume_files(b / "ckpt", PREFIX)
    assert [f.name for f in files] == [_name(6), _name(5)]
    assert sorted(p.name for p in (b / "ckpt").glob("*.dcp*")) == sorted(f.name.replace(".pth", ".dcp") for f in files)
    sa, sb = resume_state(a / "ckpt" / _name(6)), resume_state(files[0])
    parts = [k for k in sa if k in ("actor", "critic") or k.startswith("optim/")]
    assert parts and not deep_equal({k: sa[k] for k in parts}, {k: sb[k] for k in parts})
