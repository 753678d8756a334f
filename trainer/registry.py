"""Advantage estimators and policy losses, registered by name with what the rest of the run needs to
know about them (verl's `register_adv_est` / `register_policy_loss`, plus the metadata verl keeps in
if-statements). Adding one is one function in trainer/estimators.py or trainer/losses.py and one decorator:

    @register_estimator("rloo", needs_critic=False, needs_groups=True, whiten="none",
                        kl_placement="reward", kl_estimator="k1", paper="Ahmadian et al. 2024, eq. (5)")
    def rloo(scores, kl, values, response_mask, kl_coef, cfg, baseline=None): ...

Nothing outside this file compares an estimator's or a loss's name as a string: callers ask the spec.
A leaf module: it imports nothing from the project but, on first use, the two modules that register the built-ins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

# (scores [B], kl [B, R] | None, values [B, R] | None, response_mask [B, R], kl_coef, cfg) -> (advantages, returns)
EstimatorFn = Callable[..., tuple]
# (logprobs, old_logprobs, advantages, response_mask, cfg, comm, is_weights=None) -> (loss, stats)
PolicyLossFn = Callable[..., tuple]


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


ADVANTAGE_ESTIMATORS: dict[str, EstimatorSpec] = {}
POLICY_LOSSES: dict[str, PolicyLossSpec] = {}


def register_estimator(name: str, *, needs_critic: bool, needs_groups: bool, whiten: str, kl_placement: str,
                       kl_estimator: str, paper: str, needs_baseline_rollout: bool = False) -> Callable[[EstimatorFn], EstimatorFn]:
    def deco(fn: EstimatorFn) -> EstimatorFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ADVANTAGE_ESTIMATORS[name] = EstimatorSpec(name, fn, needs_critic, needs_groups, whiten, kl_placement,  # type: ignore[arg-type]
                                                   kl_estimator, paper, needs_baseline_rollout)
        return fn
    return deco


def register_policy_loss(name: str, *, paper: str, estimators: tuple[str, ...] | None = None, needs_groups: bool = False,
                         loss_agg: str = "token_mean", agg_fixed: bool = False,
                         seq_advantages: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = PolicyLossSpec(name, fn, estimators, needs_groups, paper, loss_agg, agg_fixed, seq_advantages)
        return fn
    return deco


def _builtins() -> None:
    """Register the built-in estimators and losses on first use: their modules import this one, so a config or
    a parser that asks for a spec or the names need not import them for their side effect."""
    import trainer.estimators  # noqa: F401
    import trainer.losses  # noqa: F401


def estimator_names() -> list[str]:
    _builtins()
    return list(ADVANTAGE_ESTIMATORS)


def policy_loss_names() -> list[str]:
    _builtins()
    return list(POLICY_LOSSES)


def estimator_spec(name: str) -> EstimatorSpec:
    _builtins()
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}: expected one of {', '.join(ADVANTAGE_ESTIMATORS)}") from None


def policy_loss_spec(name: str) -> PolicyLossSpec:
    _builtins()
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}: expected one of {', '.join(POLICY_LOSSES)}") from None
