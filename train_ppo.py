"""minippo: PPO (RLHF) for small causal language models, in one script.

    python train_ppo.py                                  # the embedded CPU demo (minutes)
    python train_ppo.py --from_resume 1                  # continue the last run exactly
    torchrun --nproc_per_node 8 train_ppo.py --hidden_size 768 --num_hidden_layers 8 \
        --from_weight full_sft --data_path dataset/rlaif.jsonl --reward_model_path <RM dir>

The loop reads like the algorithm: for each batch of prompts
  1. rollout    sample responses from the actor (temperature / top-k / top-p, stop at EOS)
  2. score      old log-probs (the policy that sampled), reference log-probs, critic values
  3. reward     hybrid reward: format regex + tags + reward model + accuracy + EOS + custom
  4. advantages per-token KL penalty, reward on the EOS token, GAE, whitening
  5. update     epochs x minibatches of clipped policy loss + clipped value loss (+ KL, entropy)
  6. log, checkpoint
Models: actor (trained), critic (actor's trunk + value head, trained), reference (frozen copy
of the start), reward model (frozen, external), and optionally a frozen "old actor" copy.
The math lives in trainer/ppo.py, the reward components in trainer/rewards.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from dataset.rlaif import DataError, RLAIFDataset, collate_left_pad, read_rlaif_jsonl  # noqa: E402
from model.critic import CriticModel  # noqa: E402
from model.loader import eos_token_ids, load_policy, load_reward_model  # noqa: E402
from model.weights import WeightsError, native_weight_path, save_native_weights  # noqa: E402
from trainer import checkpoint as ckpt  # noqa: E402
from trainer import distributed as D  # noqa: E402
from trainer.distributed import shard_batches  # noqa: E402  (also imported from here by tests)
from trainer.logging import RunLogger  # noqa: E402
from trainer.ppo import (  # noqa: E402
    AdaptiveKLController, FixedKLController, compute_gae, compute_token_rewards,
    kl_penalty, masked_mean, policy_loss, value_loss,
)
from trainer.provenance import append_resume_record, mark_run_end, rehash_inputs, write_run_json  # noqa: E402
from trainer.parallel import check_parallel_update, run_side_by_side, use_parallel_update  # noqa: E402
from trainer.rewards import RewardModelScorer, compute_rewards, load_reward_fn  # noqa: E402
from trainer.rollout import Rollout, attention_implementation, critic_forward, generate_rollout, policy_forward  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# --------------------------------------------------------------------------------------- flags
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="minippo: PPO for small causal LMs (MiniMind flag names)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument_group("models").add_argument
    a("--from_weight", default="full_sft", help="native MiniMind weights <save_dir>/<from_weight>_<hidden>[_moe].pth")
    a("--actor_path", default=None, help="instead: a local Hugging Face causal-LM directory (own tokenizer/template)")
    a("--tokenizer_path", default=None, help="tokenizer dir (default: model/ for native weights, the HF dir otherwise)")
    a("--hidden_size", type=int, default=128)
    a("--num_hidden_layers", type=int, default=4)
    a("--num_attention_heads", type=int, default=0, help="0 = MiniMind's 8, or read off a qwen3-arch weights file")
    a("--num_key_value_heads", type=int, default=0, help="0 = MiniMind's 4 (qwen3) / 2 (llama), or read off the file")
    a("--use_moe", type=int, default=0, choices=[0, 1])
    a("--arch", default="auto", choices=["auto", "qwen3", "llama"], help="qwen3 = current MiniMind, llama = MiniMind2; auto reads the file")
    a("--reward_model_path", default="out/demo_rm", help="AutoModelForSequenceClassification dir, or 'none'")
    a("--trust_remote_code", type=int, default=0, choices=[0, 1], help="allow remote code (get_score() reward models)")
    a("--update_old_actor_freq", type=int, default=0,
      help="0: old log-probs recorded by the actor at rollout (no copy); N: MiniMind's frozen copy refreshed every N steps")
    a("--rollout_logprobs", type=int, default=1, choices=[0, 1],
      help="with no old-actor copy, old_logprobs come from the sampling pass itself instead of a second "
           "forward (same distribution; equal up to float rounding, see tests/test_rollout.py)")
    a = p.add_argument_group("data").add_argument
    a("--data_path", default="dataset/demo_train.jsonl", help="MiniMind RLAIF jsonl")
    a("--skip_bad_lines", type=int, default=0, choices=[0, 1], help="skip and count malformed lines instead of failing")
    a("--max_seq_len", type=int, default=128, help="max prompt tokens (longer prompts lose their oldest tokens)")
    a("--max_gen_len", type=int, default=64, help="max new tokens per response")
    a("--thinking_ratio", type=float, default=1.0, help="share of prompts rendered with open thinking ('<think>\\n')")
    a("--system_prompt_ratio", type=float, default=0.0, help="share of prompts given a random system prompt")
    a("--num_workers", type=int, default=0, help="accepted for MiniMind compatibility (prompts are tokenised in-process)")
    a = p.add_argument_group("rollout").add_argument
    a("--batch_size", type=int, default=32, help="prompts per step per process")
    a("--num_generations", type=int, default=1, help="responses sampled per prompt")
    a("--temperature", type=float, default=0.8)
    a("--top_k", type=int, default=0, help="0 = off")
    a("--top_p", type=float, default=1.0, help="1.0 = off")
    a("--greedy", type=int, default=0, choices=[0, 1], help="argmax decoding (tests, debugging)")
    a("--fast_decode", type=int, default=1, choices=[0, 1],
      help="decode steps of dense Qwen3/Llama policies by model/fast_decode.py (same math, fewer ops); 0 = transformers' forward")
    a = p.add_argument_group("reward").add_argument
    a("--reasoning", type=int, default=1, choices=[0, 1], help="RM score = 0.4 x whole reply + 0.6 x <answer> content")
    a("--format_weight", type=float, default=1.0, help="x format regex reward (0.5 when matched)")
    a("--tag_weight", type=float, default=1.0, help="x tag reward (0.25 per tag present exactly once)")
    a("--rm_weight", type=float, default=0.5, help="x reward-model score (clipped to [-3, 3])")
    a("--accuracy_weight", type=float, default=1.0, help="x 1.0 when the answer matches the row's reference")
    a("--eos_penalty", type=float, default=0.5, help="subtracted when a response never emits EOS")
    a("--reward_fn", action="append", default=[], help="custom reward module:function (repeatable), fn(prompt, reply, reference) -> float")
    a = p.add_argument_group("ppo").add_argument
    a("--epochs", type=int, default=1, help="passes over the prompt data")
    a("--max_steps", type=int, default=250, help="stop after this many PPO steps (0 = no limit)")
    a("--ppo_update_iters", type=int, default=1,
      help="PPO epochs over each rollout batch (demo: 1 epoch x 250 steps matched 2 x 150 in accuracy at 2/3 the step time)")
    a("--mini_batch_size", type=int, default=16, help="rows per optimizer step (per process)")
    a("--accumulation_steps", type=int, default=1, help="micro-batches per minibatch (memory)")
    a("--learning_rate", type=float, default=5e-5, help="actor LR")
    a("--critic_learning_rate", type=float, default=1e-4)
    a("--weight_decay", type=float, default=0.0)
    a("--warmup_steps", type=int, default=5, help="linear LR warm-up (PPO steps), then cosine to 10%%")
    a("--critic_warmup_steps", type=int, default=0, help="steps that train only the critic")
    a("--grad_clip", type=float, default=1.0)
    a("--clip_epsilon", type=float, default=0.2)
    a("--vf_coef", type=float, default=0.5)
    a("--cliprange_value", type=float, default=0.2, help="0 = unclipped value loss")
    a("--gamma", type=float, default=1.0)
    a("--lam", type=float, default=0.95)
    a("--whiten_advantages", type=int, default=1, choices=[0, 1])
    a("--kl_coef", type=float, default=0.02)
    a("--kl_estimator", default="k1", choices=["k1", "k2", "k3"])
    a("--kl_placement", default="reward", choices=["reward", "loss"], help="KL as per-token reward penalty or as a loss term")
    a("--adaptive_kl", type=int, default=0, choices=[0, 1], help="Ziegler et al. adaptive KL coefficient")
    a("--kl_target", type=float, default=1.0, help="adaptive KL: target KL per sequence (nats)")
    a("--kl_horizon", type=int, default=10000, help="adaptive KL: horizon in samples")
    a("--entropy_coef", type=float, default=0.0)
    a("--early_stop_kl", type=float, default=0.0, help="stop the update when approx-KL exceeds this (0 = off)")
    a("--max_nonfinite", type=int, default=5, help="stop after this many non-finite steps in a row")
    a = p.add_argument_group("system").add_argument
    a("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    a("--dtype", default="auto", choices=["auto", *DTYPES],
      help="autocast dtype (CPU and CUDA; log-probs stay fp32). auto = bfloat16 on CUDA, float32 on CPU, where "
           "bf16 only pays from ~30M parameters (scripts/bench_ppo.py)")
    a("--frozen_low_precision", type=int, default=-1, choices=[-1, 0, 1],
      help="hold reference/RM/old actor in --dtype; -1 = on CUDA only (bf16 elementwise work is slow on CPU)")
    a("--use_compile", type=int, default=0, choices=[0, 1])
    a("--train_attn_implementation", default="auto", choices=["auto", "eager", "sdpa"],
      help="attention kernel of the update's forward/backward (sampling and scoring keep the model's own); "
           "auto = eager under bf16 on CPU (update 1.85 vs 2.31 s at 512x8, scripts/bench_ppo.py; in fp32 sdpa "
           "was faster, 3.15 vs 3.55 s), else the model's own")
    a("--num_threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    a("--parallel_update", type=int, default=-1, choices=[-1, 0, 1],
      help="actor and critic forward/backward side by side, one CPU core each, instead of one after the other "
           "on all cores (512x8 bf16 update ~2.0 -> ~1.7 s on 2 cores, peak RSS +~450 MB: both graphs are alive "
           "at once); -1 = on for single-process CPU runs under bf16 with >= 2 threads")
    a("--seed", type=int, default=42)
    a = p.add_argument_group("output").add_argument
    a("--save_dir", default="out", help="where weights are read (--from_weight) and written")
    a("--save_weight", default="ppo_actor", help="output name: <save_dir>/<save_weight>_<hidden>.pth")
    a("--save_interval", type=int, default=50, help="PPO steps between saves")
    a("--checkpoint_dir", default="checkpoints")
    a("--keep_checkpoints", type=int, default=2)
    a("--from_resume", type=int, default=0, choices=[0, 1], help="continue from the newest resume file")
    a("--resume_check_inputs", type=int, default=1, choices=[0, 1],
      help="refuse to resume if the starting weights, reward model or prompts changed since the run began (sha256s in run.json)")
    a("--run_dir", default=None, help="metrics.jsonl, run.json, plots (default runs/<save_weight>_<hidden>)")
    a("--log_interval", type=int, default=1)
    a("--sample_interval", type=int, default=10, help="log a table of sample generations every N steps")
    a("--swanlab_mode", default="local", choices=["local", "offline", "cloud", "disabled"])
    a("--use_wandb", type=int, default=1, choices=[0, 1], help="MiniMind's name for 'log to SwanLab' (0 = disabled)")
    a("--wandb_project", default="minippo", help="swanlab project")
    a("--suppress_eos", type=int, default=0, choices=[0, 1], help=argparse.SUPPRESS)  # benchmarks: fixed lengths
    return p.parse_args(argv)


def validate_args(args: argparse.Namespace) -> None:
    """One-line errors for flags that would otherwise fail deep inside the run."""
    rows = args.batch_size * args.num_generations
    checks = [
        (args.batch_size >= 1, "--batch_size must be >= 1"),
        (args.num_generations >= 1, "--num_generations must be >= 1"),
        (args.mini_batch_size >= 1 and rows % args.mini_batch_size == 0,
         f"--mini_batch_size {args.mini_batch_size} must divide --batch_size x --num_generations = {rows}"),
        (args.accumulation_steps >= 1 and args.mini_batch_size % args.accumulation_steps == 0,
         f"--accumulation_steps {args.accumulation_steps} must divide --mini_batch_size {args.mini_batch_size}"),
        (args.max_gen_len >= 1, "--max_gen_len must be >= 1"),
        (args.max_seq_len >= 8, "--max_seq_len must be >= 8"),
        (args.temperature > 0 or args.greedy, "--temperature must be > 0 (or use --greedy 1)"),
        (0 < args.top_p <= 1, "--top_p must be in (0, 1]"),
        (args.ppo_update_iters >= 1, "--ppo_update_iters must be >= 1"),
        (0 <= args.thinking_ratio <= 1, "--thinking_ratio must be in [0, 1]"),
        (args.epochs >= 1, "--epochs must be >= 1"),
        (args.save_interval >= 1, "--save_interval must be >= 1"),
        (Path(args.data_path).is_file(), f"--data_path {args.data_path}: file not found"),
        (args.reward_model_path in (None, "none") or Path(args.reward_model_path).is_dir() or args.rm_weight == 0,
         f"--reward_model_path {args.reward_model_path}: not a directory (use 'none' or --rm_weight 0 to run without a reward model)"),
        (args.actor_path is None or Path(args.actor_path).is_dir(), f"--actor_path {args.actor_path}: not a directory"),
    ]
    for ok, msg in checks:
        if not ok:
            raise SystemExit(f"error: {msg}")


# --------------------------------------------------------------------------------------- build
def lr_lambda(warmup: int, total: int):
    """Linear warm-up then cosine decay to 10% of the peak, indexed by PPO step."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def actor_weights_path(args: argparse.Namespace) -> Path | None:
    """The native .pth --from_weight names (None for --actor_path or --from_weight none)."""
    if args.actor_path or args.from_weight == "none":
        return None
    return native_weight_path(args.save_dir, args.from_weight, args.hidden_size, bool(args.use_moe))


