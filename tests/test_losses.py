"""The registered policy losses against hand-computed values (trainer/losses.py), padded rows, the clamp
before exp(), 2 gloo processes against one process with the doubled batch, and the registry's pairing rules."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import spawn_ranks
from trainer import dist as D
from trainer.ppo import kl_penalty, response_rows
from trainer.registry import policy_loss_names, policy_loss_spec
from trainer.run import distributed
from trainer.run.cli import parse_args, resolve

ROOT = Path(__file__).resolve().parent.parent
LOSSES = ("vanilla", "dual_clip", "cispo", "gspo", "gmpo", "clip_cov", "kl_cov", "sapo")


def cfg(**over):
    """The losses read these settings (the parser's defaults, the aggregation resolved as `auto` would)."""
    base = dict(clip_epsilon=0.2, clip_epsilon_high=0.2, clip_ratio_c=3.0, cispo_max_weight=5.0, gspo_clip_low=3e-4,
                gspo_clip_high=4e-4, gmpo_clip=0.4, clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0,
                kl_cov_ratio=2e-3, kl_cov_coef=1.0, sapo_tau_pos=1.0, sapo_tau_neg=1.05, loss_agg_mode="token_mean",
                max_gen_len=4)
    base.update(over)
    return SimpleNamespace(**base)


def loss_of(name, lp, old, adv, mask, c, comm=None):
    lp = lp.clone().requires_grad_(True)
    loss, stats = policy_loss_spec(name).fn(lp, old, adv, mask, c, comm)
    loss.backward()
    return loss.item(), lp.grad, stats


def close(t: torch.Tensor, want: list) -> bool:
    return torch.allclose(t, torch.tensor(want, dtype=t.dtype), rtol=1e-5, atol=1e-7)


def lp_of(*ratios, old=math.log(0.4)):
    """Log-probs whose ratio to exp(old) is each of `ratios` (one row)."""
    return torch.tensor([[old + math.log(r) for r in ratios]]), torch.full((1, len(ratios)), old)


def test_every_loss_the_issue_names_is_registered_with_a_paper():
    assert set(LOSSES) <= set(policy_loss_names())  # the registry loads the built-ins on first use
    for name in LOSSES:
        assert policy_loss_spec(name).paper


def test_vanilla_by_hand():
    lp, old = lp_of(1.5, 0.5)
    loss, grad, st = loss_of("vanilla", lp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), cfg())
    # A=1, r=1.5: max(-1.5, -1.2) = -1.2 (clipped, no gradient); A=-1, r=0.5: max(0.5, 0.8) = 0.8 (clipped)
    assert loss == pytest.approx((-1.2 + 0.8) / 2)
    assert grad.abs().sum() == 0 and st["clipfrac"].item() == 1.0


def test_dual_clip_caps_a_negative_advantage_by_hand():
    lp, old = lp_of(5.0, 1.1)
    loss, grad, st = loss_of("dual_clip", lp, old, torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2), cfg())
    # r=5, A=-1: PPO's loss is max(5, 1.2) = 5, the dual clip caps it at -A c = 3 (no gradient);
    # r=1.1: max(1.1, 1.1) = 1.1, below the cap, d/dlp = -A r / 2 tokens = 0.55
    assert loss == pytest.approx((3.0 + 1.1) / 2)
    assert grad[0, 0].item() == 0 and grad[0, 1].item() == pytest.approx(0.55)
    assert st["clipfrac_lower"].item() == 0.5
    _, grad_v, _ = loss_of("vanilla", lp, old, torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2), cfg())
    assert grad_v[0, 0].item() == pytest.approx(2.5)  # vanilla pushes on it: -A r / 2


def test_cispo_is_a_detached_clipped_weight_times_the_log_prob_by_hand():
    lp, old = lp_of(1.5, 7.0)
    adv = torch.tensor([[2.0, 1.0]])
    loss, grad, st = loss_of("cispo", lp, old, adv, torch.ones(1, 2), cfg())
    want = (-1.5 * 2.0 * lp[0, 0].item() - 5.0 * 1.0 * lp[0, 1].item()) / 2  # weight min(7, 5) = 5
    assert loss == pytest.approx(want)
    # The gradient is the weight times A (no gradient through the weight): the clipped token still learns.
    assert close(grad, [[-1.5, -2.5]])
    assert st["clipfrac"].item() == 0.5


