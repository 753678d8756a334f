"""builders/make_ifeval_data.py's wording families: every type is worded in at least 10 ways for training and 6 more
held out, no held-out wording's template occurs in training (compared as templates, with the slot values stripped,
and as the sentences each shipped row renders), the held-out-wording file is what the builder writes and carries
Google's ids and kwargs for every row (tests/test_judge_ifeval.py and tests/test_ifeval_reference.py judge it with
Google's checker in the reference venv), and --train_wordings_per_type N writes the curve's training files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from builders import make_ifeval_data as B
from dataset.ifeval import CHECKS, describe, ifeval_instructions

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "dataset" / "ifeval_eval_heldout_wording.jsonl"

# One or two constraints per type whose values occur in no template's own words, so that stripping them from a
# rendered sentence leaves the template (numbers too: 47 is said "47", "forty-seven", "at most 46", "under 47", ...).
CANON: dict[str, list[dict]] = {
    "number_words": [{"relation": "less than", "num": 47}, {"relation": "at least", "num": 38}],
    "keyword_frequency": [{"keyword": "qqq", "relation": "at least", "num": 7}, {"keyword": "qqq", "relation": "less than", "num": 8}],
    "letter_frequency": [{"letter": "q", "relation": "at least", "num": 17}, {"letter": "q", "relation": "less than", "num": 18}],
    "number_paragraphs": [{"num": 7}], "number_bullets": [{"num": 7}], "placeholders": [{"num": 7}],
    "highlighted_sections": [{"num": 7}], "sections": [{"splitter": "Qqq", "num": 7}],
    "paragraph_first_word": [{"num": 5, "nth": 4, "word": "qqq"}],
    "end_phrase": [{"phrase": "Qqq www."}], "start_phrase": [{"phrase": "Qqq www"}], "repeat_prompt": [{"request": "Qqq www."}],
    "postscript": [{"marker": "Q.Q.Q."}], "include_keywords": [{"words": ["qqq", "www"]}, {"words": ["qqq"]}],
    "forbidden_words": [{"words": ["qqq", "www"]}],
}


# The misspellings and shorthand of the held-out family's hurried lines (typos in fixed words, never in a slot).
MISSPELT = {"writ", "evrything", "answr", "wrd", "paragrphs", "paragrahs", "comas", "finsh", "strat", "exacly", "anwser",
            "qoutes", "bulet", "highlite", "sectons", "giv", "titel", "jason", "lest", "placeholers", "teh", "diffrent",
            "somwhere", "dont", "leter", "thx"}


def canonical(kind: str) -> list[dict]:
    return [{"type": kind, **c} for c in CANON.get(kind, [{}])]


def skeleton(text: str, c: dict) -> str:
    """A rendered sentence with its slot values (the constraint's parameters, in every form a template says them)
    replaced by "<>", and the three fixed yes / no / maybe answers by "<opt>": what is left is the template."""
    values = {v for k, v in B.slots(c).items() if k not in ("s", "cmp")}  # (cmp: "<" / "≥", not a word)
    values |= {str(c[k]) for k in ("phrase", "keyword", "word", "marker", "splitter", "request", "letter") if k in c}
    values |= {w.lower() for w in values} | set(c.get("words", [])) | {str(sorted(c.get("words", [])))}
    if "relation" in c:
        values |= {"fewer than", "less than", "at least", "under"}
    for v in sorted(values, key=len, reverse=True):
        text = re.sub(r"(?<![A-Za-z0-9])" + re.escape(v) + r"(?![A-Za-z0-9])", "<>", text)
    text = re.sub(r"<>(\s+<>)+", "<>", text)  # "at least 38" is one slot or two ("at least", "38"): one either way
    return re.sub(r"My answer is (yes|no|maybe)\.", "<opt>", text)


def templates(kind: str, name: str) -> dict[str, set[str]]:
    """Wording id -> its template(s) (one per canonical constraint), for a family of `kind`."""
    return {wid: {skeleton(B.worded(kind, wid, c)[0], c) for c in canonical(kind)} for wid in B.family(kind, name)}


def grams(template: str, n: int = 5) -> set[tuple[str, ...]]:
    words = re.findall(r"<opt>|<>|[a-z0-9']+", template.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_every_type_has_ten_training_wordings_and_six_held_out_in_several_voices():
    assert set(B.WORDINGS) == set(CHECKS) == set(B.KINDS)
    for kind in B.KINDS:
        train, held = B.family(kind, "train"), B.family(kind, "heldout")
        assert len(train) >= 10 and len(held) >= 6 and len(set(train)) == len(train), kind
        assert train[0] == ("ours/0" if kind == "start_phrase" else "ifeval")  # 1 wording per type: IFEval's own
        texts = B.WORDINGS[kind]["heldout"]
        assert any(t.startswith(("Kindly", "I'd", "I want", "I need", "I only", "I expect")) for t in texts), kind  # polite / first person
        assert any(set(re.findall(r"[a-z]+", t)) & MISSPELT for t in texts), kind  # a user's hurried, misspelt line
        assert any(t.startswith("~") for t in texts) == (kind != "repeat_prompt"), kind  # clauses: mid-sentence, joined
    numeric = [k for k in B.KINDS if "{num" in " ".join(B.WORDINGS[k]["heldout"]) or "bound" in " ".join(B.WORDINGS[k]["heldout"])]
    assert len(numeric) == 9
    for kind in numeric:  # numbers in digits and in words, in both families
        for name in ("train", "heldout"):
            joined = " ".join(B.WORDINGS[kind][name])
            assert re.search(r"\{(num|bound|nobound|over)\}", joined) and "_w}" in joined or "{num_W}" in joined, (kind, name)


def test_no_held_out_template_occurs_in_training():
    """Templates, not rendered strings: each wording rendered with values found in no template, the values stripped.
    No held-out template equals a training one (IFEval's sentence, PHRASINGS, the train family) or shares a run of
    five words with one."""
    for kind in B.KINDS:
        train = {t for ts in templates(kind, "train").values() for t in ts}
        train_grams = set().union(*map(grams, train))
        for wid, held in templates(kind, "heldout").items():
            for t in held:
                assert t not in train, (kind, wid, t)
                assert not grams(t) & train_grams, (kind, wid, t, grams(t) & train_grams)
    # the stripping leaves the template: two values of one wording give one template, and the values are gone
    assert templates("number_words", "train")["ifeval"] == {"Answer with <> words."}  # "less than 47", "at least 38"
    assert templates("letter_frequency", "heldout")["heldout/0"] == {'Type the character "<>" <> times across the whole reply.'}


def test_a_template_that_repeats_a_training_one_is_caught():
    """The check above is not vacuous: a held-out wording that is a training one, or a training one with its
    number said in words, is found."""
    c = canonical("number_words")[0]
    train = {t for ts in templates("number_words", "train").values() for t in ts}
    copied = skeleton(describe(c), c)
    reworded = skeleton(f"Answer with less than {B.in_words(c['num'])} words.", c)
    assert copied in train and reworded in train
    assert grams(skeleton("Please keep the length to at most 46 words, thanks.", c)) & set().union(*map(grams, train))


def test_the_held_out_wording_file_uses_only_held_out_wordings():
    """Rendered: each row's held-out wording of each constraint is in its prompt, and no training-family wording of
    the same constraint is; the shipped training files, conversely, hold no held-out wording."""
    held = rows(HELDOUT)
    assert len(held) == 300
    for r in held:
        prompt = r["prompt"].lower()
        assert r["wording"] == ["heldout"] * len(r["constraints"]) and len(r["template"]) == len(r["constraints"])
        for c, wid in zip(r["constraints"], r["template"]):
            assert wid in B.family(c["type"], "heldout") and B.worded(c["type"], wid, c)[0].lower() in prompt
            assert not [w for w in B.family(c["type"], "train") if B.worded(c["type"], w, c)[0].lower() in prompt], r["prompt"]
    training = ("ifeval_train.jsonl", "ifeval_train_w10.jsonl", "ifeval_train_w10_ifeval80.jsonl")
    for r in [r for name in training for r in rows(ROOT / "dataset" / name)]:
        prompt = r["prompt"].lower()
        for c in r["constraints"]:
            assert not [w for w in B.family(c["type"], "heldout") if B.worded(c["type"], w, c)[0].lower() in prompt], r["prompt"]


def test_the_held_out_wording_rows_carry_googles_ids_and_kwargs():
    held = rows(HELDOUT)
    starts = {q.format(t=t)[:-1]: t for q in B.REQUESTS + B.QUESTIONS for t in B.TRAIN_TOPICS + B.EVAL_TOPICS}
    for r in held:
        assert r["prompt"] == r["conversations"][0]["content"] and r["conversations"][1] == {"role": "assistant", "content": ""}
        assert (r["instruction_id_list"], r["kwargs"]) == ifeval_instructions(r["constraints"])
        assert {starts[s] for s in starts if s in r["prompt"]} <= set(B.EVAL_TOPICS)  # held-out topics only
        assert 1 <= len(r["constraints"]) <= 2
        rep = [c for c in r["constraints"] if c["type"] == "repeat_prompt"]
        assert not rep or r["prompt"].startswith(rep[0]["request"] + " ")  # the request to repeat: all before its sentence
    firsts = [r["constraints"][0]["type"] for r in held if len(r["constraints"]) == 1]
    assert {c["type"] for r in held for c in r["constraints"]} == set(CHECKS) and len(set(firsts)) >= 20
    used = {(c["type"], w) for r in held for c, w in zip(r["constraints"], r["template"])}
    assert len(used) >= 0.9 * sum(len(B.family(k, "heldout")) for k in B.KINDS)  # (nearly) every held-out wording asked
    assert sum(len(r["constraints"]) == 2 for r in held) > 60
    # voices that only placement gives: before the request, folded into it, two constraints in one sentence
    assert any(not any(r["prompt"].startswith(s) for s in starts) for r in held)
    assert any(re.search(r"\w, and \w", r["prompt"]) and any(s + ", and " in r["prompt"] for s in starts) for r in held)


def test_the_builder_is_deterministic_and_keeps_the_other_files(tmp_path):
    a = B.make_worded_rows(B.EVAL_TOPICS, 50, {k: B.family(k, "heldout") for k in B.KINDS}, "heldout_wording/0")
    b = B.make_worded_rows(B.EVAL_TOPICS, 50, {k: B.family(k, "heldout") for k in B.KINDS}, "heldout_wording/0")
    c = B.make_worded_rows(B.EVAL_TOPICS, 50, {k: B.family(k, "heldout") for k in B.KINDS}, "heldout_wording/1")
    assert a == b and a != c
    B.main(["--out_dir", str(tmp_path), "--n_train", "0", "--n_eval", "0", "--n_eval_ifeval_wording", "0",
            "--n_eval_other_types", "0"])
    assert (tmp_path / "ifeval_eval_heldout_wording.jsonl").read_bytes() == HELDOUT.read_bytes()


def test_train_wordings_per_type_writes_the_curves_training_files(tmp_path):
    for n in (1, 3, 10):
        B.main(["--out_dir", str(tmp_path), "--n_train", "460", "--train_wordings_per_type", str(n)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ifeval_train_w1.jsonl", "ifeval_train_w10.jsonl", "ifeval_train_w3.jsonl"]
    files = {n: rows(tmp_path / f"ifeval_train_w{n}.jsonl") for n in (1, 3, 10)}
    for n, rs in files.items():
        by_type: dict[str, set[str]] = {}
        for r in rs:
            assert r["wording"] != ["heldout"] * len(r["wording"]) and "heldout" not in r["wording"]
            assert (r["instruction_id_list"], r["kwargs"]) == ifeval_instructions(r["constraints"])
            for c, w in zip(r["constraints"], r["template"]):
                assert B.worded(c["type"], w, c)[0].lower() in r["prompt"].lower()
                by_type.setdefault(c["type"], set()).add(w)
        assert all(ws <= set(B.family(k, "train")[:n]) for k, ws in by_type.items())
        assert sum(len(ws) for ws in by_type.values()) >= 0.9 * n * len(B.KINDS)  # (nearly) all N of every type
    assert {w for r in files[1] for w in r["template"]} == {"ifeval", "ours/0"}  # IFEval's sentence (start_phrase: ours)

    def content(r: dict) -> list[dict]:  # the constraints without repeat_prompt's request, which holds the wording
        return [{k: v for k, v in c.items() if k != "request"} for c in r["constraints"]]
    assert [content(r) for r in files[1]] == [content(r) for r in files[10]]  # only the wording differs
    assert [r["prompt"] for r in files[1]] != [r["prompt"] for r in files[10]]


def test_the_presets_training_files_are_what_the_builder_writes(tmp_path):
    """configs/smollm2_ifeval_round3.yaml (round 3's preset) trains on the 10-wordings file with IFEval's sentence at
    80% (docs/smollm2_ifeval.md:
    the curve chose ten wordings, the 3-seed runs at 40 / 60 / 80% the share); the even 10-wordings file stays for the curve."""
    B.main(["--out_dir", str(tmp_path), "--train_wordings_per_type", "10"])
    B.main(["--out_dir", str(tmp_path), "--train_wordings_per_type", "10", "--ifeval_share", "0.8"])
    for name in ("ifeval_train_w10.jsonl", "ifeval_train_w10_ifeval80.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "dataset" / name).read_bytes(), name
    preset = (ROOT / "configs" / "smollm2_ifeval_round3.yaml").read_text()
    assert "data_path: dataset/ifeval_train_w10_ifeval80.jsonl" in preset


def test_ifeval_share_words_that_share_by_ifevals_sentence_and_keeps_the_constraints(tmp_path):
    B.main(["--out_dir", str(tmp_path), "--n_train", "1000", "--train_wordings_per_type", "10"])
    B.main(["--out_dir", str(tmp_path), "--n_train", "1000", "--train_wordings_per_type", "10", "--ifeval_share", "0.4"])
    even, shared = rows(tmp_path / "ifeval_train_w10.jsonl"), rows(tmp_path / "ifeval_train_w10_ifeval40.jsonl")

    def share(rs: list[dict]) -> float:  # among the constraints whose type has IFEval's sentence
        ws = [w for r in rs for c, w in zip(r["constraints"], r["template"]) if c["type"] != "start_phrase"]
        return sum(w == "ifeval" for w in ws) / len(ws)
    assert 0.07 < share(even) < 0.14 and 0.36 < share(shared) < 0.44
    others = {w for r in shared for w in r["template"] if w != "ifeval"}
    assert others >= {w for k in B.KINDS for w in B.family(k, "train")[1:] if k != "start_phrase"}  # the other nine still appear
    assert [r["constraints"][0]["type"] for r in even] == [r["constraints"][0]["type"] for r in shared]
    for r in shared:
        for c, w in zip(r["constraints"], r["template"]):
            assert B.worded(c["type"], w, c)[0].lower() in r["prompt"].lower()


def test_ifeval_share_without_the_wordings_file_is_one_line():
    out = subprocess.run([sys.executable, "builders/make_ifeval_data.py", "--ifeval_share", "0.4"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        "make_ifeval_data.py: error: --ifeval_share needs --train_wordings_per_type N (it shapes only the wordings file)")


def test_train_wordings_per_type_out_of_range_is_one_line():
    out = subprocess.run([sys.executable, "builders/make_ifeval_data.py", "--train_wordings_per_type", "11"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        "make_ifeval_data.py: error: --train_wordings_per_type must be between 1 and 10 (the wordings each type has "
        "for training), or 0 for the shipped files; got 11")


@pytest.mark.parametrize("kind", sorted(CHECKS))
def test_every_wording_renders_for_the_builders_constraints(kind):
    """Every template of every family fills its slots for every constraint the builder draws of its type."""
    import random

    rng = random.Random(3)
    for topic in B.EVAL_TOPICS[:6]:
        c = B.sample_constraint(kind, topic, rng)
        for name in ("train", "heldout"):
            for wid in B.family(kind, name):
                text, is_clause = B.worded(kind, wid, c)
                assert text.strip() and "{" not in text.replace("{\"", "") and (not is_clause or text[0].islower()), (wid, text)
