"""examples/slurm_train.sbatch run on this machine as SLURM would run it, with a fake srun and scontrol
(tests/fake_slurm/: every "node" is this machine, at its own loopback address; the fake srun handles signals as
SchedMD's does, a TERM to it kills the step): two training nodes under `srun torchrun` (one gloo rank each, c10d
rendezvous on the first), one engine node serving tests/engine_standin.py's vLLM protocol (and the reward model with
REWARD_MODEL_DIR), the engine URL and a shared push folder passed to the trainer; USR1 ahead of the time limit
(`--signal=B:USR1@...`) reaches the ranks through srun, the step in flight is finished and saved, the job requeues
itself, and the second start (SLURM_RESTART_COUNT=1) resumes from that step and finishes. What only a cluster can
check: docs/distributed.md#slurm-training-nodes-beside-engine-nodes.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, free_port, read_metrics
from trainer.run.signals import STOP_SIGNALS

SBATCH = ROOT / "examples" / "slurm_train.sbatch"
FAKE = ROOT / "tests" / "fake_slurm"
NODES = ["localhost", "127.0.0.2", "127.0.0.3"]  # two training nodes, one engine node
SFT = ROOT / "out" / "full_sft_128.pth"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from model.hf_convert import policy_to_hf
    from model.loader import load_policy

    actor, tok = load_policy(weights=SFT, hidden_size=128, num_hidden_layers=4)
    out = tmp_path_factory.mktemp("slurm_model") / "full_sft_128_hf"
    policy_to_hf(copy.deepcopy(actor), tok, out)
    return out


def _job(tmp: Path, hf_dir: Path, restart: int = 0, **env_over: str) -> tuple[list[str], dict]:
    """The sbatch script's command line (train_ppo.py flags: the demo, 3 GRPO steps, sampled by the engine) and the
    environment SLURM gives a batch script, the fakes first on the PATH."""
    (tmp / "out").mkdir(exist_ok=True)
    if not (tmp / "out" / SFT.name).exists():
        (tmp / "out" / SFT.name).write_bytes(SFT.read_bytes())
    flags = {"save_dir": tmp / "out", "hidden_size": 128, "num_hidden_layers": 4, "device": "cpu", "num_threads": 1,
             "dtype": "float32", "eval_data_path": "none", "swanlab_mode": "disabled", "max_steps": 3, "save_interval": 100,
             "advantage_estimator": "grpo", "num_generations": 2, "batch_size": 2, "mini_batch_size": 4, "max_gen_len": 8,
             "sample_interval": 0, "data_path": ROOT / "dataset" / "demo_train.jsonl",
             "reward_model_path": ROOT / "out" / "demo_rm"}
    argv = ["bash", str(SBATCH), *[x for k, v in flags.items() for x in (f"--{k}", str(v))]]
    env = dict(os.environ, PATH=f"{FAKE}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="minippo-test", SLURM_JOB_NODELIST="node[1-3]",
               SLURM_SUBMIT_DIR=str(ROOT), SLURM_RESTART_COUNT=str(restart), FAKE_NODES=" ".join(NODES),
               FAKE_SLURM_LOG=str(tmp / "slurm.log"), FAKE_REPO=str(ROOT), FAKE_PYTHON=sys.executable,
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", SWANLAB_MODE="disabled",
               TRAIN_NODES="2", ENGINE_NODES="1", GPUS_PER_NODE="1", MODEL_DIR=str(hf_dir), RUN_ROOT=str(tmp / "shared"),
               ENGINE_PORT=str(free_port()), RM_PORT=str(free_port()), RDZV_PORT=str(free_port()),
               SHUTDOWN_TIMEOUT="120", FAKE_KILL_WAIT="5", SERVE_ENGINE=str(FAKE / "serve_engine.sh"),
               SERVE_REWARD_MODEL=str(FAKE / "serve_reward_model.sh"))
    return argv, {**env, **env_over}


def _logged_steps(tmp: Path) -> list[int]:
    metrics = tmp / "shared" / "runs" / "metrics.jsonl"
    return [r["step"] for r in read_metrics(metrics.parent)] if metrics.exists() else []


def _run(argv: list[str], env: dict, tmp: Path, name: str, preempt_after_step: int | None = None,
         timeout: float = 400) -> tuple[int, str]:
    """The batch script to its end (its output in tmp/name.out); with preempt_after_step, USR1 to the script alone once
    that step's metrics are written, as `#SBATCH --signal=B:USR1@300` or `scancel --batch --signal=USR1` sends it."""
    out_path = tmp / f"{name}.out"
    with out_path.open("w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        if preempt_after_step is not None:
            while preempt_after_step not in _logged_steps(tmp):
                assert proc.poll() is None, out_path.read_text()[-3000:]
                assert time.monotonic() < deadline, out_path.read_text()[-3000:]
                time.sleep(0.1)
            proc.send_signal(signal.SIGUSR1)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the batch script hung: {out_path.read_text()[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the script left behind (it should leave nothing)
        except ProcessLookupError:
            pass
    return rc, out_path.read_text()


@pytest.mark.slow  # two batch-script runs of 2 torchrun "nodes" and an engine (~1-2 min)
def test_sbatch_trains_on_two_nodes_beside_an_engine_node_and_requeues_on_the_signal(hf_dir, tmp_path):
    """The time limit's USR1 while step 2 runs (--save_interval 100: no save but the one the signal asks for): the
    ranks finish that step and save it, and the requeued job goes on from the next one. At 5fab971 the script sent
    srun a TERM, which srun turns into SIGKILL: nothing was saved and the second start began again at step 1."""
    argv, env = _job(tmp_path, hf_dir, REWARD_MODEL_DIR=str(ROOT / "out" / "demo_rm"))
    rc, out = _run(argv, env, tmp_path, "first", preempt_after_step=1)
    log = (tmp_path / "slurm.log").read_text()
    assert rc == 0, out[-3000:]
    assert "USR1: time limit ahead: USR1 to the training step" in out and "requeueing job 4242" in out, out[-3000:]
    assert "SIGUSR1: finishing this step, then saving and stopping" in out, out[-3000:]
    assert "scontrol requeue 4242" in log, log
    # The engine node served the policy and the reward model on its own address, asked to listen on every interface.
    assert f"serve_engine on {NODES[2]}: ENGINE_HOST=0.0.0.0 --foreground vllm {hf_dir}" in log, log
    assert f"serve_reward_model on {NODES[2]}: RM_HOST=0.0.0.0 --foreground {ROOT / 'out' / 'demo_rm'}" in log, log
    train = next(line for line in log.splitlines() if "torchrun" in line)
    assert train.startswith(f"srun [{NODES[0]},{NODES[1]}] torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d "
                            f"--rdzv_endpoint {NODES[0]}:{env['RDZV_PORT']} --rdzv_id 4242"), train
    for flag in (f"--engine_url http://{NODES[2]}:{env['ENGINE_PORT']}", f"--engine_shared_path {tmp_path}/shared/push",
                 f"--reward_model_url http://{NODES[2]}:{env['RM_PORT']}", "--from_resume 2",
                 f"--checkpoint_dir {tmp_path}/shared/checkpoints"):
        assert flag in train, (flag, train)
    assert "--signals_to_handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in train, train
    assert f"srun [{NODES[0]},{NODES[1]}] got USR1: forwarded" in log, log
    assert f"srun [{NODES[0]},{NODES[1]}] got TERM" not in log and "forcing job termination: SIGKILL" not in \
        log.split("scontrol requeue")[0], log  # the training step was never killed
    assert f"srun [{NODES[2]}] got USR1" not in log, log  # the engines were not signalled with the trainers
    first = _logged_steps(tmp_path)
    assert first == list(range(1, len(first) + 1)) and 1 <= max(first) < 3, first  # stopped early
    saved = sorted(p.name for p in (tmp_path / "shared" / "checkpoints").glob("*_resume_step*.pth"))
    assert saved and saved[-1].endswith(f"_resume_step{max(first):08d}.pth") and len(saved) == 1, saved

    (tmp_path / "slurm.log").unlink()
    argv, env = _job(tmp_path, hf_dir, restart=1, REWARD_MODEL_DIR=str(ROOT / "out" / "demo_rm"))
    rc, out = _run(argv, env, tmp_path, "second")
    log = (tmp_path / "slurm.log").read_text()
    assert rc == 0 and "training step ended: exit status 0" in out, out[-3000:]
    assert "requeue" not in log, log
    steps = _logged_steps(tmp_path)
    assert steps == [1, 2, 3] and steps[: len(first)] == first, steps  # resumed after the last step run, not restarted
    assert list((tmp_path / "shared" / "checkpoints").glob("*_resume_step00000003.pth"))
    assert any(p.name == "model.safetensors" for p in (tmp_path / "shared" / "push").iterdir())


def test_sbatch_refuses_an_allocation_that_does_not_fit(tmp_path):
    hf_dir = tmp_path / "model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}", encoding="utf-8")
    argv, env = _job(tmp_path, hf_dir, TRAIN_NODES="3")
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == ("slurm_train: error: 3 nodes allocated, TRAIN_NODES=3 + ENGINE_NODES=1 "
                                                      "do not fit"), r.stderr
    argv, env = _job(tmp_path, hf_dir, MODEL_DIR=str(tmp_path / "out"))
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "is not the HF directory the engines start from" in r.stderr, r.stderr


@pytest.mark.slow
def test_sbatch_without_engine_nodes_samples_in_the_trainer(tmp_path):
    """ENGINE_NODES=0: every node trains, no server is started, no engine flag is passed, the run finishes (exit 0)."""
    argv, env = _job(tmp_path, tmp_path / "unused", ENGINE_NODES="0", TRAIN_NODES="2", MODEL_DIR="")
    argv[argv.index("--max_steps") + 1] = "1"
    rc, out = _run(argv, env, tmp_path, "no_engine")
    log = (tmp_path / "slurm.log").read_text()
    assert rc == 0 and "engines on none" in out and "training step ended: exit status 0" in out, out[-3000:]
    assert "serve_" not in log and "--engine_url" not in log and "--rollout_engine" not in log, log
    assert [r["step"] for r in read_metrics(tmp_path / "shared" / "runs")] == [1]


# ---- the fake srun behaves as SchedMD's (src/srun/srun_job.c _srun_signal_mgr / _handle_intr, Slurm 25.05)

TASK = r"""#!/usr/bin/env bash
# A task that records the signals it and its grandchild (in a session of its own, as torchrun starts its workers) get.
setsid bash -c 'trap "echo $SLURM_PROCID child USR1 >> $OUTF" USR1; while :; do sleep 0.05; done' &
trap 'echo $SLURM_PROCID TERM >> $OUTF' TERM
trap 'echo $SLURM_PROCID INT >> $OUTF' INT
trap 'echo $SLURM_PROCID USR1 >> $OUTF' USR1
trap 'echo $SLURM_PROCID USR2 >> $OUTF' USR2
[[ "$SLURM_PROCID" == "${FAIL_TASK:-}" ]] && { sleep 0.5; exit 3; }
touch "$OUTF.ready$SLURM_PROCID"
while :; do sleep 0.05; done
"""


def _srun(tmp: Path, *opts: str, **env_over: str) -> tuple[subprocess.Popen, Path]:
    task = tmp / "task.sh"
    task.write_text(TASK)
    task.chmod(0o755)
    out = tmp / "signals"
    env = dict(os.environ, PATH=f"{FAKE}{os.pathsep}{os.environ['PATH']}", FAKE_NODES="a b", SLURM_JOB_NODELIST="a,b",
               FAKE_SLURM_LOG=str(tmp / "slurm.log"), FAKE_PYTHON=sys.executable, OUTF=str(out), **env_over)
    proc = subprocess.Popen([str(FAKE / "srun"), "--nodes=2", *opts, str(task)], env=env, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 20
    while not all((tmp / f"signals.ready{i}").exists() for i in range(2) if str(i) != env_over.get("FAIL_TASK")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    time.sleep(0.2)  # the traps are set before the ready file; the grandchild's a moment after
    return proc, out


def _finish(proc: subprocess.Popen, out: Path) -> tuple[int, str, list[str]]:
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, err, sorted(out.read_text().splitlines()) if out.exists() else []


def test_fake_srun_turns_a_term_into_sigkill_of_the_step(tmp_path):
    """srun does not forward TERM: it prints "forcing job termination" and SIGKILLs every task, whose traps never run."""
    proc, out = _srun(tmp_path)
    proc.send_signal(signal.SIGTERM)
    rc, err, got = _finish(proc, out)
    assert rc == 128 + signal.SIGKILL and "srun: forcing job termination" in err and got == [], (rc, err, got)


def test_fake_srun_forwards_usr1_and_usr2_to_every_process_of_the_step(tmp_path):
    """USR1/USR2 reach each task and the processes it started in sessions of their own (slurmstepd signals the step's
    container), and the step keeps running."""
    proc, out = _srun(tmp_path)
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGUSR2)
    time.sleep(0.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    rc, err, got = _finish(proc, out)
    assert got == ["0 USR1", "0 USR2", "0 child USR1", "1 USR1", "1 USR2", "1 child USR1"], (got, err)


def test_fake_srun_a_second_ctrl_c_within_a_second_kills(tmp_path):
    """The first INT prints the tasks' state and is not forwarded, nor is one 1.3 s later; one more within 1 s forwards
    INT and SIGKILLs the step at once (a trap may not even run)."""
    proc, out = _srun(tmp_path)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.3)
    assert proc.poll() is None and not out.exists()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    rc, err, got = _finish(proc, out)
    assert rc == 128 + signal.SIGKILL and "interrupt (one more within 1 sec to abort)" in err, (rc, err)
    assert "sending Ctrl-C" in err and "forcing job termination" in err and set(got) <= {"0 INT", "1 INT"}, (err, got)


def test_fake_srun_kill_on_bad_exit_terminates_the_other_tasks(tmp_path):
    """--kill-on-bad-exit=1: task 1 exits 3, task 0 gets TERM and, KillWait later, SIGKILL; without it task 0 runs on."""
    proc, out = _srun(tmp_path, "--kill-on-bad-exit=1", FAIL_TASK="1", FAKE_KILL_WAIT="1")
    rc, err, got = _finish(proc, out)
    assert rc == 128 + signal.SIGKILL and "task 1: Exited with exit code 3" in err and got == ["0 TERM"], (rc, err, got)
    (tmp_path / "signals").unlink()
    proc, out = _srun(tmp_path, FAIL_TASK="1")
    time.sleep(1.5)
    assert proc.poll() is None  # the step runs on with its failed task
    proc.send_signal(signal.SIGTERM)
    _finish(proc, out)


# ---- the batch script's preemption, against the fake srun, with a stand-in for torchrun

TORCHRUN = r"""#!/usr/bin/env bash
# Stands in for `torchrun ... train_ppo.py`: on USR1 (forwarded by srun) it "finishes its step and saves", then exits.
trap 'echo "$SLURM_PROCID saved after USR1" >> "$OUTF"; exit 0' USR1
echo "$SLURM_PROCID started $*" >> "$OUTF"
touch "$OUTF.ready$SLURM_PROCID"
while :; do sleep 0.05; done
"""


def _stub_job(tmp: Path, **env_over: str) -> tuple[list[str], dict]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "torchrun").write_text(TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    argv, env = _job(tmp, tmp / "unused", ENGINE_NODES="0", TRAIN_NODES="2", MODEL_DIR="", OUTF=str(tmp / "ranks"),
                     **env_over)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return argv, env


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_sbatch_preemption_reaches_the_ranks_as_usr1_and_requeues(tmp_path, sig):
    """`--signal=B:USR1@300`, or a TERM to the batch script alone (`scancel --batch`): the script sends srun USR1, which
    srun forwards, and the ranks save. At 5fab971 it sent srun a TERM, which srun turns into SIGKILL of the step."""
    argv, env = _stub_job(tmp_path)
    with (tmp_path / "job.out").open("w") as log_out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log_out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"ranks.ready{i}").exists() for i in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "job.out").read_text()
            time.sleep(0.05)
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out, log = (tmp_path / "job.out").read_text(), (tmp_path / "slurm.log").read_text()
    ranks = (tmp_path / "ranks").read_text()
    assert rc == 0 and f"{sig.name[3:]}: time limit ahead: USR1 to the training step" in out, out
    assert "0 saved after USR1" in ranks and "1 saved after USR1" in ranks, (ranks, log)
    assert "got USR1: forwarded" in log and "forcing job termination" not in log and "scontrol requeue 4242" in log, log
    assert "--signals_to_handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in ranks, ranks


def test_sbatch_preempted_during_the_servers_start_up_requeues_without_training(tmp_path):
    """USR1 while the script waits for the engine's /health: it requeues at once and starts no training step (at
    5fab971 the signal had no trap yet and ended the script: the job was not requeued)."""
    hf_dir = tmp_path / "model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}", encoding="utf-8")
    slow = tmp_path / "serve_slow.sh"
    slow.write_text(f"#!/usr/bin/env bash\ntouch {tmp_path}/serving\nexec sleep 60\n")
    argv, env = _job(tmp_path, hf_dir, SERVE_ENGINE=str(slow))
    with (tmp_path / "job.out").open("w") as log_out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log_out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "serving").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "job.out").read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        rc = proc.wait(timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out, log = (tmp_path / "job.out").read_text(), (tmp_path / "slurm.log").read_text()
    assert rc == 0 and "USR1: time limit ahead, before training started" in out, out
    assert "scontrol requeue 4242" in log and "torchrun" not in log, log


def test_sbatch_forwards_a_signal_that_torchrun_and_the_trainer_both_handle():
    """The one signal the script sends its training srun is USR1 (srun forwards it; a TERM it turns into SIGKILL),
    torchrun is told to handle it (else it kills the agent) and the trainer stops and saves on it."""
    text = SBATCH.read_text()
    handled = re.search(r"--signals_to_handle (SIG\S+)", text)
    assert re.findall(r'kill -([A-Z][A-Z0-9]*) "\$TRAINING"', text) == ["USR1"] and "#SBATCH --signal=B:USR1@" in text
    assert handled and "SIGUSR1" in handled.group(1).split(",") and signal.SIGUSR1 in STOP_SIGNALS


# ---- ports: the reward model never shares a port with an engine server

def _ports(tmp: Path, **env_over: str) -> subprocess.CompletedProcess:
    hf_dir = tmp / "model"
    hf_dir.mkdir(exist_ok=True)
    (hf_dir / "config.json").write_text("{}", encoding="utf-8")
    down = tmp / "serve_down.sh"
    down.write_text("#!/usr/bin/env bash\nexit 1\n")  # the script stops at its start-up check, after logging the ports
    argv, env = _job(tmp, hf_dir, SERVE_ENGINE=str(down), SERVE_REWARD_MODEL=str(down),
                     REWARD_MODEL_DIR=str(tmp / "rm"), **env_over)
    for k in ("ENGINE_PORT", "RM_PORT"):
        if k not in env_over:
            env.pop(k)
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("per_node", ["1", "2", "4"])
def test_sbatch_reward_model_port_is_beside_the_engine_ports(tmp_path, per_node):
    """The default RM_PORT is the first port after the engines' (at 5fab971 it was 8001, engine server 1's port)."""
    r = _ports(tmp_path, ENGINES_PER_NODE=per_node)
    srun_log = (tmp_path / "slurm.log").read_text()
    engine = sorted(int(line.split()[-1]) for line in srun_log.splitlines() if "--foreground vllm" in line)
    rm = [int(line.split()[-1]) for line in srun_log.splitlines() if "RM_HOST" in line]
    assert engine == [8000 + i for i in range(int(per_node))] and rm == [8000 + int(per_node)], (srun_log, r.stderr)


def test_sbatch_refuses_a_reward_model_port_among_the_engine_ports(tmp_path):
    r = _ports(tmp_path, ENGINES_PER_NODE="2", ENGINE_PORT="9000", RM_PORT="9001")
    assert r.returncode == 1 and r.stderr.strip() == ("slurm_train: error: RM_PORT=9001 is one of the engine ports "
                                                      "9000-9001: set RM_PORT outside them"), r.stderr
    assert not (tmp_path / "slurm.log").exists()  # nothing started