def test_gspo_uses_the_length_normalised_sequence_ratio_by_hand():
    # Row 0: log-ratios 0.2 and -0.2 -> s = exp(0) = 1 (inside [1 - 3e-4, 1 + 4e-4]); row 1: one token, log-ratio
    # 1e-4 -> s = exp(1e-4), inside; a pad after it holds garbage.
    old = torch.full((2, 2), math.log(0.3))
    lp = old + torch.tensor([[0.2, -0.2], [1e-4, float("nan")]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, 5.0]])
    c = cfg(loss_agg_mode="seq_mean_token_mean")
    loss, grad, st = loss_of("gspo", lp, old, adv, mask, c)
    s1 = math.exp(1e-4)
    assert loss == pytest.approx((-1.0 + 2.0 * s1) / 2)
    # d/dlp_t of the sequence objective -A s / B: -A s / |y| / B per token (the paper's gradient, eq. 10)
    assert close(grad, [[-0.25, -0.25], [2.0 * s1 / 2, 0.0]])
    assert torch.isfinite(grad).all()
    # Token ratios far apart but their geometric mean ~1: GSPO does not clip what token-level PPO would.
    lp2 = old[:1] + torch.tensor([[0.5, -0.5]])
    _, g2, st2 = loss_of("gspo", lp2, old[:1], torch.ones(1, 2), torch.ones(1, 2), c)
    assert st2["clipfrac"].item() == 0 and g2.abs().sum() > 0
    # Outside the sequence range on the helpful side: clipped, no gradient.
    lp3 = old[:1] + torch.tensor([[0.01, 0.01]])
    _, g3, st3 = loss_of("gspo", lp3, old[:1], torch.ones(1, 2), torch.ones(1, 2), c)
    assert st3["clipfrac"].item() == 1 and g3.abs().sum() == 0


