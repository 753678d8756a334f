"""How far the sampler's log-probs (--rollout_logprobs 1) are from a second forward, and what that
does to the PPO ratio on the first update minibatch, before any optimizer step.

    python scripts/measure_logprob_gap.py          # 512x8 random init + 128x4 demo policy, fp32 + bf16, seeds 0,1,2
    python scripts/measure_logprob_gap.py --sizes 128x4:full_sft --dtypes bfloat16 --seeds 0 --warmup_steps 5

What is measured. Each (size, dtype, seed) builds a run with the trainer's own set-up
(`train_ppo.parse_args` + `trainer.run.setup.setup`; `:none` = random init, `:full_sft` = the shipped
out/full_sft_<hidden>.pth), takes `--batch_size` demo prompts (dataset/demo_train.jsonl, picked by the
seed) and runs `train_ppo.make_experience` with --rollout_logprobs 1 (demo reward model), so
old_logprobs come from the KV-cached sampling pass (model/generation.py `sample`, model/fast_decode.py).
Then, under the run's autocast:
  2nd fwd  `policy_forward` of the finished sequences, no grad, the model's own attention: the old
           log-probs --rollout_logprobs 0 would compute (`cost` = its wall time, with entropy as score_old).
  upd fwd  `policy_forward` as `trainer.update.actor_backward` runs it on the first update minibatch (the
           trainer's permutation): grad on, inside `attention_implementation(settings.train_attn)`, i.e.
           eager attention under bf16 on CPU. The "new" log-probs of the first ratio.
  step     one real `train_ppo.ppo_update`, then the update forward again on the same rows.
Columns (token statistics over real response tokens, response_mask; log-probs in nats):
  tok                 response tokens in the batch
  gap_mean/p99/max    |sampler - 2nd fwd| per token
  A_*                 against the sampler's old log-probs (A_ratio / A_clipfrac are what the trainer logs as
                      ppo/ratio / ppo/clipfrac for that minibatch; checked when it is the whole batch):
                      ratio = token mean of exp(upd - old), clipfrac at --clip_epsilon, logr = mean
                      |upd - old|, max = largest |upd - old| (clipping starts at log 1.2 = 0.18), out = share
                      of tokens with the ratio outside [1-eps, 1+eps] whatever the advantage's sign
  B_*                 the same against the 2nd forward (--rollout_logprobs 0 as the trainer runs it)
  C_logr              against a 2nd forward under the update's attention kernel (= B except under bf16 on
                      CPU, where scoring runs sdpa and the update eager)
  move                mean |upd after the step - upd before|: what one update moves the log-probs (one
                      optimizer step when --mini_batch_size >= --batch_size). --warmup_steps 0 (default)
                      = the peak LR; the trainer's default 5 gives LR/6 on its first step.
  cost_s / step_s     the 2nd forward's wall seconds / generate + score + update with --rollout_logprobs 1
How to read it: before the first step the ratio should be exactly 1. If A_logr is small next to `move` and
A_clipfrac ~ 0, the sampler's log-probs serve as well as a second forward; if A_logr is comparable to
`move` or A_clipfrac is clearly > 0, the first minibatch clips on rounding noise and a second forward
earns its cost, provided it removes the gap (B_logr, or C_logr for one run under the update's kernel).
A, B and C share the experience's advantages (computed with the sampler's old log-probs; the KL-in-reward
term differs by ~kl_coef x gap).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import train_ppo as T  # noqa: E402
from dataset.rlaif import collate_left_pad  # noqa: E402
from trainer.ppo import masked_mean, policy_loss  # noqa: E402
from trainer.rollout import Rollout, attention_implementation, policy_forward  # noqa: E402
from trainer.run.distributed import DistInfo  # noqa: E402
from trainer.run.setup import Setup, setup  # noqa: E402
from trainer.run.timing import PhaseTimer  # noqa: E402

COLUMNS = ("tok", "gap_mean", "gap_p99", "gap_max", "A_ratio", "A_clipfrac", "A_logr", "A_max", "A_out",
           "B_ratio", "B_clipfrac", "B_logr", "C_logr", "move", "cost_s", "step_s")


def ratio_stats(new: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, eps: float) -> dict[str, float]:
    """The trainer's own ratio / clipfrac (trainer.ppo.policy_loss), mean and max |log ratio|, out-of-range share."""
    _, st = policy_loss(new, old, adv, mask, eps)
    log_ratio = new - old
    out = (log_ratio.exp() - 1).abs() > eps
    return {"ratio": st["ratio"], "clipfrac": st["clipfrac"], "logr": masked_mean(log_ratio.abs(), mask).item(),
            "max": log_ratio.abs()[mask.bool()].max().item(), "out": masked_mean(out.float(), mask).item()}


def update_forward(built: Setup, part: Rollout) -> torch.Tensor:
    """The new log-probs exactly as `trainer.update.actor_backward` computes them (grad on, update attention)."""
    m, s = built.models, built.settings
    with attention_implementation(s.train_attn, m.actor_train, m.critic_train), torch.enable_grad(), s.autocast():
        lp, _ = policy_forward(m.actor_train, part.sequences, part.attention_mask, part.response_len, s.sample_temperature)
    return lp.detach()


