"""Hand-computed checks of trainer/ppo.py on tiny tensors (arithmetic in the comments)."""

import io
import math

import pytest
import torch

from model.generation import filter_logits, kept_logprobs, sample_from_logits, token_logprobs
from trainer.ppo import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    compute_gae,
    compute_token_rewards,
    discounted_returns,
    explained_variance,
    kl_penalty,
    masked_mean,
    masked_whiten,
    policy_loss,
    response_rows,
    rollout_is_weights,
    value_loss,
)

LN2 = math.log(2.0)
LN1_5 = math.log(1.5)


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=tol,
        rtol=tol,
    )


# ------------------------------------------------------------------ masked statistics

def test_masked_mean_all_and_per_row():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 7.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # (1 + 3 + 5 + 7 + 9) / 5 = 5
    close(masked_mean(x, mask), 5.0)
    # row 0: (1 + 3) / 2 = 2; row 1: (5 + 7 + 9) / 3 = 7
    close(masked_mean(x, mask, dim=1), [2.0, 7.0])
    # bool mask gives the same
    close(masked_mean(x, mask.bool()), 5.0)


def test_masked_whiten_ignores_pads():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 7.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # real tokens 1, 3, 5, 7: mean 4; squared deviations 9 + 1 + 1 + 9 = 20; unbiased var 20/3
    std = math.sqrt(20.0 / 3.0)  # 2.5820
    expected = torch.tensor([[-3.0, -1.0, 0.0], [1.0, 3.0, 0.0]]) / std
    close(masked_whiten(x, mask), expected)
    # shift_mean=False adds the mean (4) back on real tokens; pads stay 0
    expected_keep = expected + 4.0 * mask
    close(masked_whiten(x, mask, shift_mean=False), expected_keep)
    # changing pad contents changes nothing
    x2 = x.clone()
    x2[:, 2] = torch.tensor([1e6, float("nan")])
    close(masked_whiten(x2, mask), expected)


def test_masked_whiten_edge_cases():
    # One token: unbiased variance undefined -> 0, so it whitens to 0; no tokens: all zeros, no error
    # (under DDP a rank-local error would leave the other ranks waiting in the collective).
    close(masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[1, 0]])), [[0.0, 0.0]])
    close(masked_whiten(torch.ones(2, 2), torch.zeros(2, 2)), torch.zeros(2, 2))
    # A large mean: the one-pass float64 sums must not cancel (two-pass reference computed here).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, generator=g) * 3 + 1e3
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    real = x[mask.bool()].double()
    expected = torch.where(mask.bool(), (x.double() - real.mean()) / real.std(), 0.0).float()
    close(masked_whiten(x, mask), expected, tol=1e-4)


def test_batch_statistics_take_a_cross_rank_reduce():
    """`reduce` sums the statistics over ranks: here a fake "other rank" adds its own sums, and the
    result equals one process whitening both halves together."""
    g = torch.Generator().manual_seed(2)
    x, mask = torch.randn(4, 5, generator=g) + 2.0, (torch.rand(4, 5, generator=g) > 0.3).float()
    values = torch.randn(4, 5, generator=g)

    sums = {}

    def record(t):
        sums["mine"] = t
        return t
    masked_whiten(x[2:], mask[2:], reduce=record)
    out = masked_whiten(x[:2], mask[:2], reduce=lambda t: t + sums["mine"])
    close(out, masked_whiten(x, mask)[:2], tol=1e-6)
    explained_variance(values[2:], x[2:], mask[2:], reduce=record)
    ev = explained_variance(values[:2], x[:2], mask[:2], reduce=lambda t: t + sums["mine"])
    assert ev == pytest.approx(explained_variance(values, x, mask), abs=1e-9)


# ------------------------------------------------------------------ KL estimators