def test_gmpo_is_the_geometric_mean_with_sign_aware_clipping_by_hand():
    old = torch.zeros(2, 2)
    lp = torch.tensor([[0.6, 0.2], [0.6, -0.6]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, grad, st = loss_of("gmpo", lp, old, adv, torch.ones(2, 2), cfg())
    # Row 0, A > 0: log-ratios 0.6 -> min(0.6, 0.4) = 0.4, 0.2 stays: ratio exp(0.3). Row 1, A < 0: 0.6 stays
    # (max(0.6, 0.4)), -0.6 -> max(-0.6, -0.4) = -0.4: ratio exp(0.1). Loss: mean of -A ratio.
    assert loss == pytest.approx((-math.exp(0.3) + math.exp(0.1)) / 2)
    # Gradient only through the unclipped tokens: d/dlp = -A ratio / |y| / B
    assert close(grad, [[0.0, -math.exp(0.3) / 4], [math.exp(0.1) / 4, 0.0]])
    assert st["clipfrac"].item() == 0.5


def test_sapo_is_a_soft_gate_by_hand():
    lp, old = lp_of(1.5, 0.8)
    adv = torch.tensor([[1.0, -1.0]])
    c = cfg(loss_agg_mode="seq_mean_token_mean")
    loss, grad, st = loss_of("sapo", lp, old, adv, torch.ones(1, 2), c)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    g_pos, g_neg = sig(1.0 * 0.5) * 4 / 1.0, sig(1.05 * -0.2) * 4 / 1.05
    assert loss == pytest.approx((-g_pos + g_neg) / 2)
    # d gate / d lp = 4 sig (1 - sig) r: at r = 1 this is 1, the plain policy gradient
    d_pos = 4 * sig(0.5) * (1 - sig(0.5)) * 1.5
    d_neg = 4 * sig(-0.21) * (1 - sig(-0.21)) * 0.8
    assert close(grad, [[-d_pos / 2, d_neg / 2]])
    lp1, old1 = lp_of(1.0)
    _, g1, _ = loss_of("sapo", lp1, old1, torch.tensor([[3.0]]), torch.ones(1, 1), c)
    assert g1.item() == pytest.approx(-3.0)


def _cov_batch():
    """Four tokens whose covariance (A - mean A)(lp - mean lp) is known: A = [3, 1, 0.5, 1.5] (mean 1.5), lp =
    log 0.4 + [3, 1, 0, 0] (mean log 0.4 + 1): covariances [3, 0, 1, 0]. Every ratio 1 (old = lp): no PPO clip."""
    lp = math.log(0.4) + torch.tensor([[3.0, 1.0], [0.0, 0.0]])
    return lp, lp.clone(), torch.tensor([[3.0, 1.0], [0.5, 1.5]]), torch.ones(2, 2)


def test_clip_cov_takes_drawn_high_covariance_tokens_out_of_the_gradient():
    lp, old, adv, mask = _cov_batch()
    # Candidates: covariance in (0.5, 5): tokens 0 (cov 3) and 2 (cov 1); share 1 -> all of them drawn.
    loss, grad, st = loss_of("clip_cov", lp, old, adv, mask, cfg(clip_cov_lb=0.5, clip_cov_ub=5.0, clip_cov_ratio=1.0))
    _, grad_v, _ = loss_of("vanilla", lp, old, adv, mask, cfg())
    assert close(grad_v, [[-0.75, -0.25], [-0.125, -0.375]])  # -A r / 4 tokens
    assert close(grad, [[0.0, -0.25], [0.0, -0.375]])
    assert st["cov_frac"].item() == 0.5
    # The default share: max(1, 2e-4 x 4) = 1 token, drawn among the two candidates.
    torch.manual_seed(0)
    _, grad1, st1 = loss_of("clip_cov", lp, old, adv, mask, cfg(clip_cov_lb=0.5))
    assert st1["cov_frac"].item() == 0.25 and int((grad1 == 0).sum()) == 1
    assert grad1[0, 0] == 0 or grad1[1, 0] == 0
    # Above --clip_cov_ub: never drawn.
    _, grad2, st2 = loss_of("clip_cov", lp, old, adv, mask, cfg(clip_cov_lb=0.5, clip_cov_ub=2.0, clip_cov_ratio=1.0))
    assert close(grad2, [[-0.75, -0.25], [0.0, -0.375]])


def test_kl_cov_penalises_the_top_covariance_tokens_by_hand():
    lp, old, adv, mask = _cov_batch()
    lp = lp + torch.tensor([[0.1, 0.0], [0.0, 0.0]])  # token 0 moved: log r = 0.1, covariance still the largest
    loss, grad, st = loss_of("kl_cov", lp, old, adv, mask, cfg(kl_cov_ratio=0.25, kl_cov_coef=1.0))
    r0 = math.exp(0.1)
    assert loss == pytest.approx((-3 * r0 + 0.1 - 1 - 0.5 - 1.5) / 4)
    # -A r + coef * sign(log r) * 1 on the chosen token, -A r on the others, over 4 tokens
    assert close(grad, [[(-3 * r0 + 1.0) / 4, -0.25], [-0.125, -0.375]])
    assert st["cov_frac"].item() == 0.25


@pytest.mark.parametrize("name, token_loss", [("gspo", -1.0), ("sapo", -2.0), ("gmpo", -1.0)])
def test_a_row_without_tokens_takes_no_part_in_the_per_response_mean(name, token_loss):
    """The issue's case on the losses that average per response by default: mask [[1, 1], [0, 0]] (row 1 masked
    whole, as --mask_truncated 1 does), log-ratio 0, A = 1. Row 0's loss: GSPO -A s = -1 (s = exp(0) = 1, inside
    the clip); SAPO -A f(1) = -sigmoid(0) 4 / tau_pos = -2; GMPO -A exp(0) = -1. Row 1 is no response of the mean
    (verl's agg_loss, "exclude fully masked sequences"); it counted before, halving each."""
    lp = torch.full((2, 2), math.log(0.4))
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    c = cfg(loss_agg_mode="seq_mean_token_mean")
    loss, grad, st = loss_of(name, lp, lp.clone(), torch.ones(2, 2), mask, c)
    assert loss == pytest.approx(token_loss)
    # d/dlp per token of row 0, over 1 response and its 2 tokens: GSPO and GMPO -A s / |y| = -0.5 (the sequence
    # ratio's gradient spread over its tokens); SAPO -A f'(1) / |y| = -4 sigmoid(0)(1 - sigmoid(0)) / 2 = -0.5.
    assert close(grad, [[-0.5, -0.5], [0.0, 0.0]])
    if name == "gmpo":
        assert st["seq_ratio"].item() == 1.0  # the mean over rows with a token


@pytest.mark.parametrize("mode, want", [("seq_mean_token_mean", -1.0), ("seq_mean_token_sum", -2.0),
                                        ("seq_mean_token_sum_norm", -0.5)])
def test_every_token_level_loss_leaves_rows_without_tokens_out(mode, want):
    """The same batch through each token-level loss and per-response mode (max_gen_len 4): row 0 alone."""
    lp = torch.full((2, 2), math.log(0.4))
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    for name in ("vanilla", "dual_clip", "gspo"):
        loss, _, _ = loss_of(name, lp, lp.clone(), torch.ones(2, 2), mask, cfg(loss_agg_mode=mode))
        assert loss == pytest.approx(want), name  # -1 per token: mean -1, sum -2, sum / 4 = -0.5


def _tied_cov_batch():
    """Four rows of two tokens whose covariances all tie at 0.5: A = 2, 0, 2, 0 per row (mean 1: deviations +-1),
    lp = -0.5, -1.5, -0.5, -1.5 per row (mean -1: deviations +-0.5, exact in binary); old = lp - 0.1 on rows
    0 and 2 (log r = 0.1), lp - 0.2 on rows 1 and 3 (log r = 0.2)."""
    lp = torch.tensor([[-0.5, -0.5], [-1.5, -1.5], [-0.5, -0.5], [-1.5, -1.5]])
    old = lp - torch.tensor([[0.1, 0.1], [0.2, 0.2], [0.1, 0.1], [0.2, 0.2]])
    return lp, old, torch.tensor([2.0, 0.0, 2.0, 0.0])[:, None].expand(4, 2).contiguous(), torch.ones(4, 2)


def test_kl_cov_takes_exactly_k_tokens_when_covariances_tie():
    """verl takes the torch.topk indices: exactly k = max(1, int(ratio x N)) tokens. All 8 covariances tie, so
    ">= the k-th" took all 8; now k, the first in the batch's order (row by row)."""
    lp, old, adv, mask = _tied_cov_batch()
    loss, grad, st = loss_of("kl_cov", lp, old, adv, mask, cfg(kl_cov_ratio=0.25, kl_cov_coef=1.0))
    # k = int(0.25 x 8) = 2: tokens (0, 0) and (0, 1) get + |log r| = 0.1 each. -A r: -2 e^0.1 on rows 0 and 2, 0 on
    # rows 1 and 3. Token mean: (4 (-2 e^0.1) + 0.2) / 8.
    e1 = math.exp(0.1)
    assert loss == pytest.approx((-8 * e1 + 0.2) / 8)
    assert st["cov_frac"].item() == 0.25
    # d/dlp: (-A r + sign(log r) on a chosen token) / 8
    assert close(grad, [[(-2 * e1 + 1) / 8] * 2, [0.0, 0.0], [-2 * e1 / 8] * 2, [0.0, 0.0]])
    # The floor of one token: k = max(1, int(0.01 x 8)) = 1.
    _, grad1, st1 = loss_of("kl_cov", lp, old, adv, mask, cfg(kl_cov_ratio=0.01))
    assert st1["cov_frac"].item() == 1 / 8 and grad1[0, 0].item() == pytest.approx((-2 * e1 + 1) / 8)


@pytest.mark.parametrize("name", LOSSES)
def test_pads_change_nothing_and_get_no_gradient(name):
    """A padded copy of a batch gives the same loss and gradients, whatever the pads hold."""
    g = torch.Generator().manual_seed(1)
    old = torch.log(torch.rand(4, 3, generator=g) * 0.9 + 0.05)
    lp = old + 0.1 * torch.randn(4, 3, generator=g)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0])[:, None].expand(4, 3).contiguous()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    agg = policy_loss_spec(name).loss_agg
    c = cfg(loss_agg_mode=agg, clip_cov_ratio=1.0, clip_cov_lb=-0.01, clip_cov_ub=10.0, kl_cov_ratio=0.3, gspo_clip_low=0.5,
            gspo_clip_high=0.5)
    pad = lambda x, v: torch.cat([x, torch.full((4, 2), v)], dim=1)  # noqa: E731
    torch.manual_seed(0)
    loss, grad, _ = loss_of(name, lp, old, adv, mask, c)
    torch.manual_seed(0)
    garbage_lp = torch.where(pad(mask, 0.0).bool(), pad(lp, 0.0), torch.tensor(float("nan")))
    loss_p, grad_p, _ = loss_of(name, garbage_lp, pad(old, float("inf")), pad(adv, float("nan")), pad(mask, 0.0), c)
    assert loss_p == pytest.approx(loss, rel=1e-6)
    assert torch.allclose(grad_p[:, :3], grad, atol=1e-7) and (grad_p[:, 3:] == 0).all()


