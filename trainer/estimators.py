"""Advantage estimators, each registered by name with its metadata in ADVANTAGE_ESTIMATORS (looked up through
trainer/registry.py).

Every estimator maps the rollout's outcome scores [B] (one per response, on its last token), the
per-token KL penalty [B, R] when the KL is in the reward (None when it is in the loss), the critic's
values [B, R] (GAE only), the response mask, the KL coefficient (the controller's current value) and its own
settings (`cfg`: trainer/sections.py EstimatorConfig, the run's `cfg.estimator`) to (advantages, returns) [B, R],
before whitening: the caller whitens over every rank's tokens as the spec's `whiten` says.

References
- GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
  eq. (16), on per-token rewards with the KL penalty of Ziegler et al. 2019, sec. 2.2.
- GRPO: Shao et al. 2024, "DeepSeekMath", sec. 4.1.2: A_i = (r_i - mean(r)) / std(r).
- Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training", sec. 3.1: A_i = r_i - mean(r).
- RLOO: Ahmadian et al. 2024, "Back to Basics", eq. (5): A_i = r_i - 1/(G-1) sum_{j != i} r_j.
- REINFORCE++: Hu 2025, sec. 3: per-token KL in the reward, the discounted return as the advantage,
  normalised over the whole global batch ("_baseline": the group mean subtracted from r_i first).
- ReMax: Li et al. 2024, Algorithm 1: A_i = r_i - r(greedy reply), the greedy reply sampled per prompt.
- OPO: Hao et al. 2025, sec. 3: A_i = r_i - sum_j |o_j| r_j / sum_j |o_j| (length-weighted group mean).
- GRPO pass@k (arXiv:2503.19595, as verl's grpo_passk): only the group's best response gets
  (r_max - r_second) / std; the rest 0.
The group ones see the G = --num_generations responses to a prompt as rows i*G .. i*G+G-1 (never split
across ranks, so they need no collective).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import torch
from torch import Tensor

from trainer.ppo import compute_gae, compute_token_rewards, discounted_returns
from trainer.sections import EstimatorConfig


class EstimatorFn(Protocol):
    def __call__(self, scores: Tensor, kl: Tensor | None, values: Tensor | None, response_mask: Tensor, kl_coef: float,
                 cfg: EstimatorConfig, baseline: Tensor | None = None) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    fn: EstimatorFn
    needs_critic: bool  # builds and trains a critic (GAE); the others build none
    needs_groups: bool  # compares the --num_generations responses to one prompt: needs >= 2
    whiten: Literal["none", "global", "flag"]  # advantages whitened over every rank's tokens: never, always,
    #                                            or as --whiten_advantages says
    kl_placement: Literal["reward", "loss"]  # --kl_placement auto
    kl_estimator: Literal["k1", "k2", "k3"]  # --kl_estimator auto
    paper: str
    needs_baseline_rollout: bool = False  # a greedy response per prompt, rewarded, is its baseline (ReMax)


# Every advantage estimator by name: the built-ins below, and any a user's module registers before the command line is read.
ADVANTAGE_ESTIMATORS: dict[str, EstimatorSpec] = {}
_Estimator = TypeVar("_Estimator", bound=EstimatorFn)


def register_estimator(name: str, *, needs_critic: bool, needs_groups: bool, whiten: Literal["none", "global", "flag"],
                       kl_placement: Literal["reward", "loss"], kl_estimator: Literal["k1", "k2", "k3"], paper: str,
                       needs_baseline_rollout: bool = False) -> Callable[[_Estimator], _Estimator]:
    """Register an advantage estimator under --advantage_estimator `name` with what the run needs to know about it
    (verl's register_adv_est, with the metadata verl keeps in if-statements)."""
    def deco(fn: _Estimator) -> _Estimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ADVANTAGE_ESTIMATORS[name] = EstimatorSpec(name, fn, needs_critic, needs_groups, whiten, kl_placement, kl_estimator,
                                                   paper, needs_baseline_rollout)
        return fn
    return deco


def _groups(scores: Tensor, group_size: int) -> Tensor:
    """[B] -> [B/G, G] fp32, refusing batches that are not whole groups of >= 2."""
    if group_size < 2 or scores.shape[0] % group_size:
        raise ValueError(f"group estimators need groups of >= 2 responses (got {scores.shape[0]} scores in groups of {group_size})")
    return scores.float().view(-1, group_size)


def group_centred(scores: Tensor, group_size: int) -> Tensor:
    """r_i - mean of its group (Dr. GRPO; REINFORCE++-baseline's first step)."""
    g = _groups(scores, group_size)
    return (g - g.mean(dim=1, keepdim=True)).reshape(-1)


def eos_guard(has_eos: Tensor, penalty: float, group_size: int) -> Tensor:
    """[B] advantage shift for --eos_placement advantage: -penalty for a response cut without EOS, centred within its
    group and not scaled by the group's spread, so a group that differs only in where its replies stop gets a
    nudge of at most `penalty`, not the +-1 that GRPO's std scaling would make of it."""
    return penalty * group_centred(-(~has_eos.bool()).float(), group_size)


def group_normalised(scores: Tensor, group_size: int, eps: float = 1e-6, unbiased: bool = True) -> Tensor:
    """(r_i - mean) / (std + eps), std unbiased as in TRL and verl (MiniMind: the population std, eps 1e-4)."""
    g = _groups(scores, group_size)
    return ((g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True, unbiased=unbiased) + eps)).reshape(-1)


