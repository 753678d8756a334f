"""Tests for dataset/rlaif.py with a tiny locally trained ChatML tokenizer (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from dataset.rlaif import (
    DEFAULT_SYSTEM_PROMPTS,
    DataError,
    PromptRecord,
    RLAIFDataset,
    collate_left_pad,
    detect_assistant_prefix,
    read_rlaif_jsonl,
)
from tests.helpers import byte_level_bpe

ROOT = Path(__file__).resolve().parents[1]

OPEN = "<think>\n"
CLOSED = "<think>\n\n</think>\n\n"

# ChatML following docs: system/user/assistant turns; the generation prompt adds the assistant
# header and an open or closed think block depending on `open_thinking`.
CHATML_THINK = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if open_thinking is defined and open_thinking -%}{{- '<think>\\n' -}}"
    "{%- else -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
# Same without any think handling: `open_thinking` is ignored.
CHATML_PLAIN = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _build_tokenizer(template: str) -> PreTrainedTokenizerFast:
    corpus = ["hello world, how are you?", "user assistant system", "你好，世界！今天天气很好。"]
    tok = byte_level_bpe(corpus * 10, 300, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", bos_token="<|im_start|>",
                                 unk_token="<|endoftext|>")
    hf.chat_template = template
    return hf


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return _build_tokenizer(CHATML_THINK)


@pytest.fixture(scope="module")
def plain_tok() -> PreTrainedTokenizerFast:
    return _build_tokenizer(CHATML_PLAIN)


def _write(tmp_path: Path, lines: list, name: str = "data.jsonl") -> Path:
    """Lines given as dicts are JSON-encoded, strings written verbatim."""
    path = tmp_path / name
    text = "".join((json.dumps(x, ensure_ascii=False) if not isinstance(x, str) else x) + "\n"
                   for x in lines)
    path.write_text(text, encoding="utf-8")
    return path


def _conv(*turns: tuple[str, str]) -> dict:
    return {"conversations": [{"role": r, "content": c} for r, c in turns]}


def _record(*turns: tuple[str, str], reference: str | None = None, where: str = "t:1"):
    return PromptRecord(messages=[{"role": r, "content": c} for r, c in turns],
                        reference=reference, where=where)


# ---------------------------------------------------------------- tokenizer fixture sanity


def test_fixture_tokenizer_matches_spec(tok):
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2
    think_ids = tok.encode("<think></think>", add_special_tokens=False)
    assert len(think_ids) == 2  # single added tokens
    assert tok.decode(think_ids, skip_special_tokens=True) == "<think></think>"  # not special


# ---------------------------------------------------------------- reading


def test_single_turn_placeholder(tmp_path, tok):
    path = _write(tmp_path, [_conv(("user", "hello world"), ("assistant", "无"))])
    records, skipped = read_rlaif_jsonl(path)
    assert skipped == 0
    assert records == [PromptRecord(messages=[{"role": "user", "content": "hello world"}],
                                    reference=None, where=f"{path}:1")]

    ds = RLAIFDataset(records, tok, max_prompt_len=64, thinking_ratio=1.0)
    item = ds[0]
    expected = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert item["prompt"] == expected
    assert item["input_ids"] == tok.encode(expected, add_special_tokens=False)
    assert item["input_ids"][0] == 1  # <|im_start|>
    assert item["input_ids"][-2:] == tok.convert_tokens_to_ids(["<think>", "Ċ"])
    assert item["assistant_prefix"] == OPEN
    assert item["reference"] is None
    assert item["messages"] == [{"role": "user", "content": "hello world"}]
    assert item["index"] == 0 and item["num_truncated"] == 0


def test_multi_turn_with_reference(tmp_path, tok):
    path = _write(tmp_path, [_conv(("user", "你好"), ("assistant", "你好！"),
                                   ("user", "今天天气怎么样？"), ("assistant", "今天天气很好。"))])
    (rec,), _ = read_rlaif_jsonl(path)
    assert [m["role"] for m in rec.messages] == ["user", "assistant", "user"]
    assert rec.reference == "今天天气很好。"

    item = RLAIFDataset([rec], tok, max_prompt_len=256, thinking_ratio=0.0)[0]
    assert item["prompt"] == ("<|im_start|>user\n你好<|im_end|>\n"
                              "<|im_start|>assistant\n你好！<|im_end|>\n"
                              "<|im_start|>user\n今天天气怎么样？<|im_end|>\n"
                              "<|im_start|>assistant\n" + CLOSED)
    assert item["reference"] == "今天天气很好。"
    assert item["assistant_prefix"] == CLOSED


def test_conversation_ending_with_user_has_no_reference(tmp_path):
    path = _write(tmp_path, [_conv(("user", "a"), ("assistant", "b"), ("user", "c"))])
    (rec,), _ = read_rlaif_jsonl(path)
    assert [m["content"] for m in rec.messages] == ["a", "b", "c"]
    assert rec.reference is None


def test_record_system_prompt_kept_and_not_doubled(tmp_path, tok):
    path = _write(tmp_path, [_conv(("system", "Be brief."), ("user", "hi"), ("assistant", ""))])
    records, _ = read_rlaif_jsonl(path)
    item = RLAIFDataset(records, tok, 64, thinking_ratio=1.0, system_prompt_ratio=1.0)[0]
    assert item["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hi"}]
    assert item["prompt"] == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                              "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + OPEN)


def test_system_prompt_injection(tok):
    recs = [_record(("user", f"q{i}")) for i in range(5)]
    prompts = ("SYS-A", "系统B")
    ds = RLAIFDataset(recs, tok, 64, system_prompt_ratio=1.0, system_prompts=prompts)
    for i in range(5):
        item = ds[i]
        assert item["messages"][0]["role"] == "system"
        assert item["messages"][0]["content"] in prompts
        assert item["messages"][1:] == [{"role": "user", "content": f"q{i}"}]
        assert item["prompt"].startswith(f"<|im_start|>system\n{item['messages'][0]['content']}")
    assert recs[0].messages == [{"role": "user", "content": "q0"}]  # record untouched

    none = RLAIFDataset(recs, tok, 64, system_prompt_ratio=0.0)
    assert all(none[i]["messages"][0]["role"] == "user" for i in range(5))


def test_default_system_prompts_have_english_and_chinese():
    assert any(p.isascii() for p in DEFAULT_SYSTEM_PROMPTS)
    assert any(not p.isascii() for p in DEFAULT_SYSTEM_PROMPTS)
    assert all(p.strip() for p in DEFAULT_SYSTEM_PROMPTS)


def test_chinese_text_round_trips(tmp_path, tok):
    text = "请用中文介绍一下你自己，谢谢！"
    path = _write(tmp_path, [_conv(("user", text), ("assistant", "无"))])
    records, _ = read_rlaif_jsonl(path)
    item = RLAIFDataset(records, tok, 512)[0]
    assert text in item["prompt"]
    assert tok.decode(item["input_ids"]) == item["prompt"]


@pytest.mark.parametrize("placeholder", ["无", "", "   ", "none", "None", "N/A", "-", " 无 "])
def test_placeholders_mean_no_reference(tmp_path, placeholder):
    path = _write(tmp_path, [_conv(("user", "q"), ("assistant", placeholder))])
    (rec,), _ = read_rlaif_jsonl(path)
    assert rec.reference is None


@pytest.mark.parametrize("answer", ["42", "无穷大", "None of them."])
def test_real_answers_are_kept_as_reference(tmp_path, answer):
    path = _write(tmp_path, [_conv(("user", "q"), ("assistant", answer))])
    (rec,), _ = read_rlaif_jsonl(path)
    assert rec.reference == answer


def test_blank_lines_ignored_and_bom_tolerated(tmp_path):
    path = tmp_path / "bom.jsonl"
    body = json.dumps(_conv(("user", "a"))) + "\n\n   \n" + json.dumps(_conv(("user", "b"))) + "\n"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    records, skipped = read_rlaif_jsonl(path)
    assert skipped == 0
    assert [r.messages[0]["content"] for r in records] == ["a", "b"]
    assert [r.where for r in records] == [f"{path}:1", f"{path}:4"]


# ---------------------------------------------------------------- thinking / determinism


def test_thinking_ratio_zero_and_one(tok):
    recs = [_record(("user", f"q{i}")) for i in range(20)]
    closed = RLAIFDataset(recs, tok, 64, thinking_ratio=0.0)
    opened = RLAIFDataset(recs, tok, 64, thinking_ratio=1.0)
    for i in range(20):
        assert closed[i]["assistant_prefix"] == CLOSED and closed[i]["prompt"].endswith(CLOSED)
        assert opened[i]["assistant_prefix"] == OPEN and opened[i]["prompt"].endswith(OPEN)


def _choices(ds: RLAIFDataset, order) -> dict:
    return {i: (ds[i]["assistant_prefix"], ds[i]["messages"][0]["content"]) for i in order}


def test_per_index_choices_are_deterministic(tok):
    recs = [_record(("user", f"q{i}")) for i in range(40)]
    kw = dict(max_prompt_len=64, thinking_ratio=0.5, system_prompt_ratio=0.5, seed=7)
    a = _choices(RLAIFDataset(recs, tok, **kw), range(40))
    b = _choices(RLAIFDataset(recs, tok, **kw), reversed(range(40)))
    c = _choices(RLAIFDataset(recs, tok, **kw), [3, 17, 3, 39, 0] + list(range(40)))
    assert a == b == c
    # Both outcomes occur at ratio 0.5.
    assert {p for p, _ in a.values()} == {OPEN, CLOSED}
    assert {s.startswith("q") for _, s in a.values()} == {True, False}
    # Another seed gives another pattern.
    assert _choices(RLAIFDataset(recs, tok, **{**kw, "seed": 8}), range(40)) != a
    # The thinking decision does not depend on the system-prompt ratio.
    think_only = RLAIFDataset(recs, tok, 64, thinking_ratio=0.5, system_prompt_ratio=0.0, seed=7)
    assert [think_only[i]["assistant_prefix"] for i in range(40)] == [a[i][0] for i in range(40)]


def test_negative_index_and_out_of_range(tok):
    recs = [_record(("user", "a")), _record(("user", "b"))]
    ds = RLAIFDataset(recs, tok, 64, thinking_ratio=0.5, seed=3)
    assert ds[-1] == ds[1] and ds[-1]["index"] == 1
    with pytest.raises(IndexError):
        ds[2]


# ---------------------------------------------------------------- truncation


def test_left_truncation_keeps_assistant_prefix(tok):
    long_text = "hello world " * 30 + "END"
    rec = _record(("user", long_text))
    full = RLAIFDataset([rec], tok, 10_000, thinking_ratio=1.0)[0]["input_ids"]
    # 11 tail tokens (<|im_end|> ... <think>\n) + " ", "E", "N", "D" + "ld", " wor".
    item = RLAIFDataset([rec], tok, 17, thinking_ratio=1.0)[0]
    assert len(full) > 17
    assert item["input_ids"] == full[-17:]
    assert item["num_truncated"] == len(full) - 17
    tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    assert item["input_ids"][-len(tail):] == tail
    assert tok.decode(item["input_ids"]) == " world END<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert item["assistant_prefix"] == OPEN
    assert item["prompt"].startswith("<|im_start|>user\nhello world")  # full text kept


def test_max_prompt_len_too_small(tok):
    # Header + closed think: <|im_start|> assistant \n <think> \n \n </think> \n \n -> more than 3.
    with pytest.raises(ValueError, match=r"max_prompt_len=3.*--max_seq_len"):
        RLAIFDataset([_record(("user", "hi"))], tok, 3, thinking_ratio=0.0)


def test_max_prompt_len_exactly_tail_is_accepted(tok):
    tail = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    ds = RLAIFDataset([_record(("user", "hello"))], tok, len(tail), thinking_ratio=1.0)
    assert ds[0]["input_ids"] == tail
    with pytest.raises(ValueError, match="max_prompt_len"):
        RLAIFDataset([_record(("user", "hello"))], tok, len(tail) - 1, thinking_ratio=1.0)


@pytest.mark.parametrize("kwargs", [dict(thinking_ratio=1.5), dict(system_prompt_ratio=-0.1),
                                    dict(seed=-1), dict(system_prompt_ratio=0.5,
                                                        system_prompts=())])
def test_bad_dataset_arguments(tok, kwargs):
    with pytest.raises(ValueError):
        RLAIFDataset([_record(("user", "hi"))], tok, 64, **kwargs)


def test_template_without_think_gives_empty_prefix(plain_tok):
    item = RLAIFDataset([_record(("user", "hi"))], plain_tok, 64, thinking_ratio=1.0)[0]
    assert item["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert item["assistant_prefix"] == ""


def test_detect_assistant_prefix():
    assert detect_assistant_prefix("x<|im_start|>assistant\n<think>\n") == OPEN
    assert detect_assistant_prefix("x<|im_start|>assistant\n" + CLOSED) == CLOSED
    assert detect_assistant_prefix("x<|im_start|>assistant\n") == ""


# ---------------------------------------------------------------- collate


def test_collate_left_pads(tok):
    recs = [_record(("user", "hi")), _record(("user", "hello world, how are you?"),
                                             reference="fine")]
    ds = RLAIFDataset(recs, tok, 64, thinking_ratio=1.0)
    items = [ds[0], ds[1]]
    n0, n1 = len(items[0]["input_ids"]), len(items[1]["input_ids"])
    assert n0 < n1
    batch = collate_left_pad(items, pad_id=tok.pad_token_id)
    assert batch["input_ids"].shape == (2, n1) and batch["input_ids"].dtype == torch.long
    assert batch["attention_mask"].shape == (2, n1) and batch["attention_mask"].dtype == torch.long
    pad = n1 - n0
    assert batch["input_ids"][0, :pad].tolist() == [0] * pad
    assert batch["input_ids"][0, pad:].tolist() == items[0]["input_ids"]
    assert batch["attention_mask"][0].tolist() == [0] * pad + [1] * n0
    assert batch["input_ids"][1].tolist() == items[1]["input_ids"]
    assert batch["attention_mask"][1].tolist() == [1] * n1
    assert batch["index"] == [0, 1]
    assert batch["reference"] == [None, "fine"]
    assert batch["assistant_prefix"] == [OPEN, OPEN]
    assert batch["prompt"] == [items[0]["prompt"], items[1]["prompt"]]
    assert batch["messages"] == [items[0]["messages"], items[1]["messages"]]


def test_collate_custom_pad_id_and_dataloader(tok):
    recs = [_record(("user", "a" * k)) for k in (1, 5, 9)]
    ds = RLAIFDataset(recs, tok, 64)
    loader = torch.utils.data.DataLoader(ds, batch_size=3,
                                         collate_fn=lambda b: collate_left_pad(b, pad_id=99))
    batch = next(iter(loader))
    mask = batch["attention_mask"].bool()
    assert (batch["input_ids"][~mask] == 99).all()
    assert (batch["input_ids"][:, -1] != 99).all()  # every row ends with a real token
    assert mask.sum(1).tolist() == [len(ds[i]["input_ids"]) for i in range(3)]


def test_collate_empty_batch():
    with pytest.raises(ValueError):
        collate_left_pad([], pad_id=0)


# ---------------------------------------------------------------- bad input

GOOD = _conv(("user", "fine"), ("assistant", "无"))

BAD_LINES = {
    "malformed_json": '{"conversations": [{"role": "user", "content": "x"}',
    "not_object": '[1, 2, 3]',
    "missing_conversations": {"messages": [{"role": "user", "content": "x"}]},
    "conversations_not_list": {"conversations": "hello"},
    "message_not_object": {"conversations": ["hello"]},
    "missing_role": {"conversations": [{"content": "x"}]},
    "missing_content": {"conversations": [{"role": "user"}]},
    "content_not_string": {"conversations": [{"role": "user", "content": 5}]},
    "unknown_role": _conv(("user", "x"), ("bot", "y")),
    "sharegpt_role": _conv(("human", "x"), ("gpt", "y")),
    "empty_user": _conv(("user", "  "), ("assistant", "无")),
    "empty_system": _conv(("system", ""), ("user", "x")),
    "empty_middle_assistant": _conv(("user", "x"), ("assistant", " "), ("user", "y")),
    "system_not_first": _conv(("user", "x"), ("system", "s"), ("assistant", "无")),
    "no_user_turn": _conv(("system", "s"), ("assistant", "a")),
    "empty_conversations": {"conversations": []},
    "two_final_assistants": _conv(("user", "x"), ("assistant", "a"), ("assistant", "无")),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_raises_with_file_and_line(tmp_path, case):
    path = _write(tmp_path, [GOOD, "", BAD_LINES[case], GOOD], name=f"bad_{case}.jsonl")
    with pytest.raises(DataError) as exc:
        read_rlaif_jsonl(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}:3: ")
    assert f"bad_{case}.jsonl:3" in msg
    assert "--skip_bad_lines 1" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("case,words", [("malformed_json", "malformed JSON"),
                                        ("missing_conversations", "conversations"),
                                        ("unknown_role", "'bot'"),
                                        ("empty_user", "empty content"),
                                        ("system_not_first", "first message"),
                                        ("no_user_turn", "no user turn")])
def test_bad_line_messages_say_what_is_wrong(tmp_path, case, words):
    path = _write(tmp_path, [BAD_LINES[case]])
    with pytest.raises(DataError, match=words):
        read_rlaif_jsonl(path)


def test_invalid_utf8_line(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe{}\n")
    with pytest.raises(DataError, match=r"bin\.jsonl:2: not valid UTF-8"):
        read_rlaif_jsonl(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=r"empty\.jsonl: no records") as exc:
        read_rlaif_jsonl(path)
    assert str(exc.value).startswith(f"{path}: ")
    with pytest.raises(DataError, match="no records"):
        read_rlaif_jsonl(path, skip_bad_lines=True)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: file not found.*--data_path"):
        read_rlaif_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="not a regular file"):
        read_rlaif_jsonl(tmp_path)


def test_skip_bad_lines_counts(tmp_path):
    lines = [GOOD, BAD_LINES["malformed_json"], "", BAD_LINES["unknown_role"],
             _conv(("user", "second"), ("assistant", "ref")), BAD_LINES["system_not_first"]]
    path = _write(tmp_path, lines)
    records, skipped = read_rlaif_jsonl(path, skip_bad_lines=True)
    assert skipped == 3
    assert [r.where for r in records] == [f"{path}:1", f"{path}:5"]
    assert records[1].reference == "ref"


def test_skip_bad_lines_all_bad_is_error(tmp_path):
    path = _write(tmp_path, [BAD_LINES["malformed_json"], BAD_LINES["no_user_turn"]], "allbad.jsonl")
    with pytest.raises(DataError, match=r"allbad\.jsonl: no usable records: all 2") as exc:
        read_rlaif_jsonl(path, skip_bad_lines=True)
    assert "allbad.jsonl:1: malformed JSON" in str(exc.value)  # first error is shown


def test_tokenizer_without_chat_template():
    bare = _build_tokenizer(CHATML_THINK)
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        RLAIFDataset([_record(("user", "hi"))], bare, 64)


# ---------------------------------------------------------------- project tokenizer


@pytest.mark.skipif(not (ROOT / "model" / "tokenizer.json").exists(),
                    reason="model/tokenizer.json not present")
def test_project_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "model"))
    path = _write(tmp_path, [_conv(("user", "你好，介绍一下你自己。"), ("assistant", "无")),
                             _conv(("system", "Be brief."), ("user", "hi"), ("assistant", "hello"))])
    records, _ = read_rlaif_jsonl(path)
    for ratio, prefix in ((1.0, OPEN), (0.0, CLOSED)):
        ds = RLAIFDataset(records, tokenizer, 128, thinking_ratio=ratio)
        for i in range(2):
            item = ds[i]
            assert item["prompt"].endswith("<|im_start|>assistant\n" + prefix)
            assert item["assistant_prefix"] == prefix
            assert item["input_ids"] == tokenizer.encode(item["prompt"], add_special_tokens=False)
            assert tokenizer.decode(item["input_ids"]) == item["prompt"]
    assert records[1].reference == "hello"
    batch = collate_left_pad([ds[0], ds[1]], pad_id=tokenizer.pad_token_id)
    assert batch["input_ids"].shape[0] == 2


# ---------------------------------------------------------------- a JSON array instead of JSONL

ARRAY = [_conv(("user", "你好"), ("assistant", "无")), _conv(("system", "s"), ("user", "2+2?"), ("assistant", "4"))]


@pytest.mark.parametrize("text, lineno", [
    (json.dumps(ARRAY, indent=1, ensure_ascii=False), 1),  # pretty-printed: "[" alone on line 1
    ("\ufeff\n  \n" + json.dumps(ARRAY, ensure_ascii=False), 3),  # BOM, blank lines, the array on one line
    ("[\n" + ",\n".join(json.dumps(o, ensure_ascii=False) for o in ARRAY) + "\n]\n", 1),  # one element a line
], ids=["pretty", "bom-one-line", "element-per-line"])
@pytest.mark.parametrize("skip", [False, True])
def test_json_array_is_named_with_a_conversion(tmp_path, text, lineno, skip):
    """A JSON array is refused as a whole (even with --skip_bad_lines, which would otherwise keep the
    last element: the one line without a trailing comma) with one line saying how to convert it."""
    path = tmp_path / "data.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DataError) as exc:
        read_rlaif_jsonl(path, skip_bad_lines=skip)
    msg = str(exc.value)
    assert msg.startswith(f"{path}:{lineno}: ") and "\n" not in msg
    assert "JSON array" in msg and "not JSONL (one JSON object per line)" in msg
    assert f"jq -c '.[]' {path} > {tmp_path / 'data.jsonl'}" in msg


@pytest.mark.slow
def test_json_array_conversion_command_works(tmp_path):
    """The python command the message suggests turns the array into a file the reader accepts."""
    import subprocess
    import sys

    path = tmp_path / "my data.jsonl"  # a space (quoted in the command) and a .jsonl name that is not JSONL
    path.write_text(json.dumps(ARRAY, indent=2, ensure_ascii=False), encoding="utf-8-sig")
    with pytest.raises(DataError) as exc:
        read_rlaif_jsonl(path)
    command = str(exc.value).split("  or  ", 1)[1].replace("python -c", f"{sys.executable} -c", 1)
    subprocess.run(["bash", "-c", command], check=True, env={"PYTHONUTF8": "1"})
    records, skipped = read_rlaif_jsonl(tmp_path / "my data.lines.jsonl")
    assert skipped == 0 and [r.messages[-1]["content"] for r in records] == ["你好", "2+2?"]
    assert [r.reference for r in records] == [None, "4"]


def test_rows_carry_their_ifeval_constraints_to_the_batch(tmp_path):
    cons = [{"type": "no_comma"}]
    path = _write(tmp_path, [{"conversations": [{"role": "user", "content": "Write a note."}], "constraints": cons},
                             {"conversations": [{"role": "user", "content": "hi"}]}])
    records, _ = read_rlaif_jsonl(path)
    assert records[0].constraints == cons and records[1].constraints is None
    tok = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(["Write a note. hi"], 300, ["<|im_end|>"]), eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    batch = collate_left_pad([RLAIFDataset(records, tok, 64)[i] for i in (0, 1)], pad_id=tok.pad_token_id)
    assert batch["constraints"] == [cons, []]  # an instruction-following file: [] = nothing asked, on every rank alike
    plain, _ = read_rlaif_jsonl(_write(tmp_path, [{"conversations": [{"role": "user", "content": "hi"}]}], name="plain.jsonl"))
    assert collate_left_pad([RLAIFDataset(plain, tok, 64)[0]], pad_id=tok.pad_token_id)["constraints"] == [None]
    bad = _write(tmp_path, [{"conversations": [{"role": "user", "content": "x"}], "constraints": [{"type": "shout"}]}],
                 name="bad.jsonl")
    with pytest.raises(DataError, match=r"bad.jsonl:1: constraints\[0\]: unknown constraint .*--skip_bad_lines"):
        read_rlaif_jsonl(bad)


@pytest.mark.slow
def test_the_shipped_ifeval_files_are_what_the_script_writes(tmp_path):
    import subprocess
    import sys

    from builders.make_ifeval_data import EVAL_TOPICS, QUESTIONS, REQUESTS, TRAIN_TOPICS
    from dataset.ifeval import CHECKS, LEFT_OUT, ifeval_instructions

    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "builders/make_ifeval_data.py", "--out_dir", str(tmp_path)], cwd=root, check=True,
                   capture_output=True)
    names = ("ifeval_train.jsonl", "ifeval_eval.jsonl", "ifeval_eval_seen_wording.jsonl", "ifeval_eval_other_types.jsonl")
    for name in (*names, "ifeval_eval_heldout_wording.jsonl"):  # (its wordings and topics: tests/test_ifeval_wordings.py)
        assert (tmp_path / name).read_bytes() == (root / "dataset" / name).read_bytes(), name
    train, held, wording, other = (read_rlaif_jsonl(root / "dataset" / name)[0] for name in names)
    starts = [q.format(t=t) for q in REQUESTS + QUESTIONS for t in TRAIN_TOPICS + EVAL_TOPICS]

    def topic(r) -> str:  # the prompt opens with its request (or question) on its topic
        first = next(s for s in starts if r.messages[-1]["content"].startswith(s + " "))
        return next(t for t in TRAIN_TOPICS + EVAL_TOPICS if any(first == q.format(t=t) for q in REQUESTS + QUESTIONS))
    assert not set(TRAIN_TOPICS) & set(EVAL_TOPICS)
    assert {topic(r) for r in train} <= set(TRAIN_TOPICS) and {topic(r) for r in held + wording + other} <= set(EVAL_TOPICS)
    assert {c["type"] for r in train for c in r.constraints} == set(CHECKS) == {c["type"] for r in held for c in r.constraints}
    assert {c["type"] for r in wording for c in r.constraints} == set(CHECKS) - {"start_phrase"}
    assert all(1 <= len(r.constraints) <= 2 for r in train + held + wording) and all(r.constraints is None for r in other)
    for name in (*names, "ifeval_eval_heldout_wording.jsonl"):  # what Google's checker needs, beside ours
        for line in (root / "dataset" / name).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            assert row["prompt"] == row["conversations"][0]["content"] and len(row["wording"]) == len(row["kwargs"])
            if "constraints" in row:
                assert (row["instruction_id_list"], row["kwargs"]) == ifeval_instructions(row["constraints"])
            else:
                assert set(row["instruction_id_list"]) <= set(LEFT_OUT)


# ---------------------------------------------------------------- tool episodes in prompts, tools listed by a system prompt

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate.",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}
TOOLS_PROMPT = 'Tools:\n<tools>{tools}</tools>\nCall: <tool_call>[{"name": ..., "arguments": {...}}]</tool_call>'


def test_a_worked_tool_episode_before_the_question_is_read(tmp_path):
    row = _conv(("user", "2 * 3?"), ("assistant", '<tool_call>[{"name": "calculator"}]</tool_call>'), ("tool", "6"),
                ("assistant", "The answer is 6."), ("user", "4 * 5?"), ("assistant", ""))
    (rec,), _ = read_rlaif_jsonl(_write(tmp_path, [row]))
    assert [m["role"] for m in rec.messages] == ["user", "assistant", "tool", "assistant", "user"]
    with pytest.raises(DataError, match="the turn before the final assistant slot must be a user turn"):
        read_rlaif_jsonl(_write(tmp_path, [_conv(("user", "x"), ("tool", "6"))], name="t.jsonl"))


def test_tools_system_prompt_lists_the_tools_instead_of_the_template(plain_tok):
    from dataset.rlaif import template_renders_tools, tools_system_text

    assert not template_renders_tools(plain_tok)  # plain ChatML, as SmolLM2-135M-Instruct's: tools= is ignored
    records = [_record(("user", "4 * 5?")), _record(("system", "Be brief."), ("user", "4 * 5?"))]
    ds = RLAIFDataset(records, plain_tok, 512, thinking_ratio=0.0, tools=[CALC], tools_system_prompt=TOOLS_PROMPT)
    listed = tools_system_text(TOOLS_PROMPT, [CALC])
    assert listed == 'Tools:\n<tools>' + json.dumps([CALC]) + '</tools>\nCall: <tool_call>[{"name": ..., "arguments": {...}}]</tool_call>'
    first, second = ds[0], ds[1]
    assert first["messages"] == [{"role": "system", "content": listed}, {"role": "user", "content": "4 * 5?"}]
    assert second["messages"][0] == {"role": "system", "content": listed + "\n\nBe brief."}  # the row's own text follows
    assert first["prompt"].startswith("<|im_start|>system\nTools:\n<tools>[{")
    assert first["tools"] is None  # listed once, by the system prompt: the episode's observations render without tools=
    # Without the setting (or without tools) nothing is added.
    assert RLAIFDataset(records, plain_tok, 512, thinking_ratio=0.0, tools=[CALC])[0]["messages"][0]["role"] == "user"
    assert RLAIFDataset(records, plain_tok, 512, thinking_ratio=0.0, tools_system_prompt=TOOLS_PROMPT)[0]["tools"] is None


def test_a_template_with_a_tool_section_is_recognised():
    from dataset.rlaif import template_renders_tools
    from model.loader import load_tokenizer

    assert template_renders_tools(load_tokenizer())  # MiniMind's template lists tools= in its system turn


def test_the_shipped_tool_files_are_what_the_script_writes(tmp_path):
    """builders/make_tools_data.py: the same seed writes the shipped files; held-out operand pairs never occur in
    training; the unseen phrasings share no template with the training ones; gt is the product; the worked example
    is a call in the SmolLM2 family's form that the tool parser reads."""
    import re
    import subprocess
    import sys

    from builders.make_tools_data import SHOTS, TRAIN_TEMPLATES, UNSEEN_TEMPLATES
    from trainer.tools import parse_tool_calls

    subprocess.run([sys.executable, "builders/make_tools_data.py", "--out_dir", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True)
    names = ("smollm2_tools_train.jsonl", "smollm2_tools_eval.jsonl", "smollm2_tools_eval_unseen.jsonl")
    for name in names:
        assert (tmp_path / name).read_bytes() == (ROOT / "dataset" / name).read_bytes(), name
    train, held, unseen = (read_rlaif_jsonl(ROOT / "dataset" / n)[0] for n in names)
    assert (len(train), len(held), len(unseen)) == (600, 200, 200)
    assert not set(TRAIN_TEMPLATES) & set(UNSEEN_TEMPLATES)

    def parse(r) -> tuple[str, int, int]:
        """The row's question as (its template, a, b)."""
        for t in TRAIN_TEMPLATES + UNSEEN_TEMPLATES:
            m = re.fullmatch(re.escape(t).replace(r"\{a\}", r"(?P<a>\d+)").replace(r"\{b\}", r"(?P<b>\d+)"),
                             r.messages[-1]["content"])
            if m:
                return t, int(m["a"]), int(m["b"])
        raise AssertionError(r.messages[-1]["content"])

    def pair(r) -> tuple[int, int]:
        return parse(r)[1:]

    def phrasing(r) -> str:
        return parse(r)[0]

    assert not {pair(r) for r in train} & {pair(r) for r in held + unseen}
    assert {phrasing(r) for r in train + held} == set(TRAIN_TEMPLATES) and {phrasing(r) for r in unseen} == set(UNSEEN_TEMPLATES)
    for r in train + held + unseen:
        a, b = pair(r)
        assert r.gt == [str(a * b)] and 12 <= a <= 999 and 12 <= b <= 99
        assert [m["role"] for m in r.messages] == ["user", "assistant", "tool", "assistant", "user"]
    (call,) = parse_tool_calls(train[0].messages[1]["content"])
    q, a, b, _ = SHOTS[0]
    assert train[0].messages[0]["content"] == q and call.name == "calculator" and call.arguments == {"expression": f"{a} * {b}"}
    assert train[0].messages[2]["content"] == str(a * b)