@pytest.mark.parametrize("name", LOSSES)
def test_huge_log_ratios_give_finite_losses_and_gradients(name):
    old = torch.zeros(2, 2)
    lp = torch.tensor([[50.0, -50.0], [-50.0, 50.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    c = cfg(loss_agg_mode=policy_loss_spec(name).loss_agg, clip_cov_ratio=1.0, clip_cov_lb=-1e9, clip_cov_ub=1e9, kl_cov_ratio=1.0)
    loss, grad, stats = loss_of(name, lp, old, adv, torch.ones(2, 2), c)
    assert math.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v).all() for v in stats.values())


def test_the_k3_kl_is_finite_at_huge_log_ratios():
    k3 = kl_penalty(torch.tensor([[50.0, -50.0, -100.0]]), torch.zeros(1, 3), "k3")
    assert torch.isfinite(k3).all() and (k3 > 0).all()
    assert kl_penalty(torch.tensor([[0.3]]), torch.zeros(1, 1), "k3").item() == pytest.approx(math.expm1(-0.3) + 0.3)


# --------------------------------------------------------------------------------------- 2 processes
def _batch(seed: int = 5):
    """8 rows, uneven lengths (so the ranks hold different token counts), group advantages."""
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(8, 5, generator=g) * 0.9 + 0.05)
    lp = old + 0.3 * torch.randn(8, 5, generator=g)
    lengths = torch.tensor([5, 2, 4, 1, 3, 5, 1, 4])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).float()
    adv = torch.randn(8, generator=g)[:, None].expand(8, 5).contiguous()
    return lp, old, adv, mask


def _ddp_cfg(name: str):
    return cfg(loss_agg_mode=policy_loss_spec(name).loss_agg, clip_cov_ratio=1.0, clip_cov_lb=-0.05, clip_cov_ub=10.0,
               kl_cov_ratio=0.2, gspo_clip_low=0.05, gspo_clip_high=0.05, clip_epsilon=0.1, clip_epsilon_high=0.1)