def leave_one_out(scores: Tensor, group_size: int) -> Tensor:
    """r_i - mean of the others = G/(G-1) (r_i - mean)."""
    g = _groups(scores, group_size)
    return ((g - g.mean(dim=1, keepdim=True)) * (group_size / (group_size - 1))).reshape(-1)


def length_weighted(scores: Tensor, lengths: Tensor, group_size: int) -> Tensor:
    """r_i - sum_j |o_j| r_j / sum_j |o_j| over the group (OPO's optimal baseline for a sequence-level reward
    under the token-sum loss)."""
    g, n = _groups(scores, group_size), lengths.float().view(-1, group_size)
    return (g - (n * g).sum(dim=1, keepdim=True) / n.sum(dim=1, keepdim=True).clamp(min=1)).reshape(-1)


def best_of_group(scores: Tensor, group_size: int, eps: float = 1e-6, unbiased: bool = True) -> Tensor:
    """Pass@k: only the group's best response is credited, with (r_max - r_second) / (std + eps); every other
    response gets 0 (the group passes iff its best does). Ties go to the first."""
    g = _groups(scores, group_size)
    top = g.topk(2, dim=1)
    adv = torch.zeros_like(g)
    gap = (top.values[:, 0] - top.values[:, 1]) / (g.std(dim=1, unbiased=unbiased) + eps)
    adv.scatter_(1, top.indices[:, :1], gap[:, None])
    return adv.reshape(-1)


def outcome_returns(shaped: Tensor, kl: Tensor | None, response_mask: Tensor, kl_coef: float, gamma: float) -> tuple[Tensor, Tensor]:
    """The return-to-go of the per-token rewards (the baselined score on the last token, the KL penalty on
    every token when it is in the reward) as the advantage; equal on every token when the KL is in the loss.
    No critic learns from the returns (logged only): they are the same tensor."""
    advantages = discounted_returns(compute_token_rewards(shaped, kl, response_mask, kl_coef), response_mask, gamma)
    return advantages, advantages


@register_estimator("gae", needs_critic=True, needs_groups=False, whiten="flag", kl_placement="reward", kl_estimator="k1",
                    paper="Schulman et al. 2016 (GAE), with Ziegler et al. 2019's per-token KL reward")
def gae(scores: Tensor, kl: Tensor | None, values: Tensor | None, response_mask: Tensor, kl_coef: float, cfg: EstimatorConfig,
        baseline: Tensor | None = None) -> tuple[Tensor, Tensor]:
    if values is None:
        raise ValueError("gae needs the critic's values for every response token")
    token_rewards = compute_token_rewards(scores, kl, response_mask, kl_coef)
    return compute_gae(token_rewards, values, response_mask, cfg.gamma, cfg.lam)


@register_estimator("grpo", needs_critic=False, needs_groups=True, whiten="none", kl_placement="loss", kl_estimator="k3",
                    paper="Shao et al. 2024, DeepSeekMath, sec. 4.1.2")
def grpo(scores: Tensor, kl: Tensor | None, values: Tensor | None, response_mask: Tensor, kl_coef: float,
         cfg: EstimatorConfig, baseline: Tensor | None = None) -> tuple[Tensor, Tensor]:
    normalised = group_normalised(scores, cfg.num_generations, cfg.adv_eps, bool(cfg.adv_std_unbiased))
    return outcome_returns(normalised, kl, response_mask, kl_coef, cfg.gamma)


