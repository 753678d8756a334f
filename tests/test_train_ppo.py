"""End-to-end runs of train_ppo.py on tiny local models (CPU, seconds each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, make_tiny_world, read_metrics, run_train, tiny_flags

FIXTURE = str(ROOT / "tests" / "fixtures" / "toy_rewards.py")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("world")
    return make_tiny_world(tmp)


def test_smoke_three_steps_writes_weights_and_logs(world, tmp_path):
    flags = tiny_flags(world, tmp_path, save_dir=world["save_dir"], save_weight="smoke", swanlab_mode="offline",
                       sample_interval=1)
    r = run_train(flags, cwd=tmp_path)
    out = Path(world["save_dir"]) / f"smoke_{world['hidden']}.pth"
    state = torch.load(out, weights_only=True)
    assert state["model.embed_tokens.weight"].dtype == torch.float16  # MiniMind's format
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3]
    for key in ("reward/total", "reward/format", "reward/tags", "reward/rm", "reward/eos", "kl_ref", "ppo/approx_kl",
                "ppo/clipfrac", "ppo/entropy", "loss/policy", "loss/value", "value/explained_var", "response/length",
                "response/eos_rate", "lr/actor", "lr/critic", "tokens_per_s", "time/generate", "time/score", "time/update"):
        assert key in rows[-1], key
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["args"]["max_steps"] == 3
    assert any((tmp_path / "swanlog").rglob("*")), "swanlab offline logs were not written"
    assert list((tmp_path / "ckpt").glob("smoke_*_resume_step*.pth"))


def test_bad_flags_fail_with_one_line(world, tmp_path):
    r = run_train(tiny_flags(world, tmp_path, mini_batch_size=3), cwd=tmp_path, check=False)
    assert r.returncode != 0 and "--mini_batch_size 3 must divide" in r.stderr and "Traceback" not in r.stderr
    r = run_train(tiny_flags(world, tmp_path, hidden_size=96), cwd=tmp_path, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    r = run_train(tiny_flags(world, tmp_path, data_path=str(tmp_path / "nope.jsonl")), cwd=tmp_path, check=False)
    assert "--data_path" in r.stderr and "Traceback" not in r.stderr


def test_nonfinite_reward_skips_steps_and_stops(world, tmp_path):
    flags = tiny_flags(world, tmp_path, reward_fn=[f"{FIXTURE}:always_nan"], max_steps=10, max_nonfinite=2,
                       save_weight="nan")
    before = torch.load(Path(world["save_dir"]) / f"full_sft_{world['hidden']}.pth", weights_only=True)
    r = run_train(flags, cwd=tmp_path, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "non-finite steps in a row" in r.stdout + r.stderr
    rows = read_metrics(tmp_path / "run")
    assert [row["nonfinite"] for row in rows] == [1.0, 1.0]
    # No optimizer step was taken: the saved resume (step 1) holds the starting weights.
    resume = sorted((tmp_path / "ckpt").glob("nan_*_resume_step*.pth"))[-1]
    actor = torch.load(resume, weights_only=True)["actor"]
    assert torch.equal(actor["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.slow
def test_toy_reward_rises(world, tmp_path):
    """A reward a tiny random model can raise (share of low token ids) rises well beyond noise."""
    flags = tiny_flags(world, tmp_path, reward_fn=[f"{FIXTURE}:low_id_share"], rm_weight=0, format_weight=0,
                       tag_weight=0, accuracy_weight=0, eos_penalty=0, kl_coef=0.0, max_steps=40, batch_size=16,
                       mini_batch_size=8, learning_rate=1e-2, critic_learning_rate=3e-3, temperature=1.0,
                       max_gen_len=8, save_interval=100, sample_interval=0, epochs=20)
    run_train(flags, cwd=tmp_path, timeout=600)
    r = [row["reward/total"] for row in read_metrics(tmp_path / "run")]
    first, last = sum(r[:5]) / 5, sum(r[-5:]) / 5
    noise = torch.tensor(r[:5]).std().item()
    assert last > first + max(0.15, 4 * noise), (first, last, noise)


def test_several_generations_per_prompt(world, tmp_path):
    """--num_generations N: each prompt is sampled N times in one batch and the spread is logged."""
    flags = tiny_flags(world, tmp_path, num_generations=3, batch_size=2, mini_batch_size=3, max_steps=2,
                       save_weight="grp", sample_interval=1)
    run_train(flags, cwd=tmp_path)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all("reward/group_std" in r and r["reward/group_std"] >= 0 for r in rows)
    samples = [json.loads(l) for l in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    step1 = [s for s in samples if s["step"] == 1]
    # Rows 0..2 answer the first prompt, so the first three samples share their prompt.
    assert len({s["prompt"] for s in step1[:3]}) == 1