def _scaled(name: str, lp, old, adv, mask, c, comm, world: int, n_tokens: float, n_rows: int):
    """What trainer/update.py backpropagates on one rank: the loss scaled to its share of the global count x world
    (DDP then averages gradients over the ranks); n_rows counts the rows with a token."""
    lp = lp.clone().requires_grad_(True)
    loss, stats = policy_loss_spec(name).fn(lp, old, adv, mask, c, comm)
    share = mask.sum() / n_tokens if c.loss_agg_mode == "token_mean" else response_rows(mask).item() / n_rows
    (loss * share * world).backward()
    return (loss * share).item(), lp.grad / world, stats


def _loss_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    info = distributed.init_distributed("cpu", timeout_s=120)
    try:
        lp, old, adv, mask = _batch()
        rows = slice(rank * 4, rank * 4 + 4)
        out = {}
        for name in LOSSES:
            loss, grad, stats = _scaled(name, lp[rows], old[rows], adv[rows], mask[rows], _ddp_cfg(name), D.comm(info), world,
                                        float(mask.sum()), 8)
            out[name] = (D.sum_global(torch.tensor(loss), info).item(), grad, {k: v.item() for k, v in stats.items()},
                         float(mask[rows].sum()))
        # The default clip_cov share: one token of all 26, over both ranks together.
        torch.manual_seed(rank)
        c = _ddp_cfg("clip_cov")
        c.clip_cov_ratio = 2e-4
        _, _, st = _scaled("clip_cov", lp[rows], old[rows], adv[rows], mask[rows], c, D.comm(info), world, float(mask.sum()), 8)
        out["one_drawn"] = D.sum_global(st["cov_frac"] * mask[rows].sum(), info).item()
        # Rows without a token (1 of rank 0's, 2 of rank 1's): every loss in every per-response mode.
        empty = _empty_rows(mask)
        for name, c in _empty_row_cases():
            loss, grad, _ = _scaled(name, lp[rows], old[rows], adv[rows], empty[rows], c, D.comm(info), world,
                                    float(empty.sum()), 5)
            out[f"empty_{name}_{c.loss_agg_mode}"] = (D.sum_global(torch.tensor(loss), info).item(), grad)
        # Covariances that all tie: k = 6 of the 8 tokens, rank 0's 4, then rank 1's first 2.
        t_lp, t_old, t_adv, t_mask = _tied_cov_batch()
        t_rows = slice(rank * 2, rank * 2 + 2)
        comm = D.comm(info)  # it knows its rank (kl_cov takes tied tokens rank by rank)
        out["tied"] = _scaled("kl_cov", t_lp[t_rows], t_old[t_rows], t_adv[t_rows], t_mask[t_rows], cfg(kl_cov_ratio=0.75),
                              comm, world, 8.0, 4)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        distributed.cleanup(info)


@pytest.mark.slow  # two fresh interpreters import torch (~5 s idle)
def test_two_processes_give_one_process_with_the_doubled_batch(tmp_path):
    spawn_ranks(_loss_worker, 2, tmp_path, 120, "2-process loss check")
    lp, old, adv, mask = _batch()
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for name in LOSSES:
        loss, grad, stats = _scaled(name, lp, old, adv, mask, _ddp_cfg(name), None, 1, float(mask.sum()), 8)
        for r, res in enumerate(ranks):
            # The global loss and every row's gradient: one process's, to float rounding (sums in another order).
            assert res[name][0] == pytest.approx(loss, rel=1e-5, abs=1e-7), name
            assert torch.allclose(res[name][1], grad[r * 4:(r + 1) * 4], rtol=1e-5, atol=1e-7), name
        if name in ("clip_cov", "kl_cov"):  # the chosen tokens are chosen over both ranks' tokens together
            chosen = sum(res[name][2]["cov_frac"] * res[name][3] for res in ranks)
            assert chosen == pytest.approx(stats["cov_frac"].item() * float(mask.sum())), name
            assert chosen >= 1
    assert ranks[0]["one_drawn"] == ranks[1]["one_drawn"] == 1.0
    empty = _empty_rows(mask)
    assert response_rows(empty[:4]).item() == 3 and response_rows(empty[4:]).item() == 2
    for name, c in _empty_row_cases():
        loss, grad, _ = _scaled(name, lp, old, adv, empty, c, None, 1, float(empty.sum()), 5)
        whole, _, _ = _scaled(name, lp[empty.any(1)], old[empty.any(1)], adv[empty.any(1)], empty[empty.any(1)], c, None, 1,
                              float(empty.sum()), 5)
        assert loss == pytest.approx(whole, rel=1e-6), name  # the masked rows change nothing
        for r, res in enumerate(ranks):
            got_loss, got_grad = res[f"empty_{name}_{c.loss_agg_mode}"]
            assert got_loss == pytest.approx(loss, rel=1e-5, abs=1e-7), (name, c.loss_agg_mode)
            assert torch.allclose(got_grad, grad[r * 4:(r + 1) * 4], rtol=1e-5, atol=1e-7), (name, c.loss_agg_mode)
    t_lp, t_old, t_adv, t_mask = _tied_cov_batch()
    loss, grad, stats = _scaled("kl_cov", t_lp, t_old, t_adv, t_mask, cfg(kl_cov_ratio=0.75), None, 1, 8.0, 4)
    assert stats["cov_frac"].item() == 0.75  # k = int(0.75 x 8) = 6: rows 0-2
    assert [res["tied"][2]["cov_frac"] for res in ranks] == [1.0, 0.5]  # rank 0's 4 tokens, rank 1's first 2
    assert torch.allclose(torch.cat([res["tied"][1] for res in ranks]), grad, rtol=1e-6, atol=1e-8)


