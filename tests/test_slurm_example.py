"""examples/slurm_train.sbatch run on this machine as SLURM would run it, with a fake srun and scontrol
(tests/fake_slurm/: every "node" is this machine, at its own loopback address): two training nodes under
`srun torchrun` (one gloo rank each, c10d rendezvous on the first), one engine node serving tests/engine_standin.py's
vLLM protocol (and the reward model with REWARD_MODEL_DIR), the engine URL and a shared push folder passed to the
trainer; USR1 ahead of the time limit (`--signal=B:USR1@...`) ends the step, rank 0 saves, the job requeues itself, and
the second start (SLURM_RESTART_COUNT=1) resumes and finishes. What only a cluster can check:
docs/distributed.md#slurm-training-nodes-beside-engine-nodes.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, free_port, read_metrics

SBATCH = ROOT / "examples" / "slurm_train.sbatch"
FAKE = ROOT / "tests" / "fake_slurm"
NODES = ["localhost", "127.0.0.2", "127.0.0.3"]  # two training nodes, one engine node
SFT = ROOT / "out" / "full_sft_128.pth"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from model.loader import load_policy
    from scripts.convert_model import policy_to_hf

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
             "dtype": "float32", "eval_data_path": "none", "swanlab_mode": "disabled", "max_steps": 3, "save_interval": 1,
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
               SHUTDOWN_TIMEOUT="120", SERVE_ENGINE=str(FAKE / "serve_engine.sh"),
               SERVE_REWARD_MODEL=str(FAKE / "serve_reward_model.sh"))
    return argv, {**env, **env_over}


def _run(argv: list[str], env: dict, tmp: Path, name: str, preempt_after_step: int | None = None,
         timeout: float = 400) -> tuple[int, str]:
    """The batch script to its end (its output in tmp/name.out); with preempt_after_step, USR1 once that step's resume
    file is written, as `#SBATCH --signal=B:USR1@300` would send it."""
    out_path = tmp / f"{name}.out"
    with out_path.open("w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        if preempt_after_step is not None:
            saved = tmp / "shared" / "checkpoints"
            while not list(saved.glob(f"*_resume_step{preempt_after_step:08d}.pth")):
                assert proc.poll() is None, out_path.read_text()[-3000:]
                assert time.monotonic() < deadline, out_path.read_text()[-3000:]
                time.sleep(0.2)
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
    argv, env = _job(tmp_path, hf_dir, REWARD_MODEL_DIR=str(ROOT / "out" / "demo_rm"))
    rc, out = _run(argv, env, tmp_path, "first", preempt_after_step=1)
    log = (tmp_path / "slurm.log").read_text()
    assert rc == 0, out[-3000:]
    assert "time limit ahead: SIGTERM to the training step" in out and "requeueing job 4242" in out, out[-3000:]
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
    assert f"srun [{NODES[0]},{NODES[1]}] got TERM" in log, log  # the engines were not signalled with the trainers
    first = [r["step"] for r in read_metrics(tmp_path / "shared" / "runs")]
    assert first and max(first) < 3, first  # stopped early, at a saved step

    (tmp_path / "slurm.log").unlink()
    argv, env = _job(tmp_path, hf_dir, restart=1, REWARD_MODEL_DIR=str(ROOT / "out" / "demo_rm"))
    rc, out = _run(argv, env, tmp_path, "second")
    log = (tmp_path / "slurm.log").read_text()
    assert rc == 0 and "training step ended: exit status 0" in out, out[-3000:]
    assert "requeue" not in log, log
    steps = [r["step"] for r in read_metrics(tmp_path / "shared" / "runs")]
    assert steps == sorted(set(steps)) and steps[-1] == 3 and steps[: len(first)] == first, steps  # resumed, not restarted
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