def test_kl_estimators_hand_computed():
    # token 0: pi = 0.5, ref = 0.25 -> log r = log(ref/pi) = -ln2
    # token 1: pi = 0.25, ref = 0.5 -> log r = +ln2
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    # k1 = -log r
    close(kl_penalty(logp, ref, "k1"), [[LN2, -LN2]])
    # k2 = 0.5 (log r)^2 = 0.5 * 0.480453 = 0.240227 both
    close(kl_penalty(logp, ref, "k2"), [[0.5 * LN2**2, 0.5 * LN2**2]])
    # k3 = (r - 1) - log r: (0.5 - 1) + ln2 = 0.193147 ; (2 - 1) - ln2 = 0.306853
    close(kl_penalty(logp, ref, "k3"), [[-0.5 + LN2, 1.0 - LN2]])
    # identical policies -> 0 for every estimator
    for est in ("k1", "k2", "k3"):
        close(kl_penalty(logp, logp, est), torch.zeros(1, 2))


def test_kl_unknown_estimator_names_flag():
    with pytest.raises(ValueError, match="--kl_estimator"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ------------------------------------------------------------------ token rewards

def test_token_reward_lands_on_last_real_token():
    scores = torch.tensor([2.0, -1.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # kl_coef 0.5: row 0 -> [-0.05, -0.1 + 2 = 1.9, pad 0]; row 1 -> [-0.2, -0.25, -0.3 - 1 = -1.3]
    close(compute_token_rewards(scores, kl, mask, 0.5), [[-0.05, 1.9, 0.0], [-0.2, -0.25, -1.3]])
    # without KL only the score, at index 1 (EOS) in row 0 and index 2 in row 1
    close(compute_token_rewards(scores, None, mask, 0.5), [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0]])
    # garbage KL on the pad does not leak
    kl_bad = kl.clone()
    kl_bad[0, 2] = float("inf")
    close(compute_token_rewards(scores, kl_bad, mask, 0.5), [[-0.05, 1.9, 0.0], [-0.2, -0.25, -1.3]])


def test_token_reward_empty_row_errors():
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        compute_token_rewards(torch.zeros(2), None, torch.tensor([[1, 0], [0, 0]]), 0.1)


# ------------------------------------------------------------------ GAE

def test_gae_two_rows_different_lengths():
    gamma, lam = 0.9, 0.5  # gamma * lam = 0.45
    rewards = torch.tensor([[0.1, 1.0, 5.0], [0.0, 0.5, 2.0]])
    values = torch.tensor([[0.5, 0.2, 9.0], [1.0, 0.4, 0.8]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # row 0: EOS at t=1 then a pad (garbage r/V there)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    # row 0 (V after EOS = 0):
    #   t=1: delta = 1.0 + 0.9*0 - 0.2 = 0.8                A1 = 0.8
    #   t=0: delta = 0.1 + 0.9*0.2 - 0.5 = -0.22            A0 = -0.22 + 0.45*0.8 = 0.14
    # row 1:
    #   t=2: delta = 2.0 - 0.8 = 1.2                        A2 = 1.2
    #   t=1: delta = 0.5 + 0.9*0.8 - 0.4 = 0.82             A1 = 0.82 + 0.45*1.2 = 1.36
    #   t=0: delta = 0.0 + 0.9*0.4 - 1.0 = -0.64            A0 = -0.64 + 0.45*1.36 = -0.028
    close(adv, [[0.14, 0.8, 0.0], [-0.028, 1.36, 1.2]])
    # returns = A + V on real tokens: [0.64, 1.0, 0], [0.972, 1.76, 2.0]
    close(ret, [[0.64, 1.0, 0.0], [0.972, 1.76, 2.0]])


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    mask = torch.ones(1, 3)
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    # reward-to-go: 6, 5, 3; minus V = 0.5
    close(adv, [[5.5, 4.5, 2.5]])
    close(ret, [[6.0, 5.0, 3.0]])


# ------------------------------------------------------------------ clipped surrogate

def test_policy_loss_clipping_both_signs():
    eps = 0.2
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 3.0]])
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])  # last token is a pad with a huge A and ratio
    old = torch.zeros(1, 5)
    logp = torch.log(ratios).requires_grad_(True)
    loss, stats = policy_loss(logp, old, adv, mask, eps)
    # a: A=+1, r=1.5: max(-1.5, -1.2) = -1.2   (clip active: A>0, r>1+eps)
    # b: A=-1, r=0.5: max( 0.5,  0.8) =  0.8   (clip active: A<0, r<1-eps)
    # c: A=+2, r=0.5: max(-1.0, -1.6) = -1.0   (unclipped branch)
    # d: A=-1, r=1.5: max( 1.5,  1.2) =  1.5   (unclipped branch)
    # loss = (-1.2 + 0.8 - 1.0 + 1.5) / 4 = 0.025
    close(loss, 0.025)
    assert stats["clipfrac"] == pytest.approx(0.5)
    assert stats["ratio"] == pytest.approx(1.0)  # (1.5 + 0.5 + 0.5 + 1.5) / 4
    # approx_kl = mean((r - 1) - ln r): r=1.5 -> 0.5 - ln1.5 = 0.094535; r=0.5 -> -0.5 + ln2 = 0.193147
    assert stats["approx_kl"] == pytest.approx((2 * (0.5 - LN1_5) + 2 * (-0.5 + LN2)) / 4, abs=1e-6)
    loss.backward()
    # d loss / d logp = -A * r / 4 on unclipped tokens, 0 on clipped ones and on the pad
    close(logp.grad, [[0.0, 0.0, -2.0 * 0.5 / 4, 1.0 * 1.5 / 4, 0.0]])