def _empty_rows(mask):
    """_batch's mask with rows 1, 5 and 6 masked whole (as --mask_truncated 1 does): the ranks then hold 3 and 2
    rows with a token, 5 in all."""
    out = mask.clone()
    out[[1, 5, 6]] = 0
    return out


def _empty_row_cases():
    """Every loss in its own aggregation, and vanilla in each per-response mode."""
    return [*((n, _ddp_cfg(n)) for n in LOSSES),
            *(("vanilla", cfg(loss_agg_mode=mode, clip_epsilon=0.1, clip_epsilon_high=0.1))
              for mode in ("seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"))]


# --------------------------------------------------------------------------------------- settings
def _resolved(argv):
    return resolve(parse_args(argv), D.DistInfo())


def test_auto_aggregation_is_the_losss_own_and_a_fixed_one_refuses_others(capsys):
    assert _resolved([]).loss_agg_mode == "token_mean"  # the demo's
    base = ["--advantage_estimator", "grpo", "--num_generations", "4", "--batch_size", "8"]
    assert _resolved(base + ["--policy_loss", "gspo"]).loss_agg_mode == "seq_mean_token_mean"
    assert _resolved(base + ["--policy_loss", "gspo", "--loss_agg_mode", "token_mean"]).loss_agg_mode == "token_mean"
    with pytest.raises(SystemExit, match="--loss_agg_mode token_mean: --policy_loss gmpo is defined per response"):
        _resolved(base + ["--policy_loss", "gmpo", "--loss_agg_mode", "token_mean"])


@pytest.mark.parametrize("loss", ["gspo", "gmpo"])
def test_a_per_response_loss_takes_each_group_estimator_with_the_kl_in_the_loss(loss):
    """GSPO and GMPO need one advantage per response (the registry's seq_advantages). rloo, opo and
    reinforce_pp_baseline put the KL in the reward by default, where the KL to go varies per token (GMPO averaged
    it silently): refused in one line until --kl_placement loss; grpo, dr_grpo and grpo_passk have it there already."""
    assert policy_loss_spec(loss).seq_advantages
    base = ["--policy_loss", loss, "--num_generations", "4", "--batch_size", "8"]
    for est in policy_loss_spec(loss).estimators:
        if est in ("rloo", "opo", "reinforce_pp_baseline"):
            with pytest.raises(SystemExit, match=f"--advantage_estimator {est} puts the KL in the reward"):
                _resolved(base + ["--advantage_estimator", est])
            assert _resolved(base + ["--advantage_estimator", est, "--kl_placement", "loss"]).kl_placement == "loss"
            assert _resolved(base + ["--advantage_estimator", est, "--kl_coef", "0"]).kl_placement == "reward"  # 0 x KL
        else:
            assert _resolved(base + ["--advantage_estimator", est]).kl_placement == "loss"