@register_estimator("dr_grpo", needs_critic=False, needs_groups=True, whiten="none", kl_placement="loss", kl_estimator="k3",
                    paper="Liu et al. 2025, Understanding R1-Zero-Like Training, sec. 3.1")
def dr_grpo(scores: Tensor, kl: Tensor | None, values: Tensor | None, response_mask: Tensor, kl_coef: float,
            cfg: EstimatorConfig, baseline: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return outcome_returns(group_centred(scores, cfg.num_generations), kl, response_mask, kl_coef, cfg.gamma)


@register_estimator("rloo", needs_critic=False, needs_groups=True, whiten="none", kl_placement="reward", kl_estimator="k1",
                    paper="Ahmadian et al. 2024, Back to Basics, eq. (5)")
def rloo(scores: Tensor, kl: Tensor | None, values: Tensor | None, response_mask: Tensor, kl_coef: float,
         cfg: EstimatorConfig, baseline: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return outcome_returns(leave_one_out(scores, cfg.num_generations), kl, response_mask, kl_coef, cfg.gamma)


@register_estimator("reinforce_pp", needs_critic=False, needs_groups=False, whiten="global", kl_placement="reward",
                    kl_estimator="k1", paper="Hu 2025, REINFORCE++, sec. 3")
def reinforce_pp(scores: Tensor, kl: Tensor | None, values: Tensor | None, response_mask: Tensor, kl_coef: float,
                 cfg: EstimatorConfig, baseline: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return outcome_returns(scores.float(), kl, response_mask, kl_coef, cfg.gamma)


@register_estimator("reinforce_pp_baseline", needs_critic=False, needs_groups=True, whiten="global", kl_placement="reward",
                    kl_estimator="k1", paper="Hu 2025, REINFORCE++ (group-mean baseline variant)")
def reinforce_pp_baseline(scores: Tensor, kl: Tensor | None, values: Tensor | None, response_mask: Tensor, kl_coef: float,
                          cfg: EstimatorConfig, baseline: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return outcome_returns(group_centred(scores, cfg.num_generations), kl, response_mask, kl_coef, cfg.gamma)


@register_estimator("opo", needs_critic=False, needs_groups=True, whiten="none", kl_placement="reward", kl_estimator="k1",
                    paper="Hao et al. 2025, On-Policy RL with Optimal Reward Baseline (OPO), sec. 3")
def opo(scores: Tensor, kl: Tensor | None, values: Tensor | None, response_mask: Tensor, kl_coef: float,
        cfg: EstimatorConfig, baseline: Tensor | None = None) -> tuple[Tensor, Tensor]:
    lengths = response_mask.bool().sum(dim=1)
    return outcome_returns(length_weighted(scores, lengths, cfg.num_generations), kl, response_mask, kl_coef, cfg.gamma)


@register_estimator("grpo_passk", needs_critic=False, needs_groups=True, whiten="none", kl_placement="loss", kl_estimator="k3",
                    paper="Pass@k policy optimization, arXiv:2503.19595 (as verl's grpo_passk)")
def grpo_passk(scores: Tensor, kl: Tensor | None, values: Tensor | None, response_mask: Tensor, kl_coef: float,
               cfg: EstimatorConfig, baseline: Tensor | None = None) -> tuple[Tensor, Tensor]:
    best = best_of_group(scores, cfg.num_generations, cfg.adv_eps, bool(cfg.adv_std_unbiased))
    return outcome_returns(best, kl, response_mask, kl_coef, cfg.gamma)


@register_estimator("remax", needs_critic=False, needs_groups=False, whiten="none", kl_placement="reward", kl_estimator="k1",
                    paper="Li et al. 2024, ReMax, Algorithm 1 (arXiv:2310.10505)", needs_baseline_rollout=True)
def remax(scores: Tensor, kl: Tensor | None, values: Tensor | None, response_mask: Tensor, kl_coef: float,
          cfg: EstimatorConfig, baseline: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """r_i - r(greedy reply to the same prompt): one extra greedy rollout per prompt, rewarded like the samples."""
    if baseline is None or baseline.shape != scores.shape:
        raise ValueError("remax needs the greedy reply's reward for every response (one per row)")
    return outcome_returns(scores.float() - baseline.float(), kl, response_mask, kl_coef, cfg.gamma)
