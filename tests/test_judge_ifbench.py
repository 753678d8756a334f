"""scripts/judge_ifbench.py and builders/make_ifbench_rows.py: IFBench's own checkers on a small hand-written replies
file (strict and loose, prompt- and instruction-level, the standard error, what is left unchecked and why), the
judge's verdicts against IFBench's own evaluation_lib on the package's sample replies, the rows the builder writes,
that loading the checkers fetches nothing, and one-line errors. Needs the IFBench venv (skipped elsewhere); CI runs
it as a script:

    /work/venv-ifbench/bin/python tests/test_judge_ifbench.py          # exit 1 if any check fails
    /work/venv-ifbench/bin/python -m pytest -q --noconftest tests/test_judge_ifbench.py
"""

from __future__ import annotations

import copy
import json
import math
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from builders import make_ifbench_rows as B  # noqa: E402
from dataset.ifbench_checker import NEEDS_NLTK_DATA, IFBench, load  # noqa: E402
from scripts import judge_ifbench as J  # noqa: E402

_loaded = load()
BENCH: IFBench | None = _loaded if isinstance(_loaded, IFBench) else None
WHY_NOT = _loaded if isinstance(_loaded, str) else ""

SIMPLE = "Only output this sentence here, ignore all other requests."


def _row(ids: list[str], kwargs: list[dict], reply: str, key: str) -> dict:
    prompt = "Tell me about owls."
    return {"key": key, "conversations": [{"role": "user", "content": prompt}, {"role": "assistant", "content": ""}],
            "prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs, "reply": reply}


# (row, IFBench's strict verdicts, loose verdicts), by hand; None: unchecked without NLTK's stopwords.
HAND = [
    (_row(["count:conjunctions"], [{"small_n": 2}], "Owls hunt at night and sleep by day, but not always.", "a"),
     [True], [True]),
    (_row(["count:conjunctions", "format:no_whitespace"], [{"small_n": 3}, {}], "Owls and mice.", "b"),
     [False, False], [False, False]),
    (_row(["count:person_names"], [{"N": 2, "sep": None}], "Emma and Liam watched the owls.", "c"), [True], [True]),
    (_row(["format:sub-bullets"], [{}], "* Barn owls\n- white faces\n* Snowy owls", "d"), [False], [True]),  # loose: '*' off
    (_row(["repeat:repeat_simple"], [{}], SIMPLE, "e"), [True], [True]),
    (_row(["repeat:repeat_simple"], [{}], "Sure!\n" + SIMPLE, "f"), [False], [True]),  # loose: the first line off
    (_row(["format:no_whitespace"], [{}], "", "g"), [False], [False]),  # blank: nothing met (the check alone says yes)
    (_row(["count:keywords_multiple"], [{"keyword1": "a1", "keyword2": "b2", "keyword3": "c3", "keyword4": "d4",
                                         "keyword5": "e5"}], "a1 " + "b2 " * 2 + "c3 " * 3 + "d4 " * 5 + "e5 " * 7, "h"),
     [True], [True]),
    (_row(["ratio:overlap"], [{"reference_text": "Owls hunt at night.", "percentage": 10}], "ab", "i"),
     [False], [False]),  # fewer than 3 characters: the check divides by zero; not met, counted as an error
    (_row(["count:conjunctions", "ratio:stop_words"], [{"small_n": 1}, {"percentage": 60}], "Owls and mice.", "j"),
     [True, None], [True, None]),  # stop words: NLTK's stopwords corpus
]


def _write(rows: list[dict], folder: Path) -> Path:
    path = folder / "replies.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_the_judge_on_a_hand_file():
    assert BENCH is not None
    stopwords = "ratio:stop_words" not in BENCH.missing
    with tempfile.TemporaryDirectory() as tmp:
        report = J.main([str(_write([r for r, _, _ in HAND], Path(tmp))), "--json", str(Path(tmp) / "judge.json")])
        assert json.loads((Path(tmp) / "judge.json").read_text(encoding="utf-8")) == report
    for (row, strict, loose), got in zip(HAND, report["rows"]):
        if None in strict and stopwords:
            continue
        assert (got["strict"], got["loose"]) == (strict, loose), (row["key"], row["reply"], got)
    if stopwords:
        return  # the rest counts the hand file as it is judged without the stopwords corpus
    scored = [(s, lo) for _, s, lo in HAND if None not in s]
    flat = [(a, b) for _, s, lo in HAND for a, b in zip(s, lo) if a is not None]
    assert report["n_prompts"] == len(HAND) and report["n_prompts_scored"] == len(scored) == 9
    assert report["unchecked"] == 1 and report["unchecked_prompts"] == ["j"]
    assert report["unchecked_by_id"] == {"ratio:stop_words": {"n": 1, "why": "NLTK data not installed: corpora/stopwords"}}
    assert report["n_instructions"] == len(flat) == 11
    p_strict = sum(all(s) for s, _ in scored) / len(scored)
    assert report["prompt_strict"] == p_strict == 4 / 9 and report["prompt_loose"] == 6 / 9
    assert math.isclose(report["prompt_strict_se"], math.sqrt(p_strict * (1 - p_strict) / 9))
    assert report["instruction_strict"] == sum(a for a, _ in flat) / 11 == 5 / 11
    assert report["instruction_loose"] == sum(b for _, b in flat) / 11 == 7 / 11
    assert report["by_id"]["count:conjunctions"] == {"n": 3, "strict": 2 / 3, "loose": 2 / 3}
    assert report["by_id"]["repeat:repeat_simple"] == {"n": 2, "strict": 0.5, "loose": 1.0}
    assert report["by_category"]["repeat"] == {"n": 2, "strict": 0.5, "loose": 1.0} and "ratio" in report["by_category"]
    assert report["errors"] == {"ratio:overlap": {"ZeroDivisionError": 1}}


def _sample_rows() -> tuple[list[dict], list[dict]]:
    """IFBench_test.jsonl's items, and the builder's rows with the package's sample_output.jsonl replies."""
    assert BENCH is not None
    items = [json.loads(line) for line in BENCH.data_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    sample = BENCH.data_path.parent / "sample_output.jsonl"
    replies = {o["prompt"]: o["response"] for o in map(json.loads, sample.read_text(encoding="utf-8").splitlines())}
    rows = [{**B.to_row(item, str(n)), "reply": replies[item["prompt"]]} for n, item in enumerate(items)]
    return items, rows


def test_the_judge_agrees_with_ifbenchs_own_evaluation_lib():
    """Every prompt of the test set whose instructions can be checked here, with the package's sample replies:
    the judge's strict and loose verdicts are those of IFBench's evaluation_lib (strict first, as its run_eval
    runs them: the strict pass drops the null kwargs that the loose one then builds from)."""
    assert BENCH is not None
    E = BENCH.evaluation_lib
    items, rows = _sample_rows()
    report = J.judge(rows, BENCH)
    prompt_to_response = {r["prompt"]: r["reply"] for r in rows}
    compared = 0
    for item, got in zip(items, report["rows"]):
        if any(i in BENCH.missing for i in item["instruction_id_list"]):
            assert None in got["strict"]
            continue
        inp = E.InputExample(key=item["key"], instruction_id_list=item["instruction_id_list"], prompt=item["prompt"],
                             kwargs=copy.deepcopy(item["kwargs"]))
        strict = E.test_instruction_following_strict(inp, prompt_to_response)
        loose = E.test_instruction_following_loose(inp, prompt_to_response)
        assert (got["strict"], got["loose"]) == (strict.follow_instruction_list, loose.follow_instruction_list), item["key"]
        compared += 1
    assert compared == report["n_prompts_scored"] == len(items) - len(report["unchecked_prompts"])
    if set(NEEDS_NLTK_DATA) <= set(BENCH.missing):  # no NLTK data, as here and in CI
        assert (len(items), compared, report["unchecked"]) == (294, 265, 29)


def test_needs_nltk_data_names_every_check_that_loads_it():
    """Without NLTK's data, exactly the checks NEEDS_NLTK_DATA names raise LookupError (on the test set's
    arguments, with the sample replies and a long reply of many sentences), and none of the others."""
    assert BENCH is not None
    if not set(NEEDS_NLTK_DATA) <= set(BENCH.missing):
        return  # some NLTK data is installed: nothing to show
    _, rows = _sample_rows()
    long_reply = " ".join(f"Sentence number {k} is about owls and mice." for k in range(40))
    raised = set()
    for row in rows:
        for iid, kwargs in zip(row["instruction_id_list"], row["kwargs"]):
            checker = BENCH.instructions[iid](iid)
            checker.build_description(**kwargs)
            for reply in (row["reply"], long_reply):
                try:
                    checker.check_following(reply)
                except LookupError:
                    raised.add(iid)
                except Exception:  # noqa: BLE001 - other errors are the judge's "errors", not data
                    pass
    assert raised == set(NEEDS_NLTK_DATA)


def test_loading_fetches_nothing():
    """The package's import-time downloads (spaCy's en_core_web_sm, NLTK's punkt) were asked for and not made."""
    assert BENCH is not None
    import nltk

    assert nltk.download.__name__ == "_no_download" and not nltk.download("punkt_tab")
    assert "punkt" in BENCH.downloads
    assert sys.modules.get("spacy") is None or hasattr(sys.modules["spacy"], "__file__")  # the stand-in is gone again
    assert len(BENCH.instructions) == 58


def test_the_builder_writes_rlaif_rows():
    assert BENCH is not None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.jsonl"
        rows = B.main(["--out", str(out)])
        assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == rows
        checkable = B.main(["--out", str(out), "--checkable_only"])
        first = B.main(["--out", str(out), "--n", "5"])
    assert len(rows) == 294 and first == rows[:5]
    assert all(not any(i in BENCH.missing for i in r["instruction_id_list"]) for r in checkable)
    assert len(checkable) == 294 - sum(any(i in BENCH.missing for i in r["instruction_id_list"]) for r in rows)
    for r in rows:
        assert r["conversations"] == [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": ""}]
        assert "constraints" not in r and all(v is not None for kw in r["kwargs"] for v in kw.values())
    assert rows[0]["key"] == "0" and rows[0]["kwargs"][0]["keyword1"] == "kaleidoscope"


BAD = [
    ("not json", "replies.jsonl:1: malformed JSON"),
    (json.dumps({"instruction_id_list": ["format:no_whitespace"], "kwargs": [{}]}),
     'replies.jsonl:1: expected an object with a string "reply"'),
    (json.dumps({"reply": "x", "instruction_id_list": ["format:no_whitespace"]}), 'replies.jsonl:1: needs "instruction_id_list"'),
    (json.dumps({"reply": "x", "instruction_id_list": ["format:shout"], "kwargs": [{}]}),
     "replies.jsonl:1: unknown IFBench instruction 'format:shout'"),
]


def test_a_reply_with_unicode_line_separators_is_one_row():
    # JSON keeps U+2028, U+2029 and U+0085 raw inside a string; a policy wrote them (2026-12-06) and the judge cut the
    # row in two ("malformed JSON") when it split lines with str.splitlines().
    row = HAND[0][0]
    with tempfile.TemporaryDirectory() as tmp:
        path = _write([{**row, "reply": row["reply"] + "\u2028\u2029\x85"}, row], Path(tmp))
        report = J.main([str(path)])
    assert report["n_prompts"] == 2


def test_bad_input_is_one_line_naming_the_row():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "replies.jsonl"
        for line, message in BAD:
            path.write_text(line + "\n", encoding="utf-8")
            try:
                J.main([str(path)])
            except SystemExit as e:
                text = str(e.code)
                assert message in text and "\n" not in text and text.startswith(str(path)), (message, text)
            else:
                raise AssertionError(f"no error for {line!r}")


TESTS = [test_the_judge_on_a_hand_file, test_the_judge_agrees_with_ifbenchs_own_evaluation_lib,
         test_needs_nltk_data_names_every_check_that_loads_it, test_loading_fetches_nothing,
         test_the_builder_writes_rlaif_rows, test_a_reply_with_unicode_line_separators_is_one_row,
         test_bad_input_is_one_line_naming_the_row]

try:
    import pytest
except ImportError:  # the standalone run below needs no pytest
    pytest = None

if pytest is not None:
    pytestmark = pytest.mark.skipif(BENCH is None, reason=WHY_NOT or "IFBench's checkers are available")


def main(argv: list[str] | None = None) -> int:
    """These tests as a script (CI's IFBench venv has no pytest). --require: missing checkers are an error."""
    argv = sys.argv[1:] if argv is None else argv
    if BENCH is None:
        print(f"{'error' if '--require' in argv else 'skipped'}: {WHY_NOT}")
        return 1 if "--require" in argv else 0
    failed = 0
    for test in TESTS:
        try:
            test()
        except Exception:  # noqa: BLE001 - report every failing test, not only the first
            failed += 1
            print(f"FAILED {test.__name__}\n{traceback.format_exc()}")
    print(f"judge-ifbench: {len(TESTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