def build_models(args: argparse.Namespace, device: torch.device, frozen_dtype: torch.dtype):
    """(actor, tokenizer, reference, critic, old actor or None, reward-model scorer or None), built from
    the flags; `--from_weight none` gives a random-init actor (benchmarks). Shared with scripts/bench_ppo.py."""
    actor, tok = load_policy(
        weights=actor_weights_path(args), hf_path=args.actor_path, hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers, use_moe=bool(args.use_moe), arch=args.arch,
        num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
        tokenizer_path=args.tokenizer_path, device=device, trust_remote_code=bool(args.trust_remote_code),
    )
    rm_scorer = None
    if args.rm_weight and args.reward_model_path not in (None, "none"):
        rm_model, rm_tok = load_reward_model(args.reward_model_path, dtype=frozen_dtype, device=device,
                                             trust_remote_code=bool(args.trust_remote_code))
        rm_scorer = RewardModelScorer(rm_model, rm_tok)
    if args.actor_path:
        args.hidden_size = actor.config.hidden_size  # names the output files
    actor.config.use_cache = True
    ref = frozen_copy(actor, frozen_dtype)
    critic = CriticModel.from_policy(actor)
    old_actor = frozen_copy(actor, frozen_dtype) if args.update_old_actor_freq > 0 else None
    return actor, tok, ref, critic, old_actor, rm_scorer


