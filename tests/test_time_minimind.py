"""benchmarks/time_minimind.py against a stand-in MiniMind checkout (the real one is not shipped).

The stand-in has MiniMind's layout where it matters for imports: `trainer/` without __init__.py (a namespace
package, as in github.com/jingyaogong/minimind), `model/` and `dataset/` with one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_TRAINER = '''
import os, sys, time
sys.path.append(os.path.abspath(os.path.join(os.path.dirname(__file__), '..')))
import datasets
from trainer.trainer_utils import Logger, LMForRewardModel
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
rm = LMForRewardModel("../../no-such-reward-model")
rows = datasets.load_dataset("json", data_files=sys.argv[sys.argv.index("--data_path") + 1], split="train")
assert len(rows) == 200 and rows[0]["conversations"][0]["role"] == "user"
open("../seen_args.txt", "w").write(" ".join(sys.argv[1:]))
if os.environ.get("MINIPPO_TEST_PROBE"):
    import carried_probe  # a module only the carried-wheels folder on PYTHONPATH has
    open("../seen_probe.txt", "w").write(carried_probe.WHERE)
policy = MiniMindForCausalLM(MiniMindConfig(16, 2))
for step in range(1, 100):
    time.sleep(0.04 * step)  # steps get longer: the timed ones are steps 3..
    policy.generate(0.01 * step)
    Logger(f"Epoch:[1/1]({step}/99), Reward: {rm.get_score([], 'x'):.1f}")
'''


def _fake_minimind(root: Path) -> None:
    (root / "trainer").mkdir(parents=True)
    (root / "model").mkdir()
    (root / "dataset").mkdir()
    for script in ("train_ppo.py", "train_grpo.py"):
        (root / "trainer" / script).write_text(FAKE_TRAINER)
    (root / "dataset" / "__init__.py").write_text("")  # no trainer/__init__.py: MiniMind has none
    (root / "trainer" / "trainer_utils.py").write_text(
        "def Logger(msg):\n    print(msg)\n"
        "class LMForRewardModel:\n    def __init__(self, path):\n        raise OSError('the real reward model must not load')\n")
    (root / "model" / "__init__.py").write_text("")
    (root / "model" / "model_minimind.py").write_text(
        "import torch\n"
        "class MiniMindConfig:\n    def __init__(self, hidden_size, num_hidden_layers):\n        self.h = hidden_size\n"
        "class MiniMindForCausalLM(torch.nn.Module):\n    def __init__(self, cfg):\n        super().__init__()\n"
        "        self.w = torch.nn.Linear(cfg.h, 2)\n"
        "    def generate(self, seconds):\n        import time\n        time.sleep(seconds)\n")


@pytest.mark.slow
def test_times_steps_after_two_warmups_with_a_zero_reward_model(tmp_path):
    mm = tmp_path / "minimind"
    _fake_minimind(mm)
    out = tmp_path / "mm.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "time_minimind.py"), "--minimind_dir", str(mm),
                        "--size", "16x2", "--steps", "3", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    # Steps 3, 4, 5 of the stand-in sleep 0.15, 0.20, 0.25 s; the two warm-up steps are not counted.
    assert len(res["steps_s"]) == 3
    for got, want in zip(res["steps_s"], [0.15, 0.20, 0.25]):
        assert want <= got < want + 0.3
    assert res["median_s"] == res["steps_s"][1]
    for got, want in zip(res["generate_s"], [0.03, 0.04, 0.05]):  # the time inside MiniMind's generate()
        assert want <= got < want + 0.1
    assert "Reward: 0.0" in r.stdout and "Epoch:[1/1](6/99)" not in r.stdout  # stopped after the last timed step
    assert (mm / "out" / "full_sft_16.pth").is_file()
    args = (mm / "seen_args.txt").read_text()
    assert "--hidden_size 16 --num_hidden_layers 2 --batch_size 8 --max_seq_len 64 --max_gen_len 64" in args


@pytest.mark.slow
def test_a_folder_without_minimind_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "time_minimind.py"), "--minimind_dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and r.stderr.strip().count("\n") == 0
    assert "no trainer/train_ppo.py there" in r.stderr


def _time_minimind(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "time_minimind.py"), *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=cwd)


def test_minimind_runs_with_our_root_on_pythonpath_and_keeps_carried_wheels(tmp_path):
    """benchmarks/gpu_check.py started it with PYTHONPATH=<our root> (and from our root): our `trainer` package
    then shadowed MiniMind's namespace `trainer/` and `import trainer.trainer_utils` failed. The root must come
    off MiniMind's path, and every other PYTHONPATH entry (where carried wheels were installed) must stay."""
    import os

    mm, wheels = tmp_path / "minimind", tmp_path / "site"
    _fake_minimind(mm)
    wheels.mkdir()
    (wheels / "carried_probe.py").write_text("WHERE = 'carried'\n")
    env = dict(os.environ, PYTHONPATH=f"{wheels}{os.pathsep}{ROOT}", MINIPPO_TEST_PROBE="1")
    out = tmp_path / "mm.json"
    r = _time_minimind(["--minimind_dir", str(mm), "--size", "16x2", "--steps", "1", "--json", str(out)],
                       env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (mm / "seen_probe.txt").read_text() == "carried"
    assert json.loads(out.read_text())["script"] == "ppo"


def test_grpo_gets_minimind_own_flags_and_the_device(tmp_path):
    mm = tmp_path / "minimind"
    _fake_minimind(mm)
    out = tmp_path / "mm.json"
    r = _time_minimind(["--minimind_dir", str(mm), "--script", "grpo", "--size", "16x2", "--steps", "1", "--warmup", "1",
                        "--device", "cuda:0", "--json", str(out)])  # the stand-in never touches a GPU
    assert r.returncode == 0, r.stderr[-2000:]
    args = (mm / "seen_args.txt").read_text().split()

    def flag(name):
        return args[args.index(name) + 1]

    assert (flag("--batch_size"), flag("--num_generations"), flag("--beta"), flag("--device")) == ("2", "4", "0.1", "cuda:0")
    assert "--ppo_update_iters" not in args and args.count("--device") == 1
    res = json.loads(out.read_text())
    assert res["script"] == "grpo" and res["batch_size"] == 2 and res["num_generations"] == 4 and len(res["steps_s"]) == 1


def test_off_our_root_drops_only_the_root():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from time_minimind import off_our_root
    finally:
        sys.path.pop(0)
    path = ["", str(ROOT / "benchmarks"), str(ROOT), f"{ROOT}/.", "/opt/site", "rel"]
    assert off_our_root(path, ROOT, cwd=str(ROOT)) == [str(ROOT / "benchmarks"), "/opt/site", "rel"]
    assert off_our_root(path, ROOT, cwd="/tmp") == ["", str(ROOT / "benchmarks"), "/opt/site", "rel"]


def test_a_relative_json_path_is_written_where_the_caller_stands(tmp_path):
    """The script changes into MiniMind's trainer/ folder; `--json out.json` still means the caller's folder."""
    mm = tmp_path / "minimind"
    _fake_minimind(mm)
    caller = tmp_path / "caller"
    caller.mkdir()
    r = _time_minimind(["--minimind_dir", str(mm), "--size", "16x2", "--steps", "1", "--json", "mm.json"], cwd=caller)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((caller / "mm.json").read_text())["script"] == "ppo"
    assert not (mm / "trainer" / "mm.json").exists()
