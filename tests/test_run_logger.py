"""RunLogger: metrics.jsonl/samples.jsonl contents, resume truncation, rank gating, and swanlab
local/offline runs that must not touch the network or prompt (run in a child process)."""

import json
import math
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.run.run_logger import RunLogger, _postfix, format_sample, to_json_safe, truncate_jsonl

ROOT = Path(__file__).resolve().parents[1]


def make_logger(run_dir, **kw):
    args = dict(run_dir=run_dir, enabled=True, swanlab_mode="disabled", project="p", experiment_name="e",
                config={"lr": 1e-6}, total_steps=10, console=True)
    args.update(kw)
    return RunLogger(**args)


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def test_disabled_mode_writes_metrics_jsonl_with_steps_keys_and_null_for_nan(tmp_path):
    logger = make_logger(tmp_path / "run")
    logger.log({"reward/total": 0.5, "kl_ref": float("nan"), "ppo/approx_kl": 0.01}, step=1)
    # flushed per line: readable while the run is still open (a killed run keeps it)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 1
    logger.log({"reward/total": 0.75, "kl_ref": float("inf"), "ppo/approx_kl": 0.02}, step=2)
    logger.finish(plots=False)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert set(rows[0]) == {"step", "time", "reward/total", "kl_ref", "ppo/approx_kl"}
    assert rows[0]["reward/total"] == 0.5 and rows[1]["reward/total"] == 0.75
    assert rows[0]["kl_ref"] is None and rows[1]["kl_ref"] is None  # NaN and inf -> null
    assert "NaN" not in (tmp_path / "run" / "metrics.jsonl").read_text()
    assert isinstance(rows[0]["time"], float) and rows[1]["time"] >= rows[0]["time"]
    assert logger.id is None  # no swanlab run in disabled mode
    assert not (tmp_path / "run" / "swanlog").exists()


def test_tensor_and_numpy_values_are_converted_and_strings_rejected(tmp_path):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    logger = make_logger(tmp_path / "run", console=False)
    logger.log({"a": torch.tensor(1.5), "b": np.float32(0.25), "c": 3}, step=1)
    with pytest.raises(TypeError, match="metric 'bad' is str"):
        logger.log({"bad": "x"}, step=2)
    logger.finish(plots=False)
    (row,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert (row["a"], row["b"], row["c"]) == (1.5, 0.25, 3.0)


def test_resume_keeps_steps_up_to_start_and_drops_later_and_broken_lines(tmp_path):
    run = tmp_path / "run"
    logger = make_logger(run, console=False)
    for step in range(1, 6):
        logger.log({"x": float(step)}, step)
    logger.log_samples([{"prompt": "p", "response": "r", "reward": 1.0}], step=2)
    logger.log_samples([{"prompt": "p", "response": "r", "reward": 0.0}], step=4)
    logger.finish(plots=False)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "x": 6')  # the half-written line of a killed run

    resumed = make_logger(run, start_step=3, console=False)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    assert [r["step"] for r in read_jsonl(run / "samples.jsonl")] == [2]
    resumed.log({"x": 40.0}, 4)
    resumed.finish(plots=False)
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["x"] == 40.0


def test_fresh_run_replaces_old_logs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 7, "x": 1}\n')
    (run / "samples.jsonl").write_text('{"step": 7, "prompt": "old"}\n')
    logger = make_logger(run, console=False)
    logger.log({"x": 2.0}, 1)
    logger.finish(plots=False)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]
    assert not (run / "samples.jsonl").exists()


def test_truncate_jsonl_counts_dropped_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\nnot json\n{"step": 3}\n{"no_step": 1}\n')
    assert truncate_jsonl(path, 2) == 3
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert truncate_jsonl(tmp_path / "missing.jsonl", 2) == 0


def test_enabled_false_writes_and_prints_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    logger = make_logger(run, enabled=False, swanlab_mode="local", swanlab_logdir=tmp_path / "swanlog")
    logger.log({"reward/total": 1.0}, 1)
    logger.log_samples([{"prompt": "p", "response": "r", "reward": 1.0}], 1)
    logger.info("hello")
    logger.finish()
    assert logger.id is None
    assert not run.exists() and not (tmp_path / "swanlog").exists()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_log_samples_appends_all_rows_and_prints_the_first(tmp_path, capsys):
    run = tmp_path / "run"
    logger = make_logger(run)
    rows = [
        {"prompt": "x" * 300 + "What is 3+4?", "response": "<answer>7</answer>", "reward": 1.25, "format": 1.0},
        {"prompt": "second prompt", "response": "SECOND", "reward": 0.0, "format": float("nan")},
    ]
    logger.log_samples(rows, step=5)
    logger.finish(plots=False)
    saved = read_jsonl(run / "samples.jsonl")
    assert saved == [
        {"step": 5, "prompt": rows[0]["prompt"], "response": "<answer>7</answer>", "reward": 1.25, "format": 1.0},
        {"step": 5, "prompt": "second prompt", "response": "SECOND", "reward": 0.0, "format": None},
    ]
    out = capsys.readouterr().out
    assert "sample @ step 5" in out and "What is 3+4?" in out and "<answer>7</answer>" in out
    assert "reward=1.25 format=1" in out
    assert "x" * 200 not in out  # only the prompt's tail is shown
    assert "SECOND" not in out  # only the first row goes to the console


