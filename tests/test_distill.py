"""trainer/distill.py and trainer/ppo.py distill_penalty: on-policy distillation's per-token reverse KL in the reward,
the teacher loaded like the reference or served by vLLM (tests/teacher_standin.py), the flags' checks, and the loss
against TRL's own (tests/peer_trl_distill.py, run in a virtualenv with TRL; skipped without one)."""

from __future__ import annotations

import os
import re
import subprocess
import types
from pathlib import Path

import pytest
import torch

import trainer.estimators  # registers the estimators
import trainer.losses  # noqa: F401 - registers the losses
from model.forward import policy_forward
from model.loader import build_minimind, load_tokenizer
from model.weights import WeightsError, save_native_weights
from tests.helpers import ROOT, build_update_world, run_experience
from tests.teacher_standin import TeacherStandin
from trainer.distill import TEACHER_KEY_ENV, TeacherError, TeacherServer, load_teacher, reverse_kl, tokenizer_mismatch
from trainer.ppo import compute_token_rewards, distill_penalty, kl_penalty
from trainer.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

PEER_PYTHON = os.environ.get("MINIPPO_TRL_PYTHON", "/tmp/trl-venv/bin/python")


def _tok():
    return load_tokenizer()


# --------------------------------------------------------------------------------------- the math
def test_without_a_teacher_the_penalty_is_the_kl_as_before():
    kl, lp = torch.randn(3, 5), torch.randn(3, 5)
    assert distill_penalty(kl, 0.02, lp, None, 1.0) == (kl, 0.02)
    assert distill_penalty(kl, 0.02, lp, torch.randn(3, 5), 0.0) == (kl, 0.02)
    assert distill_penalty(None, 0.02, lp, None, 1.0) == (None, 0.02)


def test_each_token_reward_gets_minus_coef_times_the_reverse_kl_sample():
    s, t = torch.log_softmax(torch.randn(2, 4, 7), -1)[..., 0], torch.log_softmax(torch.randn(2, 4, 7), -1)[..., 0]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    kl = kl_penalty(s, torch.zeros_like(s), "k1")
    pen, coef = distill_penalty(kl, 0.1, s, t, 0.5)
    r = compute_token_rewards(torch.tensor([2.0, -1.0]), pen, mask, coef)
    want = -(0.1 * kl + 0.5 * (s - t)) * mask
    want[0, 2] += 2.0
    want[1, 3] -= 1.0
    torch.testing.assert_close(r, want)
    pen, coef = distill_penalty(None, 0.1, s, t, 0.5)  # KL in the loss: the teacher's term alone
    torch.testing.assert_close(compute_token_rewards(torch.zeros(2), pen, mask, coef), -0.5 * (s - t) * mask)


def test_a_far_teacher_is_clamped_as_the_kl_is_not_infinite():
    s, t = torch.zeros(1, 2), torch.tensor([[-float("inf"), -1e9]])
    pen, _ = distill_penalty(None, 0.0, s, t, 1.0)
    assert torch.isfinite(pen).all() and pen.max() == 20.0


def _cfg(**kw):
    base = dict(num_generations=1, gamma=0.0, lam=1.0, adv_eps=1e-6, adv_std_unbiased=1, clip_epsilon=0.2,
                clip_epsilon_high=0.2, loss_agg_mode="token_mean", max_gen_len=1)
    return types.SimpleNamespace(**{**base, **kw})


def _our_expected_surrogate(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, temp: float) -> torch.Tensor:
    """Our pipeline's expected loss at ratio 1, summed exactly over the vocabulary: every (position, token y) is a
    one-token response sampled with probability pi(y); its advantage from distill_penalty through the registered
    dr_grpo estimator (scores 0, --gamma 0), its loss from the registered vanilla loss, weighted by pi(y) through the
    loss's importance weights. Its value is sum_y pi k1 (the reverse KL) and its gradient GKD's in expectation."""
    V = student.shape[-1]
    pos = mask.bool().reshape(-1)
    s = torch.log_softmax(student.reshape(-1, V)[pos].double() / temp, -1)  # [N, V]
    t = torch.log_softmax(teacher.reshape(-1, V)[pos].double() / temp, -1)
    N = s.shape[0]
    logprobs, old, tlp = s.reshape(-1, 1), s.detach().reshape(-1, 1), t.reshape(-1, 1)  # rows (n, y), R = 1
    m = torch.ones_like(logprobs)
    pen, coef = distill_penalty(None, 0.0, old, tlp, 1.0)
    cfg = _cfg(num_generations=V)
    adv, _ = ADVANTAGE_ESTIMATORS["dr_grpo"].fn(torch.zeros(N * V), pen, None, m, coef, cfg)
    weights = (old.exp() * V).detach()  # token_mean over N*V rows of V pi(y) x loss = sum_y pi(y) loss / N
    loss, _ = POLICY_LOSSES["vanilla"].fn(logprobs, old, adv, m, cfg, is_weights=weights)
    return loss


