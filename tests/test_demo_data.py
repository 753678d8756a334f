import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from dataset import demo_task as dt
from dataset.demo_task import Problem

ROOT = Path(__file__).resolve().parents[1]
FULL_RE = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL)
SMALL = dict(n_train=200, n_eval=100, n_sft=400, n_pairs=400, n_pairs_eval=100, n_tool_train=40, n_tool_eval=20,
             n_tool_sft=40)


@pytest.fixture(scope="module")
def small():
    return dt.generate_all(0, **SMALL)


def independent_answer(problem: Problem) -> int:
    """Recompute the answer from the operands without demo_task's code."""
    ops = problem.operands
    if problem.task == "add":
        return ops[0] + ops[1]
    if problem.task == "sub":
        return ops[0] - ops[1]
    if problem.task == "mul":
        return ops[0] * ops[1]
    if problem.task == "cmp":
        return min(ops[:2]) if ops[2] else max(ops[:2])
    return sum(1 for item in ops[1:] if item == ops[0])


def prompt_of(row: dict) -> str:
    return row["conversations"][0]["content"]


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------- hand-computed replies

@pytest.mark.parametrize("problem, expected", [
    (Problem("add", "en", (47, 38)),
     "<think>\nones: 7+8=15, write 5 carry 1\ntens: 4+3+1=8\n</think>\n<answer>\n85\n</answer>"),
    (Problem("add", "zh", (95, 17)),
     "<think>\n个位：5+7=12，写2进1\n十位：9+1+1=11\n</think>\n<answer>\n112\n</answer>"),
    (Problem("add", "en", (7, 8)), "<think>\n7+8=15\n</think>\n<answer>\n15\n</answer>"),
    (Problem("sub", "en", (47, 38)),
     "<think>\nones: 17-8=9, borrow 1\ntens: 4-3-1=0\n</think>\n<answer>\n9\n</answer>"),
    (Problem("sub", "zh", (58, 3)),
     "<think>\n个位：8-3=5\n十位：5-0=5\n</think>\n<answer>\n55\n</answer>"),
    (Problem("mul", "en", (47, 6)),
     "<think>\nones: 7×6=42, write 2 carry 4\ntens: 4×6+4=28\n</think>\n<answer>\n282\n</answer>"),
    (Problem("mul", "zh", (21, 3)),
     "<think>\n个位：1×3=3\n十位：2×3=6\n</think>\n<answer>\n63\n</answer>"),
    (Problem("cmp", "en", (47, 52, 0)), "<think>\ntens: 4<5\n47<52\n</think>\n<answer>\n52\n</answer>"),
    (Problem("cmp", "zh", (75, 74, 1)),
     "<think>\n十位：7=7\n个位：5>4\n75>74\n</think>\n<answer>\n74\n</answer>"),
    # count: target "cat" (26), items cat dog cat fish
    (Problem("count", "en", (26, 26, 27, 26, 28)),
     "<think>\ncat 1, dog, cat 2, fish\n</think>\n<answer>\n2\n</answer>"),
    (Problem("count", "zh", (26, 27, 28)), "<think>\n狗、鱼\n</think>\n<answer>\n0\n</answer>"),
])
def test_full_reply_hand_computed(problem, expected):
    assert dt.full_reply(problem) == expected
    assert dt.plain_reply(problem) == f"<think>\n\n</think>\n{problem.answer}"


def test_prompts_render_and_parse_back():
    assert Problem("add", "en", (47, 38), 0).prompt == "What is 47 + 38?"
    assert Problem("cmp", "zh", (3, 60, 1), 0).prompt == "3和60哪个更小？"
    assert Problem("count", "zh", (26, 26, 27), 1).prompt == "数一数：猫、狗 里有几个“猫”？"
    rng = random.Random(5)
    for task in dt.TASKS:
        for lang in dt.LANGS:
            for _ in range(30):
                problem = dt.make_problem(rng, task, lang)
                assert dt.parse_prompt(problem.prompt) == problem
    assert dt.parse_prompt("What is the capital of France?") is None