def build_optimizers(args: argparse.Namespace, actor: torch.nn.Module, critic: torch.nn.Module, total_steps: int):
    """AdamW for actor and critic, each with warm-up + cosine LR over total_steps."""
    optims = {
        # Fused AdamW: one kernel for all parameters (~4x faster step on CPU, same math to ~1e-8).
        "actor": torch.optim.AdamW(actor.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay, fused=True),
        "critic": torch.optim.AdamW(critic.parameters(), lr=args.critic_learning_rate, weight_decay=args.weight_decay, fused=True),
    }
    scheds = {k: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(args.warmup_steps, total_steps)) for k, o in optims.items()}
    return optims, scheds


def frozen_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    m = copy.deepcopy(getattr(model, "module", model)).to(dtype).eval()
    return m.requires_grad_(False)


# --------------------------------------------------------------------------------------- one step
@torch.no_grad()
def make_experience(args, batch, models, tok, rm_scorer, custom_fns, kl_ctl, info, autocast) -> tuple[Rollout, dict, list[dict]]:
    """Steps 1-4: rollout, score, reward, advantages. Returns the rollout, metrics and sample rows."""
    actor, critic, ref, old_actor = models["actor"], models["critic"], models["ref"], models["old_actor"]
    dev = info.device
    t0 = time.perf_counter()
    with autocast():
        ro = generate_rollout(
            actor, batch["input_ids"].to(dev), batch["attention_mask"].to(dev), max_new_tokens=args.max_gen_len,
            eos_token_id=models.get("eos_ids") or tok.eos_token_id, pad_token_id=tok.pad_token_id, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, greedy=bool(args.greedy), suppress_eos=bool(args.suppress_eos),
            num_generations=args.num_generations, return_logprobs=bool(args.rollout_logprobs) and old_actor is None,
            fast_decode=bool(args.fast_decode),
        )
    t1 = time.perf_counter()
    R, temp = ro.response_len, (1.0 if args.greedy else args.temperature)
    unwrapped = getattr(actor, "module", actor)
    with autocast():
        # Log-probs under the same temperature-scaled distribution that sampled (fp32 softmax).
        if ro.old_logprobs is None:  # a frozen old actor, or --rollout_logprobs 0: score the samples again
            ro.old_logprobs, entropy = policy_forward(old_actor or unwrapped, ro.sequences, ro.attention_mask, R, temp, with_entropy=True)
        else:
            entropy = ro.entropy
        ro.ref_logprobs, _ = policy_forward(ref, ro.sequences, ro.attention_mask, R, temp)
        ro.values = critic_forward(getattr(critic, "module", critic), ro.sequences, ro.attention_mask, R).float()
    mask = ro.response_mask

    # Rewards on the full assistant reply: the prefix the template forced + the decoded response.
    rep = args.num_generations
    expand = lambda xs: [x for x in xs for _ in range(rep)]
    responses = [tok.decode(r[m.bool()].tolist(), skip_special_tokens=True) for r, m in zip(ro.sequences[:, -R:], mask)]
    replies = [p + r for p, r in zip(expand(batch["assistant_prefix"]), responses)]
    weights = {"format": args.format_weight, "tags": args.tag_weight, "rm": args.rm_weight,
               "accuracy": args.accuracy_weight, "eos": args.eos_penalty}
    rewards, comps = compute_rewards(
        prompts=expand(batch["prompt"]), messages=expand(batch["messages"]), replies=replies,
        references=expand(batch["reference"]), has_eos=ro.has_eos.tolist(), weights=weights,
        rm=rm_scorer if args.rm_weight else None, reasoning=bool(args.reasoning), custom_fns=custom_fns,
    )
    ro.rewards = rewards.to(dev)
    t2 = time.perf_counter()

    # Advantages: KL penalty per token (if in the reward) + score on the EOS token, GAE, whitening.
    kl = kl_penalty(ro.old_logprobs, ro.ref_logprobs, args.kl_estimator)  # [B, R]
    finite = bool(torch.isfinite(ro.rewards).all())
    scores = torch.nan_to_num(ro.rewards, nan=0.0, posinf=0.0, neginf=0.0)
    token_rewards = compute_token_rewards(scores, kl if args.kl_placement == "reward" else None, mask, kl_ctl.value)
    ro.advantages, ro.returns = compute_gae(token_rewards, ro.values, mask, args.gamma, args.lam)
    if args.whiten_advantages:
        ro.advantages = D.masked_whiten_global(ro.advantages, mask, info)
    ro.extras["finite"] = finite

    n_tok = mask.sum(1)
    counted = {k: torch.isfinite(v).sum().item() for k, v in comps.items()}  # NaN = component not defined for a row
    # What each per-rank mean below is a mean over, so DDP's reduction gives the global mean.
    ro.extras["metric_weights"] = {"ppo/entropy": n_tok.sum().item(), **{f"reward/{k}": n for k, n in counted.items()}}
    if "accuracy" in comps:
        ro.extras["metric_weights"]["accuracy"] = counted["accuracy"]
    metrics = {
        "reward/total": rewards.mean().item(),
        **{f"reward/{k}": (v.nanmean().item() if counted[k] else float("nan")) for k, v in comps.items()},
        "format_rate": (comps["format"] > 0).float().mean().item(),
        "kl_ref": ((ro.old_logprobs - ro.ref_logprobs) * mask).sum(1).mean().item(),
        "kl_coef": kl_ctl.value,
        "ppo/entropy": masked_mean(entropy, mask).item(),
        "response/length": n_tok.float().mean().item(),
        "response/eos_rate": ro.has_eos.float().mean().item(),
        "time/generate": t1 - t0,
        "time/score": t2 - t1,
    }
    if counted.get("accuracy"):
        metrics["accuracy"] = metrics["reward/accuracy"]
    if rep > 1:  # spread of rewards among the responses to the same prompt
        metrics["reward/group_std"] = rewards.view(-1, rep).std(dim=1).mean().item()
    metrics["tokens_generated"] = float(n_tok.sum().item())
    samples = [
        {"prompt": batch["prompt"][i // rep][-200:], "response": responses[i], "reward": rewards[i].item(),
         **{k: v[i].item() for k, v in comps.items()}}
        for i in range(min(4, len(responses)))
    ]
    return ro, metrics, samples


def ppo_update(args, ro: Rollout, models, optims, scheds, step: int, info, autocast, scaler) -> dict:
    """Step 5: `--ppo_update_iters` epochs over shuffled minibatches; one optimizer step per minibatch."""
    actor, critic = models["actor_train"], models["critic_train"]
    train_actor = step >= args.critic_warmup_steps
    B = ro.sequences.shape[0]
    g = torch.Generator().manual_seed(args.seed * 7919 + step * 31 + info.rank)
    stats: dict[str, list[float]] = {}
    stopped_early, nonfinite = False, False
    micro = args.mini_batch_size // args.accumulation_steps
    cpu_bf16 = info.device.type == "cpu" and args.dtype == "bfloat16" and not args.use_compile
    parallel = use_parallel_update(args.parallel_update, info.device, info.enabled, cpu_bf16)
    train_attn = args.train_attn_implementation
    if train_attn == "auto":  # torch's CPU flash-attention backward under bf16 is slow at PPO's short sequences
        train_attn = "eager" if cpu_bf16 else None
    with attention_implementation(train_attn, actor, critic):
        for _ in range(args.ppo_update_iters):
            for mb in torch.randperm(B, generator=g).split(args.mini_batch_size):
                # Losses are token sums over the GLOBAL token count of the minibatch, so DDP's gradient
                # mean equals the single-process token mean whatever each rank's share of tokens.
                n_tokens = D.sum_global(ro.response_mask[mb].sum(), info).clamp(min=1)
                approx_kl_sum = torch.zeros((), device=info.device)
                bad = False
                for k, ub in enumerate(mb.split(micro)):
                    part = ro.index(ub)
                    sync = k == args.accumulation_steps - 1
                    ctx = contextlib.nullcontext() if sync or not info.enabled else _no_sync(actor, critic)
                    scale = part.response_mask.sum() / n_tokens * info.world_size
                    # Actor and critic share no parameters, so each loss gets its own backward: only one
                    # graph's activations are alive at a time (the peak-memory term at 512x8), same gradients;
                    # with --parallel_update they run side by side on two cores (two graphs alive).
                    parts = [functools.partial(_critic_backward, args, critic, part, scale, autocast, scaler)]
                    if train_actor:
                        parts.insert(0, functools.partial(_actor_backward, args, actor, part, scale, models["kl_ctl"].value,
                                                          autocast, scaler))
                    with ctx:
                        for part_stats, part_bad, kl_sum in run_side_by_side(parts, parallel):
                            _append(stats, part_stats)
                            bad = bad or part_bad
                            if kl_sum is not None:
                                approx_kl_sum += kl_sum
                approx_kl = (D.sum_global(approx_kl_sum, info) / n_tokens).item()
                stats.setdefault("ppo/approx_kl", []).append(approx_kl)
                # Decisions taken together on every rank, before any optimizer moves.
                if D.any_rank(bad or not ro.extras["finite"], info):
                    nonfinite = True
                    _zero_grads(optims)
                    break
                if train_actor and args.early_stop_kl > 0 and D.any_rank(approx_kl > args.early_stop_kl, info):
                    stopped_early = True
                    _zero_grads(optims)  # the minibatch that crossed the limit does not step
                    break
                for name, model in (("actor", actor), ("critic", critic)):
                    if name == "actor" and not train_actor:
                        continue
                    if scaler:
                        scaler.unscale_(optims[name])
                    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                    stats.setdefault(f"grad_norm/{name}", []).append(gn.item())
                    (scaler.step(optims[name]) if scaler else optims[name].step())
                if scaler:
                    scaler.update()
                _zero_grads(optims)
            if stopped_early or nonfinite:
                break
    for s in scheds.values():
        s.step()
    out = {k: float(np.mean(v)) for k, v in stats.items()}
    out["ppo/early_stopped"] = float(stopped_early)
    out["nonfinite"] = float(nonfinite)
    out["value/explained_var"] = D.explained_variance_global(ro.values, ro.returns, ro.response_mask, info)
    return out


def _actor_backward(args, actor, part: Rollout, scale: torch.Tensor, kl_coef: float, autocast, scaler) -> tuple[dict, bool, torch.Tensor]:
    """Clipped policy loss (+ KL in the loss, entropy bonus) of one micro-batch, backward.
    Returns its stats, whether the loss was non-finite, and its token-summed approx-KL."""
    with autocast():
        logprobs, entropy = policy_forward(actor, part.sequences, part.attention_mask, part.response_len,
                                           1.0 if args.greedy else args.temperature, with_entropy=args.entropy_coef > 0)
        pg_loss, pg_stats = policy_loss(logprobs, part.old_logprobs, part.advantages, part.response_mask, args.clip_epsilon)
        loss = pg_loss * scale
        if args.kl_placement == "loss":
            kl = masked_mean(kl_penalty(logprobs, part.ref_logprobs, args.kl_estimator), part.response_mask)
            loss = loss + kl_coef * kl * scale
        if args.entropy_coef > 0:
            loss = loss - args.entropy_coef * masked_mean(entropy, part.response_mask) * scale
    (scaler.scale(loss) if scaler else loss).backward()
    stats = {"loss/policy": pg_loss.item(), "ppo/clipfrac": pg_stats["clipfrac"], "ppo/ratio": pg_stats["ratio"]}
    return stats, not bool(torch.isfinite(loss)), pg_stats["approx_kl"] * part.response_mask.sum()


def _critic_backward(args, critic, part: Rollout, scale: torch.Tensor, autocast, scaler) -> tuple[dict, bool, None]:
    """Clipped value loss of one micro-batch, backward. Returns its stats and whether it was non-finite."""
    with autocast():
        values = critic_forward(critic, part.sequences, part.attention_mask, part.response_len)
        v_loss, v_stats = value_loss(values, part.values, part.returns, part.response_mask, args.cliprange_value or None)
        loss = args.vf_coef * v_loss * scale
    (scaler.scale(loss) if scaler else loss).backward()
    return {"loss/value": v_loss.item(), "value/clipfrac": v_stats["value_clipfrac"]}, not bool(torch.isfinite(loss)), None


def _append(stats: dict, new: dict) -> None:
    for k, v in new.items():
        stats.setdefault(k, []).append(float(v))


def _zero_grads(optims: dict) -> None:
    for o in optims.values():
        o.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _no_sync(*models):
    with contextlib.ExitStack() as stack:
        for m in models:
            if isinstance(m, DDP) or hasattr(m, "no_sync"):
                stack.enter_context(m.no_sync())
        yield


# --------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    validate_args(args)
    info = D.init_distributed(args.device)
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    try:
        check_parallel_update(args.parallel_update, info.device, info.enabled)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    # Same seed + flags -> same run on CPU; each rank samples differently.
    random.seed(args.seed + info.rank)
    np.random.seed(args.seed + info.rank)
    torch.manual_seed(args.seed + info.rank)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if info.device.type == "cuda" else "float32"
    dtype = DTYPES[args.dtype]
    low_frozen = args.frozen_low_precision if args.frozen_low_precision >= 0 else int(info.device.type == "cuda")
    frozen_dtype = dtype if low_frozen else torch.float32
    amp = dtype != torch.float32

    def autocast():
        return torch.autocast(device_type=info.device.type, dtype=dtype) if amp else contextlib.nullcontext()

    # ---- models: actor, reference, critic, old actor, reward model
    try:
        actor, tok, ref, critic, old_actor, rm_scorer = build_models(args, info.device, frozen_dtype)
        weights = actor_weights_path(args)
        custom_fns = {spec.split(":")[-1]: load_reward_fn(spec) for spec in args.reward_fn}
        records, n_bad = read_rlaif_jsonl(args.data_path, skip_bad_lines=bool(args.skip_bad_lines))
    except (WeightsError, DataError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}")
    kl_ctl = AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon) if args.adaptive_kl else FixedKLController(args.kl_coef)

    try:  # e.g. an --actor_path tokenizer without a chat template: one line, not a traceback
        ds = RLAIFDataset(records, tok, max_prompt_len=args.max_seq_len, thinking_ratio=args.thinking_ratio,
                          system_prompt_ratio=args.system_prompt_ratio, seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    steps_per_epoch = len(ds) // (args.batch_size * info.world_size)
    if steps_per_epoch == 0:
        raise SystemExit(f"error: --data_path has {len(ds)} prompts, fewer than one global batch "
                         f"({args.batch_size} x {info.world_size} processes)")
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)

    optims, scheds = build_optimizers(args, actor, critic, total_steps)
    scaler = torch.amp.GradScaler(info.device.type) if dtype == torch.float16 else None

    # ---- resume: weights, optimizers, schedulers, KL controller, position in the data, RNG
    prefix = ckpt.resume_prefix(args.save_weight, args.hidden_size, bool(args.use_moe))
    run_dir = Path(args.run_dir or f"runs/{args.save_weight}_{args.hidden_size}{'_moe' if args.use_moe else ''}")
    flags = vars(args).copy()
    resumed = None
    if args.from_resume:
        trainables = dict(actor=actor, critic=critic, optims=optims, scheds=scheds, kl_ctl=kl_ctl, old_actor=old_actor, scaler=scaler)
        try:
            resumed = ckpt.resume_run(args.checkpoint_dir, args.save_weight, prefix, flags, trainables,
                                      check_inputs=bool(args.resume_check_inputs), seed=args.seed, rank=info.rank,
                                      world_size=info.world_size, say=print if info.is_main else (lambda m: None))
        except ckpt.ResumeError as e:
            raise SystemExit(f"error: {e}")
    step, epoch, consumed, nonfinite_run = (resumed.step, resumed.epoch, resumed.consumed, resumed.nonfinite_run) if resumed else (0, 0, 0, 0)

    # ---- DDP: only the trained models are wrapped; generation uses the unwrapped module.
    actor_train, critic_train = actor, critic
    if info.enabled:
        ddp_kw = dict(device_ids=[info.device.index] if info.device.type == "cuda" else None,
                      find_unused_parameters=bool(args.use_moe))
        actor_train, critic_train = DDP(actor, **ddp_kw), DDP(critic, **ddp_kw)
    if args.use_compile:
        actor_train, critic_train = torch.compile(actor_train), torch.compile(critic_train)
    # HF chat models may stop on several ids (tokenizer EOS + generation_config.eos_token_id).
    models = {"actor": actor, "critic": critic, "ref": ref, "old_actor": old_actor, "kl_ctl": kl_ctl,
              "eos_ids": eos_token_ids(actor, tok),
              "actor_train": actor_train, "critic_train": critic_train}

    logger = RunLogger(run_dir=run_dir, enabled=info.is_main,
                       swanlab_mode="disabled" if not args.use_wandb else args.swanlab_mode,
                       project=args.wandb_project, experiment_name=f"{args.save_weight}_{args.hidden_size}",
                       config=flags, total_steps=total_steps, start_step=step, resume_id=resumed.swanlab_id if resumed else None)
    provenance = None
    if info.is_main:
        if resumed:
            provenance = append_resume_record(run_dir, resumed.record)
            if resumed.changed_inputs:  # accepted with --resume_check_inputs 0: later resumes check the new bytes
                provenance = rehash_inputs(run_dir, resumed.changed_inputs)
        else:
            provenance = write_run_json(run_dir, args=flags, world_size=info.world_size, device=str(info.device),
                                        seed=args.seed, data_path=args.data_path,
                                        weight_paths=[str(p) for p in (weights, args.actor_path, args.reward_model_path) if p and Path(p).exists()])
        if n_bad:
            logger.info(f"skipped {n_bad} malformed lines in {args.data_path}")
        n_params = sum(p.numel() for p in actor.parameters())
        logger.info(f"actor {n_params / 1e6:.2f}M params | {len(ds)} prompts | {total_steps} steps x {args.batch_size * info.world_size} "
                    f"prompts | device {info.device} x{info.world_size} | dtype {args.dtype} | run dir {run_dir}")

    def save() -> None:
        rngs = D.all_gather_objects(ckpt.capture_rng_state(), info)
        if not info.is_main:
            return
        if args.actor_path:
            getattr(actor, "module", actor).save_pretrained(Path(args.save_dir) / f"{args.save_weight}_hf")
            tok.save_pretrained(Path(args.save_dir) / f"{args.save_weight}_hf")
        else:
            save_native_weights(actor, native_weight_path(args.save_dir, args.save_weight, args.hidden_size, bool(args.use_moe)))
        state = ckpt.training_state(actor=actor, critic=critic, optims=optims, scheds=scheds, kl_ctl=kl_ctl,
                                    old_actor=old_actor, scaler=scaler)
        state.update(step=step, epoch=epoch, consumed=consumed, nonfinite_run=nonfinite_run, rng=rngs,
                     world_size=info.world_size, args=flags, swanlab_id=logger.id, run=provenance or {})
        ckpt.save_resume(state, args.checkpoint_dir, prefix, step, args.keep_checkpoints)

    # ---- the loop
    if resumed:  # after start-up code that draws random numbers (swanlab.init uses `random`)
        ckpt.restore_rng_state(resumed.rng)
    done = step >= total_steps
    while not done and epoch < args.epochs:
        for idx in shard_batches(len(ds), args.seed, epoch, consumed, info.rank, info.world_size, args.batch_size):
            batch = collate_left_pad([ds[i] for i in idx], pad_id=tok.pad_token_id)
            if old_actor is not None and step % args.update_old_actor_freq == 0:
                old_actor.load_state_dict(actor.state_dict())  # MiniMind's scheme: refresh the frozen copy
            t_start = time.perf_counter()
            ro, metrics, samples = make_experience(args, batch, models, tok, rm_scorer, custom_fns, kl_ctl, info, autocast)
            t_upd = time.perf_counter()
            metrics.update(ppo_update(args, ro, models, optims, scheds, step, info, autocast, scaler))
            metrics["time/update"] = time.perf_counter() - t_upd
            metrics["time/step"] = time.perf_counter() - t_start
            metrics["lr/actor"] = optims["actor"].param_groups[0]["lr"]
            metrics["lr/critic"] = optims["critic"].param_groups[0]["lr"]
            # Reduce first: the adaptive KL controller must see the global kl_ref, or each rank
            # steers its own coefficient and the ranks (and the resume file) disagree.
            metrics = D.reduce_mean(metrics, info, weights=ro.extras["metric_weights"])
            if not metrics["nonfinite"]:
                kl_ctl.update(metrics["kl_ref"], args.batch_size * args.num_generations * info.world_size)
            nonfinite_run = nonfinite_run + 1 if metrics["nonfinite"] else 0
            metrics["tokens_per_s"] = metrics.pop("tokens_generated") * info.world_size / max(metrics["time/step"], 1e-9)
            step += 1
            consumed += args.batch_size * info.world_size
            if step % args.log_interval == 0 or step == total_steps:
                logger.log(metrics, step)
            if info.is_main and args.sample_interval and (step % args.sample_interval == 0 or step == 1):
                logger.log_samples(samples, step)
            if nonfinite_run >= args.max_nonfinite:
                logger.info(f"stopping: {nonfinite_run} non-finite steps in a row (no optimizer step was taken for them); "
                            f"the last good checkpoint in {args.checkpoint_dir}/ is intact. Lower --learning_rate or check --reward_fn.")
                if info.is_main:
                    mark_run_end(run_dir, "stopped: non-finite")
                logger.finish(plots=False, state="aborted")
                D.cleanup(info)
                raise SystemExit(2)
            done = step >= total_steps
            if step % args.save_interval == 0 or done:
                save()
            if done:
                break
        else:
            epoch, consumed = epoch + 1, 0
    if info.is_main:
        mark_run_end(run_dir, "finished")
        out = (Path(args.save_dir) / f"{args.save_weight}_hf") if args.actor_path else native_weight_path(args.save_dir, args.save_weight, args.hidden_size, bool(args.use_moe))
        logger.info(f"done: {step} steps; policy saved to {out}; metrics in {run_dir}/metrics.jsonl")
    logger.finish()
    D.cleanup(info)


if __name__ == "__main__":
    main()