@pytest.mark.parametrize("argv, message", [
    (["--policy_loss", "nope"], "invalid choice: 'nope'"),
    (["--policy_loss", "gspo"], "--policy_loss gspo compares the --num_generations responses"),
    (["--policy_loss", "gmpo", "--advantage_estimator", "gae", "--num_generations", "2", "--batch_size", "8"],
     "--policy_loss gmpo pairs with --advantage_estimator grpo / dr_grpo"),
    (["--policy_loss", "gmpo", "--advantage_estimator", "rloo", "--num_generations", "4", "--batch_size", "8"],
     "--policy_loss gmpo needs one advantage per response: --advantage_estimator rloo puts the KL in the reward (per token); "
     "add --kl_placement loss"),
    (["--policy_loss", "gspo", "--advantage_estimator", "grpo", "--kl_placement", "reward", "--num_generations", "4",
      "--batch_size", "8"],
     "--policy_loss gspo needs one advantage per response: --kl_placement reward puts the KL in the reward (per token); "
     "use --kl_placement loss"),
    (["--policy_loss", "gmpo", "--advantage_estimator", "grpo", "--gamma", "0.99", "--num_generations", "4", "--batch_size", "8"],
     "--policy_loss gmpo needs one advantage per response: --gamma 0.99 discounts the score per token; use --gamma 1"),
    (["--clip_epsilon", "0"], "--clip_epsilon 0.0 must be a finite number > 0"),
    (["--clip_epsilon", "0.3", "--clip_epsilon_high", "0.2"], "--clip_epsilon_high 0.2 is below --clip_epsilon 0.3"),
    (["--gspo_clip_low", "1e-3", "--gspo_clip_high", "1e-4"], "--gspo_clip_high 0.0001 is below --gspo_clip_low"),
    (["--clip_ratio_c", "0.5"], "--clip_ratio_c 0.5 must be > 1"),
    (["--cispo_max_weight", "0.5"], "--cispo_max_weight 0.5 must be >= 1"),
    (["--epsilon", "-0.1"], "--epsilon -0.1 must be a finite number > 0"),
    (["--sapo_tau_neg", "0"], "--sapo_tau_neg 0.0 must be a finite number > 0"),
    (["--clip_cov_lb", "5", "--clip_cov_ub", "1"], "--clip_cov_lb 5.0 must be below --clip_cov_ub 1.0"),
])
def test_bad_loss_settings_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _resolved(argv)
    text = str(e.value) + capsys.readouterr().err
    assert message in text
    assert "Traceback" not in text


# --------------------------------------------------------------------------------------- MiniMind's GRPO
MINIMIND_GRPO = ["--batch_size", "2", "--num_generations", "4", "--beta", "0.1", "--epsilon", "0.2", "--epsilon_high", "5.0",
                 "--max_gen_len", "3", "--use_wandb", "--learning_rate", "3e-7"]


def _minimind_batch():
    g = torch.Generator().manual_seed(7)
    old = torch.log(torch.rand(8, 3, generator=g) * 0.9 + 0.05)
    lp = old + 0.4 * torch.randn(8, 3, generator=g)  # far enough apart that clipping and the weight cap act
    lp[0, 0] = old[0, 0] + 2.0  # ratio e^2 = 7.4: above CISPO's cap of 5
    ref = old + 0.2 * torch.randn(8, 3, generator=g)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, -1.0, 0.0, 3.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]).float()
    return lp, old, ref, rewards, mask


def _minimind_loss(lp, old, ref, rewards, mask, loss_type, beta=0.1, eps=0.2, eps_high=5.0, G=4):
    """MiniMind's trainer/train_grpo.py (d65ef2c) update, written out by hand on the same tensors."""
    grouped = rewards.view(-1, G)
    mean = grouped.mean(dim=1).repeat_interleave(G)
    std = grouped.std(dim=1, unbiased=False).repeat_interleave(G)
    adv = ((rewards - mean) / (std + 1e-4)).unsqueeze(1)
    d = ref - lp
    kl = torch.exp(d) - d - 1
    ratio = torch.exp(lp - old)
    if loss_type == "cispo":
        per_token = -(torch.clamp(ratio, max=eps_high).detach() * adv * lp - beta * kl)
    else:
        per_token = -(torch.min(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv) - beta * kl)
    return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()


def _our_loss(c, lp, old, ref, rewards, mask):
    """What train_ppo.py computes for the same batch under the resolved settings: the estimator's advantages, the
    registered loss and the KL in the loss (one process, one minibatch of every row: scale 1)."""
    from trainer.ppo import aggregate_loss
    from trainer.registry import estimator_spec

    adv, _ = estimator_spec(c.advantage_estimator).fn(rewards, None, None, mask, c.kl_coef, c)
    pg, _ = policy_loss_spec(c.policy_loss).fn(lp, old, adv, mask, c, None)
    return pg + c.kl_coef * aggregate_loss(kl_penalty(lp, ref, c.kl_estimator), mask, c.loss_agg_mode, c.max_gen_len)


@pytest.mark.parametrize("loss_type", ["cispo", "grpo"])
def test_a_minimind_grpo_command_line_gives_minimind_s_math_on_one_batch(loss_type):
    c = _resolved(MINIMIND_GRPO + ["--loss_type", loss_type])
    got = (c.advantage_estimator, c.kl_placement, c.kl_estimator, c.mini_batch_size, c.ppo_update_iters)
    assert got == ("grpo", "loss", "k3", 8, 1)
    assert c.swanlab_mode != "disabled"  # the bare --use_wandb turns logging on
    lp, old, ref, rewards, mask = _minimind_batch()
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    theirs, ours = _minimind_loss(a, old, ref, rewards, mask, loss_type), _our_loss(c, b, old, ref, rewards, mask)
    theirs.backward()
    ours.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    assert torch.allclose(b.grad, a.grad, rtol=1e-5, atol=1e-7)
    # ...and the flags matter: our own GRPO defaults (unbiased std, token mean) give another loss.
    ours_default = ["--advantage_estimator", "grpo", "--num_generations", "4", "--batch_size", "2", "--mini_batch_size", "8",
                    "--policy_loss", "cispo" if loss_type == "cispo" else "vanilla", "--kl_coef", "0.1"]
    other = _our_loss(_resolved(ours_default),
                      lp, old, ref, rewards, mask)
    assert other.item() != pytest.approx(theirs.item(), rel=1e-3)