def test_policy_loss_on_policy_is_minus_mean_advantage():
    adv = torch.tensor([[1.0, 3.0], [-2.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    lp = torch.zeros(2, 2)
    loss, stats = policy_loss(lp, lp, adv, mask, 0.2)
    # ratio = 1 everywhere: loss = -(1 + 3 - 2) / 3
    close(loss, -2.0 / 3.0)
    assert stats["clipfrac"] == 0.0 and stats["approx_kl"] == pytest.approx(0.0)


# ------------------------------------------------------------------ value loss

def test_value_loss_clipped_and_unclipped():
    values = torch.tensor([[0.5, 0.1, -0.5, 0.3, 7.0]], requires_grad=True)
    old = torch.zeros(1, 5)
    returns = torch.tensor([[1.0, 1.0, 0.0, 0.0, -7.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = value_loss(values, old, returns, mask, 0.2)
    # v_clip = clamp(v, -0.2, 0.2) = 0.2, 0.1, -0.2, 0.2
    # t0: (0.5-1)^2 = 0.25 vs (0.2-1)^2 = 0.64  -> 0.64 (clipped larger)
    # t1: 0.81 vs 0.81                           -> 0.81 (equal: not counted as clipped)
    # t2: 0.25 vs 0.04                           -> 0.25
    # t3: 0.09 vs 0.04                           -> 0.09
    # loss = 0.5 * (0.64 + 0.81 + 0.25 + 0.09) / 4 = 0.22375
    close(loss, 0.22375)
    assert stats["value_clipfrac"] == pytest.approx(0.25)
    # unclipped: 0.5 * (0.25 + 0.81 + 0.25 + 0.09) / 4 = 0.175, for None and 0
    for c in (None, 0.0):
        loss_u, stats_u = value_loss(values, old, returns, mask, c)
        close(loss_u, 0.175)
        assert stats_u["value_clipfrac"] == 0.0
    loss.backward()
    # t0 took the clipped branch (v outside the clip range): no gradient; pad: none
    assert values.grad[0, 0] == 0.0 and values.grad[0, 4] == 0.0
    # t1: d/dv 0.5*(v-1)^2/4 = (0.1-1)/4 = -0.225
    close(values.grad[0, 1], -0.225)


# ------------------------------------------------------------------ entropy, explained variance

def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    values = torch.tensor([[1.0, 2.0, 2.0, -5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # R = 1, 2, 3: Var = 2/3 ; R - V = 0, 0, 1: mean 1/3, Var = (1/9 + 1/9 + 4/9) / 3 = 2/9
    # EV = 1 - (2/9) / (2/3) = 2/3
    assert explained_variance(values, returns, mask) == pytest.approx(2.0 / 3.0, abs=1e-6)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert math.isnan(explained_variance(values, torch.ones(1, 4), mask))  # Var[R] = 0
    assert math.isnan(explained_variance(values, returns, torch.zeros(1, 4)))


# ------------------------------------------------------------------ KL controllers

def test_adaptive_kl_up_down_and_clamp():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # KL 12: 12/6 - 1 = 1.0 -> clamped to 0.2; mult = 1 + 0.2 * 100 / 10000 = 1.002
    ctl.update(12.0, 100)
    assert ctl.value == pytest.approx(0.1002)
    # KL 3: 3/6 - 1 = -0.5 -> clamped to -0.2; mult = 0.998
    ctl.update(3.0, 100)
    assert ctl.value == pytest.approx(0.1002 * 0.998)
    # KL 6.6 (inside the clamp): 6.6/6 - 1 = 0.1; mult = 1 + 0.1 * 100 / 10000 = 1.001
    ctl2 = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl2.update(6.6, 100)
    assert ctl2.value == pytest.approx(0.1001)
    with pytest.raises(ValueError, match="non-finite"):
        ctl2.update(float("nan"), 1)


def test_kl_controllers_state_dict_roundtrip_weights_only():
    ctl = AdaptiveKLController(0.2, target=1.0, horizon=100)
    ctl.update(5.0, 10)  # e = 0.2 -> 0.2 * 1.02 = 0.204
    assert ctl.value == pytest.approx(0.204)
    buf = io.BytesIO()
    torch.save({"kl_ctl": ctl.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["kl_ctl"]
    fresh = AdaptiveKLController(0.2, target=1.0, horizon=100)
    fresh.load_state_dict(state)
    assert fresh.value == pytest.approx(0.204)

    fixed = FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05
    other = FixedKLController(0.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.05
    assert all(isinstance(v, float) for v in fixed.state_dict().values())


def test_discounted_returns_by_hand_skip_pads():
    # Row 0: rewards 1, 2, 3 over three real tokens, gamma 0.5: G = 1 + 0.5*2 + 0.25*3 = 2.75, 2 + 1.5 = 3.5, 3.
    # Row 1: a pad in the middle (t=1) is skipped: G_0 = 1 + 0.5*4 = 3, G_2 = 4.
    rewards = torch.tensor([[1.0, 2.0, 3.0], [1.0, 99.0, 4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    g = discounted_returns(rewards, mask, 0.5)
    assert torch.allclose(g, torch.tensor([[2.75, 3.5, 3.0], [3.0, 0.0, 4.0]]))


def test_aggregate_loss_modes_by_hand():
    # Row 0: two tokens (1, 3); row 1: four tokens (2, 2, 2, 6).
    x = torch.tensor([[1.0, 3.0, 0.0, 0.0], [2.0, 2.0, 2.0, 6.0]])
    m = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert aggregate_loss(x, m, "token_mean").item() == pytest.approx(16 / 6)
    assert aggregate_loss(x, m, "seq_mean_token_mean").item() == pytest.approx((2 + 3) / 2)
    assert aggregate_loss(x, m, "seq_mean_token_sum").item() == pytest.approx((4 + 12) / 2)
    assert aggregate_loss(x, m, "seq_mean_token_sum_norm", max_len=8).item() == pytest.approx((4 + 12) / 2 / 8)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(x, m, "sum")


@pytest.mark.parametrize("mode, verl", [("token_mean", -1.0), ("seq_mean_token_mean", -1.0), ("seq_mean_token_sum", -2.0),
                                        ("seq_mean_token_sum_norm", -1.0)])
def test_a_row_without_tokens_is_no_response_of_the_mean(mode, verl):
    """The issue's case, as verl's agg_loss computes it: mask [[1, 1], [0, 0]] (row 1 masked whole, as
    --mask_truncated 1 does), log-ratio 0, A = 1, so every real token's loss is -A r = -1. Row 0's token mean
    is -1 and its sum -2; row 1 is left out of the mean over responses (it counted before: -0.5, -1, -0.5)."""
    lp = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [0, 0]])
    loss, _ = policy_loss(lp, lp, torch.ones(2, 2), mask, 0.2, loss_agg_mode=mode, max_len=2)
    # token_mean: -2 / 2 tokens; seq_mean_token_mean: -1 / 1 row; seq_mean_token_sum: -2 / 1 row;
    # seq_mean_token_sum_norm: -2 / 1 row / max_len 2 (verl: sum of row sums / 2, no row count)
    assert loss.item() == verl
    assert response_rows(mask).item() == 1
    # No row with a token: 0, not nan (the count is clamped to 1 as masked_mean's).
    assert aggregate_loss(torch.ones(2, 2), torch.zeros(2, 2), mode, max_len=2).item() == 0.0
    # A masked row changes nothing: the loss of row 0 alone.
    assert aggregate_loss(torch.tensor([[1.0, 3.0], [7.0, 9.0]]), mask, mode, 2).item() == \
        aggregate_loss(torch.tensor([[1.0, 3.0]]), mask[:1], mode, 2).item()


def test_clip_higher_clips_the_upper_side_only_at_eps_high():
    # ratio 1.25 with a positive advantage: the symmetric clip (0.2) caps it at 1.2, clip-higher 0.28 does not.
    old = torch.zeros(1, 2)
    lp = torch.log(torch.tensor([[1.25, 0.75]]))
    adv = torch.tensor([[1.0, -1.0]])
    m = torch.ones(1, 2)
    sym, st = policy_loss(lp, old, adv, m, 0.2)
    high, sth = policy_loss(lp, old, adv, m, 0.2, clip_eps_high=0.28)
    # token 0: -A*clip = -1.2 (sym) vs -1.25 (high); token 1 (A<0, ratio 0.75): max(0.75, 0.8) = 0.8 in both.
    assert sym.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert high.item() == pytest.approx((-1.25 + 0.8) / 2)
    assert st["clipfrac"].item() == pytest.approx(1.0) and sth["clipfrac"].item() == pytest.approx(0.5)


# ------------------------------------------------------------------------------ reward normalisation
def test_reward_normalizer_batch_running_and_clip_by_hand():
    from trainer.ppo import RewardNormalizer

    batch = RewardNormalizer("batch")
    shift, scale = batch.fit(torch.tensor([1.0, 3.0, float("nan")]))  # NaN left out: mean 2, unbiased std sqrt(2)
    assert shift == pytest.approx(2.0) and scale == pytest.approx(math.sqrt(2.0), rel=1e-6)
    run = RewardNormalizer("running", clip=1.0)
    run.fit(torch.tensor([1.0, 3.0]))
    shift, scale = run.fit(torch.tensor([5.0, 7.0, 9.0]))  # every reward so far: 1, 3, 5, 7, 9 -> mean 5, var 10
    assert shift == pytest.approx(5.0) and scale == pytest.approx(math.sqrt(10.0), rel=1e-6)
    assert run.apply(torch.tensor([5.0, 6.0, 9.0, -20.0]), shift, scale).tolist() == pytest.approx([0.0, 1 / math.sqrt(10), 1.0, -1.0])
    again = RewardNormalizer("running")
    again.load_state_dict(run.state_dict())
    assert again.fit(torch.tensor([5.0])) == run.fit(torch.tensor([5.0]))  # the state carries the history
    none = RewardNormalizer("none", clip=2.0)
    assert none.fit(torch.tensor([100.0])) == (0.0, 1.0)
    assert none.apply(torch.tensor([3.0, -1.0]), 0.0, 1.0).tolist() == [2.0, -1.0]
    with pytest.raises(ValueError, match="unknown --reward_norm"):
        RewardNormalizer("welford")


# ------------------------------------------------------------------ rollout importance sampling (engines)
def _is_batch():
    """Two responses; log pi_old - log mu per token: row 0 (ln 1.5, -ln 2, ln 3), row 1 (ln 1.8, pad, pad)."""
    old = torch.log(torch.tensor([[0.3, 0.2, 0.6], [0.36, 0.9, 0.9]]))
    mu = torch.log(torch.tensor([[0.2, 0.4, 0.2], [0.2, 0.1, 0.1]]))
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    return old, mu, mask


def test_rollout_is_token_weights_by_hand():
    """verl's rollout_is "token" / TRL's token_truncate: w_t = min(pi_old / mu, cap), 0 at pads, detached."""
    old, mu, mask = _is_batch()
    w, stats = rollout_is_weights(old, mu, mask, "token", cap=2.0)
    close(w, [[1.5, 0.5, 2.0], [1.8, 0.0, 0.0]])
    close(stats["is_weight"], (1.5 + 0.5 + 3.0 + 1.8) / 4)  # before truncation
    close(stats["is_clipped"], 1 / 4)  # only 3.0 passes the cap
    close(stats["engine_kl"], -(math.log(1.5) - LN2 + math.log(3.0) + math.log(1.8)) / 4)  # mean(log mu - log pi_old)
    close(stats["logprob_diff"], (math.log(1.5) + LN2 + math.log(3.0) + math.log(1.8)) / 4)
    assert not w.requires_grad


def test_rollout_is_sequence_weights_by_hand():
    """verl's rollout_is "sequence" / TRL's sequence_truncate: one weight per response, exp of the summed log-ratio."""
    old, mu, mask = _is_batch()
    w, stats = rollout_is_weights(old, mu, mask, "sequence", cap=5.0)
    close(w, [[2.25, 2.25, 2.25], [1.8, 0.0, 0.0]])  # 1.5 x 0.5 x 3 = 2.25
    w, _ = rollout_is_weights(old, mu, mask, "sequence", cap=2.0)
    close(w, [[2.0, 2.0, 2.0], [1.8, 0.0, 0.0]])


def test_rollout_is_is_one_where_engine_and_trainer_agree_and_none_only_measures():
    old, _, mask = _is_batch()
    w, stats = rollout_is_weights(old, old.clone(), mask, "token", cap=2.0)
    assert torch.equal(w, mask)
    assert stats["engine_kl"].item() == 0 and stats["is_clipped"].item() == 0
    w, stats = rollout_is_weights(old, old - 50.0, mask, "none", cap=2.0)
    assert w is None and math.isfinite(stats["is_weight"].item())  # the log-ratio is clamped before exp()
    with pytest.raises(ValueError, match="unknown rollout IS mode"):
        rollout_is_weights(old, old, mask, "tokens", cap=2.0)


def test_rollout_is_weights_are_one_only_with_pi_old_over_the_engines_kept_tokens():
    """An engine sampling with top-p 0.9 from the trainer's own logits reports log p - log S (vLLM's processed
    log-probs; S the kept mass of each position). Weighed against the trainer's full-vocabulary log p (5fab971's
    pairing) every on-policy weight is S; against the trainer's kept_logprobs (the same rule on its own logits) it is
    exactly 1. A sampled token the trainer's filters cut (log pi_old = -inf: its logits put it past the boundary)
    gets weight 0 and the statistics stay finite."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 32, generator=g) * 2
    tokens = sample_from_logits(filter_logits(logits.view(-1, 32), 1.0, 0, 0.9), g).view(4, 6)
    mu = kept_logprobs(logits, tokens, 1.0, 0, 0.9)
    mask = torch.ones(4, 6)
    mass = logits.softmax(-1).where(filter_logits(logits, 1.0, 0, 0.9).isfinite(), 0.0).sum(-1)
    w_full, _ = rollout_is_weights(token_logprobs(logits, tokens)[0], mu, mask, "token", 2.0)
    assert mass.max() < 0.999 and (w_full - mass).abs().max() < 1e-5  # the bug: off by the kept mass
    old = kept_logprobs(logits, tokens, 1.0, 0, 0.9)
    w, stats = rollout_is_weights(old, mu, mask, "token", 2.0)
    assert w is not None and torch.equal(w, torch.ones_like(w)) and stats["is_weight"] == 1
    old[1, 2] = float("-inf")
    for mode in ("token", "sequence"):
        w, stats = rollout_is_weights(old, mu, mask, mode, 2.0)
        assert w is not None and w[1, 2] < 1e-8 and (w[1].max() < 1e-8 if mode == "sequence" else w[0].eq(1).all())
        assert all(bool(torch.isfinite(v)) for v in stats.values()), stats
