"""Step 5, the whole PPO update in one place: --ppo_update_iters epochs over shuffled minibatches; per
minibatch the forward/backward in --accumulation_steps micro-batches (DDP's gradient sync on the last
one only, actor and critic side by side with --parallel_update), the registered policy loss and the
clipped value loss of trainer/ppo.py, the decisions every rank takes together (a non-finite loss, the
early stop on approx-KL), and the optimizer step with its non-finite guard. Below `ppo_update` every function reads
the update's own section (trainer/sections.py UpdateConfig: `cfg.update`, the loss and optimizer sections nested).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import numpy as np
import torch

from model.forward import attention_implementation, critic_forward, policy_forward
from trainer import dist as D
from trainer.config import Config
from trainer.parallel import run_side_by_side
from trainer.ppo import aggregate_loss, explained_variance, kl_penalty, response_rows, value_loss
from trainer.registry import policy_loss_spec
from trainer.rollout import Rollout
from trainer.runtime import Models, Optim, Phase, Runtime, on
from trainer.sections import UpdateConfig

# Logged as the minibatch's loss, the one its gradient is of: each micro-batch's loss times its share of the
# minibatch's tokens (rows), summed over micro-batches and ranks. So --accumulation_steps and the world size do
# not change the figure; a mean of the micro-batches' own means would (the other ppo/ stats are such means).
SUMMED = ("loss/policy", "loss/value")


def ppo_update(cfg: Config, ro: Rollout, m: Models, opt: Optim, step: int, rt: Runtime, kl_coef: float,
               phase: Phase) -> dict[str, float]:
    """`--ppo_update_iters` epochs over shuffled minibatches of the scored rollout; one optimizer step per
    minibatch. Returns the step's update statistics (means over minibatches)."""
    u = cfg.update
    info = rt.info
    train_actor = step >= u.critic_warmup_steps
    g = torch.Generator().manual_seed(u.seed * 7919 + step * 31 + info.rank)
    stats: dict[str, list] = {}  # per minibatch: floats, or 0-d tensors still on the device
    stopped_early = nonfinite = False
    with attention_implementation(u.train_attn, *[x for x in (m.actor_train, m.critic_train) if x is not None]):
        for _ in range(u.ppo_update_iters):
            for mb in torch.randperm(ro.sequences.shape[0], generator=g).split(u.mini_batch_size):
                bad, approx_kl = minibatch_backward(u, ro, mb, m, opt, rt, train_actor, kl_coef, stats, phase)
                stats.setdefault("ppo/approx_kl", []).append(approx_kl)
                # Decisions taken together on every rank, before any optimizer moves.
                if D.any_rank(bad or not ro.rewards_finite, info):
                    nonfinite = True
                    opt.zero_grad()
                    break
                if train_actor and u.early_stop_kl > 0 and D.any_rank(approx_kl > u.early_stop_kl, info):
                    stopped_early = True
                    opt.zero_grad()  # the minibatch that crossed the limit does not step
                    break
                with phase("update_optimizer", autocast=False):  # clip, then step unless a gradient norm is NaN/inf
                    trained = {"actor": m.actor_train} if train_actor else {}
                    if m.critic_train is not None:
                        trained["critic"] = m.critic_train
                    if not optimizer_step(opt, trained, u.optim.grad_clip, stats, info):
                        nonfinite = True
                        break
            if stopped_early or nonfinite:
                break
    with warnings.catch_warnings():  # the schedule counts PPO steps, skipped updates too (critic warm-up, non-finite)
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")
        for sched in opt.scheds.values():
            sched.step()
    means = torch.stack([torch.stack([torch.as_tensor(x, dtype=torch.float64, device=rt.device) for x in v]).mean()
                         for v in stats.values()])
    out = dict(zip(stats, means.tolist()))  # the step's stats, read from the device once
    out["ppo/early_stopped"] = float(stopped_early)
    out["nonfinite"] = float(nonfinite)
    if m.critic is not None:
        out["value/explained_var"] = explained_variance(ro.values, ro.returns, ro.response_mask, reduce=D.rank_sum(info))
    return out