def measure(size: str, dtype: str, seed: int, o: argparse.Namespace) -> dict[str, float]:
    """One (size, dtype, seed): build the run, one experience, the three forwards, one update (COLUMNS)."""
    dims, _, weight = size.partition(":")
    hidden, layers = (int(x) for x in dims.lower().split("x"))
    argv = ["--hidden_size", str(hidden), "--num_hidden_layers", str(layers), "--from_weight", weight or "none",
            "--dtype", dtype, "--seed", str(seed), "--batch_size", str(o.batch_size),
            "--mini_batch_size", str(min(o.mini_batch_size, o.batch_size)), "--max_gen_len", str(o.gen_len),
            "--temperature", str(o.temperature), "--clip_epsilon", str(o.clip_epsilon), "--rollout_logprobs", "1",
            "--num_threads", str(o.num_threads), "--warmup_steps", str(o.warmup_steps), "--swanlab_mode", "disabled"]
    args = T.parse_args(argv)
    built = setup(args, DistInfo())
    m, s = built.models, built.settings
    ds = built.dataset
    rows = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[: args.batch_size].tolist()
    batch = collate_left_pad([ds[i] for i in rows], pad_id=m.tok.pad_token_id)

    timer = PhaseTimer()
    exp = T.make_experience(args, batch, m, s, built.kl_ctl.value, built.custom_fns, timer)
    ro = exp.rollout
    mask = ro.response_mask.bool()

    # --rollout_logprobs 0: the second forward make_experience would run (score_old), timed.
    with torch.no_grad(), s.autocast():
        t0 = time.perf_counter()
        second, _ = policy_forward(m.actor, ro.sequences, ro.attention_mask, ro.response_len, s.sample_temperature,
                                   with_entropy=True)
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
        cost = time.perf_counter() - t0
        with attention_implementation(s.train_attn, m.actor):
            second_upd_attn, _ = policy_forward(m.actor, ro.sequences, ro.attention_mask, ro.response_len,
                                                s.sample_temperature)
    gap = (ro.old_logprobs - second).abs()[mask]

    # The first update minibatch, as ppo_update draws it at step 0 on rank 0.
    g = torch.Generator().manual_seed(args.seed * 7919)
    mb = torch.randperm(ro.sequences.shape[0], generator=g).split(args.mini_batch_size)[0]
    part, pmask = ro.index(mb), ro.response_mask[mb]
    new = update_forward(built, part)
    A = ratio_stats(new, part.old_logprobs, part.advantages, pmask, args.clip_epsilon)
    B = ratio_stats(new, second[mb], part.advantages, pmask, args.clip_epsilon)
    C = ratio_stats(new, second_upd_attn[mb], part.advantages, pmask, args.clip_epsilon)

    with timer("update"):
        stats = T.ppo_update(args, ro, m, built.optim, 0, s, built.kl_ctl.value, timer)
    if len(mb) == ro.sequences.shape[0]:  # one minibatch: the trainer's own logged figures are A's
        assert abs(stats["ppo/ratio"] - A["ratio"]) < 1e-6 and abs(stats["ppo/clipfrac"] - A["clipfrac"]) < 1e-6, stats
    after = update_forward(built, part)
    step_s = sum(timer.wall[k] for k in ("generate", "score", "update"))
    return {"tok": float(mask.sum()), "gap_mean": gap.mean().item(), "gap_p99": torch.quantile(gap.double(), 0.99).item(),
            "gap_max": gap.max().item(), **{f"A_{k}": v for k, v in A.items()},
            "B_ratio": B["ratio"], "B_clipfrac": B["clipfrac"], "B_logr": B["logr"], "C_logr": C["logr"],
            "move": masked_mean((after - new).abs(), pmask).item(), "cost_s": cost, "step_s": step_s}


def width(key: str) -> int:
    return 6 if key == "tok" else 7 if key.endswith("_s") else 10 if key.endswith("ratio") else 9


def fmt(v: float, key: str) -> str:
    if key == "tok":
        return f"{v:6.0f}"
    if key.endswith("_s"):
        return f"{v:7.3f}"
    if key.endswith("ratio"):
        return f"{v:10.7f}"
    return f"{v:9.2e}" if v else f"{0:9d}"


def row(size: str, dtype: str, seed: str, r: dict[str, float]) -> str:
    return f"{size:<15}{dtype:<9}{seed:>5} " + " ".join(fmt(r[c], c) for c in COLUMNS)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="512x8:none,128x4:full_sft",
                   help="HIDDENxLAYERS[:from_weight] list; none = random init, full_sft = out/full_sft_<hidden>.pth")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--mini_batch_size", type=int, default=16, help="the trainer's default; capped at --batch_size")
    p.add_argument("--gen_len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--clip_epsilon", type=float, default=0.2)
    p.add_argument("--warmup_steps", type=int, default=0,
                   help="the trainer's LR warm-up for the measured step (0 = peak LR; the trainer's default 5 = LR/6 at step 0)")
    p.add_argument("--num_threads", type=int, default=1)
    o = p.parse_args(argv)
    os.chdir(ROOT)  # the trainer's default paths (dataset/, out/) are relative to the repo

    print(f"{'size':<15}{'dtype':<9}{'seed':>5} " + " ".join(f"{c:>{width(c)}}" for c in COLUMNS))
    for size in o.sizes.split(","):
        for dtype in o.dtypes.split(","):
            results = []
            for seed in (int(x) for x in o.seeds.split(",")):
                r = measure(size, dtype, seed, o)
                results.append(r)
                print(row(size, dtype, str(seed), r), flush=True)
            mean = {c: statistics.fmean(r[c] for r in results) for c in COLUMNS}
            for c in ("gap_max", "A_max"):  # over seeds: the max
                mean[c] = max(r[c] for r in results)
            print(row(size, dtype, "mean", mean), flush=True)


if __name__ == "__main__":
    main()