def test_slips_are_wrong_but_consistent():
    # Forgotten carry / borrow, flipped comparison, missed occurrence.
    assert dt.solve(Problem("add", "en", (47, 38)), slip=True) == (
        "ones: 7+8=15, write 5 carry 1\ntens: 4+3=7", "75")
    assert dt.solve(Problem("sub", "zh", (47, 38)), slip=True) == ("个位：17-8=9，借1\n十位：4-3=1", "19")
    assert dt.solve(Problem("cmp", "en", (47, 52, 0)), slip=True) == ("tens: 4>5\n47>52", "47")
    assert dt.solve(Problem("count", "en", (26, 26, 27, 26)), slip=True) == ("cat 1, dog, cat", "1")
    rng = random.Random(0)
    for task in dt.TASKS:
        for lang in dt.LANGS:
            for _ in range(50):
                problem = dt.make_problem(rng, task, lang)
                assert dt.solve(problem, slip=True)[1] != problem.answer
                wrong = dt.wrong_full_reply(problem, rng)
                assert FULL_RE.match(wrong) and dt.extract_answer(wrong) != problem.answer
                assert dt.extract_answer(dt.wrong_plain_reply(problem, rng)) != problem.answer
                broken = dt.broken_reply(problem, rng)
                assert "</answer>" not in broken or dt.extract_answer(broken) == ""
                assert dt.extract_answer(broken) != problem.answer


def test_format_ok_and_extract_answer():
    full = "<think>\nones: 1+2=3\n</think>\n<answer>\n3\n</answer>"
    assert dt.format_ok(full) and dt.extract_answer(full) == "3"
    plain = "<think>\n\n</think>\n3"
    assert not dt.format_ok(plain) and dt.extract_answer(plain) == "3"
    assert not dt.format_ok(full + "\nmore") and not dt.format_ok(full[len("<think>\n"):])
    assert dt.extract_answer("<think>\n1+2=") is None


# ---------------------------------------------------------------- generated sets

def test_generation_is_deterministic(small):
    assert dt.generate_all(0, **SMALL) == small
    other = dt.generate_all(1, **SMALL)
    for name in small:
        assert other[name] != small[name]


def test_counts_and_balance(small):
    assert {k: len(v) for k, v in small.items()} == {
        "demo_train": 200, "demo_eval": 100, "demo_sft": 400, "demo_pairs": 400, "demo_pairs_eval": 100,
        "demo_tools_train": 40, "demo_tools_eval": 20, "demo_tools_sft": 40}
    for name, rows in small.items():
        if name.startswith("demo_tools"):  # the tool task is products only
            assert {r["task"] for r in rows} == {"mul"} and Counter(r["lang"] for r in rows)["zh"] == len(rows) // 2
            continue
        tasks = Counter(r["task"] for r in rows)
        assert set(tasks) == set(dt.TASKS) and max(tasks.values()) - min(tasks.values()) <= 1, name
        assert Counter(r["lang"] for r in rows)["zh"] == len(rows) // 2, name
    styles = Counter(r["style"] for r in small["demo_sft"])
    assert styles == {"full": 200, "plain": 200}
    kinds = Counter(r["kind"] for r in small["demo_pairs"])
    assert set(kinds) == {k for k, _ in dt.PAIR_KINDS}


def test_train_eval_disjoint_and_answers_correct(small):
    sides = {"train": ("demo_train", "demo_sft", "demo_pairs"), "eval": ("demo_eval", "demo_pairs_eval")}
    keys = {}
    for side, names in sides.items():
        keys[side] = set()
        for name in names:
            for row in small[name]:
                problem = dt.parse_prompt(prompt_of(row))
                assert problem is not None and problem.task == row["task"] and problem.lang == row["lang"]
                assert dt.is_eval_key(problem.key) == (side == "eval")
                keys[side].add(problem.key)
                if len(row["conversations"]) == 2 and "style" not in row:
                    assert row["conversations"][1] == {"role": "assistant",
                                                       "content": str(independent_answer(problem))}
    assert keys["train"] and keys["eval"] and not keys["train"] & keys["eval"]
    # Distinct prompt texts within each RLAIF file.
    for name in ("demo_train", "demo_eval"):
        assert len({prompt_of(r) for r in small[name]}) == len(small[name])


def test_problem_key_ignores_language_and_order():
    assert dt.problem_key("add", (47, 38)) == dt.problem_key("add", (38, 47)) == "add:38,47"
    assert dt.problem_key("sub", (47, 38)) == "sub:47,38"
    assert dt.problem_key("cmp", (52, 47, 1)) == dt.problem_key("cmp", (47, 52, 1)) != \
        dt.problem_key("cmp", (47, 52, 0))
    assert dt.problem_key("count", (0, 1, 0, 2)) == dt.problem_key("count", (0, 2, 1, 0))
    en, zh = Problem("mul", "en", (47, 6), 0), Problem("mul", "zh", (47, 6), 2)
    assert en.key == zh.key