def test_our_estimator_is_in_expectation_the_full_vocabulary_reverse_kl_and_its_gradient():
    torch.manual_seed(0)
    student = (torch.randn(2, 3, 11, dtype=torch.float64) * 2).requires_grad_(True)
    teacher, mask, T = torch.randn(2, 3, 11, dtype=torch.float64) * 2, torch.tensor([[1, 1, 0], [1, 1, 1]]), 0.8
    exact = reverse_kl(student, teacher, T)  # [2, 3], fp32
    exact_loss = (exact * mask).sum() / mask.sum()
    torch.autograd.grad(exact_loss, student)  # reverse_kl is differentiable (GKD's loss)
    ours = _our_expected_surrogate(student, teacher, mask, T)
    g_ours = torch.autograd.grad(ours, student)[0]
    s = torch.log_softmax(student.detach() / T, -1)
    t = torch.log_softmax(teacher / T, -1)
    k1_expectation = ((s.exp() * (s - t)).sum(-1) * mask).sum() / mask.sum()
    torch.testing.assert_close(exact_loss.double(), k1_expectation, atol=1e-6, rtol=1e-6)
    # -A r at ratio 1 is sum pi (-A) = sum pi k1 = the reverse KL; the gradient: autograd's on the exact KL
    torch.testing.assert_close(ours.detach(), k1_expectation, atol=1e-6, rtol=1e-6)  # fp32 rewards
    st = student.detach().clone().requires_grad_(True)
    ss, tt = torch.log_softmax(st / T, -1), torch.log_softmax(teacher / T, -1)
    g_exact = torch.autograd.grad((((ss.exp() * (ss - tt)).sum(-1)) * mask).sum() / mask.sum(), st)[0]
    torch.testing.assert_close(g_ours, g_exact, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not Path(PEER_PYTHON).is_file(), reason=f"no TRL virtualenv at {PEER_PYTHON} (MINIPPO_TRL_PYTHON)")
