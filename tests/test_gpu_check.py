"""benchmarks/gpu_check.py: one line and exit 2 without CUDA; --allow_cpu runs every check on the CPU (smoke)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.test_time_minimind import _fake_minimind

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
ROWS = ["gpu tests", "bench", "deterministic", "fast decode", "logprob gap", "2 processes", "fsdp2", "minimind",
        "cuda graphs"]


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
    assert table["cuda graphs"][1].startswith("no CUDA: graphs not exercised") and "8/8 rows identical" in table["cuda graphs"][1]
    # Each check's command was printed before it ran, and the runs wrote where they were told.
    commands = [l for l in r.stdout.splitlines() if l.startswith("$ ")]
    for part in ("-m pytest -q -m gpu", "benchmarks/bench_ppo.py", "train_ppo.py --device cpu --dtype bfloat16 --deterministic 1",
                 "--_child fast_decode", "benchmarks/measure_logprob_gap.py", "torch.distributed.run",
                 "benchmarks/time_minimind.py", "--_child cuda_graphs"):
        assert any(part in c for c in commands), part
    assert (work / "det_a" / "out" / "ppo_actor_64.pth").is_file() and (work / "ddp_gloo" / "out" / "ppo_actor_64.pth").is_file()


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_minimind_row_runs_minimind_off_our_root_with_carried_wheels(tmp_path, monkeypatch):
    """The minimind row, as gpu_check runs it (its child environment, from our root), against a stand-in with
    MiniMind's namespace `trainer/`: our root must not shadow it (it did: `import trainer.trainer_utils`
    failed), and PYTHONPATH entries already set (where carried wheels were installed) must reach MiniMind."""
    import argparse

    gc = _gpu_check_module()
    mm, wheels = tmp_path / "minimind", tmp_path / "site"
    _fake_minimind(mm)
    wheels.mkdir()
    (wheels / "carried_probe.py").write_text("WHERE = 'carried'\n")
    monkeypatch.setenv("PYTHONPATH", str(wheels))
    monkeypatch.setenv("MINIPPO_TEST_PROBE", "1")
    o = argparse.Namespace(minimind_dir=str(mm), steps=1, timeout=120)
    ctx = gc.Context(o, True, tmp_path / "work")
    (tmp_path / "work").mkdir()
    assert ctx.env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), str(wheels)]  # ours: root first, wheels kept
    result, figures = gc.check_minimind(ctx)
    assert result == "PASS" and "s/step" in figures, figures
    assert (mm / "seen_probe.txt").read_text() == "carried"
    args = (mm / "seen_args.txt").read_text().split()
    assert args[args.index("--device") + 1] == "cpu" and args.count("--device") == 1


def test_peer_env_takes_our_root_off_and_keeps_the_rest(monkeypatch):
    gc = _gpu_check_module()
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), "/opt/site", f"{ROOT}/.", "/x"]), "A": "1"}
    assert gc.peer_env(env) == {"PYTHONPATH": os.pathsep.join(["/opt/site", "/x"]), "A": "1"}
    assert gc.peer_env({"PYTHONPATH": str(ROOT)}) == {}


@pytest.mark.slow
def test_peers_allow_cpu_prints_every_row_and_writes_every_step_time(tmp_path):
    """--peers --allow_cpu: every row of the GPU run at a tiny shape on the CPU. Ours run for real; MiniMind is the
    stand-in checkout; TRL runs where it is installed and is a SKIP row naming why where it is not (as in CI)."""
    mm = tmp_path / "minimind"
    _fake_minimind(mm)
    out = tmp_path / "peers.json"
    r = _run(["--peers", "--allow_cpu", "--minimind_dir", str(mm), "--peer_steps", "1", "--workdir", str(tmp_path / "w"),
              "--peers_json", str(out)], timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    head = next(l for l in r.stdout.splitlines() if l.startswith("| framework"))
    assert [c.strip() for c in head.strip("|").split("|")] == [
        "framework", "algorithm", "shape (params)", "rows x tokens", "s/step median [min-max]",
        "generate / score / update s", "ms per decode token", "tokens/s", "peak alloc / reserved MB", "x ours"]
    rows = json.loads(out.read_text())["rows"]
    names = [(r["framework"].split(" (")[0], r["algorithm"], r["shape"].split(",")[0]) for r in rows]
    assert names == [("ours", "PPO", "64x2"), ("MiniMind", "PPO", "64x2"), ("ours", "GRPO", "64x2"), ("MiniMind", "GRPO", "64x2"),
                     ("TRL", "GRPO", "64x2"), ("TRL, static cache", "GRPO", "64x2"), ("ours", "GRPO", "112x2"), ("TRL", "GRPO", "112x2"),
                     ("MiniMind", "GRPO", "112x2")]
    assert not any(r.get("fail") for r in rows), [r.get("fail") for r in rows]
    for row in rows[:4] + rows[6:7]:  # ours and the MiniMind stand-in ran: every timed step is in the JSON
        assert len(row["step_s"]) == 1 and len(row["generate_s"]) == 1 and row["rows"] == 8 and row["tokens"] == 4
    assert rows[1]["ratio"] > 0 and rows[3]["ratio"] > 0  # MiniMind's s/step over ours at the same work
    trl = rows[4:6] + rows[7:8]
    assert all(t.get("skip", "").startswith("ModuleNotFoundError") or len(t.get("step_s", [])) == 1 for t in trl), trl
    assert "cannot build 14/2 heads" in rows[8]["skip"]
    assert "\ncuda graphs: PASS: no CUDA: graphs not exercised" in r.stdout  # the graph row, after the table


def test_a_failed_row_names_the_exception_not_a_progress_bar_after_it():
    gc = _gpu_check_module()
    trl_stderr = ("Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: index_copy_(): self and "
                  "source expected to have the same dtype\n  0%|          | 0/2 [00:00<?, ?it/s]\r  0%|  | 0/2\n")
    assert gc.last_line(trl_stderr).startswith("RuntimeError: index_copy_()")
    assert gc.last_line("RuntimeError: x\nerror: --steps must be >= 1\n") == "error: --steps must be >= 1"
    assert gc.last_line("step 1\nstep 2\n") == "step 2"


def _cuda_graphs_json(**over) -> dict:
    """The cuda graphs child's JSON as a GPU run writes it."""
    r = {"cuda": True, "size": "768x8", "dtype": "bf16", "batch": 8, "prompt_len": 64, "gen_len": 64,
         "graph_identical": True, "graphs_captured": 2, "graph_ms_per_token": 0.5, "eager_ms_per_token": 6.0,
         "loop_identical_rows": 8, "loop_max_abs_dlogprob": 1e-3, "steady_runs": 20, "steady_captures": 4,
         "steady_captures_first_half": 4, "steady_buckets": 3, "steady_reserved_mb": [900.0, 900.0]}
    return {**r, **over}


def test_cuda_graphs_row_prints_captures_per_run_and_reserved_memory():
    """The graph row on a GPU: captures per rollout of a steady run and reserved MB; FAIL where graphs are captured
    again late in the run (one per rollout, as before they were kept) or reserved memory grows."""
    gc = _gpu_check_module()
    result, text = gc.cuda_graphs_figures(_cuda_graphs_json())
    assert result == "PASS", text
    assert "steady run of 20 rollouts over 3 shape buckets: 4 captures (0.20 per run), 0 in its second half" in text
    assert "reserved 900 MB after 10 rollouts and 900 MB after all" in text and "bit-identical to the eager step" in text
    result, text = gc.cuda_graphs_figures(_cuda_graphs_json(steady_captures=20, steady_captures_first_half=10))
    assert result == "FAIL" and "20 captures (1.00 per run), 10 in its second half" in text
    result, text = gc.cuda_graphs_figures(_cuda_graphs_json(steady_reserved_mb=[900.0, 1200.0]))
    assert result == "FAIL" and "1200 MB after all (GROWS)" in text
    result, text = gc.cuda_graphs_figures(_cuda_graphs_json(graph_identical=False))
    assert result == "FAIL" and "DIFFERS from" in text