def test_sft_replies_follow_their_style(small):
    for row in small["demo_sft"]:
        user, assistant = row["conversations"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        reply = assistant["content"]
        assert reply.startswith("<think>\n")
        problem = dt.parse_prompt(user["content"])
        assert dt.extract_answer(reply) == str(independent_answer(problem))
        assert bool(FULL_RE.match(reply)) == (row["style"] == "full")


def test_pairs_prefer_the_correct_reply(small):
    for row in small["demo_pairs"] + small["demo_pairs_eval"]:
        assert [m["role"] for m in row["conversations"]] == ["user"]
        answer = str(independent_answer(dt.parse_prompt(prompt_of(row))))
        chosen, rejected = row["chosen"], row["rejected"]
        assert chosen.startswith("<think>\n") and rejected.startswith("<think>\n")
        assert dt.extract_answer(chosen) == answer and chosen != rejected
        if row["kind"] == "full_vs_plain":
            assert FULL_RE.match(chosen) and dt.extract_answer(rejected) == answer
        else:
            assert dt.extract_answer(rejected) != answer
        if row["kind"].startswith("full_vs"):
            assert FULL_RE.match(chosen)


# ---------------------------------------------------------------- shipped files

@pytest.mark.parametrize("name, count", [("demo_train", 10_000), ("demo_eval", 500)])
def test_shipped_rlaif_files(name, count):
    path = ROOT / "dataset" / f"{name}.jsonl"
    rows = read_jsonl(path)
    assert len(rows) == count
    for row in rows:
        conv = row["conversations"]
        assert [m["role"] for m in conv] == ["user", "assistant"]
        assert all(isinstance(m["content"], str) and m["content"] for m in conv)
        problem = dt.parse_prompt(conv[0]["content"])
        assert problem is not None and conv[1]["content"] == str(independent_answer(problem))
        assert dt.is_eval_key(problem.key) == (name == "demo_eval")
    assert abs(sum(r["lang"] == "zh" for r in rows) / count - 0.5) < 0.01


def test_shipped_files_match_the_generator():
    """The shipped RLAIF files are exactly what `make_demo_data.py --seed 0` writes."""
    files = dt.generate_all(0, n_sft=0, n_pairs=0, n_pairs_eval=0)
    for name in ("demo_train", "demo_eval"):
        expected = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in files[name])
        assert (ROOT / "dataset" / f"{name}.jsonl").read_text(encoding="utf-8") == expected, (
            f"dataset/{name}.jsonl is stale: run python builders/make_demo_data.py")


# ---------------------------------------------------------------- the tool task

def test_tool_sft_episodes_call_the_calculator_and_answer_with_its_reply():
    from dataset.demo_tools import calculator

    rows = dt.make_tool_sft(random.Random(0), 2000)
    tool, direct = [r for r in rows if r["style"] == "tool"], [r for r in rows if r["style"] != "tool"]
    wide = 0
    for r in tool:
        user, call, reply, answer = r["conversations"]
        assert [m["role"] for m in r["conversations"]] == ["user", "assistant", "tool", "assistant"]
        body = json.loads(re.search(r"<tool_call>\n(.*)\n</tool_call>$", call["content"]).group(1))
        a, b = map(int, body["arguments"]["expression"].split(" * "))
        assert body["name"] == "calculator" and f"{a}" in user["content"] and f"{b}" in user["content"]
        assert reply["content"] == calculator(body["arguments"]["expression"]) == str(a * b)
        # The result on a line of its own in the thought, as in the tool reply, then as the answer.
        assert f"\n{a * b}\n</think>" in answer["content"] and dt.extract_answer(answer["content"]) == str(a * b)
        assert dt.format_ok(answer["content"])
        wide += b >= 10
        if b < 10:  # the demo's own products: never a held-out one
            assert not dt.is_eval_key(dt.problem_key("mul", (a, b)))
    assert all(len(r["conversations"]) == 2 for r in direct)
    # ~50% copy-forcing episodes (two-digit b), ~20% of the demo's products through the calculator
    assert abs(wide / len(rows) - 0.5) < 0.04
    assert abs((len(tool) - wide) / (len(rows) - wide) - 0.2) < 0.04
