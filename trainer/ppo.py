"""PPO math for RLHF on token sequences, with no model or data code so it can be checked line by line.

References
- PPO clipped surrogate and clipped value loss: Schulman et al. 2017, "Proximal Policy Optimization
  Algorithms", eq. (7); value clipping as in the OpenAI baselines implementation of that paper.
- GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
  Estimation", eq. (16): A_t = sum_l (gamma*lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t.
- Per-token KL penalty and adaptive KL coefficient: Ziegler et al. 2019, "Fine-Tuning Language Models
  from Human Preferences", sec. 2.2.
- KL estimators k1/k2/k3: John Schulman, "Approximating KL Divergence" (2020 note), with
  r = p_ref(x) / pi(x) and x ~ pi: k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r.
- The advantage estimators built from these (GAE, GRPO, Dr. GRPO, RLOO, REINFORCE++) are registered
  by name in trainer/estimators.py, the policy losses in trainer/losses.py.
- Clip-higher (an upper clip 1 + eps_high above 1 + eps_low) and token-level loss aggregation: DAPO,
  Yu et al. 2025, sec. 3.1 and 3.3; Dr. GRPO's constant normaliser: Liu et al. 2025, eq. (4).

Shapes: B = batch rows, R = response length. `response_mask` is [B, R], 1/True for real response
tokens (up to and including EOS), 0/False for the pads after it. Masking uses torch.where rather
than multiplication so garbage (inf/nan) in pad positions cannot leak into results or gradients.
Batch statistics (whitening, explained variance) take an optional `reduce` that sums over ranks, so
the same formula serves one process and DDP. Entropy lives with the log-probs it shares a softmax
with (model/generation.py: token_logprobs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "masked_mean",
    "masked_whiten",
    "kl_penalty",
    "distill_penalty",
    "compute_token_rewards",
    "compute_gae",
    "discounted_returns",
    "aggregate_loss",
    "response_rows",
    "policy_loss",
    "clipped_surrogate",
    "value_loss",
    "explained_variance",
    "FixedKLController",
    "AdaptiveKLController",
    "RewardNormalizer",
]

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
# Sums a statistics tensor over data-parallel ranks (trainer.dist.rank_sum); None = one process.
Reduce = Callable[[Tensor], Tensor]
# A log-ratio is clamped to +-this before exp(): e^20 ~ 5e8 is far past any clip, and a policy that moved
# that far (a bad batch, a diverged step) then gives a large finite loss instead of inf/NaN.
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class Comm:
    """The collectives a loss over every rank's tokens needs (trainer.dist.comm); None = one process.
    sum: a tensor summed over ranks; gather: equal-shaped tensors of every rank, concatenated along dim 0 in rank
    order; rank: this rank's place in that order (kl_cov takes tied tokens rank by rank)."""

    sum: Reduce
    gather: Callable[[Tensor], Tensor]
    rank: int = 0


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _zero_pads(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(_as_bool(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


# ----------------------------------------------------------------------------- masked statistics

def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over positions where mask is set (over all of them, or along `dim`).

    A slice with no real tokens has mean 0 (count clamped to 1) instead of nan, so per-row means of
    an empty row do not poison batch statistics.
    """
    m = _as_bool(mask)
    total = _zero_pads(x, m)
    count = m.to(x.dtype)
    if dim is None:
        return total.sum() / count.sum().clamp(min=1)
    return total.sum(dim) / count.sum(dim).clamp(min=1)


def _summed(stats: Tensor, reduce: Reduce | None) -> list[float]:
    """Sums over this rank's tokens, summed over every rank by `reduce` (None: one process)."""
    return (reduce(stats) if reduce is not None else stats).tolist()


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  reduce: Reduce | None = None) -> Tensor:
    """(x - mean) / std over the masked tokens (unbiased variance); pads of the result are 0.

    With shift_mean=False the mean is added back (only the scale is normalised), as done for
    rewards so that their sign is kept. `reduce` sums a float64 tensor over ranks (an all_reduce):
    N processes with B/N rows each then whiten exactly as one process with all B rows. One pass of
    sums keeps it to one collective; float64 keeps sq - n*mean^2 from cancelling badly.
    """
    m = _as_bool(mask)
    xd = torch.where(m, x.double(), torch.zeros((), dtype=torch.float64, device=x.device))
    total, sq, n = _summed(torch.stack([xd.sum(), (xd * xd).sum(), m.sum().double()]), reduce)
    mean = total / max(n, 1.0)
    var = (sq - n * mean * mean) / max(n - 1.0, 1.0)  # one token: 0, so it whitens to 0
    out = (x.float() - mean) / math.sqrt(max(var, 0.0) + eps)
    if not shift_mean:
        out = out + mean
    return _zero_pads(out, m)


# ----------------------------------------------------------------------------- KL and rewards

def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi; shape [B, R].

    k1 is unbiased but can be negative per token; k2 is biased, low variance, >= 0; k3 is unbiased
    and >= 0 (Schulman's note). Pads are not masked here: callers mask.
    """
    log_ratio = (ref_logprobs.float() - logprobs.float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # log r, r = p_ref / pi
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio  # expm1: exact near r = 1
    raise ValueError(
        f"unknown KL estimator {estimator!r}: --kl_estimator must be one of {', '.join(KL_ESTIMATORS)}"
    )


def distill_penalty(kl: Tensor | None, kl_coef: float, logprobs: Tensor, teacher_logprobs: Tensor | None,
                    distill_coef: float) -> tuple[Tensor | None, float]:
    """The per-token penalty and its coefficient for compute_token_rewards (r_t = -coef x penalty_t), with on-policy
    distillation's term added: kl_coef x KL_t (kl None: the KL is in the loss) + distill_coef x k1 of the reverse
    KL(pi || teacher) at the sampled token, log pi(y_t) - log p_teacher(y_t) (Agarwal et al. 2024, GKD with lambda = 1,
    beta = 1; trainer/distill.py), clamped as kl_penalty's. Without a teacher: (kl, kl_coef) unchanged."""
    if teacher_logprobs is None or distill_coef == 0:
        return kl, kl_coef
    reverse_kl = distill_coef * kl_penalty(logprobs, teacher_logprobs, "k1")
    return (reverse_kl if kl is None else kl_coef * kl.float() + reverse_kl), 1.0


def _last_token_index(response_mask: Tensor) -> Tensor:
    m = _as_bool(response_mask)
    if m.dim() != 2:
        raise ValueError(f"response_mask must be [B, R], got shape {tuple(m.shape)}")
    empty = (~m.any(dim=1)).nonzero().flatten()
    if empty.numel():
        raise ValueError(
            f"response rows {empty.tolist()} have no real tokens: every response needs at least "
            "one token (its EOS) to carry the reward"
        )
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    return torch.where(m, positions, -1).max(dim=1).values


def compute_token_rewards(
    scores: Tensor, kl: Tensor | None, response_mask: Tensor, kl_coef: float
) -> Tensor:
    """r_t = -kl_coef * KL_t on every real token, plus the sequence score on the last real token
    (Ziegler et al. 2019). Pads get 0."""
    m = _as_bool(response_mask)
    last = _last_token_index(m)
    if scores.shape != (m.shape[0],):
        raise ValueError(f"scores must have shape [B]={m.shape[0]}, got {tuple(scores.shape)}")
    rewards = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    if kl is not None:
        rewards = _zero_pads(-kl_coef * kl.float(), m)
    rows = torch.arange(m.shape[0], device=m.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards


def compute_gae(
    token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the real tokens of each row.

    Backwards: delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, where
    "t+1" is the next REAL token (pads are skipped) and V/A after the last real token are 0
    (the episode ends at EOS or at the length cut). Returns (advantages, returns), pads = 0,
    returns = advantages + values. Advantages are not whitened here.
    """
    m = _as_bool(response_mask)
    rewards = _zero_pads(token_rewards.float(), m)
    vals = _zero_pads(values.float(), m)
    B, R = m.shape
    advantages = torch.zeros(B, R, dtype=torch.float32, device=m.device)
    next_value = torch.zeros(B, dtype=torch.float32, device=m.device)
    next_adv = torch.zeros(B, dtype=torch.float32, device=m.device)
    for t in reversed(range(R)):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv_t = delta + gamma * lam * next_adv
        real = m[:, t]
        advantages[:, t] = torch.where(real, adv_t, 0.0)
        # A pad leaves the carried value/advantage untouched, so it is invisible to the recursion.
        next_value = torch.where(real, vals[:, t], next_value)
        next_adv = torch.where(real, adv_t, next_adv)
    returns = _zero_pads(advantages + vals, m)
    return advantages, returns


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """G_t = sum_l gamma^l r_{t+l} over the real tokens of each row (REINFORCE's return-to-go); pads 0.
    It is GAE with V = 0 and lam = 1, so the same recursion serves both."""
    zeros = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    return compute_gae(token_rewards, zeros, response_mask, gamma, 1.0)[0]


# ----------------------------------------------------------------------------- losses

def response_rows(response_mask: Tensor) -> Tensor:
    """How many rows hold at least one response token (0-d int64): the count the per-response means divide by.
    A row with none (every token masked by --mask_truncated 1, or empty) takes no part in the loss, so it is
    no response of the mean either (verl's agg_loss: "exclude fully masked sequences")."""
    return _as_bool(response_mask).any(dim=1).sum()


def aggregate_loss(token_loss: Tensor, response_mask: Tensor, mode: str = "token_mean", max_len: int | None = None) -> Tensor:
    """Per-token losses [B, R] -> the scalar to minimise (the papers differ here):

    token_mean (DAPO; PPO-for-LMs implementations): mean over every real token of the batch, so
      each token weighs the same whatever its response's length;
    seq_mean_token_mean (GRPO's 1/G sum_i 1/|o_i| sum_t): each response's token mean, then the mean
      over responses, so a long response's tokens weigh less;
    seq_mean_token_sum: each response's token sum, mean over responses;
    seq_mean_token_sum_norm (Dr. GRPO): token sums divided by a constant, `max_len`, not by each
      response's own length, which removes GRPO's length bias; then the mean over responses (so
      divided by the response count as well as by `max_len`).

    The per-response means are over the rows with at least one real token (`response_rows`): a row
    with none adds nothing and is not counted (as verl's agg_loss), so masking rows does not shrink the step."""
    m = _as_bool(response_mask)
    if mode == "token_mean":
        return masked_mean(token_loss, m)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}: expected one of {', '.join(LOSS_AGG_MODES)}")
    if mode == "seq_mean_token_sum_norm" and not max_len:
        raise ValueError("seq_mean_token_sum_norm needs max_len (the generation budget)")
    n_rows = response_rows(m).clamp(min=1)
    if mode == "seq_mean_token_mean":
        return masked_mean(token_loss, m, dim=1).sum() / n_rows  # an empty row's token mean is 0
    mean_row_sum = _zero_pads(token_loss, m).sum(dim=1).sum() / n_rows
    return mean_row_sum if mode == "seq_mean_token_sum" else mean_row_sum / max_len


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    loss_agg_mode: str = "token_mean",
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) per token, as a loss to minimise:
    max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high)), aggregated by `aggregate_loss`.
    eps_high (DAPO's clip-higher) defaults to eps: the symmetric clip."""
    token_loss, stats = clipped_surrogate(logprobs, old_logprobs, advantages, response_mask, clip_eps, clip_eps_high)
    return aggregate_loss(token_loss, _as_bool(response_mask), loss_agg_mode, max_len), stats


def log_ratio_of(logprobs: Tensor, old_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """log pi/pi_old per token: 0 at pads (exp() stays finite there), clamped to +-MAX_LOG_RATIO."""
    return _zero_pads(logprobs - old_logprobs, response_mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def ratio_stats(log_ratio: Tensor, ratio: Tensor, mask: Tensor, **more: Tensor) -> dict[str, Tensor]:
    """What every loss logs (0-d tensors: the trainer reads them once per minibatch): approx_kl, the k3
    estimate of KL(old || new) from the old policy's tokens (--early_stop_kl reads it), and the mean ratio."""
    with torch.no_grad():
        return {"approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask), "ratio": masked_mean(ratio, mask),
                **{k: v.detach() for k, v in more.items()}}


def clipped_surrogate(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor,
                      clip_eps: float, clip_eps_high: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO loss max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high)) [B, R] (pads 0), and its stats."""
    m = _as_bool(response_mask)
    log_ratio = log_ratio_of(logprobs, old_logprobs, m)
    ratio = torch.exp(log_ratio)
    adv = _zero_pads(advantages.detach(), m)
    unclipped = -adv * ratio
    high = clip_eps if clip_eps_high is None else clip_eps_high
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    token_loss = _zero_pads(torch.maximum(unclipped, clipped), m)
    return token_loss, ratio_stats(log_ratio, ratio, m, clipfrac=masked_mean((clipped > unclipped).float(), m))


ROLLOUT_IS_MODES = ("token", "sequence", "none")


def rollout_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor, mode: str,
                       cap: float) -> tuple[Tensor | None, dict[str, Tensor]]:
    """Truncated importance weights for the engine/trainer mismatch, and their statistics (0-d tensors).

    The engine samples from mu (its kernels, its precision); the update's ratio is taken against the trainer's
    own pi_old. E_mu[w f] = E_pi_old[f] with w = pi_old / mu, so each token's policy loss is multiplied by
        token:    w_t = min(exp(log pi_old(y_t) - log mu(y_t)), cap)
        sequence: w   = min(exp(sum_t log pi_old(y_t) - log mu(y_t)), cap), the same for every token of the response
    (Ionides 2008's truncated IS; verl's rollout_is token / sequence with rollout_is_threshold, TRL's
    vllm_importance_sampling_correction token_truncate / sequence_truncate). Detached; 0 at pads; the log-ratio is
    clamped to +-MAX_LOG_RATIO before exp(). mode "none": no weights (None), the statistics still measured.

    Both log-probs must be over the same tokens: under top-k / top-p, mu is the engine's renormalised over the tokens
    it kept (vLLM's processed log-probs), so old_logprobs must be pi_old's renormalised over the tokens the trainer's
    logits keep (model/generation.py kept_logprobs), else every weight is off by the kept mass. A sampled token the
    trainer's filters cut (its logits put it just past the boundary) has log pi_old = -inf: weight 0, its log-ratio
    in the statistics clamped like the weights'.

    Statistics: engine_kl, mean(log mu - log pi_old) over the tokens (k1 of KL(mu || pi_old) from mu's samples,
    verl's rollout_corr/kl); logprob_diff, mean |log mu - log pi_old|; is_weight, the mean weight before
    truncation; is_clipped, the share of tokens (sequence: of responses' tokens) whose weight the cap cut."""
    m = _as_bool(response_mask)
    with torch.no_grad():
        diff = _zero_pads((old_logprobs.float() - rollout_logprobs.float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), m)
        log_ratio = _zero_pads(diff.sum(dim=1, keepdim=True).expand_as(diff), m) if mode == "sequence" else diff
        raw = _zero_pads(torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)), m)
        stats = {"engine_kl": masked_mean(-diff, m), "logprob_diff": masked_mean(diff.abs(), m),
                 "is_weight": masked_mean(raw, m), "is_clipped": masked_mean((raw > cap).float(), m)}
        if mode == "none":
            return None, stats
        if mode != "token" and mode != "sequence":
            raise ValueError(f"unknown rollout IS mode {mode!r}: expected one of {', '.join(ROLLOUT_IS_MODES)}")
        return raw.clamp(max=cap), stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_range: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """0.5 * masked mean of max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clamp(V - V_old, -c, c).
    clip_range None or 0 disables clipping."""
    m = _as_bool(response_mask)
    v = values.float()
    ret = returns.detach().float()
    err = _zero_pads((v - ret) ** 2, m)
    if not clip_range:
        return 0.5 * masked_mean(err, m), {"value_clipfrac": torch.zeros((), device=v.device)}
    old = old_values.detach().float()
    v_clipped = old + torch.clamp(v - old, -clip_range, clip_range)
    err_clipped = _zero_pads((v_clipped - ret) ** 2, m)
    loss = 0.5 * masked_mean(torch.maximum(err, err_clipped), m)
    with torch.no_grad():
        clipfrac = masked_mean((err_clipped > err).float(), m)
    return loss, {"value_clipfrac": clipfrac}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor, reduce: Reduce | None = None) -> float:
    """1 - Var[R - V] / Var[R] over the masked tokens (population variances; of every rank's tokens
    with `reduce`, as in masked_whiten); nan when Var[R] is 0 or there are no tokens."""
    m = _as_bool(mask)
    zero = torch.zeros((), dtype=torch.float64, device=returns.device)
    r = torch.where(m, returns.detach().double(), zero)
    d = torch.where(m, (returns.detach() - values.detach()).double(), zero)
    n, r_sum, r_sq, d_sum, d_sq = _summed(torch.stack([m.sum().double(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum()]), reduce)
    if n == 0:
        return math.nan
    var_r = r_sq / n - (r_sum / n) ** 2
    var_d = d_sq / n - (d_sum / n) ** 2
    # Single-pass variances leave rounding residue: constant returns must still give nan.
    if not math.isfinite(var_r) or var_r <= 1e-12 * max(r_sq / n, 1e-30):
        return math.nan
    return 1.0 - var_d / var_r


# ----------------------------------------------------------------------------- KL controllers

class FixedKLController:
    """Constant KL coefficient (--kl_coef)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019: steer the KL coefficient so the measured KL approaches `target`.

    e = clip(KL / target - 1, -0.2, 0.2);  value *= 1 + e * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if not target > 0:
            raise ValueError(f"adaptive KL target must be > 0, got {target}")
        if not horizon > 0:
            raise ValueError(f"adaptive KL horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"adaptive KL controller got a non-finite KL ({current_kl}); the rollout diverged")
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        # Only the coefficient is restored: target/horizon come from the current flags, so a resumed
        # run may change them deliberately.
        self.value = float(state["value"])


# ----------------------------------------------------------------------------- reward normalisation

class RewardNormalizer:
    """--reward_norm none | batch | running, then --reward_clip: the scores the estimator sees.

    batch: (r - mean) / std over every rank's finite rewards of this step; running: over every finite reward
    so far, the batch's moments merged into the running ones (Chan et al.'s parallel update), as OpenRLHF's
    running reward normalisation. The running moments are state: the resume file keeps them. A reward enters the
    moments winsorised at its rank's batch median +- OUTLIER_STD * max(robust std, 1) (robust std = 1.4826 x the
    median absolute deviation): one row far out moves them by a bounded amount, where one 1e30 would fix the std for
    good. The floor of 1 keeps rare successes of a 0/1 reward (median and MAD 0) in; the scores are not changed."""

    OUTLIER_STD = 10.0

    def __init__(self, mode: str, clip: float = 0.0, eps: float = 1e-8) -> None:
        if mode not in ("none", "batch", "running"):
            raise ValueError(f"unknown --reward_norm {mode!r}: expected none, batch or running")
        self.mode, self.clip, self.eps = mode, float(clip), eps
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    def fit(self, scores: Tensor, reduce: Reduce | None = None) -> tuple[float, float]:
        """(shift, scale) for this step's scores (updating the running moments): r -> (r - shift) / scale."""
        if self.mode == "none":
            return 0.0, 1.0
        finite = torch.isfinite(scores)
        x = torch.where(finite, scores.double(), torch.zeros((), dtype=torch.float64, device=scores.device))
        if self.mode == "running" and finite.any():  # rank-local bounds: the summed moments still agree on every rank
            median = x[finite].median()
            bound = self.OUTLIER_STD * max(1.4826 * (x[finite] - median).abs().median().item(), 1.0)
            x = torch.where(finite, x.clamp(median.item() - bound, median.item() + bound), x)
        n, total, sq = _summed(torch.stack([finite.sum().double(), x.sum(), (x * x).sum()]), reduce)
        if n == 0:
            return (self.mean, math.sqrt(self.m2 / max(self.count - 1.0, 1.0) + self.eps)) if self.mode == "running" else (0.0, 1.0)
        b_mean = total / n
        b_m2 = max(sq - n * b_mean * b_mean, 0.0)
        if self.mode == "batch":
            return b_mean, math.sqrt(b_m2 / max(n - 1.0, 1.0) + self.eps)
        delta, count = b_mean - self.mean, self.count + n
        self.mean += delta * n / count
        self.m2 += b_m2 + delta * delta * self.count * n / count
        self.count = count
        return self.mean, math.sqrt(self.m2 / max(self.count - 1.0, 1.0) + self.eps)

    def apply(self, scores: Tensor, shift: float, scale: float) -> Tensor:
        out = (scores.float() - shift) / scale if self.mode != "none" else scores.float()
        return out.clamp(-self.clip, self.clip) if self.clip > 0 else out

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])
