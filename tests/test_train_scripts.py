"""builders/train_sft.py and builders/train_reward_model.py: their pure parts, and the rebuild chain end to end on a slice."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dataset.rlaif import PromptRecord, RLAIFDataset
from model.loader import load_tokenizer
from trainer.reward_model import RewardModelScorer

SCRIPTS = Path(__file__).resolve().parents[1] / "builders"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sft = _load("train_sft")
rm_script = _load("train_reward_model")

USER = {"role": "user", "content": "What is 12 + 7?"}
FULL = "<think>\nones: 2+7=9\ntens: 1\n</think>\n<answer>\n19\n</answer>"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_sft_prompt_tokens_are_exactly_the_ppo_prompt(tok):
    ids, labels = sft.encode_sft_example(tok, [USER, {"role": "assistant", "content": FULL}])
    ppo = RLAIFDataset([PromptRecord([USER], None, "mem:1")], tok, max_prompt_len=256)[0]["input_ids"]
    n = len(ppo)
    assert ids[:n] == ppo  # the policy learns to continue exactly where PPO's prompts end
    assert labels[:n] == [sft.IGNORE_INDEX] * n
    assert labels[n:] == ids[n:]
    assert ids[-1] == tok.eos_token_id
    # The learned text is the reply after the "<think>\n" the prompt already holds.
    assert tok.decode(ids[n:-1]) == FULL[len("<think>\n"):]


def test_sft_rejects_replies_without_the_think_prefix(tok):
    with pytest.raises(ValueError, match="must start with"):
        sft.encode_sft_example(tok, [USER, {"role": "assistant", "content": "19"}], "f.jsonl:3")
    with pytest.raises(ValueError, match="end with the assistant"):
        sft.encode_sft_example(tok, [USER], "f.jsonl:4")


def test_sft_missing_tokenizer_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="--tokenizer_path .*missing_tok: not a local directory"):
        sft.main(["--tokenizer_path", str(tmp_path / "missing_tok"), "--max_steps", "1"])


def test_sft_collate_and_loss_mask():
    ids, labels = sft.collate_right_pad([[1, 2, 3], [4, 5]], [[-100, 2, 3], [-100, 5]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert labels.tolist() == [[-100, 2, 3], [-100, 5, -100]]


def test_lr_schedule_warmup_then_cosine_to_floor():
    def lr(s):
        return sft.lr_at(s, total_steps=110, warmup_steps=10, base_lr=1.0, min_lr_ratio=0.1)

    assert lr(0) == pytest.approx(0.1) and lr(9) == pytest.approx(1.0)
    assert lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert lr(110) == pytest.approx(0.1)


def test_rm_encoding_matches_the_ppo_scorer(tok):
    conv = [USER, {"role": "assistant", "content": FULL}]
    ours = rm_script.encode_conversations(tok, [conv], max_length=512)[0]
    model = rm_script.build_reward_model(tok, hidden_size=16, num_hidden_layers=1, num_heads=2, max_length=64)
    assert ours == RewardModelScorer(model, tok)._tokenize([conv])[0]
    assert rm_script.encode_conversations(tok, [conv], max_length=5)[0] == ours[-5:]  # keeps the end


def test_bradley_terry_loss_and_pair_accuracy():
    loss = rm_script.bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1.0)) + math.log(2.0)) / 2)
    acc = rm_script.pair_accuracy(torch.tensor([0.5, -0.1, 0.0, 2.0]), ["a", "a", "b", "b"])
    assert acc == {"all": 0.5, "a": 0.5, "b": 0.5}


def test_epoch_batches_and_length_split():
    import numpy as np

    batches = sft.epoch_batches(9, batch_size=2, rng=np.random.default_rng(0))
    flat = [int(i) for b in batches for i in b]
    assert len(batches) == 4 and all(len(b) == 2 for b in batches)
    assert len(set(flat)) == 8  # 9 rows, batch 2: one row dropped, none repeated
    lengths = [5, 50, 6, 51, 7]
    parts = sft.split_by_length(np.array([0, 1, 2, 3, 4]), lengths, micro_batches=2)
    assert [p.tolist() for p in parts] == [[0, 2, 4], [1, 3]]  # short rows together, long rows together


def test_sft_loss_with_fixed_token_normaliser_is_sum_over_constant(tok):
    from model.loader import build_minimind

    torch.manual_seed(0)
    model = build_minimind(32, 1, vocab_size=len(tok))
    ids, labels = sft.collate_right_pad([[1, 5, 6, 7], [1, 8, 9]], [[-100, -100, 6, 7], [-100, 8, 9]], pad_id=0)
    mean = sft.sft_loss(model, ids, labels)
    assert sft.sft_loss(model, ids, labels, tokens_per_batch=2.0).item() == pytest.approx(mean.item() * 4 / 2, rel=1e-5)
    logits = model(input_ids=ids).logits.float()
    manual = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    assert mean.item() == pytest.approx(manual.item(), rel=1e-5)


def test_reward_model_starts_from_the_policy_trunk(tok, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from model.loader import build_minimind
    from model.weights import save_native_weights

    torch.manual_seed(0)
    policy = build_minimind(64, 2, vocab_size=len(tok), num_attention_heads=2, num_key_value_heads=1)
    path = tmp_path / "full_sft_64.pth"
    save_native_weights(policy, path, dtype=torch.float32)
    rm = rm_script.reward_model_from_policy(path, tok)
    ids = torch.tensor([tok("<|im_start|>user\nWhat is 2 + 3?<|im_end|>")["input_ids"]])
    with torch.no_grad():
        want = policy.model(input_ids=ids).last_hidden_state
        got = rm.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, want)  # same trunk, same hidden states
    rm.save_pretrained(tmp_path / "rm")  # a stock HF classifier: no remote code to load it
    again = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert type(again).__name__ == "Qwen3ForSequenceClassification" and again.config.num_labels == 1

    with pytest.raises(SystemExit, match="--init_from"):
        rm_script.reward_model_from_policy(tmp_path / "missing.pth", tok)


def _run_script(name: str, *flags: str, cwd: Path) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), "--num_threads", "1", *flags],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
def test_rebuild_commands_make_loadable_deterministic_artifacts(tmp_path):
    """The README's rebuild chain on a slice of the demo data: SFT policy; the RM's digit-split
    tokenizer, its SFT base and the RM from that trunk. The same seed gives byte-identical policy
    weights, and both artifacts load through PPO's loaders."""
    from dataset.demo_task import generate_all
    from model.loader import load_policy, load_reward_model

    # The SFT and pair files are not shipped (make_demo_data.py writes them): a small seeded slice.
    files = generate_all(0, n_train=0, n_eval=0, n_sft=64, n_pairs=64, n_pairs_eval=32)
    for name, stem in (("sft", "demo_sft"), ("pairs", "demo_pairs"), ("pairs_eval", "demo_pairs_eval")):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in files[stem]),
                                                encoding="utf-8")
    tiny = ["--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2"]
    for run in ("a", "b"):
        _run_script("train_sft", "--data_path", "sft.jsonl", *tiny, "--num_key_value_heads", "1", "--max_steps", "4",
                    "--batch_size", "8", "--save_dir", run, "--save_weight", "sft", cwd=tmp_path)
    assert (tmp_path / "a" / "sft_32.pth").read_bytes() == (tmp_path / "b" / "sft_32.pth").read_bytes()
    policy, tok = load_policy(weights=tmp_path / "a" / "sft_32.pth", hidden_size=32, num_hidden_layers=1)
    assert policy.config.vocab_size == len(tok)

    _load("train_tokenizer").main(["--split_digits", "--out_dir", str(tmp_path / "rm_tok")])
    _run_script("train_sft", "--data_path", "sft.jsonl", *tiny, "--num_key_value_heads", "1", "--max_steps", "4",
                "--batch_size", "8", "--tokenizer_path", "rm_tok", "--save_dir", "base", "--save_weight", "rm_base", cwd=tmp_path)
    out = _run_script("train_reward_model", "--data_path", "pairs.jsonl", "--eval_data_path", "pairs_eval.jsonl",
                      "--init_from", "base/rm_base_32.pth", "--tokenizer_path", "rm_tok", "--max_steps", "4",
                      "--batch_size", "8", "--save_path", "rm", cwd=tmp_path)
    reported = float(out.split("held-out pair accuracy (reloaded, RewardModelScorer, fp32):")[1].split()[0])
    # Giving freed heap memory back to the OS after every step (the default, --malloc_trim_interval 1, used
    # for "rm" above) or never (0) changes nothing in the result.
    _run_script("train_reward_model", "--data_path", "pairs.jsonl", "--eval_data_path", "pairs_eval.jsonl",
                "--init_from", "base/rm_base_32.pth", "--tokenizer_path", "rm_tok", "--max_steps", "4",
                "--batch_size", "8", "--save_path", "rm_no_trim", "--malloc_trim_interval", "0", cwd=tmp_path)
    assert (tmp_path / "rm_no_trim" / "model.safetensors").read_bytes() == (tmp_path / "rm" / "model.safetensors").read_bytes()
    rm, rm_tok = load_reward_model(tmp_path / "rm")
    assert rm.config.num_labels == 1 and rm.config.hidden_size == 32
    assert rm_tok.tokenize("x 106") == ["x", "Ġ1", "0", "6"]  # the RM directory carries the digit-split tokenizer
    # The figure the script prints is what PPO's scorer gets from the saved directory.
    rows = files["demo_pairs_eval"]
    scorer = RewardModelScorer(rm, rm_tok, max_length=512, batch_size=32, clip=float("inf"))
    s_chosen, s_rejected = rm_script.score_pairs(scorer, rows)
    acc = rm_script.pair_accuracy(s_chosen - s_rejected, [r["kind"] for r in rows])
    assert abs(acc["all"] - reported) < 1e-3, (acc, reported)
