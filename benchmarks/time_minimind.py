"""Time MiniMind's own PPO trainer (its trainer/train_ppo.py, unmodified) on this machine, at the work
benchmarks/bench_ppo.py measures, so the two can be alternated in one run (README "Speed and memory").

    git clone https://github.com/jingyaogong/minimind /path/to/minimind   # not shipped here
    python benchmarks/time_minimind.py --minimind_dir /path/to/minimind --size 512x8 --json mm.json
    python benchmarks/bench_ppo.py --sizes 512x8 --minimind_s <the median it printed>

What it sets up (MiniMind's trainer loads fixed paths): random-init HIDDENxLAYERS weights (seeded)
saved as <minimind_dir>/out/full_sft_<hidden>.pth if that file is absent, and 200 prompts of ~64
chat-template tokens in <minimind_dir>/minippo_bench_prompts.jsonl. Its reward model is replaced by
one that scores 0 (its rule rewards still run), the `datasets` package by a json-lines reader (same
records). Flags as in bench_ppo: batch 8, prompt 64, 64 new tokens (a random model never stops),
one PPO epoch of one minibatch, no data-loader workers, 2 threads unless --num_threads. A step is the
wall time between two of its end-of-step log lines; the first two steps are warm-up. Prints the
median s/step and exits as soon as the last timed step is logged.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import runpy
import statistics
import sys
import time
import types
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minimind_dir", required=True, help="a checkout of github.com/jingyaogong/minimind")
    p.add_argument("--size", default="512x8", help="HIDDENxLAYERS")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after two warm-up steps)")
    p.add_argument("--num_threads", type=int, default=2)
    p.add_argument("--json", default="", help="write the step times here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    o = parse_args(argv)
    root = Path(o.minimind_dir).resolve()
    script = root / "trainer" / "train_ppo.py"
    if not script.is_file():
        raise SystemExit(f"error: --minimind_dir {root}: no trainer/train_ppo.py there (clone jingyaogong/minimind)")
    try:
        hidden, layers = (int(x) for x in o.size.lower().split("x"))
    except ValueError:
        raise SystemExit(f"error: --size {o.size!r}: use HIDDENxLAYERS, e.g. 512x8")
    if o.steps < 1:
        raise SystemExit("error: --steps must be >= 1")
    import torch

    torch.set_num_threads(o.num_threads)
    datasets = types.ModuleType("datasets")  # MiniMind reads its jsonl through `datasets`; same records
    datasets.load_dataset = lambda kind, data_files, split: [json.loads(line) for line in open(data_files)]
    datasets.Features = datasets.Sequence = datasets.Value = object
    sys.modules.setdefault("datasets", datasets)
    sys.path.insert(0, str(root))
    os.chdir(root / "trainer")  # MiniMind's paths are relative to trainer/
    import trainer.trainer_utils as tu  # MiniMind's module
    from model.model_minimind import MiniMindConfig, MiniMindForCausalLM  # MiniMind's module

    weights = root / "out" / f"full_sft_{hidden}.pth"
    if not weights.exists():
        weights.parent.mkdir(exist_ok=True)
        torch.manual_seed(0)
        torch.save(MiniMindForCausalLM(MiniMindConfig(hidden_size=hidden, num_hidden_layers=layers)).state_dict(), weights)
    data = root / "minippo_bench_prompts.jsonl"
    rng = random.Random(0)
    words = "the a of to and in is for on with as by at from that this be are or was it".split()
    with open(data, "w") as f:  # 44-56 words: 57-70 tokens with MiniMind's chat template
        for _ in range(200):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(44, 56)))
            f.write(json.dumps({"conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": ""}]}) + "\n")

    class ZeroRewardModel:
        def __init__(self, *args, **kwargs):
            pass

        def get_score(self, messages, response):
            return 0.0

    tu.LMForRewardModel = ZeroRewardModel
    stamps: list[float] = []
    log = tu.Logger

    def timed_logger(msg, *args, **kwargs):
        if str(msg).startswith("Epoch:["):  # MiniMind's end-of-step line
            stamps.append(time.perf_counter())
            if len(stamps) == o.steps + 2:
                steps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # steps 3..: two warm-up steps
                med = statistics.median(steps)
                print(f"MiniMind {o.size}: median {med:.2f} s/step over {len(steps)} steps {[round(s, 2) for s in steps]}", flush=True)
                if o.json:
                    Path(o.json).write_text(json.dumps({"size": o.size, "steps_s": steps, "median_s": med}))
                os._exit(0)  # the measurement is complete; MiniMind would go on for the whole epoch
        log(msg, *args, **kwargs)

    tu.Logger = timed_logger
    sys.argv = [str(script), "--hidden_size", str(hidden), "--num_hidden_layers", str(layers), "--batch_size", "8",
                "--max_seq_len", "64", "--max_gen_len", "64", "--ppo_update_iters", "1", "--mini_batch_size", "8",
                "--num_workers", "0", "--data_path", str(data), "--save_interval", "100000", "--device", "cpu"]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