def test_format_sample_tail_and_components():
    block = format_sample({"prompt": "line1\nline2", "response": "r" * 10, "reward": 0.5, "acc": None},
                          step=3, prompt_chars=8, response_chars=4)
    lines = block.splitlines()
    assert lines[0].strip("-").strip() == "sample @ step 3"
    assert lines[1] == "prompt  : ... \u23ce line2"  # newline shown as a symbol, last 8 chars kept
    assert lines[2] == "response: rrrr... [+6 chars]"
    assert lines[3] == "rewards : reward=0.5 acc=nan"


def test_postfix_picks_known_keys():
    text = _postfix({"reward/total": 0.81234, "ppo/approx_kl": 0.0123, "kl_ref": 1.5, "accuracy": 0.25,
                     "tokens_per_s": 1234.6, "loss/value": 9.0})
    assert text == "R=0.812 acc=0.25 kl_ref=1.5 akl=0.0123 tok/s=1235"
    assert _postfix({"kl_ref": float("nan")}) == ""


def test_to_json_safe():
    assert to_json_safe({"a": float("nan"), "b": [1, float("-inf")], "c": Path("x"), "d": True}) == {
        "a": None, "b": [1, None], "c": "x", "d": True}


def test_bad_mode_and_cloud_without_key_fail_fast(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--swanlab_mode 'wandb'"):
        make_logger(tmp_path / "a", swanlab_mode="wandb")
    # no key anywhere swanlab looks: env, ./.env, ./.swanlab/.netrc, ~/.swanlab/.netrc
    for var in ("SWANLAB_API_KEY", "SWANLAB_ROOT", "SWANLAB_SAVE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="swanlab login.*--swanlab_mode local"):
        make_logger(tmp_path / "b", swanlab_mode="cloud")
    assert not (tmp_path / "b").exists()  # failed before touching any file


# ------------------------------------------------------------------ real swanlab runs (child process)

CHILD = textwrap.dedent(
    """
    import builtins, json, socket, sys
    sys.path.insert(0, {root!r})
    attempts = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guard(real):
        def connect(self, address):
            if self.family != socket.AF_UNIX:
                attempts.append(repr(address))
                raise OSError("network disabled in this test")
            return real(self, address)
        return connect

    def no_input(*a, **k):
        attempts.append("input() prompt")
        raise EOFError("no prompts allowed")

    socket.socket.connect, socket.socket.connect_ex = guard(real_connect), guard(real_connect_ex)
    builtins.input = no_input

    from trainer.run.run_logger import RunLogger
    logger = RunLogger(run_dir="run", enabled=True, swanlab_mode={mode!r}, project="minippo-test",
                       experiment_name="t", config={{"lr": 1e-6}}, total_steps=3, swanlab_logdir="swanlog")
    for step in (1, 2, 3):
        logger.log({{"reward/total": 0.1 * step, "reward/format": 1.0, "kl_ref": 0.5, "accuracy": 0.25}}, step)
    logger.log_samples([{{"prompt": "p", "response": "r", "reward": 1.0}}], 3)
    logger.finish(plots=False)
    print("RESULT " + json.dumps({{"id": logger.id, "dir": str(logger.swanlab_dir), "attempts": attempts}}))
    """
)


def run_child(tmp_path, mode):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWANLAB_")}
    env.update(HOME=str(tmp_path), SWANLAB_MODE="online")  # even a hostile env default must not win
    proc = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), mode=mode)], cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), proc


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["local", "offline"])
def test_swanlab_run_is_written_without_network_or_prompt(tmp_path, mode):
    result, proc = run_child(tmp_path, mode)
    assert result["attempts"] == []
    assert result["id"]
    run_dir = tmp_path / result["dir"]
    assert run_dir.parent == tmp_path / "swanlog" and run_dir.is_dir()
    assert run_dir.name.startswith("run-") and run_dir.name.endswith(result["id"])
    assert any(run_dir.glob("*.swanlab"))  # swanlab's own record of the run
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    assert "login" not in proc.stdout.lower() + proc.stderr.lower()
    if mode == "local":
        # The dashboard's experiment table reads logs/<Tag.sort>; the charts read logs/<Tag.folder>.
        # They must agree, or the table shows "TypeError" and shifted values (swanlab 0.10.3 bug).
        with sqlite3.connect(tmp_path / "swanlog" / "runs.swanlab") as db:
            tags = db.execute("SELECT name, sort, folder FROM tag").fetchall()
        assert {name for name, _, _ in tags} == {"reward/total", "reward/format", "kl_ref", "accuracy",
                                                "samples/text"}
        for name, sort, folder in tags:
            assert folder == str(sort), (name, sort, folder)
            assert (run_dir / "logs" / folder).is_dir()
        last = json.loads((run_dir / "logs" / dict((n, f) for n, _, f in tags)["reward/total"] / "1000.log")
                          .read_text().splitlines()[-1])
        assert last["index"] == 3 and math.isclose(last["data"], 0.3)