def test_against_trl_distillation_and_gkd_losses(tmp_path):
    """TRL's DistillationTrainer loss and GKDTrainer.generalized_jsd_loss (beta = 1) on the same logits: their value is
    our reverse_kl's masked mean and the expectation of our per-token k1 reward; their gradient is our estimator's
    expected gradient (TRL 1.16.0, torch 2.13.0+cpu, transformers 5.25.0 when written)."""
    torch.manual_seed(1)
    student, teacher = torch.randn(2, 5, 13) * 3, torch.randn(2, 5, 13) * 3
    mask, T = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), 0.7
    torch.save({"student_logits": student, "teacher_logits": teacher, "mask": mask, "temperature": torch.tensor(T)},
               tmp_path / "in.pt")
    r = subprocess.run([PEER_PYTHON, str(ROOT / "tests" / "peer_trl_distill.py"), str(tmp_path / "in.pt"),
                        str(tmp_path / "out.pt")], cwd="/tmp", capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr[-2000:]
    peer = torch.load(tmp_path / "out.pt", weights_only=True)
    ours = (reverse_kl(student, teacher, T) * mask).sum() / mask.sum()
    torch.testing.assert_close(peer["distillation_loss"].double(), ours.double(), atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(peer["gkd_loss"].double(), ours.double(), atol=2e-6, rtol=2e-6)
    st = student.double().requires_grad_(True)
    g = torch.autograd.grad(_our_expected_surrogate(st, teacher.double(), mask, T), st)[0]
    torch.testing.assert_close(peer["gkd_grad"].double(), g, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(peer["distillation_grad"].double(), g, atol=2e-6, rtol=2e-5)


# --------------------------------------------------------------------------------------- the teacher
def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path):
    tok = _tok()
    other = _tok()
    other.add_tokens(["<teacher_only>"])
    assert tokenizer_mismatch(tok, _tok()) is None
    assert "vocabularies differ" in tokenizer_mismatch(tok, other)
    d = tmp_path / "hf_teacher"
    m = build_minimind(32, 1, vocab_size=len(other))
    m.save_pretrained(d)
    other.save_pretrained(d)
    cfg = types.SimpleNamespace(teacher_model_path=str(d), trust_remote_code=0, tokenizer_path=None, actor_path=None)
    with pytest.raises(WeightsError) as e:
        load_teacher(cfg, tok, torch.device("cpu"), torch.float32)
    assert "\n" not in str(e.value) and str(d) in str(e.value) and "model/" in str(e.value)
    assert "'<teacher_only>' is id None for the actor" in str(e.value)


def test_a_native_teacher_is_read_off_its_file_frozen_and_leaves_the_random_stream_alone(tmp_path):
    torch.manual_seed(3)
    wide = build_minimind(96, 3)
    save_native_weights(wide, tmp_path / "teacher_96.pth", dtype=torch.float32)
    cfg = types.SimpleNamespace(teacher_model_path=str(tmp_path / "teacher_96.pth"), trust_remote_code=0, tokenizer_path=None,
                                actor_path=None)
    torch.manual_seed(7)
    teacher = load_teacher(cfg, _tok(), torch.device("cpu"), torch.float32)
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))  # the random init before the weights load drew from a forked stream
    assert (teacher.config.hidden_size, teacher.config.num_hidden_layers) == (96, 3)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    for a, b in zip(wide.state_dict().values(), teacher.state_dict().values()):
        assert torch.equal(a.float(), b.float())


@pytest.mark.parametrize("name, says", [("bad.pth", "cannot be read as a tensor-only state dict"),
                                         ("nowhere.pth", "--teacher_model_path .*nowhere.pth: no such directory or .pth file"),
                                         ("hf_dir_without_model", "--teacher_model_path")])
def test_a_bad_teacher_is_one_line_naming_the_teacher_flag(tmp_path, name, says):
    (tmp_path / "bad.pth").write_bytes(b"not a zip")
    (tmp_path / "hf_dir_without_model").mkdir()
    cfg = types.SimpleNamespace(teacher_model_path=str(tmp_path / name), trust_remote_code=0, tokenizer_path=None, actor_path=None)
    with pytest.raises((WeightsError, OSError, ValueError)) as e:
        load_teacher(cfg, _tok(), torch.device("cpu"), torch.float32)
    assert "\n" not in str(e.value).strip() and re.search(says, str(e.value)), str(e.value)


# --------------------------------------------------------------------------------------- the served teacher
@pytest.fixture(scope="module")
def served():
    torch.manual_seed(5)
    model = build_minimind(32, 1).eval()
    return model, _tok()


def _batch(tok):
    """Two left-padded prompts + right-padded responses (the rollout's layout), R = 4."""
    pad = tok.pad_token_id
    seq = torch.tensor([[pad, pad, 11, 12, 13, 21, 22, pad, pad], [31, 32, 33, 34, 35, 41, 42, 43, 44]])
    att = (seq != pad).long()
    att[0, :2] = 0
    return seq, att


def test_the_served_teacher_gives_the_local_forwards_log_probs(served):
    model, tok = served
    srv = TeacherStandin(model, tok, api_key="s3cret").start()
    try:
        os.environ[TEACHER_KEY_ENV] = "s3cret"
        teacher = TeacherServer(srv.url, timeout=30).connect(tok)
        seq, att = _batch(tok)
        got = teacher.logprobs(seq, att, 4)
        with torch.no_grad():
            want, _ = policy_forward(model, seq, att, 4, 1.0)
        resp = att[:, -4:].bool()
        torch.testing.assert_close(got[resp], want[resp], atol=1e-5, rtol=1e-5)
        assert (got[~resp] == 0).all()
        sent = srv.requests[-1]["body"]
        assert sent["prompt_logprobs"] == 0 and sent["prompt"][0] == [11, 12, 13, 21, 22]  # pads never sent
    finally:
        os.environ.pop(TEACHER_KEY_ENV, None)
        srv.stop()


