"""Policy losses, each registered by name with its metadata in POLICY_LOSSES (looked up through trainer/registry.py).

A loss maps the update's `logprobs`, the sampling policy's `old_logprobs`, the `advantages` and the
`response_mask` (all [B, R]), its own settings (`cfg`: trainer/sections.py PolicyLossConfig, the run's `cfg.loss`),
the collectives `comm` (None in one process) and, for an engine's
samples, the rollout importance weights `is_weights` [B, R] (None otherwise: each token's loss is multiplied by
its weight before aggregation; a loss defined per response, GMPO, by the response's mean weight) to
(loss, stats): the loss aggregated by the resolved --loss_agg_mode (the update scales it to the global
token or row count, so N ranks give one process's gradient), stats 0-d tensors (approx_kl, ratio,
clipfrac, and what the loss adds). Every log-ratio is clamped before exp() (trainer/ppo.py: MAX_LOG_RATIO).

Notation: r = pi / pi_old per token, A the advantage, eps = --clip_epsilon, eps_high = --clip_epsilon_high,
sg = stop-gradient. Each is written as the loss to minimise (the papers' objectives negated).

References
- vanilla: Schulman et al. 2017, PPO, eq. (7); clip-higher: Yu et al. 2025, DAPO, sec. 3.1.
- dual_clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL" (arXiv:1912.09729), eq. (5).
- cispo: MiniMax 2025, "MiniMax-M1" (arXiv:2506.13585), sec. 3.1, eq. (4)-(5).
- gspo: Zheng et al. 2025, "Group Sequence Policy Optimization" (Qwen, arXiv:2507.18071), eq. (5)-(7) and
  GSPO-token, eq. (13)-(14).
- gmpo: Zhao et al. 2025, "Geometric-Mean Policy Optimization" (arXiv:2507.20673), eq. (4).
- clip_cov, kl_cov: Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs" (arXiv:2505.22617), sec. 4.
- sapo: Gao et al. 2025, "Soft Adaptive Policy Optimization" (Qwen, arXiv:2511.20347), eq. (5)-(7).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import Tensor

from trainer.ppo import Comm, aggregate_loss, clipped_surrogate, log_ratio_of, masked_mean, ratio_stats, response_rows
from trainer.sections import PolicyLossConfig


class PolicyLossFn(Protocol):
    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor,
                 cfg: PolicyLossConfig, comm: Comm | None = None,
                 is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]: ...


@dataclass(frozen=True)
class PolicyLossSpec:
    name: str
    fn: PolicyLossFn
    estimators: tuple[str, ...] | None  # the advantage estimators it pairs with (None = every one)
    needs_groups: bool
    paper: str
    loss_agg: str  # --loss_agg_mode auto: the paper's aggregation
    agg_fixed: bool  # the loss is defined per sequence: no other --loss_agg_mode
    seq_advantages: bool = False  # needs one advantage per response (equal on its tokens): no KL in the reward,
    #                               no discount (validate refuses what would vary it per token)


# Every policy loss by name: the built-ins below, and any a user's module registers before the command line is read.
POLICY_LOSSES: dict[str, PolicyLossSpec] = {}
_Loss = TypeVar("_Loss", bound=PolicyLossFn)


def register_policy_loss(name: str, *, paper: str, estimators: tuple[str, ...] | None = None, needs_groups: bool = False,
                         loss_agg: str = "token_mean", agg_fixed: bool = False,
                         seq_advantages: bool = False) -> Callable[[_Loss], _Loss]:
    """Register a policy loss under --policy_loss `name` with what the run needs to know about it (verl's
    register_policy_loss, with the metadata verl keeps in if-statements)."""
    def deco(fn: _Loss) -> _Loss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = PolicyLossSpec(name, fn, estimators, needs_groups, paper, loss_agg, agg_fixed, seq_advantages)
        return fn
    return deco


# The estimators that give one advantage per response compared within its group of --num_generations (with the
# KL in the loss and --gamma 1: rloo, opo and reinforce_pp_baseline put it in the reward by default, which makes
# it vary per token; validate refuses that for the seq_advantages losses).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "grpo_passk")


def _agg(token_loss: Tensor, mask: Tensor, cfg: PolicyLossConfig, is_weights: Tensor | None = None) -> Tensor:
    """The resolved --loss_agg_mode of the per-token losses, each first multiplied by its rollout importance weight
    (an engine's samples: trainer/ppo.py rollout_is_weights; verl multiplies its pg_losses the same way)."""
    if is_weights is not None:
        token_loss = _zero(token_loss * is_weights.detach(), mask)
    return aggregate_loss(token_loss, mask, cfg.loss_agg_mode, cfg.max_gen_len)


def _zero(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _inputs(logprobs: Tensor, advantages: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The mask as bool, and log-probs and (detached) advantages with 0 at pads: whatever a pad holds (inf, NaN)
    reaches neither the loss nor, through a product's backward, the gradient."""
    m = response_mask.bool()
    return _zero(logprobs, m), _zero(advantages.detach(), m), m


@register_policy_loss("vanilla", paper="Schulman et al. 2017, PPO, eq. (7); clip-higher: Yu et al. 2025, DAPO, sec. 3.1")
def vanilla(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, cfg: PolicyLossConfig,
            comm: Comm | None = None, is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate: max(-A r, -A clip(r, 1 - eps, 1 + eps_high))."""
    token_loss, stats = clipped_surrogate(logprobs, old_logprobs, advantages, response_mask, cfg.clip_epsilon,
                                          cfg.clip_epsilon_high)
    return _agg(token_loss, response_mask, cfg, is_weights), stats


@register_policy_loss("dual_clip", paper="Ye et al. 2020, Mastering Complex Control in MOBA Games, eq. (5)")
def dual_clip(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, cfg: PolicyLossConfig,
              comm: Comm | None = None, is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's loss, and for A < 0 at most -A c (c = --clip_ratio_c): a token whose ratio grew far past 1 under a
    negative advantage otherwise pushes an unbounded step."""
    logprobs, adv, m = _inputs(logprobs, advantages, response_mask)
    token_loss, stats = clipped_surrogate(logprobs, old_logprobs, adv, m, cfg.clip_epsilon, cfg.clip_epsilon_high)
    cap = -adv * cfg.clip_ratio_c
    dual = (adv < 0) & (token_loss > cap) & m
    token_loss = torch.where(dual, cap, token_loss)
    stats["clipfrac_lower"] = masked_mean(dual.float(), m)
    return _agg(token_loss, m, cfg, is_weights), stats


@register_policy_loss("cispo", paper="MiniMax 2025, MiniMax-M1, sec. 3.1 (CISPO)")
def cispo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, cfg: PolicyLossConfig,
          comm: Comm | None = None, is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE with a clipped, detached importance weight: -sg(min(r, --cispo_max_weight)) A log pi. No token
    is dropped from the gradient (PPO's clip zeroes it), so rare tokens keep learning; the paper bounds only
    the weight's top."""
    logprobs, adv, m = _inputs(logprobs, advantages, response_mask)
    log_ratio = log_ratio_of(logprobs, old_logprobs, m)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=cfg.cispo_max_weight).detach()
    token_loss = _zero(-weight * adv * logprobs, m)
    clipfrac = masked_mean((ratio > cfg.cispo_max_weight).float(), m)
    return _agg(token_loss, m, cfg, is_weights), ratio_stats(log_ratio, ratio, m, clipfrac=clipfrac)


@register_policy_loss("gspo", paper="Zheng et al. 2025, GSPO (Qwen), eq. (5)-(7), (13)-(14)", estimators=GROUP_ESTIMATORS,
                      needs_groups=True, loss_agg="seq_mean_token_mean", seq_advantages=True)
def gspo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, cfg: PolicyLossConfig,
         comm: Comm | None = None, is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The clip on the sequence's ratio s = (pi(y)/pi_old(y))^(1/|y|) = exp(mean_t log r_t) (the length-normalised
    log-ratio), in the GSPO-token form: s_t = sg(s) pi_t / sg(pi_t), whose value is s and whose gradient is s's when
    every token of the response shares its advantage. Clip range [1 - --gspo_clip_low, 1 + --gspo_clip_high]."""
    logprobs, adv, m = _inputs(logprobs, advantages, response_mask)
    log_ratio = log_ratio_of(logprobs, old_logprobs, m)
    seq_log_ratio = masked_mean(log_ratio, m, dim=1)  # [B]
    log_s = (seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()).clamp(max=10.0)
    s = torch.exp(log_s)
    unclipped = -adv * s
    clipped = -adv * s.clamp(1.0 - cfg.gspo_clip_low, 1.0 + cfg.gspo_clip_high)
    token_loss = _zero(torch.maximum(unclipped, clipped), m)
    stats = ratio_stats(log_ratio, torch.exp(log_ratio), m, clipfrac=masked_mean((clipped > unclipped).float(), m),
                        seq_ratio=masked_mean(s, m))
    return _agg(token_loss, m, cfg, is_weights), stats


@register_policy_loss("gmpo", paper="Zhao et al. 2025, Geometric-Mean Policy Optimization, eq. (4)",
                      estimators=GROUP_ESTIMATORS, needs_groups=True, loss_agg="seq_mean_token_mean", agg_fixed=True,
                      seq_advantages=True)
def gmpo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, cfg: PolicyLossConfig,
         comm: Comm | None = None, is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The geometric mean of the token ratios instead of their arithmetic mean: per response
    -A exp(mean_t clip_sgn(log r_t)), where each log-ratio is clipped to [-c, c] (c = --gmpo_clip) only on the side
    that would help (PPO's pessimism, in log space); the mean over the responses with a token (a row with none, e.g.
    masked by --mask_truncated 1, takes no part: verl's geo_mean still counts it). A is the response's mean advantage
    (one per response: the registry's seq_advantages, enforced by validate)."""
    logprobs, adv, m = _inputs(logprobs, advantages, response_mask)
    log_ratio = log_ratio_of(logprobs, old_logprobs, m)
    n = m.sum(dim=1).clamp(min=1)
    adv = adv.sum(dim=1) / n  # [B]
    sign = torch.sign(adv)[:, None]
    clipped_lr = log_ratio.clamp(-cfg.gmpo_clip, cfg.gmpo_clip)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped_lr)
    seq_ratio = torch.exp(_zero(pessimistic, m).sum(dim=1) / n)
    rows = m.any(dim=1)
    n_rows = response_rows(m).clamp(min=1)
    row_loss = -adv * seq_ratio
    if is_weights is not None:  # a per-response loss: each response's mean rollout importance weight
        row_loss = row_loss * masked_mean(is_weights.detach(), m, dim=1)
    loss = _zero(row_loss, rows).sum() / n_rows
    clipped = (pessimistic != log_ratio) & m
    return loss, ratio_stats(log_ratio, torch.exp(log_ratio), m, clipfrac=masked_mean(clipped.float(), m),
                             seq_ratio=masked_mean(seq_ratio, rows))


def _global_means(adv: Tensor, logp: Tensor, m: Tensor, comm: Comm | None) -> tuple[Tensor, Tensor, Tensor]:
    """Mean advantage, mean log-prob and token count over every rank's tokens of this micro-batch."""
    sums = torch.stack([_zero(adv, m).sum(), _zero(logp, m).sum(), m.sum().to(adv.dtype)]).double()
    if comm is not None:
        sums = comm.sum(sums)
    n = sums[2].clamp(min=1)
    return (sums[0] / n).to(adv.dtype), (sums[1] / n).to(adv.dtype), sums[2]


def _kth(values: Tensor, k: int, largest: bool, comm: Comm | None) -> Tensor:
    """The k-th largest (smallest) of every rank's `values` (flat), +-inf padding where there are fewer: each rank
    sends its own best k, so the gather has the same shape on every rank whatever its token count."""
    fill = float("-inf") if largest else float("inf")
    best = torch.full((k,), fill, dtype=values.dtype, device=values.device)
    top = values.topk(min(k, values.numel()), largest=largest).values
    best[: top.numel()] = top
    if comm is not None:
        best = comm.gather(best)
    return best.topk(k, largest=largest).values[-1]


def _top_k(values: Tensor, m: Tensor, k: int, comm: Comm | None) -> Tensor:
    """The mask of exactly k of every rank's tokens: those with the k largest `values` (-inf at pads), the ties at
    the k-th largest taken in the global batch's order (rank by rank, then row by row), as one process with every
    row takes them. verl takes torch.topk's k indices (its ties in no stated order); ">= the k-th" took every tie."""
    kth = _kth(values.flatten(), k, largest=True, comm=comm)
    above, tied = m & (values > kth), m & (values == kth)
    counts = torch.stack([above.sum(), tied.sum()])
    if comm is None:
        n_above, tied_before = counts[0], counts.new_zeros(())
    else:
        every = comm.gather(counts).view(-1, 2)  # [world, 2], rank order
        n_above, tied_before = every[:, 0].sum(), every[: comm.rank, 1].sum()
    take = k - n_above - tied_before  # how many of this rank's ties are taken: its first ones
    return above | (tied & (tied.flatten().cumsum(0).view_as(tied) <= take))


def _covariance(logprobs: Tensor, advantages: Tensor, m: Tensor, comm: Comm | None) -> tuple[Tensor, Tensor]:
    """Per token (A - mean A)(log pi - mean log pi) over every rank's tokens (the paper's centred cross term whose
    batch mean drives the entropy change), and the global token count."""
    adv, logp = advantages.detach().float(), logprobs.detach().float()
    mean_a, mean_lp, n = _global_means(adv, logp, m, comm)
    return (adv - mean_a) * (logp - mean_lp), n


@register_policy_loss("clip_cov", paper="Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs, sec. 4 (Clip-Cov)")
def clip_cov(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, cfg: PolicyLossConfig,
             comm: Comm | None = None, is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's loss, with max(1, --clip_cov_ratio x N) tokens of the N taken out of the gradient, drawn at random among
    those PPO kept whose covariance lies in [--clip_cov_lb, --clip_cov_ub]: the tokens whose update drives the
    entropy down fastest. The draw is over every rank's tokens (each rank draws uniform keys; the global
    smallest keys win)."""
    logprobs, adv, m = _inputs(logprobs, advantages, response_mask)
    token_loss, stats = clipped_surrogate(logprobs, old_logprobs, adv, m, cfg.clip_epsilon, cfg.clip_epsilon_high)
    cov, n = _covariance(logprobs, adv, m, comm)
    ratio = torch.exp(log_ratio_of(logprobs, old_logprobs, m))
    ppo_clipped = (-adv * ratio.clamp(1.0 - cfg.clip_epsilon, 1.0 + cfg.clip_epsilon_high)) > (-adv * ratio)
    candidates = m & ~ppo_clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    k = max(1, int(cfg.clip_cov_ratio * float(n)))
    keys = torch.where(candidates, torch.rand(m.shape, device=m.device), torch.full((), float("inf"), device=m.device))
    chosen = candidates & (keys <= _kth(keys.flatten(), k, largest=False, comm=comm))
    token_loss = torch.where(chosen, 0.0, token_loss)  # no gradient through the chosen tokens
    stats["cov_frac"] = masked_mean(chosen.float(), m)
    return _agg(token_loss, m, cfg, is_weights), stats


@register_policy_loss("kl_cov", paper="Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs, sec. 4 (KL-Cov)")
def kl_cov(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, cfg: PolicyLossConfig,
           comm: Comm | None = None, is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The unclipped surrogate -A r, plus --kl_cov_coef |log r| on the max(1, --kl_cov_ratio x N) tokens of the N
    with the largest covariance (over every rank's tokens): a KL leash only where entropy collapses fastest."""
    logprobs, adv, m = _inputs(logprobs, advantages, response_mask)
    log_ratio = log_ratio_of(logprobs, old_logprobs, m)
    ratio = torch.exp(log_ratio)
    cov, n = _covariance(logprobs, adv, m, comm)
    k = max(1, int(cfg.kl_cov_ratio * float(n)))
    chosen = _top_k(torch.where(m, cov, torch.full((), float("-inf"), device=m.device)), m, k, comm)
    token_loss = -adv * ratio + torch.where(chosen, cfg.kl_cov_coef * log_ratio.abs(), 0.0)
    stats = ratio_stats(log_ratio, ratio, m, clipfrac=torch.zeros((), device=m.device), cov_frac=masked_mean(chosen.float(), m))
    return _agg(_zero(token_loss, m), m, cfg, is_weights), stats


@register_policy_loss("sapo", paper="Gao et al. 2025, Soft Adaptive Policy Optimization (Qwen), eq. (5)-(7)",
                      loss_agg="seq_mean_token_mean")
def sapo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, cfg: PolicyLossConfig,
         comm: Comm | None = None, is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """A soft gate instead of the hard clip: -A f(r), f(r) = sigmoid(tau (r - 1)) 4 / tau, whose slope is 1 at r = 1
    and fades smoothly off-policy; tau = --sapo_tau_pos for A > 0, --sapo_tau_neg (steeper: negative updates
    destabilise more) otherwise."""
    logprobs, adv, m = _inputs(logprobs, advantages, response_mask)
    log_ratio = log_ratio_of(logprobs, old_logprobs, m)
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    token_loss = _zero(-gate * adv, m)
    return _agg(token_loss, m, cfg, is_weights), ratio_stats(log_ratio, ratio, m, clipfrac=torch.zeros((), device=m.device),
                                                 gate=masked_mean(gate, m))
