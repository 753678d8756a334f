"""The on-policy distillation demo's figures (docs/distillation.md): held-out accuracy and the reverse KL to the teacher
of each policy, and the accuracy against training wall time of the runs that made them.

    python builders/make_teacher.py                                   # out/demo_teacher_128.pth (PPO, 250 steps)
    python train_ppo.py --config configs/distill_demo.yaml            # out/distill_student_128.pth
    python train_ppo.py --save_weight ppo_same_time --max_steps N     # PPO from the same start, the same wall time
    python benchmarks/distill_demo.py --teacher out/demo_teacher_128.pth \\
        --policy start=out/full_sft_128.pth --policy distilled=out/distill_student_128.pth \\
        --policy ppo=out/ppo_same_time_128.pth --policy teacher=out/demo_teacher_128.pth \\
        --run distilled=runs/distill_student_128 --run ppo=runs/ppo_same_time_128 --out docs/distill_demo

Accuracy: greedy replies to the first --n held-out prompts (dataset/demo_eval.jsonl), scored as training's evaluation.
KL to the teacher: replies sampled at temperature 1 from the policy, sum over each reply's tokens of
log pi(y_t) - log p_teacher(y_t) (an unbiased sample of the sequence-level reverse KL KL(pi || teacher)), mean over
replies (trainer/evaluate.py kl_ref with the teacher as reference). Writes OUT.json and OUT.png and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dataset.rlaif import read_rlaif_jsonl
from model.loader import load_policy
from trainer.evaluate import EvalSettings, evaluate_policy


def _pairs(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


def measure(policies: dict[str, str], teacher_path: str, n: int, hidden: int, layers: int) -> dict[str, dict]:
    records = read_rlaif_jsonl(ROOT / "dataset" / "demo_eval.jsonl")[0][:n]
    teacher, _ = load_policy(weights=teacher_path, hidden_size=hidden, num_hidden_layers=layers)
    out = {}
    for name, path in policies.items():
        policy, tok = load_policy(weights=path, hidden_size=hidden, num_hidden_layers=layers)
        greedy = evaluate_policy(policy, tok, records, EvalSettings(max_prompt_len=128, max_new_tokens=64))
        sampled = evaluate_policy(policy, tok, records, EvalSettings(max_prompt_len=128, max_new_tokens=64, temperature=1.0),
                                  ref_policy=teacher)
        out[name] = {"accuracy": greedy["accuracy"], "format_rate": greedy["format_rate"], "kl_to_teacher": sampled["kl_ref"],
                     "weights": path}
        print(name, out[name], flush=True)
    return out


def curves(runs: dict[str, str]) -> dict[str, list[tuple[float, float, int]]]:
    """Per run: (training seconds so far, held-out accuracy, step) at each evaluation, from its metrics.jsonl (the
    seconds are the steps' own time/step: evaluation time is left out)."""
    out = {}
    for name, run in runs.items():
        rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line.strip()]
        wall, points = 0.0, []
        for r in rows:
            wall += r.get("time/step", 0.0)
            if "eval/accuracy" in r:
                points.append((wall, r["eval/accuracy"], int(r.get("step", 0))))
        out[name] = points
    return out


def plot(results: dict[str, dict], lines: dict[str, list], path: Path) -> None:
    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name, pts in lines.items():
        ax1.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=name)
    ax1.set(xlabel="training wall time (s, evaluation excluded)", ylabel="held-out accuracy (%, greedy)",
            title="accuracy against wall time")
    ax1.legend()
    names = list(results)
    ax2.bar(names, [results[k]["kl_to_teacher"] for k in names], color="tab:gray")
    ax2.set(ylabel="KL(policy || teacher), nats / reply", title="reverse KL to the teacher (sampled, T=1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True)
    p.add_argument("--policy", action="append", default=[], help="NAME=weights.pth (repeatable)")
    p.add_argument("--run", action="append", default=[], help="NAME=run dir (its metrics.jsonl; repeatable)")
    p.add_argument("--n", type=int, default=500, help="held-out prompts")
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--out", default="docs/distill_demo")
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.time()
    results = measure(_pairs(a.policy), a.teacher, a.n, a.hidden_size, a.num_hidden_layers)
    lines = curves(_pairs(a.run))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(), "n": a.n,
            "eval_seconds": round(time.time() - t0, 1)}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results, "curves": lines}, indent=1))
    table = ["| policy | held-out accuracy (greedy) | format | KL to teacher (nats / reply) |", "|---|---|---|---|"]
    table += [f"| {k} | {100 * v['accuracy']:.1f}% | {100 * v['format_rate']:.1f}% | {v['kl_to_teacher']:.2f} |"
              for k, v in results.items()]
    plot(results, lines, out.with_suffix(".png"))
    print("\n".join(table))


if __name__ == "__main__":
    main()
