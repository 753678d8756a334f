"""The peer's figure: TRL's GRPOTrainer doing the SmolLM2 IFEval preset's work on this CPU, timed per step and per
phase, for an A/B against `benchmarks/bench_ppo.py --actor_path` (docs/speed-and-memory.md).

Runs in a scratch virtualenv of its own (TRL is not a dependency of minippo):

    python3 -m venv /tmp/venv-trl && /tmp/venv-trl/bin/pip install -r requirements.txt trl==1.16.0
    /tmp/venv-trl/bin/python benchmarks/trl_peer.py --num_threads 1 --steps 3

The work, as the preset's step (configs/smollm2_ifeval.yaml): 4 prompts of dataset/ifeval_train.jsonl x 4 samples
= 16 rows, T=0.7, exactly 64 new tokens (min_new_tokens, so EOS does not shorten TRL's rows and the work stays
equal), the IFEval constraint reward (dataset/ifeval.py, the same function), beta 0.02 (so a reference forward),
one optimizer step per generation batch (num_iterations 1), bf16 mixed precision on fp32 weights (`bf16=True`,
`use_cpu=True`). Phases come from TRL's own profiling contexts ("profiling/Time taken: ..."), collected here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "out" / "smollm2_135m_instruct"))
    p.add_argument("--num_threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps, after --warmup untimed ones")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default=None, help="write the figures here")
    o = p.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from dataset.ifeval import reward as ifeval_reward

    torch.set_num_threads(o.num_threads)
    phases: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))  # name -> {step: seconds}
    step_s: list[float] = []

    def collect(self: profiling.ProfilingContext, duration: float) -> None:
        phases[self.name][len(step_s)] += duration  # the step under way: those finished so far

    profiling.ProfilingContext._log_metrics = collect  # TRL's own phase timers, kept instead of sent to a tracker

    rows = [json.loads(line) for line in (ROOT / "dataset" / "ifeval_train.jsonl").read_text().splitlines()]
    n = 4 * (o.warmup + o.steps)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["conversations"][0]["content"]}],
                               "constraints": json.dumps(r["constraints"])} for r in rows[:n]])

    def constraint_reward(completions: list, constraints: list[str], **_: object) -> list[float]:
        return [ifeval_reward(json.loads(c), comp[-1]["content"]) for comp, c in zip(completions, constraints)]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            step_s.append(time.perf_counter() - self.t)

    tok = AutoTokenizer.from_pretrained(o.model)
    model = AutoModelForCausalLM.from_pretrained(o.model, dtype=torch.float32)
    cfg = GRPOConfig(
        output_dir=str(Path(os.environ.get("TMPDIR", "/tmp")) / "trl_peer"), use_cpu=True, bf16=True,
        per_device_train_batch_size=16, num_generations=4, max_completion_length=64, temperature=0.7,
        beta=0.02, learning_rate=2e-5, num_iterations=1, max_steps=o.warmup + o.steps, logging_steps=1,
        report_to=[], save_strategy="no", seed=42, shuffle_dataset=False, dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": 64},
    )
    trainer = GRPOTrainer(model=model, reward_funcs=constraint_reward, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[StepTimer()])
    trainer.train()
    timed = step_s[o.warmup:]
    per_step = {name: statistics.median(v.get(i, 0.0) for i in range(o.warmup, len(step_s))) for name, v in phases.items()}
    out = {"trl_step_s_median": statistics.median(timed), "step_s": step_s, "phases_s_median_per_step": per_step,
           "threads": o.num_threads, "torch": torch.__version__}
    print(json.dumps(out, indent=1))
    if o.json:
        Path(o.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
