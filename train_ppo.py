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
Where things live: the math in trainer/ppo.py, sampling and scoring forwards in trainer/rollout.py,
reward components in trainer/rewards.py, one minibatch's forward/backward and optimizer step in
trainer/update.py; how a run is built, resumed, saved, logged and spread over
ranks in trainer/run/ (setup.py, lifecycle.py, checkpoint.py, distributed.py, ...).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from trainer.ppo import compute_gae, compute_token_rewards, explained_variance, kl_penalty, masked_whiten  # noqa: E402
from trainer.rewards import RewardFnError, compute_rewards  # noqa: E402
from trainer.rollout import Rollout, attention_implementation, critic_forward, forward_in_row_chunks, generate_rollout  # noqa: E402
from trainer.rollout import policy_forward, rollout_metrics  # noqa: E402
from trainer.run import distributed as D  # noqa: E402
from trainer.run.lifecycle import Run  # noqa: E402
from trainer.run.setup import DTYPES, Models, Optim, Settings, on, setup  # noqa: E402
from trainer.run.timing import PhaseTimer  # noqa: E402
from trainer.update import minibatch_backward, optimizer_step  # noqa: E402


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
      help="with no old-actor copy, old_logprobs come from the sampling pass itself instead of a second forward "
           "(fp32: equal to ~1e-6; bf16: ~2e-3 nats apart, no clipping on it; the second forward costs ~9%% of a step: "
           "scripts/measure_logprob_gap.py, README)")
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
      help="autocast dtype (CPU and CUDA; log-probs stay fp32). auto = bfloat16 on CUDA; on a CPU bfloat16 only "
           "for models from 5M layer weights (e.g. 256x8, 512x8, 768x16) on a CPU with native bf16 (AMX or AVX512-BF16), "
           "else float32 (README \"Speed and memory\")")
    a("--ref_device", default="", help="device of the frozen reference (e.g. cuda:1 beside the actor on cuda:0); default: the actor's")
    a("--critic_device", default="", help="device of the critic (trained there; tensors move where they meet); default: the actor's")
    a("--reward_device", default="", help="device of the reward model; default: the actor's")
    a("--frozen_low_precision", type=int, default=-1, choices=[-1, 0, 1],
      help="hold reference/RM/old actor in --dtype; -1 = where --dtype auto picks bf16 (CUDA; large models on a "
           "CPU with native bf16)")
    a("--use_compile", type=int, default=0, choices=[0, 1])
    a("--train_attn_implementation", default="auto", choices=["auto", "eager", "sdpa"],
      help="attention kernel of the update's forward/backward (sampling and scoring keep the model's own); "
           "auto = eager under bf16 on CPU (update 1.85 vs 2.31 s at 512x8, scripts/bench_ppo.py; in fp32 sdpa "
           "was faster, 3.15 vs 3.55 s), else the model's own")
    a("--forward_batch_size", type=int, default=0,
      help="rows per scoring forward (old/ref log-probs, critic values); 0 = all batch_size x num_generations rows "
           "at once. Lower it when [rows, response_len, vocab] logits do not fit in memory")
    a("--num_threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    a("--parallel_update", type=int, default=-1, choices=[-1, 0, 1],
      help="actor and critic forward/backward side by side, one CPU core each, instead of one after the other "
           "on all cores (512x8 bf16 update ~2.0 -> ~1.7 s on 2 cores, peak RSS +~450 MB: both graphs are alive "
           "at once); -1 = on for single-process CPU runs under bf16 with >= 2 threads")
    a("--seed", type=int, default=42)
    a("--deterministic", type=int, default=0, choices=[0, 1],
      help="torch's deterministic algorithms and a fixed cuBLAS workspace: exact repeats on GPU too, slower "
           "(CPU runs repeat exactly without it)")
    a("--ddp_timeout", type=int, default=1800,
      help="seconds a collective waits for a missing rank before the run fails (NCCL waits this long for a dead peer)")
    a = p.add_argument_group("output").add_argument
    a("--save_dir", default="out", help="where weights are read (--from_weight) and written")
    a("--save_weight", default="ppo_actor", help="output name: <save_dir>/<save_weight>_<hidden>.pth")
    a("--save_interval", type=int, default=50, help="PPO steps between saves")
    a("--checkpoint_dir", default="checkpoints")
    a("--keep_checkpoints", type=int, default=2)
    a("--from_resume", type=int, default=0, choices=[0, 1, 2],
      help="1: continue from the newest resume file (an error if there is none); 2: continue if there is one, "
           "else start (preemptible jobs); 0: a new run (refused where another run left resume files)")
    a("--resume_check_inputs", type=int, default=1, choices=[0, 1],
      help="refuse to resume if the starting weights, reward model or prompts changed since the run began (sha256s in run.json)")
    a("--run_dir", default=None, help="metrics.jsonl, run.json, plots (default runs/<save_weight>_<hidden>)")
    a("--log_interval", type=int, default=1)
    a("--sample_interval", type=int, default=10, help="log a table of sample generations every N steps")
    a = p.add_argument_group("MiniMind compatibility (accepted so MiniMind command lines run)").add_argument
    a("--rollout_engine", default="torch", choices=["torch", "sglang"], help="torch: sampling in-process (sglang: not supported)")
    a("--sglang_base_url", default=None, help="accepted; used only with --rollout_engine sglang (not supported)")
    a("--sglang_model_path", default=None, help="accepted; as above")
    a("--sglang_shared_path", default=None, help="accepted; as above")
    a("--debug_mode", type=int, nargs="?", const=1, default=0, help="1: the sample table every --debug_interval steps")
    a("--debug_interval", type=int, default=20)
    a("--debug_log_ratio", type=int, nargs="?", const=1, default=0,
      help="accepted: the first-minibatch ratio and approx-KL MiniMind prints are logged every step (ppo/ratio, ppo/approx_kl)")
    a("--swanlab_mode", default="local", choices=["local", "offline", "cloud", "disabled"])
    a("--use_wandb", type=int, default=1, choices=[0, 1], help="MiniMind's name for 'log to SwanLab' (0 = disabled)")
    a("--wandb_project", default="minippo", help="swanlab project")
    a("--suppress_eos", type=int, default=0, choices=[0, 1], help=argparse.SUPPRESS)  # benchmarks: fixed lengths
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------- steps 1-4
@dataclass
class Experience:
    """Steps 1-4 of one PPO step: the rollout with everything the update needs, and what to log."""

    rollout: Rollout
    metrics: dict[str, float]
    metric_weights: dict[str, float]  # what each per-rank metric is a mean over (for DDP's global mean)
    samples: list[dict]  # a few rows for the sample table