def test_minimind_grpo_defaults_and_conflicts(capsys):
    c = _resolved(["--loss_type", "cispo", "--batch_size", "4"])  # MiniMind's defaults for what is not given
    assert (c.policy_loss, c.num_generations, c.kl_coef, c.cispo_max_weight, c.clip_epsilon, c.adv_std_unbiased, c.adv_eps) == \
        ("cispo", 6, 0.1, 5.0, 0.2, 0, 1e-4)
    assert c.save_weight == "grpo" and _resolved(["--loss_type", "cispo", "--batch_size", "4", "--save_weight", "x"]).save_weight == "x"
    assert _resolved(["--beta", "0.04", "--batch_size", "4"]).policy_loss == "cispo"  # any MiniMind GRPO name: its default loss
    c = _resolved(["--loss_type", "grpo", "--num_generations", "2", "--batch_size", "4", "--epsilon", "0.3"])
    assert (c.policy_loss, c.num_generations, c.clip_epsilon, c.clip_epsilon_high) == ("vanilla", 2, 0.3, 0.3)
    assert _resolved([]).policy_loss == "vanilla" and _resolved([]).num_generations == 1  # no MiniMind GRPO name: ours
    for ours, theirs in (("kl_coef", "beta"), ("clip_epsilon", "epsilon"), ("cispo_max_weight", "epsilon_high")):
        with pytest.raises(SystemExit, match=f"--{theirs} is MiniMind's name for --{ours}: give one of them"):
            parse_args([f"--{theirs}", "1.5", f"--{ours}", "1.5"])
    for argv in (["--use_wandb"], ["--use_wandb", "1"]):
        assert _resolved(argv).swanlab_mode == "local"
    assert _resolved(["--use_wandb", "0"]).swanlab_mode == "disabled"


@pytest.mark.parametrize("name", LOSSES)
def test_rollout_is_weights_multiply_each_tokens_loss(name):
    """An engine's samples: the loss with weights w equals the loss of the per-token losses times w (verl's
    pg_losses * rollout_is_weights; TRL's per_token_loss * importance_sampling_ratio); weights of 1 change nothing.
    GMPO, defined per response, weighs each response by its mean weight."""
    g = torch.Generator().manual_seed(3)
    old = torch.log(torch.rand(3, 4, generator=g) * 0.9 + 0.05)
    lp = old + 0.1 * torch.randn(3, 4, generator=g)
    adv = torch.tensor([1.0, -0.5, 2.0])[:, None].expand(3, 4).contiguous()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float32)
    c = cfg(loss_agg_mode=policy_loss_spec(name).loss_agg, clip_cov_ratio=0.3, clip_cov_lb=-0.01, clip_cov_ub=10.0,
            kl_cov_ratio=0.3, gspo_clip_low=0.5, gspo_clip_high=0.5)

    def fn(*args, **kw):  # clip_cov draws its tokens: the same draw for every call
        torch.manual_seed(0)
        return policy_loss_spec(name).fn(*args, **kw)

    plain, _ = fn(lp, old, adv, mask, c)
    ones, _ = fn(lp, old, adv, mask, c, None, is_weights=torch.ones(3, 4))
    assert ones.item() == pytest.approx(plain.item(), rel=1e-6)
    w = torch.tensor([[0.5, 1.0, 2.0, 1.5], [1.0, 0.25, 9.0, 9.0], [2.0, 2.0, 2.0, 0.0]])
    weighted, _ = fn(lp, old, adv, mask, c, None, is_weights=w)
    if name == "gmpo":  # -A * seq_ratio per response, times the response's mean weight: rescale each row's share
        rows = []
        for i in range(3):
            one, _ = fn(lp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], c)
            rows.append(one.item() * (w[i] * mask[i]).sum().item() / mask[i].sum().item())
        assert weighted.item() == pytest.approx(sum(rows) / 3, rel=1e-5)
        return
    # Each row alone with a constant weight scales that row's contribution; the weights enter linearly.
    a = torch.zeros_like(w)
    a[0] = w[0]
    b = w - a
    wa, _ = fn(lp, old, adv, mask, c, None, is_weights=a)
    wb, _ = fn(lp, old, adv, mask, c, None, is_weights=b)
    assert weighted.item() == pytest.approx(wa.item() + wb.item(), rel=1e-5, abs=1e-7)
    assert weighted.item() != pytest.approx(plain.item(), rel=1e-3)