@pytest.mark.parametrize("mode, says", [("logits", "serves logits, not log-probs"), ("short", "without a prompt log-prob per token"),
                                        ("nan", "expected"), ("other_tokenizer", "another tokenizer")])
def test_a_server_answering_outside_the_contract_is_refused_in_one_line(served, mode, says):
    model, tok = served
    srv = TeacherStandin(model, tok, mode=mode).start()
    try:
        with pytest.raises(TeacherError) as e:
            TeacherServer(srv.url, timeout=30).connect(tok)
        assert says in str(e.value) and "\n" not in str(e.value) and srv.url in str(e.value)
    finally:
        srv.stop()


def test_a_server_that_wants_a_key_says_which_variable(served):
    model, tok = served
    srv = TeacherStandin(model, tok, api_key="k").start()
    try:
        with pytest.raises(TeacherError, match=f"set {TEACHER_KEY_ENV}"):
            TeacherServer(srv.url, timeout=30).connect(tok)
    finally:
        srv.stop()


def test_no_server_is_one_line_saying_to_start_it():
    with pytest.raises(TeacherError, match="not reachable.*start it first"):
        TeacherServer("http://127.0.0.1:9", timeout=5).connect(_tok())


# --------------------------------------------------------------------------------------- the flags
@pytest.mark.parametrize("flags, says", [
    (["--distill_coef", "1"], "give --teacher_model_path"),
    (["--teacher_url", "http://h:1"], "--distill_coef, which is 0"),
    (["--distill_coef", "1", "--teacher_url", "http://h:1", "--teacher_model_path", "out"], "one teacher two ways"),
    (["--distill_coef", "1", "--teacher_url", "http://h:1"], "use --temperature 1"),
    (["--distill_coef", "1", "--teacher_url", "h:1", "--temperature", "1"], "expected http://HOST:PORT"),
    (["--distill_coef", "nan", "--teacher_model_path", "out"], "finite number >= 0"),
    (["--distill_coef", "1", "--teacher_model_path", "out", "--policy_loss", "gspo", "--advantage_estimator", "grpo",
      "--num_generations", "2", "--kl_placement", "loss"], "needs one advantage per response"),
])
def test_distill_flags_are_checked_in_one_line(flags, says):
    from trainer.run.cli import parse_args, validate

    with pytest.raises(SystemExit) as e:
        validate(parse_args(flags))
    assert says in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------------------- a step
def test_a_step_scores_the_teacher_and_a_teacher_equal_to_the_start_is_kl_zero(tmp_path):
    first = build_update_world(["--advantage_estimator", "reinforce_pp"])
    save_native_weights(first.actor, tmp_path / "same_64.pth", dtype=torch.float32)
    world = build_update_world(["--advantage_estimator", "reinforce_pp", "--distill_coef", "1",
                                "--teacher_model_path", str(tmp_path / "same_64.pth")])
    assert not world.models.teacher.training
    ro, metrics = run_experience(world)
    mask = ro.response_mask.bool()
    torch.testing.assert_close(ro.teacher_logprobs[mask], ro.old_logprobs[mask], atol=1e-4, rtol=1e-4)
    assert abs(metrics["distill/reverse_kl"]) < 1e-4


def test_a_step_with_another_teacher_puts_minus_k1_in_the_advantage(tmp_path):
    torch.manual_seed(11)
    save_native_weights(build_minimind(64, 2), tmp_path / "other_64.pth", dtype=torch.float32)
    flags = ["--advantage_estimator", "dr_grpo", "--num_generations", "2", "--gamma", "0", "--kl_coef", "0",
             "--format_weight", "0", "--tag_weight", "0", "--accuracy_weight", "0", "--eos_penalty", "0", "--ifeval_weight", "0",
             "--distill_coef", "1", "--teacher_model_path", str(tmp_path / "other_64.pth"), "--mini_batch_size", "4"]
    world = build_update_world(flags, n_prompts=2)
    ro, metrics = run_experience(world)
    mask = ro.response_mask.bool()
    k1 = ro.old_logprobs - ro.teacher_logprobs
    torch.testing.assert_close(ro.advantages[mask], -k1[mask])  # Thinking Machines' per-token advantage, exactly
    assert metrics["distill/reverse_kl"] > 0.01  # another random model: near uniform both, but apart
