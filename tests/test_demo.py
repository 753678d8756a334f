"""The embedded demo: the shipped artifacts load, and a shortened default PPO run improves the
held-out reasoning-format rate and answer accuracy by much more than the noise, and the shipped
reward model keeps its held-out pair accuracy.

Noise: 4 binomial standard errors of a difference of two rates on the 500 held-out prompts (~12.6
accuracy points at p = 0.5). That is far above the measured run-to-run spread of the default run
(greedy accuracy 64.2 / 64.4 / 64.6% over seeds 42 / 1 / 2, see README), so the bar is conservative."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from tests.helpers import ROOT, read_metrics, run_train

SFT = ROOT / "out" / "full_sft_128.pth"
RM = ROOT / "out" / "demo_rm"


def _evaluate(weights: Path, n: int = 500) -> dict:
    from dataset.rlaif import read_rlaif_jsonl
    from model.loader import load_policy
    from trainer.evaluate import EvalSettings, evaluate_policy

    policy, tok = load_policy(weights=weights, hidden_size=128, num_hidden_layers=4)
    records, _ = read_rlaif_jsonl(ROOT / "dataset" / "demo_eval.jsonl")
    return evaluate_policy(policy.eval(), tok, records[:n], EvalSettings(temperature=0.0))


def test_shipped_artifacts_load():
    from model.loader import load_policy, load_reward_model

    policy, tok = load_policy(weights=SFT, hidden_size=128, num_hidden_layers=4)
    assert policy.config.vocab_size == len(tok) == 6400
    rm, rm_tok = load_reward_model(RM)
    assert rm.config.num_labels == 1


@pytest.mark.slow
def test_short_default_ppo_improves_format_and_accuracy_beyond_noise(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(SFT, out / SFT.name)
    flags = ["--save_dir", str(out), "--max_steps", "50", "--run_dir", str(tmp_path / "run"),
             "--checkpoint_dir", str(tmp_path / "ckpt"), "--swanlab_mode", "disabled", "--save_interval", "50",
             "--reward_model_path", str(RM), "--data_path", str(ROOT / "dataset" / "demo_train.jsonl")]
    run_train(flags, cwd=tmp_path, timeout=1200)
    before, after = _evaluate(SFT), _evaluate(out / "ppo_actor_128.pth")
    n = before["n"]
    for key in ("format_rate", "accuracy"):
        # Noise: binomial standard error of a difference of two rates measured on n prompts each.
        p = (before[key] + after[key]) / 2
        noise = math.sqrt(2 * max(p * (1 - p), 0.01) / n)
        assert after[key] - before[key] > 4 * noise, (key, before, after)
    rows = read_metrics(tmp_path / "run")
    steps = [r for r in rows if "reward/total" in r]
    assert steps[-1]["reward/total"] > steps[0]["reward/total"]
    # Evaluation during training is on for the demo's data: greedy, held-out, before step 1 and after step 50.
    evals = [r for r in rows if "eval/format_rate" in r]
    assert [r["step"] for r in evals] == [0, 50] and evals[-1]["eval/format_rate"] > evals[0]["eval/format_rate"] + 0.3


@pytest.mark.slow
def test_shipped_reward_model_meets_its_held_out_pair_accuracy():
    """The README's figure for out/demo_rm, through the exact scorer PPO uses, on the held-out pairs
    regenerated from the seeded generator (the same rows builders/make_demo_data.py writes)."""
    from builders.train_reward_model import pair_accuracy, score_pairs
    from dataset.demo_task import generate_all
    from model.loader import load_reward_model
    from trainer.reward_model import RewardModelScorer

    rows = generate_all(0, n_train=0, n_eval=0, n_sft=0, n_pairs=0)["demo_pairs_eval"]
    assert len(rows) == 1000
    rm, rm_tok = load_reward_model(RM)
    scorer = RewardModelScorer(rm, rm_tok, max_length=512, batch_size=250, clip=float("inf"))
    s_chosen, s_rejected = score_pairs(scorer, rows)
    acc = pair_accuracy(s_chosen - s_rejected, [r["kind"] for r in rows])
    assert acc["all"] >= 0.94, acc  # README: 95.1% (the target is 90%)
    # Format-level preferences are what the RM must never get wrong.
    for kind in ("full_vs_plain", "correct_vs_broken", "full_vs_wrong_plain"):
        assert acc[kind] >= 0.98, (kind, acc)
