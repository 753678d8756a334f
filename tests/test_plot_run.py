"""trainer/plots.py and scripts/plot_run.py on synthetic metrics.jsonl files."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image as mpimg

from trainer.run.plots import collect_series, ema, figure_specs, plot_run, read_metrics

ROOT = Path(__file__).resolve().parents[1]


def write_metrics(run_dir: Path, rows: list[dict], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail, encoding="utf-8")
    return path


def full_rows(n: int = 40) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for s in range(1, n + 1):
        rows.append({
            "step": s, "time": 1.7e9 + s,
            "reward/total": math.tanh(s / 20) + 0.1 * rng.standard_normal(),
            "reward/format": min(1.0, s / 30), "reward/length_penalty": -0.01 * s,
            "kl_ref": 0.05 * s, "ppo/approx_kl": 0.01, "ppo/clipfrac": 0.1,
            "loss/value": 1 / s, "explained_var": None if s % 5 == 0 else 1 - 1 / s,  # nulls are skipped
            "response/length": 50.0, "response/eos_rate": 0.9,
            "lr/actor": 1e-6, "lr/critic": 1e-5, "accuracy": s / 40, "format_rate": 0.5,
            "time/step": 1.0,
        })
    return rows


def assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200
    assert img.std() > 0.01  # not a blank canvas


def test_ema_matches_hand_computation():
    # alpha 0.5: step 1 -> 0.5*1 / 0.5 = 1; step 2 -> (0.25 + 1.5) / (0.25 + 0.5) = 7/3
    np.testing.assert_allclose(ema(np.array([1.0, 3.0]), 0.5), [1.0, 7 / 3])
    np.testing.assert_allclose(ema(np.array([2.0, 2.0, 2.0]), 0.1), [2.0, 2.0, 2.0])  # no pull towards 0


def test_read_and_collect_tolerate_nulls_duplicates_and_a_partial_line(tmp_path):
    path = write_metrics(tmp_path, [
        {"step": 1, "time": 1.0, "a": 1.0, "b": None},
        {"step": 2, "time": 2.0, "a": 2.0, "b": 5.0},
        {"step": 2, "a": 20.0},  # re-logged step: the last value wins
        {"step": 3, "a": "text"},  # not a number: ignored
    ], tail='{"step": 4, "a": 4')
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 2, 3]
    series = collect_series(records)
    assert set(series) == {"a", "b"}  # step/time are axes, not metrics
    np.testing.assert_array_equal(series["a"][0], [1, 2])
    np.testing.assert_array_equal(series["a"][1], [1.0, 20.0])
    np.testing.assert_array_equal(series["b"][0], [2])


def test_figure_specs_choose_panels_by_key():
    keys = {"reward/total", "reward/format", "reward/accuracy", "kl_ref", "explained_var", "lr/actor", "time/step"}
    specs = {stem: [key for key, _ in panels] for stem, _, panels in figure_specs(keys)}
    assert specs == {
        "reward": ["reward/total", "reward/accuracy", "reward/format"],  # total first, then sorted
        "kl": ["kl_ref"],
        "value": ["explained_var"],  # alias of value/explained_var
        "lr": ["lr/actor"],
    }
    assert figure_specs({"time/step"}) == []


@pytest.mark.slow
def test_plot_run_writes_every_family_and_an_overview(tmp_path):
    write_metrics(tmp_path / "run", full_rows(), tail='{"step": 41, "reward/tot')
    paths = plot_run(tmp_path / "run")
    names = [p.name for p in paths]
    assert names == ["reward.png", "kl.png", "value.png", "response.png", "lr.png", "accuracy.png", "overview.png"]
    for p in paths:
        assert p.parent == tmp_path / "run" / "plots"
        assert_png(p)


def test_plot_run_skips_absent_families_and_handles_a_single_point(tmp_path):
    write_metrics(tmp_path / "run", [{"step": 1, "reward/total": 0.5, "kl_ref": None}])
    paths = plot_run(tmp_path / "run")
    assert [p.name for p in paths] == ["reward.png", "overview.png"]  # kl_ref is null everywhere
    for p in paths:
        assert_png(p)


def test_plot_run_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no such metrics file"):
        plot_run(tmp_path / "missing")
    write_metrics(tmp_path / "run", [{"step": 1, "time/step": 1.0}])
    with pytest.raises(ValueError, match="no plottable metrics"):
        plot_run(tmp_path / "run")


@pytest.mark.slow
def test_cli_prints_written_paths(tmp_path):
    rows = [{"step": s, "reward/total": s / 10, "kl_ref": 0.1 * s} for s in range(1, 11)]
    write_metrics(tmp_path / "run", rows)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_run.py"), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = [Path(line) for line in proc.stdout.splitlines()]
    assert [p.name for p in printed] == ["reward.png", "kl.png", "overview.png"]
    for p in printed:
        assert_png(p)

    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_run.py"), str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert bad.stderr.strip().startswith("plot_run: ") and len(bad.stderr.strip().splitlines()) == 1


def test_plot_keys_draws_just_the_chosen_metrics_and_names_a_missing_one(tmp_path):
    from scripts.plot_run import main
    rows = [{"step": s, "reward/ifeval": s / 10, "kl_ref": 0.1 * s, **({"eval/ifeval_pass_rate": 0.4 + s / 100} if s % 5 == 0 else {})}
            for s in range(0, 11)]
    write_metrics(tmp_path / "run", rows)
    main([str(tmp_path / "run"), "--keys", "eval/ifeval_pass_rate", "reward/ifeval", "kl_ref", "--out", str(tmp_path / "f.png")])
    assert_png(tmp_path / "f.png")
    assert not (tmp_path / "run" / "plots").exists()
    with pytest.raises(SystemExit, match=r"no finite values for eval/accuracy \(it has: eval/ifeval_pass_rate, kl_ref, reward/ifeval\)"):
        main([str(tmp_path / "run"), "--keys", "eval/accuracy", "--out", str(tmp_path / "g.png")])
    with pytest.raises(SystemExit, match="--keys and --out go together"):
        main([str(tmp_path / "run"), "--keys", "kl_ref"])
