"""Advantage estimators and policy losses by name, with what the rest of the run needs to know about them
(verl's `register_adv_est` / `register_policy_loss`, plus the metadata verl keeps in if-statements). Adding one is
one function and one decorator, in trainer/estimators.py or trainer/losses.py, or in a user's module imported before
the command line is read (a script that imports it, then calls train_ppo.main(): the flags' choices are read then):

    @register_estimator("rloo", needs_critic=False, needs_groups=True, whiten="none",
                        kl_placement="reward", kl_estimator="k1", paper="Ahmadian et al. 2024, eq. (5)")
    def rloo(scores: Tensor, kl: Tensor | None, values: Tensor | None, response_mask: Tensor, kl_coef: float,
             cfg: EstimatorConfig, baseline: Tensor | None = None) -> tuple[Tensor, Tensor]: ...

An estimator gets its own section (trainer/sections.py EstimatorConfig, the run's `cfg.estimator`), a loss its own
(PolicyLossConfig, `cfg.loss`). Nothing outside this file compares an estimator's or a loss's name as a string:
callers ask the spec.

Each table lives beside the decorator that fills it (trainer/estimators.py, trainer/losses.py); this module imports
both, so importing it registers the built-ins, and neither imports it back.
"""

from __future__ import annotations

from trainer.estimators import ADVANTAGE_ESTIMATORS, EstimatorFn, EstimatorSpec, register_estimator
from trainer.losses import POLICY_LOSSES, PolicyLossFn, PolicyLossSpec, register_policy_loss

__all__ = ["ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "EstimatorFn", "EstimatorSpec", "PolicyLossFn", "PolicyLossSpec",
           "register_estimator", "register_policy_loss", "estimator_names", "policy_loss_names", "estimator_spec",
           "policy_loss_spec"]


def estimator_names() -> list[str]:
    return list(ADVANTAGE_ESTIMATORS)


def policy_loss_names() -> list[str]:
    return list(POLICY_LOSSES)


def estimator_spec(name: str) -> EstimatorSpec:
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}: expected one of {', '.join(ADVANTAGE_ESTIMATORS)}") from None


def policy_loss_spec(name: str) -> PolicyLossSpec:
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}: expected one of {', '.join(POLICY_LOSSES)}") from None
