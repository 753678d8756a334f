"""benchmarks/time_minimind.py against a stand-in MiniMind checkout (the real one is not shipped)."""

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
rm = LMForRewardModel("../../no-such-reward-model")
rows = datasets.load_dataset("json", data_files=sys.argv[sys.argv.index("--data_path") + 1], split="train")
assert len(rows) == 200 and rows[0]["conversations"][0]["role"] == "user"
open("../seen_args.txt", "w").write(" ".join(sys.argv[1:]))
for step in range(1, 100):
    time.sleep(0.05 * step)  # steps get longer: the timed ones are steps 3..
    Logger(f"Epoch:[1/1]({step}/99), Reward: {rm.get_score([], 'x'):.1f}")
'''


def _fake_minimind(root: Path) -> None:
    (root / "trainer").mkdir(parents=True)
    (root / "model").mkdir()
    (root / "trainer" / "train_ppo.py").write_text(FAKE_TRAINER)
    (root / "trainer" / "__init__.py").write_text("")
    (root / "trainer" / "trainer_utils.py").write_text(
        "def Logger(msg):\n    print(msg)\n"
        "class LMForRewardModel:\n    def __init__(self, path):\n        raise OSError('the real reward model must not load')\n")
    (root / "model" / "__init__.py").write_text("")
    (root / "model" / "model_minimind.py").write_text(
        "import torch\n"
        "class MiniMindConfig:\n    def __init__(self, hidden_size, num_hidden_layers):\n        self.h = hidden_size\n"
        "class MiniMindForCausalLM(torch.nn.Module):\n    def __init__(self, cfg):\n        super().__init__()\n"
        "        self.w = torch.nn.Linear(cfg.h, 2)\n")


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
