"""scripts/judge_ifeval.py: Google's checker on a small hand-written replies file (strict and loose, prompt- and
instruction-level, per type, ours beside Google's), the shipped held-out files' ids and kwargs against our
constraints, and one-line errors. Needs the reference venv (skipped elsewhere); CI runs it as a script:

    /work/venv-ifeval/bin/python tests/test_judge_ifeval.py          # exit 1 if any check fails
    /work/venv-ifeval/bin/python -m pytest -q --noconftest tests/test_judge_ifeval.py
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dataset import ifeval as F  # noqa: E402
from dataset.ifeval_google import Google, load, punkt_available  # noqa: E402
from scripts import judge_ifeval as J  # noqa: E402

_loaded = load()
GOOGLE: Google | None = _loaded if isinstance(_loaded, Google) else None
WHY_NOT = _loaded if isinstance(_loaded, str) else ""


def _row(constraints: list[dict], reply: str) -> dict:
    ids, kwargs = F.ifeval_instructions(constraints)
    prompt = "Write about the sea. " + " ".join(map(F.describe, constraints))
    return {"conversations": [{"role": "user", "content": prompt}, {"role": "assistant", "content": ""}],
            "constraints": constraints, "instruction_id_list": ids, "kwargs": kwargs, "wording": ["ifeval"] * len(ids),
            "reply": reply}


# (row, Google's strict verdicts, loose verdicts), by hand.
HAND = [
    (_row([{"type": "no_comma"}, {"type": "number_words", "relation": "at least", "num": 5}],
          "The sea is calm and blue today."), [True, True], [True, True]),
    (_row([{"type": "quotation"}], 'Sure, here it is:\n"The sea is calm."'), [False], [True]),  # loose: first line off
    (_row([{"type": "end_phrase", "phrase": "Any other questions?"}], "The sea is calm.\nAny other questions?\n"),
     [True], [True]),
    (_row([{"type": "highlighted_sections", "num": 1}, {"type": "title"}], "The sea is calm."), [False, False], [False, False]),
    (_row([{"type": "json"}, {"type": "forbidden_words", "words": ["storm"]}], '```json\n{"sea": "calm"}\n```'),
     [True, True], [True, True]),
    (_row([{"type": "start_phrase", "phrase": "I think"}], "I think the sea is calm."), [True], [True]),
    (_row([{"type": "number_bullets", "num": 2}], "* one\n* two\n* three"), [False], [True]),  # loose: last line off
    (_row([{"type": "no_comma"}], "   "), [False], [False]),  # blank: nothing met
    (_row([{"type": "lowercase"}], "i like the sea."), [False], [False]),  # langdetect (seeded) does not say English
    ({"prompt": "Tell me about owls. Your ENTIRE response should be in French language, no other language is allowed.",
      "instruction_id_list": ["language:response_language"], "kwargs": [{"language": "fr"}], "wording": ["ifeval"],
      "reply": "Les chouettes sont des oiseaux nocturnes qui chassent la nuit dans les forêts."}, [True], [True]),
    ({"prompt": "Tell me about owls. Your response should contain at least 2 sentences.",
      "instruction_id_list": ["length_constraints:number_sentences"], "kwargs": [{"num_sentences": 2, "relation": "at least"}],
      "reply": "Owls hunt at night. They see well in the dark."}, [True], [True]),  # only where punkt_tab is installed
]


def _write(rows: list[dict], folder: Path) -> Path:
    path = folder / "replies.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_the_judge_on_a_hand_file():
    punkt = punkt_available()
    with tempfile.TemporaryDirectory() as tmp:
        report = J.main([str(_write([r for r, _, _ in HAND], Path(tmp))), "--json", str(Path(tmp) / "judge.json")])
        assert json.loads((Path(tmp) / "judge.json").read_text(encoding="utf-8")) == report
    checked = HAND if punkt else HAND[:-1]
    for (row, strict, loose), got in zip(HAND, report["rows"]):
        if row in [r for r, _, _ in checked]:
            assert (got["strict"], got["loose"]) == (strict, loose), (row["reply"], got)
    assert report["unchecked"] == (0 if punkt else 1) and report["n_prompts_scored"] == len(checked)
    n = sum(len(s) for _, s, _ in checked)
    assert report["n_instructions"] == n
    assert report["instruction_strict"] == sum(sum(s) for _, s, _ in checked) / n
    assert report["instruction_loose"] == sum(sum(lo) for _, _, lo in checked) / n
    assert report["prompt_strict"] == sum(all(s) for _, s, _ in checked) / len(checked)
    assert report["prompt_loose"] == sum(all(lo) for _, _, lo in checked) / len(checked)
    assert report["by_type"]["start_phrase"] == {"ifeval_id": "combination:repeat_prompt", "n": 1, "strict": 1.0, "loose": 1.0}
    assert report["by_type"]["number_bullets"]["strict"] == 0.0 and report["by_type"]["language:response_language"]["n"] == 1
    # ours beside Google's: the lowercase reply langdetect calls another language is the one difference
    assert report["ours_vs_google"]["compared"] == 12
    assert [(d["type"], d["ours"], d["google"]) for d in report["ours_vs_google"]["differ"]] == [("lowercase", True, False)]


def test_the_shipped_rows_name_the_same_checks_for_google_as_for_us():
    """Every held-out row with random replies: Google's strict verdicts, built from the row's ids and kwargs, are
    ours (built from its constraints), but for the language check of lowercase / uppercase."""
    from tests.test_ifeval_reference import _random_reply

    rng = random.Random(0)
    rows = []
    for name in ("ifeval_eval.jsonl", "ifeval_eval_seen_wording.jsonl", "ifeval_eval_heldout_wording.jsonl"):
        for line in (ROOT / "dataset" / name).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            c = row["constraints"][rng.randrange(len(row["constraints"]))]  # a reply aimed at one of its constraints
            rows.append({**row, "reply": _random_reply(c["type"], c, rng)})
    report = J.judge(rows, GOOGLE, punkt=False)
    assert report["n_prompts_scored"] == len(rows) and report["unchecked"] == 0  # Google's checker judges every row
    assert report["ours_vs_google"]["compared"] == sum(len(r["constraints"]) for r in rows)
    assert {"ifeval", "ours", "heldout"} <= set(report["by_wording"])
    assert {d["type"] for d in report["ours_vs_google"]["differ"]} <= {"lowercase", "uppercase"}
    assert all(d["ours"] and not d["google"] for d in report["ours_vs_google"]["differ"])
    # the types we do not train: the language rows are checked; the punkt ones only where punkt_tab is installed
    other = [{**json.loads(line), "reply": "The sea is calm. IT IS BLUE."}
             for line in (ROOT / "dataset" / "ifeval_eval_other_types.jsonl").read_text(encoding="utf-8").splitlines()]
    report = J.judge(other, GOOGLE, punkt=punkt_available())
    assert report["by_type"]["language:response_language"]["n"] == 20 and report["ours_vs_google"]["compared"] == 0
    assert report["unchecked"] == (0 if punkt_available() else 40)


def test_if_verifiables_own_harness_strips_the_reply_first():
    """The one documented difference of if-verifiable's evaluate_instructions from IFEval's evaluation_lib (which
    the judge and the trainer's reward follow): it strips the reply, so a blank first paragraph no longer counts."""
    c = {"type": "paragraph_first_word", "num": 2, "nth": 2, "word": "sea"}
    reply = "\n\nIntro.\n\nSea is calm."
    ids, kwargs = F.ifeval_instructions([c])
    results, _ = GOOGLE.evaluate(response=reply, instruction_id_list=ids, kwargs_list=kwargs, prompt="",
                                 instruction_registry=GOOGLE.instructions)
    assert results[0].strict_pass is True
    assert J.verdicts(GOOGLE, ids[0], kwargs[0], "", reply)[0] is False and F.reward([c], reply) == 0.0


BAD = [
    ("not json", "replies.jsonl:1: malformed JSON"),
    (json.dumps({"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}),
     'replies.jsonl:1: expected an object with a string "reply"'),
    (json.dumps({"reply": "x", "instruction_id_list": ["punctuation:no_comma"]}), 'replies.jsonl:1: needs "instruction_id_list"'),
    (json.dumps({"reply": "x", "instruction_id_list": ["punctuation:shout"], "kwargs": [{}]}),
     "replies.jsonl:1: unknown IFEval instruction 'punctuation:shout'"),
    (json.dumps({"reply": "x", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}], "constraints": [{"type": "title"}]}),
     'replies.jsonl:1: "constraints" and "instruction_id_list" name different instructions'),
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


TESTS = [test_the_judge_on_a_hand_file, test_the_shipped_rows_name_the_same_checks_for_google_as_for_us,
         test_if_verifiables_own_harness_strips_the_reply_first, test_a_reply_with_unicode_line_separators_is_one_row,
         test_bad_input_is_one_line_naming_the_row]

try:
    import pytest
except ImportError:  # the standalone run below needs no pytest
    pytest = None

if pytest is not None:
    pytestmark = pytest.mark.skipif(GOOGLE is None, reason=WHY_NOT or "Google's IFEval checker is available")


def main(argv: list[str] | None = None) -> int:
    """These tests as a script (CI's reference venv has no pytest). --require: a missing checker is an error."""
    argv = sys.argv[1:] if argv is None else argv
    if GOOGLE is None:
        print(f"{'error' if '--require' in argv else 'skipped'}: {WHY_NOT}")
        return 1 if "--require" in argv else 0
    failed = 0
    for test in TESTS:
        try:
            test()
        except Exception:  # noqa: BLE001 - report every failing test, not only the first
            failed += 1
            print(f"FAILED {test.__name__}\n{traceback.format_exc()}")
    print(f"judge-ifeval: {len(TESTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
