"""dataset/jsonl.py: a row whose text holds a Unicode line separator stays one row, for every reader that indexes
rows by line (scripts/eval_policy.py's source rows, the judges, the IFBench row builder)."""

from __future__ import annotations

import json
from pathlib import Path

from dataset.jsonl import jsonl_lines
from dataset.rlaif import read_rlaif_jsonl
from scripts.eval_policy import source_rows

# JSON writes these raw inside a string (ensure_ascii=False); str.splitlines() splits at every one of them.
SEPARATORS = "\u2028\u2029\x85\x1c\x1d\x1e\x0b\x0c"


def _rows() -> list[dict]:
    return [{"conversations": [{"role": "user", "content": f"Say {i}.{SEPARATORS}Then stop."},
                               {"role": "assistant", "content": ""}], "task": f"t{i}"} for i in range(3)]


def test_lines_split_at_newline_only(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _rows()), encoding="utf-8")
    lines = jsonl_lines(path)
    assert [json.loads(line) for line in lines if line] == _rows()
    assert lines[-1] == ""  # the final newline: readers skip blank lines


def test_eval_policy_finds_each_records_own_source_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in _rows()), encoding="utf-8")
    records, skipped = read_rlaif_jsonl(path)
    assert skipped == 0 and len(records) == 3
    assert [row["task"] for row in source_rows(path, records)] == ["t0", "t1", "t2"]
