"""Build the on-policy distillation demo's teacher (docs/distillation.md): the default PPO demo run, from the shipped
out/full_sft_128.pth, written as out/demo_teacher_128.pth. Deterministic on a CPU (the demo's seed; the same flags
give the same weights; how long it takes: docs/distillation.md):

    python builders/make_teacher.py                 # out/demo_teacher_128.pth, runs/demo_teacher_128/
    python train_ppo.py --config configs/distill_demo.yaml   # then distil the 1.7M start policy from it

The teacher is the PPO-trained policy itself (64% held-out accuracy against the start's 39%: README's table), so
the student has something to learn from it and the two share the tokenizer. Flags after the script's own go to
train_ppo.py (e.g. --max_steps 100 for a quicker, weaker teacher).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save_dir", default="out", help="where out/full_sft_128.pth is read and the teacher written")
    p.add_argument("--save_weight", default="demo_teacher", help="the teacher's name: <save_dir>/<save_weight>_128.pth")
    args, rest = p.parse_known_args(argv)
    name = f"{args.save_weight}_128"
    cmd = [sys.executable, str(ROOT / "train_ppo.py"), "--config", str(ROOT / "configs" / "demo.yaml"),
           "--save_dir", args.save_dir, "--save_weight", args.save_weight, "--run_dir", str(ROOT / "runs" / name),
           "--checkpoint_dir", str(ROOT / "checkpoints" / name), "--swanlab_mode", "disabled", *rest]
    print(" ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    raise SystemExit(main())
