"""Check replies to IFEval prompts with Google's own checker (if-verifiable's IFEval instructions): strict and
loose accuracy, prompt-level and instruction-level, overall, per type and per wording. Runs in the reference venv
(no torch; docs/smollm2_ifeval.md says how to make it):

    python scripts/eval_policy.py --hf_path out/smollm2_ifeval_hf --data_path dataset/ifeval_eval_seen_wording.jsonl \\
        --max_new_tokens 96 --thinking_ratio 0 --reward_model_path none --replies_out out/ifeval_replies.jsonl
    .venv-ifeval/bin/python scripts/judge_ifeval.py out/ifeval_replies.jsonl --json out/ifeval_judge.json

Each input row: "instruction_id_list" and "kwargs" (IFEval's input_data format, as builders/make_ifeval_data.py
writes them), "reply", and optionally "prompt" (else the last user turn of "conversations"), "constraints" (ours:
the per-type table then names our types, and dataset/ifeval.py's verdicts are compared with Google's strict ones)
and "wording". Strict: the reply as it is; loose: IFEval's variants too (first and / or last line dropped, '*'
removed); a blank reply meets nothing (IFEval's evaluation_lib, with Google's checker classes and the package's
loose variants). langdetect is seeded (0). Instructions that need NLTK's punkt_tab data (number_sentences,
capital_word_frequency) are left unchecked, and their rows out of the prompt-level figures, where it is not installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dataset import ifeval
from dataset.ifeval_google import NEEDS_PUNKT, Google, load, punkt_available
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
                             f"(builders/make_ifeval_data.py writes them)")
        unknown = [i for i in ids if i not in known]
        if unknown:
            raise SystemExit(f"{where}: unknown IFEval instruction {unknown[0]!r}")
        if "constraints" in row:
            try:
                ifeval.validate(row["constraints"], where)
            except ValueError as e:
                raise SystemExit(str(e)) from None
            if [ifeval.IFEVAL_IDS[c["type"]] for c in row["constraints"]] != ids:
                raise SystemExit(f"{where}: \"constraints\" and \"instruction_id_list\" name different instructions")
        if not isinstance(row.get("prompt"), str):
            users = [m.get("content") for m in row.get("conversations") or [] if isinstance(m, dict) and m.get("role") == "user"]
            row["prompt"] = users[-1] if users and isinstance(users[-1], str) else ""
        rows.append(row)
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return rows


def _rate(hits: list[bool]) -> float | None:
    return sum(hits) / len(hits) if hits else None


def verdicts(google: Google, iid: str, kwargs: dict, prompt: str, reply: str) -> tuple[bool, bool]:
    """(strict, loose) for one instruction, as IFEval's evaluation_lib judges it with Google's checker: strict on
    the reply as it is, loose on any of its variants; a blank reply or variant meets nothing. (if-verifiable's own
    evaluate_instructions strips the reply and drops <think> blocks first, which moves paragraph_first_word's nth
    paragraph for a reply opening with a blank one; IFEval's evaluation_lib and the trainer's reward do not.)"""
    checker = google.instructions[iid](iid)
    checker.build_description(**{k: v for k, v in kwargs.items() if v is not None})
    args = checker.get_instruction_args()
    if args and "prompt" in args:
        checker.build_description(prompt=prompt)

    def met(text: str) -> bool:
        try:
            return bool(text.strip() and checker.check_following(text))
        except RecursionError:  # JSON nested past the parser's depth: Google's checker raises, not met
            return False
    return met(reply), any(met(v) for v in google.loose_variants(reply))


def judge(rows: list[dict], google: Google, punkt: bool) -> dict[str, Any]:
    """Google's strict and loose verdicts per instruction, and the figures over them."""
    per_row: list[dict] = []
    by_type: dict[str, dict] = {}
    by_wording: dict[str, dict] = {}
    prompt_strict: list[bool] = []
    prompt_loose: list[bool] = []
    differ: list[dict] = []
    compared = unchecked = 0
    for row in rows:
        ids = row["instruction_id_list"]
        labels = [c["type"] for c in row["constraints"]] if "constraints" in row else ids
        wording = row.get("wording") or [None] * len(ids)
        got: list[tuple[bool, bool] | None] = []
        for k, iid in enumerate(ids):
            if iid in NEEDS_PUNKT and not punkt:
                got.append(None)
                unchecked += 1
                continue
            s, lo = verdicts(google, iid, row["kwargs"][k], row["prompt"], row["reply"])
            got.append((s, lo))
            t = by_type.setdefault(labels[k], {"ifeval_id": iid, "strict": [], "loose": []})
            t["strict"].append(s)
            t["loose"].append(lo)
            if isinstance(wording[k], str):
                w = by_wording.setdefault(wording[k], {"strict": [], "loose": []})
                w["strict"].append(s)
                w["loose"].append(lo)
        if all(g is not None for g in got):
            prompt_strict.append(all(g[0] for g in got if g))
            prompt_loose.append(all(g[1] for g in got if g))
        if "constraints" in row:  # ours beside Google's strict verdict
            for (kind, ok), g in zip(ifeval.results(row["constraints"], row["reply"]), got):
                compared += 1
                if g is not None and ok is not g[0]:
                    differ.append({"type": kind, "reply": row["reply"], "ours": ok, "google": g[0]})
        per_row.append({"strict": [g and g[0] for g in got], "loose": [g and g[1] for g in got]})
    flat = [(s, lo) for t in by_type.values() for s, lo in zip(t["strict"], t["loose"])]
    return {
        "n_prompts": len(rows), "n_prompts_scored": len(prompt_strict), "n_instructions": len(flat), "unchecked": unchecked,
        "prompt_strict": _rate(prompt_strict), "prompt_loose": _rate(prompt_loose),
        "instruction_strict": _rate([s for s, _ in flat]), "instruction_loose": _rate([lo for _, lo in flat]),
        "by_type": {k: {"ifeval_id": t["ifeval_id"], "n": len(t["strict"]), "strict": _rate(t["strict"]),
                        "loose": _rate(t["loose"])} for k, t in sorted(by_type.items())},
        "by_wording": {k: {"n": len(w["strict"]), "strict": _rate(w["strict"]), "loose": _rate(w["loose"])}
                       for k, w in sorted(by_wording.items())},
        "ours_vs_google": {"compared": compared, "differ": differ},
        "rows": per_row,
    }


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def print_report(r: dict[str, Any], source: str) -> None:
    print(f"{source}: {r['n_prompts']} prompts, {r['n_instructions']} instructions checked by Google's IFEval checker"
          + (f" ({r['unchecked']} unchecked: NLTK's punkt_tab data is not installed)" if r["unchecked"] else ""))
    print(f"  {'':<20} {'strict':>8} {'loose':>8}")
    print(f"  {'prompt-level':<20} {_pct(r['prompt_strict']):>8} {_pct(r['prompt_loose']):>8}   ({r['n_prompts_scored']} prompts)")
    print(f"  {'instruction-level':<20} {_pct(r['instruction_strict']):>8} {_pct(r['instruction_loose']):>8}")
    width = max([22, *map(len, r["by_type"])])
    print(f"  {'type':<{width}} {'IFEval id':<44} {'n':>5} {'strict':>8} {'loose':>8}")
    for kind, t in r["by_type"].items():
        print(f"  {kind:<{width}} {t['ifeval_id']:<44} {t['n']:>5} {_pct(t['strict']):>8} {_pct(t['loose']):>8}")
    for kind, w in r["by_wording"].items():
        print(f"  worded as {kind + ':':<12} {w['n']} instructions, strict {_pct(w['strict'])}, loose {_pct(w['loose'])}")
    o = r["ours_vs_google"]
    if o["compared"]:
        print(f"  dataset/ifeval.py agrees with Google's strict verdict on {o['compared'] - len(o['differ'])} of "
              f"{o['compared']} instructions" + (" (differences: lowercase / uppercase replies langdetect does not call "
                                                 "English, JSON nested past the parser's depth)" if o["differ"] else ""))
        for d in o["differ"][:10]:
            print(f"    {d['type']}: {d['reply'][:120]!r} ours {d['ours']}, Google's {d['google']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("replies", help="jsonl: IFEval rows with a \"reply\" each (scripts/eval_policy.py --replies_out)")
    p.add_argument("--json", default="", help="write the figures (and each row's verdicts) here")
    a = p.parse_args(argv)
    google = load()
    if isinstance(google, str):
        raise SystemExit(f"error: {google}; scripts/judge_ifeval.py runs in the venv of docs/smollm2_ifeval.md")
    report = judge(read_rows(a.replies, google.instructions), google, punkt_available())
    print_report(report, a.replies)
    if a.json:
        out = Path(a.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
