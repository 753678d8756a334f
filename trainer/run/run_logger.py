"""Run logger for the PPO trainer: metrics.jsonl + swanlab + a tqdm progress bar, rank 0 only.

    logger = RunLogger(run_dir="runs/x", enabled=is_main, swanlab_mode="local", project="minippo",
                       experiment_name="ppo_actor_512", config=flags, total_steps=1000,
                       start_step=step, resume_id=saved_id)
    logger.log({"reward/total": 0.8, "kl_ref": 1.2}, step)     # once per PPO step
    logger.log_samples([{"prompt": ..., "response": ..., "reward": 0.8}], step)
    logger.info("a console line that does not break the bar")
    logger.finish()                                            # closes swanlab, writes plots/

<run_dir>/metrics.jsonl is the source of truth (one {"step", "time", **metrics} object per line,
NaN/inf written as null, flushed per line); swanlab is a viewer on top of it and any swanlab
failure outside cloud mode only costs the dashboard, never the run.

Metric names. Keys are passed to swanlab unchanged, `/` groups included (reward/total,
ppo/approx_kl, ...): swanlab turns the group into a chart section, and the charts of slash keys
render fine in the local dashboard. The "TypeError" seen in the local dashboard's experiment
table is NOT caused by the slash (checked against swanboard's /api/v1/project/summaries with
plain keys like "alpha", "beta": same result). swanlab 0.10.3's local-mode writer numbers metric
folders logs/1, logs/2, ... while swanboard's table reads folder str(Tag.sort) with sort counting
from 0, so the first metric shows "TypeError" and every other column shows the previous metric's
value. `_align_local_table_columns` starts that folder counter at 0 so table and charts agree, and
local mode never logs a media type the local dashboard lacks (echarts): such a record takes a
folder number without a table column and shifts the columns after it again.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["RunLogger", "SWANLAB_MODES", "format_sample", "to_json_safe", "truncate_jsonl"]

SWANLAB_MODES = ("local", "offline", "cloud", "disabled")

# (key suffix, label) shown in the progress bar when present; matched as the whole key or its
# last `/`-separated part(s), so "ppo/approx_kl" and "eval/accuracy" both qualify.
_POSTFIX = (("reward/total", "R"), ("accuracy", "acc"), ("kl_ref", "kl_ref"), ("approx_kl", "akl"),
            ("tokens/s", "tok/s"), ("tokens_per_s", "tok/s"))

_TEXT_KEYS = ("prompt", "response")


def to_json_safe(value: Any) -> Any:
    """Plain JSON types: tensors/numpy scalars via .item(), NaN/inf -> None, unknown objects -> str."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): to_json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_safe(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return to_json_safe(item())
        except (TypeError, ValueError, RuntimeError):  # multi-element tensor/array
            pass
    if hasattr(value, "tolist"):
        return to_json_safe(value.tolist())
    return str(value)


