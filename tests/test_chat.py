"""scripts/chat.py: reply splitting, streaming, non-interactive turns with history, the REPL."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from model.loader import build_minimind, load_tokenizer
from model.weights import save_native_weights
from scripts import chat
from tests.tiny_hf import save_tiny_causal_lm


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("chat") / "tiny_64.pth"
    save_native_weights(build_minimind(64, 2), path, dtype=torch.float32)
    return path


def _run(weights: Path, *extra: str) -> list[str]:
    return ["--weights", str(weights), "--hidden_size", "64", "--num_hidden_layers", "2", "--max_new_tokens", "6", *extra]


def _turns(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------- pieces

@pytest.mark.parametrize("reply, think, answer", [
    ("<think>\nadd 12 and 7\n</think>\n\n<answer>\n19\n</answer>", "add 12 and 7", "<answer>\n19\n</answer>"),
    ("<think>\n\n</think>\n\n19", "", "19"),
    ("<think>\nstill thinking, cut at the lim", "still thinking, cut at the lim", ""),
    ("just an answer", None, "just an answer"),
])
def test_split_reply(reply, think, answer):
    assert chat.split_reply(reply) == (think, answer)


def test_streamer_emits_whole_characters_that_add_up_to_the_reply():
    tok = load_tokenizer()
    text = "答案是 19，因为 12 + 7 = 19。"
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    pieces: list[str] = []
    s = chat.ReplyStreamer(tok, pieces.append)
    s.put(torch.tensor([[1, 2, 3]]))  # the prompt: skipped
    for i in ids:
        s.put(torch.tensor([i]))
    s.end()
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert len(pieces) > 3  # it streamed, it did not wait for the end


def test_styled_writer_dims_only_the_think_part():
    buf = io.StringIO()
    w = chat.StyledWriter(buf, color=True, prefix="<think>\n")
    for piece in ["a b", "</thi", "nk>\n\n", "19"]:
        w.write(piece)
    out = buf.getvalue()
    assert out.endswith("19") and f"{chat.DIM}19" not in out
    assert out.startswith(f"{chat.DIM}<think>\n{chat.RESET}{chat.DIM}a b{chat.RESET}")
    plain = io.StringIO()
    w = chat.StyledWriter(plain, color=False, prefix="<think>\n")
    w.write("x</think>\n\ny")
    assert plain.getvalue() == "<think>\nx</think>\n\ny"


def test_explicit_sampling_settings_beat_folder_defaults():
    cfg = chat.generation_config(chat.Settings(temperature=0.7, top_k=0, top_p=0.9), [2], 0)
    assert (cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, cfg.repetition_penalty) == (True, 0.7, 0, 0.9, 0.0, 1.0)
    greedy = chat.generation_config(chat.Settings(temperature=0), [2, 5], 0)
    assert greedy.do_sample is False and greedy.eos_token_id == [2, 5]


# ---------------------------------------------------------------- the script

def test_prompt_mode_streams_and_shows_think_and_answer(weights, capsys):
    chat.main(_run(weights, "--prompt", "12 + 7 = ?", "--open_thinking", "1"))
    out = capsys.readouterr().out
    assert out.startswith("user> 12 + 7 = ?\nassistant> <think>\n")
    assert "[think]\n" in out and "[answer]\n" in out
    # 6 random tokens never close the think block: the answer section says so.
    assert "cut while thinking" in out and "cut at --max_new_tokens 6" in out
    assert "\033[" not in out  # no colour codes when stdout is not a terminal


def test_two_prompts_are_one_conversation(weights, tmp_path, capsys):
    log = tmp_path / "t.jsonl"
    chat.main(_run(weights, "--prompt", "12 + 7 = ?", "--prompt", "再乘以 2 呢？", "--open_thinking", "0",
                   "--temperature", "1", "--system", "Be brief.", "--transcript", str(log)))
    first, second = _turns(log)
    assert first["think"] == "" and first["answer"]  # closed thinking: everything generated is the answer
    assert first["prompt_text"] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n12 + 7 = ?<|im_end|>\n"
                                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # The second turn sees the first exchange, the assistant turn as its answer only.
    assert second["prompt_text"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n12 + 7 = ?<|im_end|>\n"
        f"<|im_start|>assistant\n{first['answer']}<|im_end|>\n"
        "<|im_start|>user\n再乘以 2 呢？<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    out = capsys.readouterr().out
    assert out.count("[answer]") == 2 and f"[answer]\n{first['answer']}\n" in out


def test_history_off_and_greedy_is_repeatable(weights, tmp_path, capsys):
    log = tmp_path / "t.jsonl"
    chat.main(_run(weights, "--prompt", "hi", "--prompt", "hi", "--history", "0", "--temperature", "0",
                   "--open_thinking", "0", "--transcript", str(log)))
    a, b = _turns(log)
    assert a["prompt_text"] == b["prompt_text"] and a["reply"] == b["reply"]


def test_repl_clear_and_exit(weights, monkeypatch, tmp_path, capsys):
    lines = iter(["hello", "/clear", "again", "/exit", "never read"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    log = tmp_path / "t.jsonl"
    chat.main(_run(weights, "--open_thinking", "0", "--transcript", str(log)))
    out = capsys.readouterr().out
    assert "/clear resets the history" in out and "(history cleared)" in out
    first, second = _turns(log)
    assert "hello" not in second["prompt_text"]  # history was cleared
    assert len(_turns(log)) == 2  # nothing after /exit


def test_hf_directory_of_another_family(tmp_path, capsys):
    """A local HF model with its own template (no think support): the reply is all answer."""
    save_tiny_causal_lm(tmp_path / "q2", "qwen2")
    log = tmp_path / "t.jsonl"
    chat.main(["--hf_path", str(tmp_path / "q2"), "--prompt", "hi", "--max_new_tokens", "4", "--transcript", str(log)])
    (turn,) = _turns(log)
    assert turn["prompt_text"] == "<s>user: hi</s>\nassistant:"
    assert turn["think"] is None
    out = capsys.readouterr().out
    assert "[think]" not in out and "[answer]" in out


def test_bad_arguments_fail_with_one_line(weights, tmp_path):
    with pytest.raises(SystemExit, match="exactly one of --weights"):
        chat.main(["--prompt", "hi"])
    with pytest.raises(SystemExit, match="--hidden_size"):
        chat.main(["--weights", str(weights), "--hidden_size", "96", "--num_hidden_layers", "2", "--prompt", "hi"])
    with pytest.raises(SystemExit, match="--actor_path"):
        chat.main(["--hf_path", str(tmp_path / "missing"), "--prompt", "hi"])
