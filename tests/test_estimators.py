"""trainer/estimators.py and trainer/losses.py through the registry (trainer/registry.py): hand-computed
values, the metadata the run relies on, and one-line errors for unknown names."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import trainer.estimators as E
import trainer.losses  # noqa: F401 - registers the policy losses
from trainer.ppo import compute_gae, compute_token_rewards, policy_loss
from trainer.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, estimator_spec, policy_loss_spec, register_estimator

ROOT = Path(__file__).resolve().parent.parent


def test_group_baselines_by_hand():
    # Two prompts x 3 responses. Group 1: rewards 1, 2, 3 (mean 2, unbiased std 1); group 2: 0, 0, 3
    # (mean 1, unbiased std sqrt(3)).
    r = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 3.0])
    s3 = math.sqrt(3.0)
    assert torch.allclose(E.group_normalised(r, 3, eps=0.0), torch.tensor([-1.0, 0.0, 1.0, -1 / s3, -1 / s3, 2 / s3]))
    assert torch.allclose(E.group_centred(r, 3), torch.tensor([-1.0, 0.0, 1.0, -1.0, -1.0, 2.0]))
    # RLOO: r_i minus the mean of the other two: 1 - 2.5, 2 - 2, 3 - 1.5; 0 - 1.5, 0 - 1.5, 3 - 0.
    assert torch.allclose(E.leave_one_out(r, 3), torch.tensor([-1.5, 0.0, 1.5, -1.5, -1.5, 3.0]))


def test_eos_guard_is_the_group_centred_cut_indicator_unscaled():
    # Group 1: two of four cut (-1 each, mean -0.5); group 2: none cut. Each cut reply gets -penalty/2, each that
    # ended +penalty/2, whatever the spread of the group's rewards; a group with no cut reply gets nothing.
    has_eos = torch.tensor([True, False, True, False, True, True, True, True])
    assert torch.allclose(E.eos_guard(has_eos, 0.15, 4), torch.tensor([0.075, -0.075, 0.075, -0.075, 0, 0, 0, 0]))
    assert torch.equal(E.eos_guard(torch.zeros(4, dtype=torch.bool), 0.15, 4), torch.zeros(4))


def test_an_all_equal_group_has_zero_finite_advantages():
    r = torch.tensor([0.5, 0.5, 0.5, 0.5])
    for fn in (E.group_normalised, E.group_centred, E.leave_one_out):
        assert torch.equal(fn(r, 4), torch.zeros(4)), fn.__name__


def test_group_baselines_refuse_groups_of_one():
    with pytest.raises(ValueError, match="groups of >= 2"):
        E.group_normalised(torch.tensor([1.0, 2.0]), 1)
    with pytest.raises(ValueError, match="groups of >= 2"):
        E.leave_one_out(torch.tensor([1.0, 2.0, 3.0]), 2)


CFG = SimpleNamespace(gamma=1.0, lam=0.95, num_generations=2, adv_eps=1e-6, adv_std_unbiased=1)


@pytest.mark.parametrize("name,want", [
    # scores 1, 3 | 2, 2 in groups of 2; KL in the loss (None): every real token carries the baselined score.
    ("grpo", [-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0, 0.0]),
    ("dr_grpo", [-1.0, 1.0, 0.0, 0.0]),
    ("rloo", [-2.0, 2.0, 0.0, 0.0]),
    ("reinforce_pp", [1.0, 3.0, 2.0, 2.0]),
    ("reinforce_pp_baseline", [-1.0, 1.0, 0.0, 0.0]),
])
def test_critic_free_estimators_by_hand(name, want):
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    adv, ret = estimator_spec(name).fn(scores, None, None, mask, 0.0, CFG)
    expect = torch.tensor(want, dtype=torch.float32)[:, None].expand(4, 3) * mask
    assert torch.allclose(adv, expect, atol=1e-6) and ret is adv


def test_kl_in_the_reward_reaches_every_token_before_the_score():
    # reinforce_pp, one row of 3 tokens, gamma 1, kl 0.5 per token, coef 0.1: rewards -.05, -.05, 1 - .05.
    adv, _ = estimator_spec("reinforce_pp").fn(torch.tensor([1.0]), torch.full((1, 3), 0.5), None,
                                               torch.ones(1, 3), 0.1, CFG)
    assert torch.allclose(adv, torch.tensor([[0.85, 0.9, 0.95]]))


def test_gae_is_the_papers_recursion():
    scores, values = torch.tensor([1.0]), torch.tensor([[0.5, 0.25]])
    mask = torch.ones(1, 2)
    adv, ret = estimator_spec("gae").fn(scores, None, values, mask, 0.0, SimpleNamespace(gamma=1.0, lam=0.5))
    # delta_1 = 1 - 0.25 = 0.75; delta_0 = 0 + 0.25 - 0.5 = -0.25; A_0 = -0.25 + 0.5 * 0.75 = 0.125.
    assert torch.allclose(adv, torch.tensor([[0.125, 0.75]])) and torch.allclose(ret, adv + values)
    assert torch.equal(adv, compute_gae(compute_token_rewards(scores, None, mask, 0.0), values, mask, 1.0, 0.5)[0])


def test_opo_passk_and_remax_by_hand():
    cfg = SimpleNamespace(gamma=1.0, num_generations=3, adv_eps=0.0, adv_std_unbiased=1)
    scores = torch.tensor([1.0, 2.0, 4.0, 0.0, 3.0, 3.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    # OPO: group 1 lengths 2, 1, 3 -> baseline (2 + 2 + 12) / 6 = 8/3; group 2 lengths 3, 1, 2 -> (0 + 3 + 6) / 6 = 1.5
    adv, _ = estimator_spec("opo").fn(scores, None, None, mask, 0.0, cfg)
    want = torch.tensor([1 - 8 / 3, 2 - 8 / 3, 4 - 8 / 3, -1.5, 1.5, 1.5])[:, None] * mask
    assert torch.allclose(adv, want, atol=1e-6)
    # pass@k: group 1 best 4, second 2, std sqrt(7/3): only row 2 gets 2 / std; group 2 ties at 3: the first wins, gap 0.
    adv, _ = estimator_spec("grpo_passk").fn(scores, None, None, mask, 0.0, cfg)
    assert torch.allclose(adv[:, 0], torch.tensor([0.0, 0.0, 2 / math.sqrt(7 / 3), 0.0, 0.0, 0.0]), atol=1e-6)
    # ReMax: minus the greedy reply's reward for the same prompt.
    adv, _ = estimator_spec("remax").fn(scores, None, None, mask, 0.0, cfg, baseline=torch.tensor([2.0, 2, 2, 1, 1, 1]))
    assert torch.allclose(adv, torch.tensor([-1.0, 0, 2, -1, 2, 2])[:, None] * mask)
    with pytest.raises(ValueError, match="remax needs the greedy reply's reward"):
        estimator_spec("remax").fn(scores, None, None, mask, 0.0, cfg)


def test_grpo_std_flags_follow_minimind_or_trl():
    r = torch.tensor([0.0, 1.0])  # population std 0.5, unbiased sqrt(0.5)
    pop = SimpleNamespace(gamma=1.0, num_generations=2, adv_eps=1e-4, adv_std_unbiased=0)
    adv, _ = estimator_spec("grpo").fn(r, None, None, torch.ones(2, 1), 0.0, pop)
    assert torch.allclose(adv[:, 0], torch.tensor([-0.5, 0.5]) / (0.5 + 1e-4))
    unb = SimpleNamespace(gamma=1.0, num_generations=2, adv_eps=0.0, adv_std_unbiased=1)
    adv, _ = estimator_spec("grpo").fn(r, None, None, torch.ones(2, 1), 0.0, unb)
    assert torch.allclose(adv[:, 0], torch.tensor([-0.5, 0.5]) / math.sqrt(0.5))


def test_the_registry_metadata_the_run_reads():
    assert list(ADVANTAGE_ESTIMATORS) == ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                                          "opo", "grpo_passk", "remax"]
    assert [n for n, s in ADVANTAGE_ESTIMATORS.items() if s.needs_critic] == ["gae"]
    assert {n for n, s in ADVANTAGE_ESTIMATORS.items() if s.needs_groups} == {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline",
                                                                                "opo", "grpo_passk"}
    assert [n for n, s in ADVANTAGE_ESTIMATORS.items() if s.needs_baseline_rollout] == ["remax"]
    assert {n: s.whiten for n, s in ADVANTAGE_ESTIMATORS.items()} == {
        "gae": "flag", "grpo": "none", "dr_grpo": "none", "rloo": "none", "reinforce_pp": "global", "reinforce_pp_baseline": "global",
        "opo": "none", "grpo_passk": "none", "remax": "none"}
    assert {n for n, s in ADVANTAGE_ESTIMATORS.items() if s.kl_placement == "loss"} == {"grpo", "dr_grpo", "grpo_passk"}
    assert {n: s.loss_agg for n, s in POLICY_LOSSES.items() if s.loss_agg != "token_mean"} == {
        "gspo": "seq_mean_token_mean", "gmpo": "seq_mean_token_mean", "sapo": "seq_mean_token_mean"}
    assert [n for n, s in POLICY_LOSSES.items() if s.needs_groups] == ["gspo", "gmpo"]
    assert [n for n, s in POLICY_LOSSES.items() if s.seq_advantages] == ["gspo", "gmpo"]
    # ...whose paired estimators that put the KL in the reward by default (validate refuses them without
    # --kl_placement loss): the KL to go varies per token.
    assert {e for e in POLICY_LOSSES["gmpo"].estimators if ADVANTAGE_ESTIMATORS[e].kl_placement == "reward"} == {
        "rloo", "opo", "reinforce_pp_baseline"}
    # A loss that pairs with some estimators names only registered ones.
    assert all(set(s.estimators or ()) <= set(ADVANTAGE_ESTIMATORS) for s in POLICY_LOSSES.values())
    assert all(s.paper for s in ADVANTAGE_ESTIMATORS.values()) and all(s.paper for s in POLICY_LOSSES.values())


def test_unknown_names_and_double_registrations_are_refused():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo2': expected one of gae, grpo"):
        estimator_spec("ppo2")
    with pytest.raises(ValueError, match="unknown policy loss 'nope': expected one of vanilla"):
        policy_loss_spec("nope")
    with pytest.raises(ValueError, match="registered twice"):
        register_estimator("gae", needs_critic=True, needs_groups=False, whiten="flag", kl_placement="reward",
                           kl_estimator="k1", paper="")(lambda *a: None)


def test_vanilla_is_the_clipped_surrogate_with_its_flags():
    lp, old = torch.tensor([[0.0, math.log(1.5)]]), torch.zeros(1, 2)
    adv, mask = torch.tensor([[1.0, 1.0]]), torch.ones(1, 2)
    cfg = SimpleNamespace(clip_epsilon=0.2, clip_epsilon_high=0.28, loss_agg_mode="token_mean", max_gen_len=2)
    loss, stats = policy_loss_spec("vanilla").fn(lp, old, adv, mask, cfg)
    # ratios 1 and 1.5 (clipped to 1.28 with A > 0): loss = -(1 + 1.28) / 2
    assert loss.item() == pytest.approx(-1.14) and stats["clipfrac"].item() == 0.5
    assert torch.equal(loss, policy_loss(lp, old, adv, mask, 0.2, 0.28, "token_mean", 2)[0])


def test_the_builtins_register_without_an_import_cycle():
    """Each table lives beside its decorator (trainer/estimators.py, trainer/losses.py): they import neither the
    registry nor the config, which import them, so registration needs no circle and no import inside a function."""
    code = ("import sys, trainer.estimators, trainer.losses; "
            "print(sorted(m for m in sys.modules if m in ('trainer.registry', 'trainer.config')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
    assert "gae" in ADVANTAGE_ESTIMATORS and "vanilla" in POLICY_LOSSES