@torch.no_grad()
def make_experience(args: argparse.Namespace, batch: dict, m: Models, s: Settings, kl_coef: float,
                    custom_fns: dict, timer: PhaseTimer | None = None) -> Experience:
    """Rollout, score, reward, advantages for one batch of prompts."""
    timer = timer or PhaseTimer()
    # Steps 1-3 are rank-local: a failure on some ranks only (reward function, reward model, OOM) stops
    # every rank here with its line, before the collectives of step 4.
    with D.failing_together(s.info):
        with timer("generate"), s.autocast():  # 1. rollout: [B*N, P+R] sequences, N = --num_generations
            ro = generate_rollout(
                m.actor, batch["input_ids"].to(s.device), batch["attention_mask"].to(s.device), max_new_tokens=args.max_gen_len,
                eos_token_id=m.eos_ids or m.tok.eos_token_id, pad_token_id=m.tok.pad_token_id, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, greedy=bool(args.greedy), suppress_eos=bool(args.suppress_eos),
                num_generations=args.num_generations, return_logprobs=bool(args.rollout_logprobs) and m.old_actor is None,
                fast_decode=bool(args.fast_decode),
            )
        R, temp = ro.response_len, s.sample_temperature
        with timer("score"):
            with s.autocast():  # 2. score: log-probs under the temperature-scaled distribution that sampled (fp32 softmax)
                entropy, rows = ro.entropy, args.forward_batch_size  # rows per scoring forward (0 = all at once)
                if ro.old_logprobs is None:  # a frozen old actor, or --rollout_logprobs 0: score the samples again,
                    scorer = m.old_actor or m.actor  # with the update's attention kernel: the first ratio is then exactly 1
                    with timer("score_old"), attention_implementation(s.train_attn, scorer):
                        ro.old_logprobs, entropy = forward_in_row_chunks(policy_forward, scorer, ro.sequences, ro.attention_mask,
                                                                         R, temp, with_entropy=True, rows=rows)
                with timer("score_ref"), s.autocast(s.ref_device):
                    ref_logprobs, _ = forward_in_row_chunks(policy_forward, m.ref, *on(s.ref_device, ro.sequences, ro.attention_mask),
                                                            R, temp, rows=rows)
                    ro.ref_logprobs = ref_logprobs.to(s.device)  # [B, R]
                with timer("score_critic"), s.autocast(s.critic_device):
                    values = forward_in_row_chunks(critic_forward, m.critic, *on(s.critic_device, ro.sequences, ro.attention_mask),
                                                   R, rows=rows)
                    ro.values = values.float().to(s.device)  # [B, R]
            with timer("score_reward"):  # 3. reward
                responses, comps = score_responses(args, batch, ro, m, custom_fns, timer)
    compute_advantages(args, ro, kl_coef, s)  # 4. advantages
    metrics, weights = rollout_metrics(ro, comps, entropy, kl_coef, args.num_generations)
    samples = [{"prompt": batch["prompt"][i // args.num_generations][-200:], "response": responses[i],
                "reward": ro.rewards[i].item(), **{k: v[i].item() for k, v in comps.items()}}
               for i in range(min(4, len(responses)))]
    return Experience(ro, metrics, weights, samples)


def score_responses(args: argparse.Namespace, batch: dict, ro: Rollout, m: Models, custom_fns: dict,
                    timer: PhaseTimer) -> tuple[list[str], dict]:
    """Sets ro.rewards [B] (the weighted total); returns the decoded responses and each component [B].
    Rewards see the full assistant reply: the prefix the chat template forced + the decoded response."""
    rep = args.num_generations
    expand = lambda xs: [x for x in xs for _ in range(rep)]  # prompt i's samples are rows i*N .. i*N+N-1
    tokens, mask = ro.sequences[:, -ro.response_len:].tolist(), ro.response_mask.bool().tolist()  # one copy, not two per row
    responses = [m.tok.decode([t for t, keep in zip(row, k) if keep], skip_special_tokens=True) for row, k in zip(tokens, mask)]
    replies = [p + r for p, r in zip(expand(batch["assistant_prefix"]), responses)]
    weights = {"format": args.format_weight, "tags": args.tag_weight, "rm": args.rm_weight,
               "accuracy": args.accuracy_weight, "eos": args.eos_penalty}
    try:
        rewards, comps = compute_rewards(
            prompts=expand(batch["prompt"]), messages=expand(batch["messages"]), replies=replies,
            references=expand(batch["reference"]), has_eos=ro.has_eos.tolist(), weights=weights,
            rm=m.rm_scorer if args.rm_weight else None, reasoning=bool(args.reasoning), custom_fns=custom_fns, timer=timer,
        )
    except RewardFnError as e:  # the user's function, the user's to fix: one line, not a traceback
        raise SystemExit(f"error: {e}") from None
    ro.rewards = rewards.to(ro.sequences.device)
    return responses, comps


def compute_advantages(args: argparse.Namespace, ro: Rollout, kl_coef: float, s: Settings) -> None:
    """Sets ro.advantages and ro.returns [B, R]: per-token KL penalty (if in the reward) + the score on
    the last token, GAE, whitening over every rank's tokens."""
    kl = kl_penalty(ro.old_logprobs, ro.ref_logprobs, args.kl_estimator)  # [B, R]
    ro.rewards_finite = bool(torch.isfinite(ro.rewards).all())  # a non-finite step is skipped by the update
    scores = torch.nan_to_num(ro.rewards, nan=0.0, posinf=0.0, neginf=0.0)
    token_rewards = compute_token_rewards(scores, kl if args.kl_placement == "reward" else None, ro.response_mask, kl_coef)
    ro.advantages, ro.returns = compute_gae(token_rewards, ro.values, ro.response_mask, args.gamma, args.lam)
    if args.whiten_advantages:
        ro.advantages = masked_whiten(ro.advantages, ro.response_mask, reduce=D.rank_sum(s.info))


# --------------------------------------------------------------------------------------- step 5
def ppo_update(args: argparse.Namespace, ro: Rollout, m: Models, opt: Optim, step: int, s: Settings, kl_coef: float,
               timer: PhaseTimer | None = None) -> dict[str, float]:
    """`--ppo_update_iters` epochs over shuffled minibatches; one optimizer step per minibatch."""
    timer = timer or PhaseTimer()
    train_actor = step >= args.critic_warmup_steps
    g = torch.Generator().manual_seed(args.seed * 7919 + step * 31 + s.info.rank)
    stats: dict[str, list] = {}  # per minibatch: floats, or 0-d tensors still on the device
    stopped_early = nonfinite = False
    with attention_implementation(s.train_attn, m.actor_train, m.critic_train):
        for _ in range(args.ppo_update_iters):
            for mb in torch.randperm(ro.sequences.shape[0], generator=g).split(args.mini_batch_size):
                bad, approx_kl = minibatch_backward(args, ro, mb, m, opt, s, train_actor, kl_coef, stats, timer)
                stats.setdefault("ppo/approx_kl", []).append(approx_kl)
                # Decisions taken together on every rank, before any optimizer moves.
                if D.any_rank(bad or not ro.rewards_finite, s.info):
                    nonfinite = True
                    opt.zero_grad()
                    break
                if train_actor and args.early_stop_kl > 0 and D.any_rank(approx_kl > args.early_stop_kl, s.info):
                    stopped_early = True
                    opt.zero_grad()  # the minibatch that crossed the limit does not step
                    break
                with timer("update_optimizer"):  # clip, then step unless a gradient norm is NaN/inf (skipped, counted)
                    trained = {"actor": m.actor_train, "critic": m.critic_train} if train_actor else {"critic": m.critic_train}
                    if not optimizer_step(opt, trained, args.grad_clip, stats, s.info):
                        nonfinite = True
                        break
            if stopped_early or nonfinite:
                break
    for sched in opt.scheds.values():
        sched.step()
    as_t = lambda x: torch.as_tensor(x, dtype=torch.float64, device=s.device)  # noqa: E731
    means = torch.stack([torch.stack([as_t(x) for x in v]).mean() for v in stats.values()])
    out = dict(zip(stats, means.tolist()))  # the step's stats, read from the device once
    out["ppo/early_stopped"] = float(stopped_early)
    out["nonfinite"] = float(nonfinite)
    out["value/explained_var"] = explained_variance(ro.values, ro.returns, ro.response_mask, reduce=D.rank_sum(s.info))
    return out


# --------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    built = setup(args)  # torchrun's ranks, threads, seeds, models, data, optimizers, DDP
    s, m, opt, kl_ctl = built.settings, built.models, built.optim, built.kl_ctl
    with Run(args, built) as run:  # resume, run.json, logger; marks the run's end however it ends
        for batch in run.batches():
            if m.old_actor is not None and run.step % args.update_old_actor_freq == 0:
                m.old_actor.load_state_dict(m.actor.state_dict())  # MiniMind's scheme: refresh the frozen copy
            timer = PhaseTimer()
            with timer("step"):
                exp = make_experience(args, batch, m, s, kl_ctl.value, built.custom_fns, timer)  # steps 1-4
                with timer("update"):
                    stats = ppo_update(args, exp.rollout, m, opt, run.step, s, kl_ctl.value, timer)  # step 5
            times = {f"time/{k}": v for k, v in timer.wall.items()
                     if k in ("generate", "score", "update", "step") or k.startswith("reward/")}
            metrics = {**exp.metrics, **stats, **times,
                       "lr/actor": opt.optims["actor"].param_groups[0]["lr"], "lr/critic": opt.optims["critic"].param_groups[0]["lr"]}
            # Reduce first: the adaptive KL controller must see the global kl_ref, or each rank
            # steers its own coefficient and the ranks (and the resume file) disagree.
            metrics = D.reduce_mean(metrics, s.info, weights=exp.metric_weights)
            if not metrics["nonfinite"]:
                kl_ctl.update(metrics["kl_ref"], args.batch_size * args.num_generations * s.info.world_size)
            run.end_step(metrics, exp.samples)  # 6. log; checkpoint every --save_interval steps
        run.finish()


if __name__ == "__main__":
    D.exit_after(main)
