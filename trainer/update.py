"""The mechanics of one PPO minibatch: forward/backward in --accumulation_steps micro-batches (DDP
gradient sync on the last one only, actor and critic side by side with --parallel_update), the
clipped losses of trainer/ppo.py, and the optimizer step with its non-finite guard. train_ppo.ppo_update
loops over epochs and minibatches and takes the decisions (early stop, skips) on every rank together."""

from __future__ import annotations

import argparse
import contextlib
import functools

import numpy as np
import torch

from trainer.ppo import aggregate_loss, kl_penalty, policy_loss, value_loss
from trainer.rollout import Rollout, critic_forward, policy_forward
from trainer.run import distributed as D
from trainer.run.parallel import run_side_by_side
from trainer.run.setup import Models, Optim, Settings, on
from trainer.run.timing import PhaseTimer


def minibatch_backward(args: argparse.Namespace, ro: Rollout, mb: torch.Tensor, m: Models, opt: Optim, s: Settings, train_actor: bool,
                        kl_coef: float, stats: dict, timer: PhaseTimer) -> tuple[bool, float]:
    """Gradients of one minibatch, summed over --accumulation_steps micro-batches. Returns whether a
    loss was non-finite and the minibatch's approx-KL (token mean over every rank)."""
    # Losses are token sums over the GLOBAL token count of the minibatch (row sums over the global row
    # count for the per-sequence --loss_agg_mode), so DDP's gradient mean equals the single-process
    # mean whatever each rank's share of tokens.
    n_tokens = D.sum_global(ro.response_mask[mb].sum(), s.info).clamp(min=1)
    per_token = args.loss_agg_mode == "token_mean"
    n_rows = len(mb) * s.info.world_size  # every rank's minibatch has the same number of rows
    approx_kl_sum = torch.zeros((), device=s.device)
    bad = torch.zeros((), dtype=torch.bool, device=s.device)
    for k, ub in enumerate(mb.split(args.mini_batch_size // args.accumulation_steps)):
        part = ro.index(ub)
        sync = k == args.accumulation_steps - 1  # DDP all-reduces gradients on the last micro-batch only
        ctx = contextlib.nullcontext() if sync or not s.info.enabled else D.no_sync(m.actor_train, m.critic_train)
        scale = part.response_mask.sum() / n_tokens * s.info.world_size
        pg_scale = scale if per_token else len(ub) / n_rows * s.info.world_size  # this micro-batch's share of rows
        # Actor and critic share no parameters, so each loss gets its own backward: only one
        # graph's activations are alive at a time (the peak-memory term at 512x8), same gradients;
        # with --parallel_update they run side by side on two cores (two graphs alive).
        parts = []
        if m.critic_train is not None:
            parts.append(functools.partial(critic_backward, args, m.critic_train, part, scale, s, opt.scaler, timer))
        if train_actor:
            # A critic graph kept from scoring (Settings.reuse_values) goes first, so it is freed before the actor's.
            at = len(parts) if part.values_with_grad is not None else 0
            parts.insert(at, functools.partial(actor_backward, args, m.actor_train, part, pg_scale, kl_coef, s, opt.scaler, timer))
        with ctx:
            for part_stats, part_bad, kl_sum in run_side_by_side(parts, s.parallel_update):
                for key, v in part_stats.items():
                    stats.setdefault(key, []).append(v)
                bad = bad | part_bad
                if kl_sum is not None:
                    approx_kl_sum += kl_sum
    # The minibatch's one host sync: its verdict and approx-KL, read together.
    bad, approx_kl = torch.stack([bad.float(), D.sum_global(approx_kl_sum, s.info) / n_tokens]).tolist()
    return bool(bad), approx_kl


def actor_backward(args, actor, part: Rollout, scale: torch.Tensor | float, kl_coef: float, s: Settings, scaler,
                    timer: PhaseTimer) -> tuple[dict, bool, torch.Tensor]:
    """Clipped policy loss (+ KL in the loss, entropy bonus) of one micro-batch, backward.
    Returns its stats, whether the loss was non-finite, and its token-summed approx-KL."""
    with s.autocast():
        with timer("update_actor_fwd"):
            logprobs, entropy = policy_forward(actor, part.sequences, part.attention_mask, part.response_len,
                                               s.sample_temperature, with_entropy=args.entropy_coef > 0)
        agg = functools.partial(aggregate_loss, response_mask=part.response_mask, mode=args.loss_agg_mode, max_len=args.max_gen_len)
        pg_loss, pg_stats = policy_loss(logprobs, part.old_logprobs, part.advantages, part.response_mask, args.clip_epsilon,
                                        s.clip_epsilon_high, args.loss_agg_mode, args.max_gen_len)
        loss = pg_loss * scale
        if s.kl_placement == "loss":
            kl = agg(kl_penalty(logprobs, part.ref_logprobs, s.kl_estimator))
            loss = loss + kl_coef * kl * scale
        if args.entropy_coef > 0:
            loss = loss - args.entropy_coef * agg(entropy) * scale
    scaler.scale(loss).backward()
    stats = {"loss/policy": pg_loss.detach(), "ppo/clipfrac": pg_stats["clipfrac"], "ppo/ratio": pg_stats["ratio"]}
    return stats, ~torch.isfinite(loss.detach()), pg_stats["approx_kl"] * part.response_mask.sum()


def critic_backward(args, critic, part: Rollout, scale: torch.Tensor, s: Settings, scaler,
                    timer: PhaseTimer) -> tuple[dict, torch.Tensor, None]:
    """Clipped value loss of one micro-batch, backward. Returns its stats and whether it was non-finite."""
    dev = s.critic_device  # the critic may live on its own device (--critic_device): its tensors go there
    sequences, attention_mask, old_values, returns, mask, scale = on(dev, part.sequences, part.attention_mask, part.values,
                                                                     part.returns, part.response_mask, scale)
    with s.autocast(dev):
        if part.values_with_grad is not None:  # the scoring forward's graph (one epoch, one minibatch): no second forward
            values = part.values_with_grad
        else:
            with timer("update_critic_fwd"):
                values = critic_forward(critic, sequences, attention_mask, part.response_len)
        v_loss, v_stats = value_loss(values, old_values, returns, mask, args.cliprange_value or None)
        loss = args.vf_coef * v_loss * scale
    scaler.scale(loss).backward()
    stats = {"loss/value": v_loss.detach().to(s.device), "value/clipfrac": v_stats["value_clipfrac"].to(s.device)}
    return stats, ~torch.isfinite(loss.detach()).to(s.device), None


def optimizer_step(opt: Optim, trained: dict[str, torch.nn.Module], grad_clip: float, stats: dict,
                   info: D.DistInfo) -> bool:
    """Clip each trained model's gradients (logging the pre-clip norm) and step its optimizer. False, with
    no step taken on any rank, when a gradient norm is NaN/inf: a loss can be finite while its gradient is
    not, and one such step makes every weight NaN. fp16's scaler skips overflowing steps itself."""
    norms = []
    for name, model in trained.items():
        opt.scaler.unscale_(opt.optims[name])
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip).to(info.device))
    norms = torch.stack(norms).tolist()  # one host sync for both models
    for name, norm in zip(trained, norms):
        stats.setdefault(f"grad_norm/{name}", []).append(norm)
    if not opt.scaler.is_enabled() and D.any_rank(not all(map(np.isfinite, norms)), info):
        opt.zero_grad()
        return False
    for name in trained:
        opt.scaler.step(opt.optims[name])
    opt.scaler.update()
    opt.zero_grad()
    return True
