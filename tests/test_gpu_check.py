"""benchmarks/gpu_check.py: one line and exit 2 without CUDA; --allow_cpu runs every check on the CPU (smoke)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.test_time_minimind import _fake_minimind

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
ROWS = ["gpu tests", "bench", "deterministic", "fast decode", "logprob gap", "2 processes", "fsdp2", "minimind"]


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    # No GPU visible, whatever the machine: the no-CUDA path is what these tests are about.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _table(stdout: str) -> dict[str, tuple[str, str]]:
    """check -> (result, figures) from the final markdown table."""
    rows = [l for l in stdout.splitlines() if l.startswith("| ") and not l.startswith("| check ")]
    out = {}
    for line in rows:
        check, result, figures = (c.strip() for c in line.strip("|").split(" | ", 2))
        out[check] = (result, figures)
    return out


def test_without_cuda_it_says_so_in_one_line_and_exits_2():
    r = _run([], timeout=120)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA device") and "--allow_cpu" in lines[0]


def test_bad_minimind_dir_is_one_line(tmp_path):
    r = _run(["--allow_cpu", "--minimind_dir", str(tmp_path)], timeout=120)
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"error: --minimind_dir {tmp_path}: no trainer/train_ppo.py there "
                                             f"(clone jingyaogong/minimind)"]


@pytest.mark.slow
def test_allow_cpu_smoke_run_prints_every_row(tmp_path):
    mm = tmp_path / "minimind"
    _fake_minimind(mm)  # a stand-in MiniMind checkout: the minimind row runs too
    work = tmp_path / "work"
    r = _run(["--allow_cpu", "--minimind_dir", str(mm), "--workdir", str(work)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "no GPU: --allow_cpu smoke run" in r.stdout and "CUDA none" in r.stdout
    table = _table(r.stdout)
    assert list(table) == ROWS
    assert table["gpu tests"][0] == "SKIP" and "skipped" in table["gpu tests"][1]  # the gpu tests exist, skipped here
    for check in ROWS[1:]:
        assert table[check][0] == "PASS", (check, table[check])
    assert "s/step" in table["bench"][1] and "peak RSS" in table["bench"][1]
    assert table["deterministic"][1].startswith("identical: ")
    assert "no LoRA: A_logr" in table["logprob gap"][1] and "LoRA r4: A_logr" in table["logprob gap"][1]
    assert "gloo with --device cpu" in table["2 processes"][1]
    assert table["fsdp2"][0] == "PASS" and "policy and DCP shards written" in table["fsdp2"][1]
    assert "x as long" in table["minimind"][1]  # MiniMind's s/step against the bench row's
    # Each check's command was printed before it ran, and the runs wrote where they were told.
    commands = [l for l in r.stdout.splitlines() if l.startswith("$ ")]
    for part in ("-m pytest -q -m gpu", "benchmarks/bench_ppo.py", "train_ppo.py --device cpu --dtype bfloat16 --deterministic 1",
                 "--_child fast_decode", "benchmarks/measure_logprob_gap.py", "torch.distributed.run", "--_child minimind"):
        assert any(part in c for c in commands), part
    assert (work / "det_a" / "out" / "ppo_actor_64.pth").is_file() and (work / "ddp_gloo" / "out" / "ppo_actor_64.pth").is_file()


@pytest.mark.slow
def test_minimind_child_runs_minimind_on_the_given_device(tmp_path):
    """time_minimind.py starts MiniMind's trainer with --device cpu; the check's child swaps in its --device
    (the stand-in trainer records its arguments and never touches a GPU)."""
    mm = tmp_path / "minimind"
    _fake_minimind(mm)
    out = tmp_path / "mm.json"
    r = _run(["--_child", "minimind", "--minimind_dir", str(mm), "--size", "16x2", "--steps", "1", "--device", "cuda:0",
              "--json", str(out)], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    args = (mm / "seen_args.txt").read_text().split()
    assert args[args.index("--device") + 1] == "cuda:0" and args.count("--device") == 1
    assert '"median_s"' in out.read_text()
