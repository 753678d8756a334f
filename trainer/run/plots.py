"""PNG plots of a run's metrics.jsonl: one figure per metric family plus an overview.

    from trainer.run.plots import plot_run
    paths = plot_run("runs/ppo_actor_512")          # -> runs/ppo_actor_512/plots/*.png

Each panel draws the raw series faintly and an exponential moving average on top, so a noisy
PPO curve is readable at a glance. Panels whose keys never appear (or are always null) are
skipped, and so is a figure left with no panel. Uses matplotlib's object API on the Agg canvas
(no pyplot), so importing this never changes the process-wide backend or leaks figures.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["Panel", "read_metrics", "collect_series", "ema", "figure_specs", "plot_run", "plot_keys"]

Series = tuple[np.ndarray, np.ndarray]  # (steps, values), finite values only, sorted by step


@dataclass(frozen=True)
class Panel:
    keys: tuple[str, ...]  # first key present in the run is drawn (later ones are aliases)
    ylabel: str
    note: str = ""  # shown after the key in the panel title
    smooth: bool = True


# (file stem, figure title, panels). Reward panels are added per run: every `reward/*` key.
_FIXED_FIGURES: tuple[tuple[str, str, tuple[Panel, ...]], ...] = (
    ("kl", "KL and clipping", (
        Panel(("kl_ref",), "nats / response", "KL(policy || reference)"),
        Panel(("ppo/approx_kl",), "nats / token", "KL(old || new) in the update"),
        Panel(("ppo/clipfrac",), "fraction of tokens", "ratio outside the clip range"),
    )),
    ("value", "Value function", (
        Panel(("loss/value",), "loss", "critic loss"),
        # The trainer may log it ungrouped; both spellings mean the same quantity.
        Panel(("value/explained_var", "explained_var"), "explained variance", "1 = values predict returns"),
    )),
    ("response", "Responses", (
        Panel(("response/length",), "tokens", "mean response length"),
        Panel(("response/eos_rate",), "fraction", "responses that ended with EOS"),
    )),
    ("lr", "Learning rates", (
        Panel(("lr/actor",), "learning rate", smooth=False),
        Panel(("lr/critic",), "learning rate", smooth=False),
    )),
    ("accuracy", "Task metrics", (
        Panel(("accuracy",), "fraction", "answers matching the reference"),
        Panel(("format_rate",), "fraction", "replies in the expected format"),
    )),
)


def read_metrics(path: str | Path) -> list[dict]:
    """Records of a metrics.jsonl. Lines that are not JSON objects with a "step" are skipped,
    which covers the partially written last line of a killed run."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such metrics file (expected <run_dir>/metrics.jsonl from a training run)")
    records = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), (int, float)):
                records.append(rec)
    return records


def collect_series(records: list[dict]) -> dict[str, Series]:
    """Per-key (steps, values) with nulls/NaN dropped. A step logged twice keeps its last value."""
    by_key: dict[str, dict[int, float]] = {}
    for rec in records:
        step = int(rec["step"])
        for key, value in rec.items():
            if key in ("step", "time") or not isinstance(value, (int, float)):
                continue
            value = float(value)
            if math.isfinite(value):
                by_key.setdefault(key, {})[step] = value
    out = {}
    for key, points in by_key.items():
        steps = np.array(sorted(points), dtype=np.int64)
        out[key] = (steps, np.array([points[s] for s in steps], dtype=np.float64))
    return out


def ema(values: np.ndarray, alpha: float) -> np.ndarray:
    """Bias-corrected exponential moving average (weight `alpha` on the newest value), so the
    first points are not dragged towards zero."""
    out = np.empty(len(values), dtype=np.float64)
    acc, norm = 0.0, 0.0
    for i, v in enumerate(values):
        acc = (1.0 - alpha) * acc + alpha * float(v)
        norm = (1.0 - alpha) * norm + alpha
        out[i] = acc / norm
    return out


def _auto_alpha(n: int) -> float:
    # Span grows with the run (about n/15 points, capped at 50): short runs are barely smoothed,
    # long runs get a clear trend line.
    span = min(max(n / 15.0, 1.0), 50.0)
    return 2.0 / (span + 1.0)