def truncate_jsonl(path: Path, keep_through_step: int) -> int:
    """Rewrite a jsonl file keeping only well-formed lines with step <= keep_through_step (a resumed
    run re-logs the later ones; a half-written line from a kill is dropped too). Returns lines
    dropped. Atomic: a crash mid-rewrite leaves the old file."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
                ok = isinstance(rec, dict) and rec.get("step") is not None and rec["step"] <= keep_through_step
            except (json.JSONDecodeError, TypeError):
                ok = False
            if ok:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


def _as_float(key: str, value: Any) -> float:
    if hasattr(value, "item"):
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"RunLogger.log: metric {key!r} is {type(value).__name__} ({value!r:.40}), expected a number") from None


def _postfix(metrics: Mapping[str, float]) -> str:
    parts, seen = [], set()
    for name, label in _POSTFIX:
        key = next((k for k in metrics if k == name or k.endswith("/" + name)), None)
        value = metrics.get(key) if key is not None else None
        if value is None or label in seen or not math.isfinite(value):
            continue
        seen.add(label)
        parts.append(f"{label}={value:.0f}" if label == "tok/s" else f"{label}={value:.3g}")
    return " ".join(parts)


def _one_line(text: str) -> str:
    return text.replace("\r", "").replace("\n", " \u23ce ")


def format_sample(row: Mapping[str, Any], step: int, prompt_chars: int = 160, response_chars: int = 600) -> str:
    """Compact console block for one sample: prompt tail, response, numeric reward components."""
    prompt = _one_line(str(row.get("prompt", "")))
    if len(prompt) > prompt_chars:
        prompt = "..." + prompt[-prompt_chars:]
    response = str(row.get("response", ""))
    if len(response) > response_chars:
        response = response[:response_chars] + f"... [+{len(response) - response_chars} chars]"
    numbers = []
    for k, v in row.items():
        if k in _TEXT_KEYS:
            continue
        v = to_json_safe(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            numbers.append(f"{k}={v:.3g}")
        elif v is None:
            numbers.append(f"{k}=nan")
    rule = "-" * 20
    return (f"{rule} sample @ step {step} {rule}\n"
            f"prompt  : {prompt}\n"
            f"response: {response}\n"
            f"rewards : {' '.join(numbers) or '-'}")


def _align_local_table_columns(run: Any) -> bool:
    """Work around swanlab 0.10.3 local mode's off-by-one between metric folders (from 1) and
    swanboard's table, which reads folder str(Tag.sort) with sort from 0 (see module docstring).
    Only touches a fresh, unmodified 0.10.x LocalCallbacker; anything else is left alone."""
    import swanlab

    if not str(getattr(swanlab, "__version__", "")).startswith("0.10."):
        return False
    manager = getattr(run, "_callbacker", None)
    for cb in getattr(manager, "registered_callbacks", None) or []:
        if (getattr(cb, "name", None) == "SwanLabLocalCallbacker" and getattr(cb, "_next_kid", None) == 1
                and not getattr(cb, "_metrics", True)):
            cb._next_kid = 0
            return True
    return False


def _swanlab_has_api_key() -> bool:
    """Whether swanlab would find an API key (env var, .env, config files, .netrc) - local reads only."""
    import swanlab

    try:
        return bool(swanlab.Settings().api_key)
    except Exception:  # noqa: BLE001 - a malformed settings file fails in swanlab's validation: let swanlab.init report it
        return False


class RunLogger:
    """Rank-0 run logging. With enabled=False every method is a no-op (non-zero ranks)."""

    def __init__(self, *, run_dir: str | Path, enabled: bool, swanlab_mode: str, project: str,
                 experiment_name: str, config: dict, total_steps: int, start_step: int = 0,
                 resume_id: str | None = None, swanlab_logdir: str | Path = "swanlog",
                 console: bool = True) -> None:
        self.enabled = enabled
        self.id: str | None = None  # swanlab run id, saved in the resume file
        self.run_dir = Path(run_dir)
        self.swanlab_mode = swanlab_mode
        self.swanlab_dir: Path | None = None  # this run's folder under swanlab_logdir
        self._console = console and enabled
        self._run: Any = None  # the live swanlab Run, None when not logging to swanlab
        self._bar: tqdm | None = None
        self._metrics_file: TextIO | None = None  # metrics.jsonl, open from here to finish() on rank 0
        self._samples_path = self.run_dir / "samples.jsonl"
        self._warned: set[str] = set()
        self._finished = False
        if not enabled:
            return
        if swanlab_mode not in SWANLAB_MODES:
            raise ValueError(f"--swanlab_mode {swanlab_mode!r}: expected one of {', '.join(SWANLAB_MODES)}")
        if swanlab_mode == "cloud" and importlib.util.find_spec("swanlab") is None:
            raise SystemExit("--swanlab_mode cloud needs swanlab: pip install 'swanlab[dashboard]'")
        if swanlab_mode == "cloud" and not _swanlab_has_api_key():
            # Checked before touching any file; swanlab itself would prompt for a login in a terminal.
            raise SystemExit("--swanlab_mode cloud needs a SwanLab API key: run `swanlab login` "
                             "(or set SWANLAB_API_KEY), or use --swanlab_mode local")

        self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = self.run_dir / "metrics.jsonl"
        if start_step > 0:
            # Resume: keep history up to the checkpoint; the steps after it are re-logged.
            for path in (metrics_path, self._samples_path):
                truncate_jsonl(path, start_step)
        else:
            # A fresh run owns the directory's logs: appending to an old run would mix two runs.
            for path in (metrics_path, self._samples_path):
                path.unlink(missing_ok=True)
        self._metrics_file = metrics_path.open("a", encoding="utf-8")

        if swanlab_mode != "disabled":
            self._init_swanlab(project, experiment_name, config, resume_id, Path(swanlab_logdir))
        if self._console:  # after swanlab's start-up, which would otherwise skew the first ETA
            self._bar = tqdm(total=total_steps if total_steps > 0 else None, initial=start_step, unit="step",
                             dynamic_ncols=True, mininterval=0.5, file=sys.stderr, desc="ppo")

    # ---- swanlab

    def _init_swanlab(self, project: str, experiment_name: str, config: dict, resume_id: str | None,
                      logdir: Path) -> None:
        try:
            import swanlab
        except ImportError:
            self._warn("swanlab is not installed; logging to metrics.jsonl only (pip install 'swanlab[dashboard]')")
            return
        cloud = self.swanlab_mode == "cloud"
        if self.swanlab_mode == "local" and importlib.util.find_spec("swanboard") is None:
            self._warn("swanlab local mode needs the dashboard package (pip install 'swanlab[dashboard]'); "
                       "the run is still written under " + str(logdir))

        # interactive=False: swanlab must never stop on a login prompt. Login and the
        # network only happen in swanlab's "online" mode; outside it we also blank any
        # SWANLAB_WEBHOOK (an HTTP POST at init) and skip the requirements probe, which runs
        # `pip list` (pip checks PyPI for its own new version).
        settings_kw: dict[str, Any] = {"interactive": False}
        if not cloud:
            settings_kw["integration"] = swanlab.Settings.Integration(
                webhook=swanlab.Settings.Integration.Webhook(url=""))
            settings_kw["probe"] = swanlab.Settings.Probe(requirements=False)
        init_kw: dict[str, Any] = {}
        # Local mode always starts a new experiment in the local dashboard; cloud continues the
        # run id, and offline keeps it so a later `swanlab sync` continues the same cloud run.
        if resume_id and self.swanlab_mode in ("cloud", "offline"):
            init_kw.update(id=resume_id, resume="allow")
        try:
            run = swanlab.init(
                mode="online" if cloud else self.swanlab_mode, project=project, name=experiment_name,
                config=to_json_safe(config), log_dir=str(logdir), settings=swanlab.Settings(**settings_kw),
                reinit=True,  # a run left open in this process (e.g. after an exception) is closed
                **init_kw,
            )
        except Exception as e:  # noqa: BLE001 - swanlab's own and its HTTP client's errors: outside cloud mode only the dashboard is lost
            if cloud:
                if self._metrics_file is not None:
                    self._metrics_file.close()
                raise SystemExit(f"swanlab cloud init failed ({type(e).__name__}: {e}); "
                                 "check `swanlab login` / the network, or use --swanlab_mode local") from None
            self._warn(f"swanlab {self.swanlab_mode} init failed ({type(e).__name__}: {e}); "
                       "logging to metrics.jsonl only")
            return
        self._run = run
        self.id = run.id
        self.swanlab_dir = Path(run.dir)
        if self.swanlab_mode == "local":
            _align_local_table_columns(run)
        where = f"swanlab {self.swanlab_mode} run {run.id} -> {run.dir}"
        if self.swanlab_mode == "local":
            where += f" (view: swanlab watch {logdir})"
        elif self.swanlab_mode == "offline":
            where += f" (upload later: swanlab sync {run.dir})"
        if not resume_id:
            self.info(where)
        elif self.swanlab_mode == "cloud":
            self.info(f"resume: continuing {where}")
        elif self.swanlab_mode == "offline":
            self.info(f"resume: offline mode keeps run id {run.id} but writes a new folder: {where}")
        else:
            self.info(f"resume: swanlab local mode cannot continue run {resume_id}; new {where}")

    def _swanlab_log(self, data: dict[str, Any], step: int) -> None:
        if self._run is None or not data:
            return
        try:
            self._run.log(data, step=step)
        except Exception as e:  # noqa: BLE001 - the dashboard is optional; the jsonl keeps the numbers
            self._warn(f"swanlab.log failed ({type(e).__name__}: {e}); continuing with metrics.jsonl only")
            self._run = None

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _warn(self, msg: str) -> None:
        if msg in self._warned:
            return
        self._warned.add(msg)
        line = f"[warn] {msg}"
        if self._bar is not None:
            tqdm.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    # ---- public API

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record one step: a flushed line in metrics.jsonl, swanlab scalars, the bar's position/postfix."""
        if not self.enabled or self._finished or self._metrics_file is None:
            return
        values = {str(k): _as_float(str(k), v) for k, v in metrics.items()}
        record = {"step": int(step), "time": time.time(), **values}
        self._metrics_file.write(json.dumps(to_json_safe(record), allow_nan=False) + "\n")
        self._metrics_file.flush()
        self._swanlab_log({k: v for k, v in values.items() if math.isfinite(v)}, int(step))
        if self._bar is not None:
            if step > self._bar.n:
                self._bar.update(step - self._bar.n)
            text = _postfix(values)
            if text:
                self._bar.set_postfix_str(text, refresh=True)

    def log_samples(self, rows: list[dict], step: int) -> None:
        """Append rows to samples.jsonl, print the first to the console, and log them to swanlab."""
        if not self.enabled or self._finished or not rows:
            return
        safe_rows = [to_json_safe(dict(row)) for row in rows]
        with self._samples_path.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps({"step": int(step), **row}, ensure_ascii=False, allow_nan=False) + "\n"
                            for row in safe_rows))
        self.info(format_sample(rows[0], step))
        if self._run is None:
            return
        import swanlab

        data: dict[str, Any] = {"samples/text": [swanlab.Text(_sample_text(r), caption=_sample_caption(r))
                                                 for r in safe_rows]}
        if self.swanlab_mode != "local":  # the local dashboard has no echarts (see module docstring)
            try:
                data["samples/table"] = _samples_table(swanlab, safe_rows)
            except Exception as e:  # noqa: BLE001 - the table is optional; the samples are logged as text
                self._warn(f"swanlab table of samples failed ({type(e).__name__}: {e}); logging them as text only")
        self._swanlab_log(data, int(step))

    def info(self, msg: str) -> None:
        """Print a line on rank 0 without breaking the progress bar."""
        if not self._console:
            return
        if self._bar is not None:
            tqdm.write(msg, file=sys.stdout)
        else:
            print(msg, flush=True)

    def finish(self, plots: bool = True, state: str = "success", error: str | None = None) -> None:
        """Close the bar, the files and swanlab (state: success|crashed|aborted), then write
        <run_dir>/plots/*.png if `plots`. Safe to call twice; never raises for plotting."""
        if not self.enabled or self._finished:
            return
        self._finished = True
        self._close_bar()
        if self._metrics_file is not None:
            self._metrics_file.close()
        if self._run is not None:
            try:
                self._run.finish(state=state, error=error)
            except Exception as e:  # noqa: BLE001 - the dashboard is optional; the jsonl is closed already
                self._warn(f"swanlab finish failed ({type(e).__name__}: {e})")
            self._run = None
        if plots:
            try:
                from trainer.run.plots import plot_run

                paths = plot_run(self.run_dir)
                self.info(f"plots: {len(paths)} PNGs in {self.run_dir / 'plots'}")
            except ValueError as e:  # nothing logged yet
                self.info(f"plots: skipped ({e})")
            except Exception as e:  # noqa: BLE001 - plotting never fails a finished run; the message says how to retry
                self._warn(f"plotting {self.run_dir} failed ({type(e).__name__}: {e}); "
                           f"retry with: python scripts/plot_run.py {self.run_dir}")

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            self.finish()
        else:
            crashed = not issubclass(exc_type, (KeyboardInterrupt, SystemExit))
            self.finish(state="crashed" if crashed else "aborted", error=f"{exc_type.__name__}: {exc}")


def _sample_caption(row: Mapping[str, Any]) -> str:
    reward = row.get("reward")
    return f"reward={reward:.3g}" if isinstance(reward, (int, float)) and not isinstance(reward, bool) else ""


def _sample_text(row: Mapping[str, Any]) -> str:
    numbers = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items() if k not in _TEXT_KEYS)
    return f"PROMPT:\n{row.get('prompt', '')}\n\nRESPONSE:\n{row.get('response', '')}\n\n{numbers}"


def _samples_table(swanlab: Any, rows: Iterable[Mapping[str, Any]]) -> Any:
    rows = list(rows)
    headers = [k for k in _TEXT_KEYS if any(k in r for r in rows)]
    headers += [k for k in dict.fromkeys(k for r in rows for k in r) if k not in _TEXT_KEYS]
    table = swanlab.echarts.Table()
    table.add(headers, [[_cell(r.get(h)) for h in headers] for r in rows])
    return table


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    return "" if value is None else value
