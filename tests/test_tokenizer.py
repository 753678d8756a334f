import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "model"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def load_script():
    spec = importlib.util.spec_from_file_location("train_tokenizer", ROOT / "builders" / "train_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


# ---------------------------------------------------------------- layout

def test_vocab_and_special_ids(tok):
    assert len(tok) == 6400 and tok.vocab_size == 6400
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]) \
        == [0, 1, 2, 3, 4]
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 0, 1, 2)
    assert tok.model_max_length == 32768
    assert sorted(tok.all_special_ids) == [0, 1, 2]


def test_saved_files():
    names = {p.name for p in MODEL_DIR.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    assert "config.json" not in names  # model/ holds code; a config.json would shadow model configs
    config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["clean_up_tokenization_spaces"] is False


def test_think_tokens_are_single_and_not_special(tok):
    assert tok.encode("<think>") == [3] and tok.encode("</think>") == [4]
    ids = tok.encode("<think>\n1+2=3\n</think>\n<answer>\n3\n</answer><|im_end|>")
    assert ids[0] == 3 and ids.count(4) == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\n1+2=3\n</think>\n<answer>\n3\n</answer>"
    assert tok.decode(ids) == "<think>\n1+2=3\n</think>\n<answer>\n3\n</answer><|im_end|>"


def test_no_bos_or_eos_added(tok):
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    assert 1 not in tok.encode("hi") and 2 not in tok.encode("hi")


def test_numbers_are_chunked_and_small_numbers_are_single_tokens(tok):
    # Numbers are pre-split into chunks of at most three digits...
    ids = tok.encode("1234567")
    assert tok.decode(ids) == "1234567" and len(ids) >= 3
    # ...and the demo's small numbers are one token each, with the leading space attached.
    assert tok.convert_ids_to_tokens(tok.encode("47")) == ["47"]
    assert tok.convert_ids_to_tokens(tok.encode(" 47")) == ["Ġ47"]
    # The answer tags of the reasoning format are one token each.
    assert len(tok.encode("<answer>")) == 1 and len(tok.encode("</answer>")) == 1


# ---------------------------------------------------------------- chat template

def test_template_system_and_user(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    assert render(tok, msgs) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n"


def test_template_user_only_has_no_default_system(tok):
    assert render(tok, [{"role": "user", "content": "你好"}]) == "<|im_start|>user\n你好<|im_end|>\n"


def test_template_multi_turn(tok):
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\n\n</think>\nb"},
            {"role": "user", "content": "c"}]
    assert render(tok, msgs) == ("<|im_start|>user\na<|im_end|>\n"
                                 "<|im_start|>assistant\n<think>\n\n</think>\nb<|im_end|>\n"
                                 "<|im_start|>user\nc<|im_end|>\n")


@pytest.mark.parametrize("kwargs, tail", [
    ({"open_thinking": True}, "<|im_start|>assistant\n<think>\n"),
    ({"open_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ({}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
])
def test_generation_prompt_and_open_thinking(tok, kwargs, tail):
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    text = render(tok, msgs, add_generation_prompt=True, **kwargs)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n" + tail


def test_tokenized_template_matches_text(tok):
    msgs = [{"role": "user", "content": "47和52哪个更大？"}]
    text = render(tok, msgs, add_generation_prompt=True, open_thinking=True)
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, open_thinking=True,
                                  return_dict=False)
    assert list(ids) == tok.encode(text)
    assert ids[0] == 1 and ids[-2:] == [3, tok.encode("\n")[0]]


def test_shipped_template_is_the_scripts():
    assert (MODEL_DIR / "chat_template.jinja").read_text(encoding="utf-8").strip() == \
        load_script().CHAT_TEMPLATE.strip()


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.",
    "人工智能是计算机科学的一个分支。今天天气很好！",
    "<think>\n个位：7+8=15，写5进1\n十位：4+3+1=8\n</think>\n<answer>\n85\n</answer>",
    "<think>\n\n</think>\n85",
    "  leading spaces,\ttabs\n\n\nand newlines \r\n é ü 😀 “quotes” ",
    "def f(x):\n    return x * 10 - 3  # 中文注释",
])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_demo_text_is_compact(tok):
    from dataset.demo_task import Problem, full_reply, plain_reply

    problem = Problem("add", "en", (47, 38), 0)
    assert len(tok.encode(problem.prompt)) <= 12
    assert len(tok.encode(full_reply(problem))) <= 36
    assert len(tok.encode(plain_reply(problem))) <= 8


# ---------------------------------------------------------------- training function

def test_train_bpe_fixes_the_special_layout():
    script = load_script()
    texts = ["What is 47 + 38? <think>\nones: 7+8=15\n</think>\n<answer>\n85\n</answer>"] * 20 + ["你好，世界"] * 5
    tokenizer = script.train_bpe(texts, vocab_size=300)
    assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")] \
        == [0, 1, 2, 3, 4]
    special = {t.content: t.special for t in tokenizer.get_added_tokens_decoder().values()}
    assert special == {"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True,
                       "<think>": False, "</think>": False}
    enc = tokenizer.encode("<think>\n12+3\n</think>")
    assert enc.tokens[:5] == ["<think>", "Ċ", "1", "2", "+"]
    assert tokenizer.decode(enc.ids, skip_special_tokens=True) == "<think>\n12+3\n</think>"


# ---------------------------------------------------------------- the reward model's digit-split copy

def test_split_digits_copy_keeps_ids_and_splits_numbers(tok, tmp_path):
    script = load_script()
    script.main(["--split_digits", "--out_dir", str(tmp_path / "rm_tok")])
    digits = AutoTokenizer.from_pretrained(str(tmp_path / "rm_tok"))
    assert len(digits) == len(tok) and digits.get_vocab() == tok.get_vocab()
    assert (digits.pad_token_id, digits.eos_token_id, digits.padding_side) == (tok.pad_token_id, tok.eos_token_id, "left")
    text = "<think>\nones: 9+3=12, write 2 carry 1\ntens: 6+2+1=9\n</think>\n<answer>\n106\n</answer>"
    assert digits.convert_ids_to_tokens(digits.encode("106 + 2")) == ["1", "0", "6", "Ġ+", "Ġ2"]
    assert digits.decode(digits.encode(text)) == text
    assert tok.encode("no numbers here, <think> </think>") == digits.encode("no numbers here, <think> </think>")
    messages = [{"role": "user", "content": "12 + 5 = ?"}, {"role": "assistant", "content": "17"}]
    assert render(digits, messages) == render(tok, messages)


def test_split_digits_refuses_a_foreign_tokenizer(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": {"type": "ByteLevel"}}))
    with pytest.raises(SystemExit, match="no .* rule to change"):
        load_script().main(["--split_digits", "--from_dir", str(tmp_path / "src"), "--out_dir", str(tmp_path / "out")])