def figure_specs(keys: Iterable[str]) -> list[tuple[str, str, list[tuple[str, Panel]]]]:
    """Figures that have data for these keys: (file stem, title, [(key drawn, panel)])."""
    keys = set(keys)
    reward_keys = sorted(k for k in keys if k.startswith("reward/"))  # eval/reward/* are drawn with the evaluation
    if "reward/total" in reward_keys:  # the headline number goes first
        reward_keys.remove("reward/total")
        reward_keys.insert(0, "reward/total")
    reward_panels = tuple(
        Panel((k,), "reward", "total reward" if k == "reward/total" else "") for k in reward_keys
    )
    # Held-out evaluation: a few points per run, drawn unsmoothed.
    eval_panels = tuple(Panel((k,), k.split("/")[-1].replace("_", " "), "held-out, greedy", smooth=False)
                        for k in sorted(k for k in keys if k.startswith("eval/")))
    specs = []
    for stem, title, panels in (("reward", "Rewards", reward_panels), ("eval", "Held-out evaluation", eval_panels),
                                *_FIXED_FIGURES):
        chosen = []
        for panel in panels:
            key = next((k for k in panel.keys if k in keys), None)
            if key is not None:
                chosen.append((key, panel))
        if chosen:
            specs.append((stem, title, chosen))
    return specs


def _draw_panel(ax: Axes, key: str, panel: Panel, series: Series, color: str) -> None:
    steps, values = series
    smooth = panel.smooth and len(values) >= 3
    if smooth:
        alpha = _auto_alpha(len(values))
        ax.plot(steps, values, color=color, alpha=0.3, linewidth=1.0, label="raw")
        ax.plot(steps, ema(values, alpha), color=color, linewidth=2.0, label=f"EMA (alpha={alpha:.2f})")
        ax.legend(loc="best", fontsize=7, frameon=False)
    else:
        ax.plot(steps, values, color=color, linewidth=1.5, marker="o" if len(values) < 3 else None, markersize=3)
    ax.set_title(f"{key} - {panel.note}" if panel.note else key, fontsize=10)
    ax.set_xlabel("PPO step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))


def _save_grid(path: Path, title: str, panels: list[tuple[str, Panel]], series: dict[str, Series],
               ncols_max: int) -> Path:
    n = len(panels)
    ncols = min(n, ncols_max)
    nrows = math.ceil(n / ncols)
    # Fixed margins instead of constrained layout: as readable here, and cheaper to draw (timings: docs/observability.md).
    fig = Figure(figsize=(5.0 * ncols, 3.6 * nrows + 0.5), dpi=100)
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.45 / ncols, right=1 - 0.1 / ncols, bottom=0.5 / (3.6 * nrows + 0.5),
                        top=1 - 0.75 / (3.6 * nrows + 0.5), wspace=0.35, hspace=0.55)
    fig.suptitle(title, fontsize=13)
    colors = [f"C{i % 10}" for i in range(n)]
    for i, (key, panel) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        _draw_panel(ax, key, panel, series[key], colors[i])
    fig.savefig(path)
    return path


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write <run_dir>/plots/<family>.png for each metric family with data, then overview.png.
    Returns the written paths (overview last). Raises ValueError when there is nothing to plot."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    series = collect_series(read_metrics(metrics_path))
    specs = figure_specs(series.keys())
    if not specs:
        raise ValueError(f"{metrics_path}: no plottable metrics (need e.g. reward/total, kl_ref, loss/value)")
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    last_step = max(int(s[0][-1]) for s in series.values())
    paths = [
        _save_grid(out_dir / f"{stem}.png", f"{title} - {run_dir.name}", panels, series, ncols_max=3)
        for stem, title, panels in specs
    ]
    all_panels = [p for _, _, panels in specs for p in panels]
    paths.append(_save_grid(out_dir / "overview.png", f"{run_dir.name} - overview (last step {last_step})",
                            all_panels, series, ncols_max=4))
    return paths


def plot_keys(run_dir: str | Path, keys: list[str], out: str | Path, title: str | None = None) -> Path:
    """One PNG of the chosen keys side by side (a figure for a doc page), each panel as in plot_run: held-out
    eval/* keys unsmoothed, training keys raw + EMA. Raises ValueError naming a key the run never logged."""
    run_dir = Path(run_dir)
    series = collect_series(read_metrics(run_dir / "metrics.jsonl"))
    missing = [k for k in keys if k not in series]
    if missing:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no finite values for {', '.join(missing)} "
                         f"(it has: {', '.join(sorted(series))})")
    panels = [(k, Panel((k,), k.split("/")[-1].replace("_", " "), "held-out, greedy" if k.startswith("eval/") else "",
                        smooth=not k.startswith("eval/"))) for k in keys]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save_grid(out, title or run_dir.name, panels, series, ncols_max=len(keys) if len(keys) <= 3 else 2)
