"""Generate the embedded demo's data files (deterministic: same seed -> byte-identical files).

Rebuild everything the demo needs, from the repository root:

    python builders/make_demo_data.py            # dataset/demo_*.jsonl
    python builders/train_tokenizer.py           # model/tokenizer*.json

Writes into --out_dir:
    demo_train.jsonl       10,000 RLAIF prompts (shipped)  {"conversations": [user, assistant=reference]}
    demo_eval.jsonl           500 held-out RLAIF prompts (shipped)
    demo_sft.jsonl         40,000 SFT conversations, ~50% "full" / ~50% "plain" replies
    demo_pairs.jsonl       60,000 preference pairs (train side) for the demo reward model (one pass)
    demo_pairs_eval.jsonl   1,000 preference pairs (eval side) for held-out RM accuracy
    demo_tools_train.jsonl  2,000 multiplication prompts for the tool demo (shipped; configs/demo_tools.yaml)
    demo_tools_eval.jsonl     200 held-out multiplication prompts for the tool demo (shipped)
    demo_tools_sft.jsonl    8,000 SFT conversations of the tool demo, 60% calculator episodes (multi-turn)
Rows also carry "task" and "lang" (and "style" / "kind"); MiniMind loaders ignore extra keys.
The task itself lives in dataset/demo_task.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset.demo_task import generate_all


def write_jsonl(path: Path, rows: list[dict]) -> None:
    # ensure_ascii=False keeps Chinese readable, as in MiniMind's own jsonl files.
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    path.write_text(text, encoding="utf-8", newline="\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out_dir", type=Path, default=Path(__file__).resolve().parents[1] / "dataset")
    parser.add_argument("--n_train", type=int, default=10_000)
    parser.add_argument("--n_eval", type=int, default=500)
    parser.add_argument("--n_sft", type=int, default=40_000)
    parser.add_argument("--n_pairs", type=int, default=60_000)
    parser.add_argument("--n_pairs_eval", type=int, default=1_000)
    parser.add_argument("--n_tool_train", type=int, default=2_000)
    parser.add_argument("--n_tool_eval", type=int, default=200)
    parser.add_argument("--n_tool_sft", type=int, default=8_000)
    args = parser.parse_args(argv)
    for flag in ("n_train", "n_eval", "n_sft", "n_pairs", "n_pairs_eval", "n_tool_train", "n_tool_eval", "n_tool_sft"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag} must be >= 0")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"--out_dir {args.out_dir} exists and is not a directory")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    try:
        files = generate_all(args.seed, n_train=args.n_train, n_eval=args.n_eval, n_sft=args.n_sft,
                             n_pairs=args.n_pairs, n_pairs_eval=args.n_pairs_eval, n_tool_train=args.n_tool_train,
                             n_tool_eval=args.n_tool_eval, n_tool_sft=args.n_tool_sft)
    except RuntimeError as err:  # too many distinct prompts asked of a small problem space
        raise SystemExit(f"make_demo_data: {err}") from None
    for stem, rows in files.items():
        path = args.out_dir / f"{stem}.jsonl"
        write_jsonl(path, rows)
        print(f"{path}: {len(rows)} rows")
    print(f"done in {time.perf_counter() - start:.1f} s (seed {args.seed})")


if __name__ == "__main__":
    main()