def minibatch_backward(u: UpdateConfig, ro: Rollout, mb: torch.Tensor, m: Models, opt: Optim, rt: Runtime, train_actor: bool,
                       kl_coef: float, stats: dict, phase: Phase) -> tuple[bool, float]:
    """Gradients of one minibatch, summed over --accumulation_steps micro-batches. Returns whether a
    loss was non-finite and the minibatch's approx-KL (token mean over every rank)."""
    info = rt.info
    # Losses are token sums over the GLOBAL token count of the minibatch (row sums over the global count
    # of rows with a token for the per-sequence --loss_agg_mode: a row with none, masked by --mask_truncated,
    # is no response of the mean), so DDP's gradient mean equals the single-process mean whatever each
    # rank's share of tokens and of masked rows.
    n_tokens = D.sum_global(ro.response_mask[mb].sum(), info).clamp(min=1)
    per_token = u.loss.loss_agg_mode == "token_mean"
    n_rows = None if per_token else D.sum_global(response_rows(ro.response_mask[mb]), info).clamp(min=1)
    approx_kl_sum = torch.zeros((), device=rt.device)
    bad = torch.zeros((), dtype=torch.bool, device=rt.device)
    losses: dict[str, torch.Tensor] = {}  # this rank's shares of the minibatch's losses (SUMMED)
    # Micro-batches of the minibatch's rows in rollout order: a GRPO group's rows stay together, so a padding-free
    # forward runs their shared prompt once (Packing.shared); the minibatch and its gradient are the same either way.
    for k, ub in enumerate(mb.sort().values.split(u.mini_batch_size // u.accumulation_steps)):
        part = ro.index(ub)
        sync = k == u.accumulation_steps - 1  # DDP all-reduces gradients on the last micro-batch only
        ctx = contextlib.nullcontext() if sync or not info.enabled else D.no_sync(m.actor_train, m.critic_train)
        scale = part.response_mask.sum() / n_tokens * info.world_size
        # this micro-batch's share of the rows with a token (its loss is a mean over those)
        pg_scale = scale if per_token else response_rows(part.response_mask) / n_rows * info.world_size
        # Actor and critic share no parameters, so each loss gets its own backward: only one
        # graph's activations are alive at a time (activations set the update's peak memory), same gradients;
        # with --parallel_update they run side by side on two cores (two graphs alive).
        parts = []
        if m.critic_train is not None:
            parts.append(functools.partial(critic_backward, u, m.critic_train, part, scale, rt, opt.scaler, phase))
        if train_actor:
            # A critic graph kept from scoring (--reuse_values) goes first, so it is freed before the actor's.
            at = len(parts) if part.values_with_grad is not None else 0
            parts.insert(at, functools.partial(actor_backward, u, m.actor_train, part, pg_scale, kl_coef, rt, opt.scaler, phase))
        with ctx:
            for part_stats, part_bad, kl_sum in run_side_by_side(parts, bool(u.parallel_update)):
                for key, v in part_stats.items():
                    if key in SUMMED:
                        losses[key] = losses[key] + v if key in losses else v
                    else:
                        stats.setdefault(key, []).append(v)
                bad = bad | part_bad
                if kl_sum is not None:
                    approx_kl_sum += kl_sum
    # The minibatch's one collective and one host sync: its approx-KL and losses summed over ranks, and the verdict.
    keys = list(losses)  # the same on every rank: which models train is the run's, not the rank's
    summed = D.sum_global(torch.stack([approx_kl_sum.float(), *(losses[k].float() for k in keys)]), info)
    bad, approx_kl, *values = torch.cat([bad.float()[None], summed[:1] / n_tokens, summed[1:]]).tolist()
    for key, v in zip(keys, values):
        stats.setdefault(key, []).append(v)
    return bool(bad), approx_kl


def actor_backward(u: UpdateConfig, actor: torch.nn.Module, part: Rollout, scale: torch.Tensor | float, kl_coef: float,
                   rt: Runtime, scaler: torch.amp.GradScaler, phase: Phase) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The registered policy loss (+ KL in the loss, entropy bonus) of one micro-batch, backward.
    Returns its stats, whether the loss was non-finite, and its token-summed approx-KL."""
    with rt.autocast():
        with phase("update_actor_fwd", autocast=False):
            logprobs, entropy = policy_forward(actor, part.sequences, part.attention_mask, part.response_len,
                                               u.sample_temperature, with_entropy=u.entropy_coef > 0,
                                               padding_free=bool(u.padding_free))
        agg = functools.partial(aggregate_loss, response_mask=part.response_mask, mode=u.loss.loss_agg_mode,
                                max_len=u.loss.max_gen_len)
        pg_loss, pg_stats = policy_loss_spec(u.loss.name).fn(logprobs, part.old_logprobs, part.advantages, part.response_mask,
                                                             u.loss, D.comm(rt.info), is_weights=part.is_weights)
        loss = pg_loss * scale
        if u.kl_placement == "loss":
            kl = agg(kl_penalty(logprobs, part.ref_logprobs, u.kl_estimator))
            loss = loss + kl_coef * kl * scale
        if u.entropy_coef > 0:
            loss = loss - u.entropy_coef * agg(entropy) * scale
    scaler.scale(loss).backward()
    # this micro-batch's share of the minibatch's policy loss (summed over micro-batches and ranks: SUMMED)
    share = (pg_loss * scale).detach() / rt.info.world_size
    stats = {"loss/policy": share, **{f"ppo/{k}": v for k, v in pg_stats.items() if k != "approx_kl"}}
    return stats, ~torch.isfinite(loss.detach()), pg_stats["approx_kl"] * part.response_mask.sum()


def critic_backward(u: UpdateConfig, critic: torch.nn.Module, part: Rollout, scale: torch.Tensor, rt: Runtime,
                    scaler: torch.amp.GradScaler, phase: Phase) -> tuple[dict, torch.Tensor, None]:
    """Clipped value loss of one micro-batch, backward. Returns its stats and whether it was non-finite."""
    dev = rt.critic_device  # the critic may live on its own device (--critic_device): its tensors go there
    sequences, attention_mask, old_values, returns, mask, scale = on(dev, part.sequences, part.attention_mask, part.values,
                                                                     part.returns, part.response_mask, scale)
    with rt.autocast(dev):
        if part.values_with_grad is not None:  # the scoring forward's graph (--reuse_values): no second forward
            values = part.values_with_grad
        else:
            with phase("update_critic_fwd", autocast=False):
                values = critic_forward(critic, sequences, attention_mask, part.response_len, padding_free=bool(u.padding_free))
        v_loss, v_stats = value_loss(values, old_values, returns, mask, u.cliprange_value or None)
        loss = u.vf_coef * v_loss * scale
    scaler.scale(loss).backward()
    share = (v_loss * scale).detach().to(rt.device) / rt.info.world_size  # as actor_backward's loss/policy
    stats = {"loss/value": share, "value/clipfrac": v_stats["value_clipfrac"].to(rt.device)}
    return stats, ~torch.isfinite(loss.detach()).to(rt.device), None


def optimizer_step(opt: Optim, trained: dict[str, torch.nn.Module], grad_clip: float, stats: dict,
                   info: D.DistInfo) -> bool:
    """Clip each trained model's gradients (logging the pre-clip norm) and step its optimizer. False, with
    no step taken on any rank, when a gradient norm is NaN/inf: a loss can be finite while its gradient is
    not, and one such step makes every weight NaN. fp16's scaler skips overflowing steps itself."""
    norms = []
    for name, model in trained.items():
        opt.scaler.unscale_(opt.optims[name])
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # sharded: a DTensor, the same on every rank
        norms.append(D.whole(norm).to(info.device))
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
