"""Evaluate a policy on held-out RLAIF prompts: format rate, answer accuracy, RM score, length, EOS rate, and the
IFEval pass rate for rows with "constraints".

    python scripts/eval_policy.py --weights out/full_sft_128.pth --hidden_size 128 --num_hidden_layers 4
    python scripts/eval_policy.py --weights out/ppo_actor_128.pth --hidden_size 128 --num_hidden_layers 4 \\
        --ref_weights out/full_sft_128.pth --temperature 0.8 --json out/eval_ppo.json
    python scripts/eval_policy.py --hf_path path/to/hf_model --reward_model_path none
    python scripts/eval_policy.py --hf_path out/smollm2_ifeval_hf --ref_hf_path out/smollm2_135m_instruct \
        --data_path dataset/ifeval_eval.jsonl --max_new_tokens 96 --thinking_ratio 0 --reward_model_path none
    python scripts/eval_policy.py --hf_path out/smollm2_135m_instruct --reasoning_gym chain_sum --n 100 \
        --thinking_ratio 0 --reward_model_path none     # train_ppo --reasoning_gym's held-out rows, its verifier
    python scripts/eval_policy.py --hf_path out/smollm2_135m_instruct --reasoning_gym chain_sum --n 100 \
        --rg_template heldout --thinking_ratio 0 --reward_model_path none   # the same rows, templates never trained on
    python scripts/eval_policy.py --hf_path out/smollm2_tools_hf --config configs/smollm2_tools.yaml \
        --data_path dataset/smollm2_tools_eval_unseen.jsonl   # tool episodes as the preset runs them, its settings

Prints a table (overall and per task when the data rows carry a "task" key) and writes the
figures, plus a few example replies, as JSON; --replies_out FILE writes every reply beside its data row, e.g. for
IFEval rows, checked by Google's own checker with scripts/judge_ifeval.py (docs/smollm2_ifeval.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

from dataset import rgym
from dataset.jsonl import jsonl_lines
from dataset.rlaif import TOOLS_PLACEHOLDER, TOOLS_UNSEEN, DataError, read_rlaif_jsonl, template_renders_tools
from model.loader import load_policy, load_reward_model
from model.weights import WeightsError
from trainer.evaluate import EvalSettings, evaluate_policy
from trainer.reward_model import RewardModelScorer
from trainer.tools import ToolError, ToolRunner, load_tools

DEFAULT_RM = "out/demo_rm"


def source_rows(path: str | Path, records: list) -> list[dict]:
    """Each record's source line as read (records remember "path:lineno")."""
    lines = jsonl_lines(path)
    return [json.loads(lines[int(rec.where.rsplit(":", 1)[1]) - 1]) for rec in records]


def read_tasks(path: str | Path, records: list) -> list[str | None] | None:
    """The optional "task" key of each record's source line."""
    tasks = [t if isinstance(t := row.get("task"), str) else None for row in source_rows(path, records)]
    return tasks if any(t is not None for t in tasks) else None


def write_replies(path: str | Path, sources: list[dict], rows: list[dict]) -> None:
    """One jsonl line per evaluated prompt: its source row's fields plus "reply" (what the reward saw) and, with a
    reference model, "kl_ref" (the reply's summed log-ratio), e.g. for scripts/judge_ifeval.py, which checks IFEval
    rows with Google's checker."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)

    def extra(row):
        return {"kl_ref": row["kl_ref"]} if "kl_ref" in row else {}

    out.write_text("".join(json.dumps({**src, "reply": row["reply"], **extra(row)}, ensure_ascii=False) + "\n"
                           for src, row in zip(sources, rows, strict=True)), encoding="utf-8")


def _fmt(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if pct else f"{v:.3f}"


def print_table(m: dict, label: str) -> None:
    print(f"\n{label}")
    print(f"  n                 {m['n']}")
    print(f"  format rate       {_fmt(m['format_rate'], True)}")
    print(f"  accuracy          {_fmt(m['accuracy'], True)}   (of {m['n_with_reference']} with a reference; "
          f"in format {_fmt(m['accuracy_formatted'], True)}, plain {_fmt(m['accuracy_unformatted'], True)})")
    print(f"  RM score mean     {_fmt(m['rm_score_mean'])}")
    print(f"  mean length       {m['mean_response_len']:.1f} tokens (incl. EOS)")
    print(f"  EOS rate          {_fmt(m['eos_rate'], True)}")
    print(f"  words, distinct-2 {m['mean_words']:.1f} words per reply, {_fmt(m['distinct_2'], True)} distinct bigrams")
    if m.get("kl_ref") is not None:
        print(f"  KL to reference   {m['kl_ref']:.3f} nats/sequence")
    if m.get("ifeval_pass_rate") is not None:
        print(f"  IFEval pass rate  {_fmt(m['ifeval_pass_rate'], True)} (every constraint met; single constraints "
              f"{_fmt(m['ifeval_constraint_rate'], True)})")
        print("  " + ", ".join(f"{k} {_fmt(v, True)}" for k, v in m["ifeval_by_type"].items()))
    if m.get("tool_call_rate") is not None:
        print(f"  tool calls        {_fmt(m['tool_call_rate'], True)} of episodes call a tool, "
              f"{_fmt(m['tool_ok_rate'], True)} call and every call runs")
    if m.get("rg_tags_rate") is not None:
        print(f"  answer tags       {_fmt(m['rg_tags_rate'], True)} of replies give <answer>...</answer> (what the "
              f"verifier reads)")
    if m.get("by_task"):
        w = max(16, *map(len, m["by_task"]))
        tags = m.get("rg_tags_rate") is not None
        print(f"  {'task':<{w}} {'n':>5} {'format':>8} {'accuracy':>9}" + (f" {'tags':>7}" if tags else ""))
        for task, t in m["by_task"].items():
            print(f"  {task:<{w}} {t['n']:>5} {_fmt(t['format_rate'], True):>8} {_fmt(t['accuracy'], True):>9}"
                  + (f" {_fmt(t['rg_tags_rate'], True):>7}" if tags else ""))


# A train_ppo.py preset's settings that decide how its prompts are rendered and its episodes run: (its name, ours).
PRESET_SETTINGS = (("tools", "tools"), ("tools_system_prompt", "tools_system_prompt"), ("max_turns", "max_turns"),
                   ("max_total_len", "max_total_len"), ("thinking_ratio", "thinking_ratio"),
                   ("max_seq_len", "max_prompt_len"), ("max_gen_len", "max_new_tokens"),
                   ("reward_model_path", "reward_model_path"), ("reasoning_gym", "reasoning_gym"))


def preset_defaults(path: str) -> dict:
    """The settings of PRESET_SETTINGS from a train_ppo.py --config preset (its defaults where it sets none)."""
    from trainer.run.cli import parse_args as train_args  # here: only --config needs the trainer's parser

    cfg = train_args(["--config", path])
    found = {ours: getattr(cfg, theirs) for theirs, ours in PRESET_SETTINGS}
    if cfg.eval_data_path not in (None, "auto", "none"):  # the held-out file the run evaluated on
        found["data_path"] = cfg.eval_data_path
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=None, metavar="PRESET",
                   help="a train_ppo.py preset (configs/*.yaml): its " + ", ".join(t for t, _ in PRESET_SETTINGS)
                        + " become this script's defaults (max_seq_len as --max_prompt_len, max_gen_len as "
                          "--max_new_tokens), and its eval_data_path the default --data_path; flags override them")
    src = p.add_argument_group("policy (one of)")
    src.add_argument("--weights", default=None, help="native MiniMind .pth (needs the shape flags)")
    src.add_argument("--hf_path", default=None, help="local Hugging Face causal-LM directory")
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--use_moe", type=int, default=0, choices=(0, 1))
    p.add_argument("--arch", default="auto", choices=("auto", "qwen3", "llama"))
    p.add_argument("--tokenizer_path", default=None)
    p.add_argument("--reward_model_path", default=None,
                   help=f"sequence-classification RM directory (default {DEFAULT_RM} if it exists; 'none' to skip)")
    p.add_argument("--ref_weights", default=None, help="native .pth of a reference policy: also report KL to it")
    p.add_argument("--ref_hf_path", default=None,
                   help="local HF causal-LM directory of a reference policy (e.g. the model before training): also report KL to it")
    p.add_argument("--data_path", default="dataset/demo_eval.jsonl")
    p.add_argument("--reasoning_gym", default=None, metavar="TASK[,TASK]",
                   help="instead of --data_path: the held-out rows train_ppo.py --reasoning_gym evaluates on (the same spec), "
                        "scored by each task's score_answer")
    p.add_argument("--rg_template", default=rgym.TRAIN, choices=rgym.template_names(),
                   help="--reasoning_gym: the prompt template the held-out rows are asked in: train (the one training "
                        "uses), heldout (the templates training never uses, in turn over the rows; the table gives the "
                        "accuracy per template), or one of those")
    p.add_argument("--n", type=int, default=0, help="evaluate the first n prompts (0 = all)")
    p.add_argument("--samples_per_prompt", type=int, default=1,
                   help="replies drawn per prompt (needs --temperature > 0): each prompt's rows follow one another in "
                        "--replies_out, and every figure is over replies, so a type's rate is the chance one sample meets it")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--max_prompt_len", type=int, default=256)
    p.add_argument("--thinking_ratio", type=float, default=1.0)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="autocast dtype of the evaluation; bfloat16 gives the eval/* figures of a run trained under bf16 "
                        "autocast (train_ppo's --dtype), greedy ties and all")
    p.add_argument("--tools", default=None,
                   help="a tool module (as train_ppo.py --tools): replies are multi-turn episodes with tool calls")
    p.add_argument("--max_turns", type=int, default=3, help="--tools: policy turns per episode")
    p.add_argument("--max_total_len", type=int, default=1024, help="--tools: tokens per episode, prompt included")
    p.add_argument("--tools_system_prompt", default=None, metavar="TEXT",
                   help="--tools: list the tools in this system prompt ({tools} = their JSON schemas) instead of through "
                        "the chat template's tools= (as train_ppo.py --tools_system_prompt)")
    p.add_argument("--json", default="out/eval.json", help="write the figures here ('' to skip)")
    p.add_argument("--examples", type=int, default=8, help="example replies to print and keep in the JSON")
    p.add_argument("--replies_out", default="",
                   help="write every reply here, one jsonl line per prompt: its data row's fields plus \"reply\" "
                        "(scripts/judge_ifeval.py reads it)")
    preset = p.parse_known_args(argv)[0].config
    if preset:
        p.set_defaults(**preset_defaults(preset))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if (args.weights is None) == (args.hf_path is None):
        raise SystemExit("give exactly one of --weights PATH (native .pth) or --hf_path DIR")
    if args.samples_per_prompt < 1 or (args.samples_per_prompt > 1 and args.temperature == 0):
        raise SystemExit(f"--samples_per_prompt {args.samples_per_prompt}: give 1, or more than 1 with --temperature > 0 "
                         "(greedy replies to one prompt are all the same)")
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    t0 = time.time()
    try:
        policy, tokenizer = load_policy(
            weights=args.weights, hf_path=args.hf_path, hidden_size=args.hidden_size,
            num_hidden_layers=args.num_hidden_layers, use_moe=bool(args.use_moe), arch=args.arch,
            tokenizer_path=args.tokenizer_path,
        )
        ref_policy = None
        if args.ref_weights and args.ref_hf_path:
            raise SystemExit("give at most one of --ref_weights PATH (native .pth) or --ref_hf_path DIR")
        if args.ref_hf_path:
            ref_policy, _ = load_policy(hf_path=args.ref_hf_path, tokenizer_path=args.tokenizer_path)
            ref_policy.eval().requires_grad_(False)
        elif args.ref_weights:
            ref_policy, _ = load_policy(
                weights=args.ref_weights, hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                use_moe=bool(args.use_moe), arch=args.arch, tokenizer_path=args.tokenizer_path,
            )
            ref_policy.eval().requires_grad_(False)
        rm_path = args.reward_model_path
        if rm_path is None:
            rm_path = DEFAULT_RM if Path(DEFAULT_RM).is_dir() else "none"
        scorer = None
        if rm_path.lower() != "none":
            rm, rm_tok = load_reward_model(rm_path)
            scorer = RewardModelScorer(rm, rm_tok)
        if args.reasoning_gym:
            records = rgym.held_out(args.reasoning_gym, args.n or rgym.HELD_OUT_ROWS, args.rg_template)
        else:
            records, _ = read_rlaif_jsonl(args.data_path)
        tools = ToolRunner(load_tools(args.tools)) if args.tools else None
        if tools is not None and args.tools_system_prompt is None and not template_renders_tools(tokenizer):
            raise SystemExit(f"--tools {args.tools}: {TOOLS_UNSEEN}")
        if tools is not None and args.max_total_len <= args.max_prompt_len:
            raise SystemExit(f"--max_total_len {args.max_total_len} must exceed --max_prompt_len {args.max_prompt_len} "
                             f"(the prompt) to leave room for turns")
        if args.tools_system_prompt is not None and TOOLS_PLACEHOLDER not in args.tools_system_prompt:
            raise SystemExit("--tools_system_prompt has no {tools}, where the tools' JSON schemas go")
        if args.rg_template != rgym.TRAIN and not args.reasoning_gym:
            raise SystemExit(f"--rg_template {args.rg_template} asks --reasoning_gym's rows: give --reasoning_gym SPEC")
    except (WeightsError, DataError, ToolError, rgym.ReasoningGymError) as e:
        raise SystemExit(str(e)) from None
    if args.n > 0:
        records = records[: args.n]
    records = [r for r in records for _ in range(args.samples_per_prompt)]
    if args.reasoning_gym:
        # Per task, and with held-out templates per task and template ("basic_arithmetic/what_is").
        held = args.rg_template != rgym.TRAIN
        tasks = [(f"{r.rg['task']}/{r.rg['template']}" if held else r.rg["task"]) if r.rg else None for r in records]
        data = (f"reasoning-gym {args.reasoning_gym} (held-out rows"
                + (f", template {args.rg_template})" if held else ")"))
    else:
        tasks, data = read_tasks(args.data_path, records), args.data_path
    policy.eval()

    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if args.dtype == "bfloat16" else contextlib.nullcontext())
    with autocast:
        settings = EvalSettings(batch_size=args.batch_size, max_prompt_len=args.max_prompt_len,
                                max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed, thinking_ratio=args.thinking_ratio, max_turns=args.max_turns,
                                max_total_len=args.max_total_len, tools_system_prompt=args.tools_system_prompt)
        metrics = evaluate_policy(policy, tokenizer, records, settings, rm_scorer=scorer, ref_policy=ref_policy,
                                  tools=tools, tasks=tasks, return_rows=True)
    rows = metrics.pop("rows")
    if args.reasoning_gym:  # the share of replies the verifier reads an answer from, overall and per task (template)
        tagged = [rgym.tagged(row["reply"]) for row in rows]
        metrics["rg_tags_rate"] = sum(tagged) / max(len(tagged), 1)
        for task, t in (metrics.get("by_task") or {}).items():
            mine = [x for x, label in zip(tagged, tasks or [], strict=True) if label == task]
            t["rg_tags_rate"] = sum(mine) / max(len(mine), 1)
    elapsed = time.time() - t0
    source = args.weights or args.hf_path
    mode = "greedy" if args.temperature == 0 else f"T={args.temperature:g}, top_p={args.top_p:g}"
    print_table(metrics, f"{source} on {data} ({mode}, max {args.max_new_tokens} new tokens, "
                         f"RM {rm_path}) in {elapsed:.0f} s")
    for row in rows[: args.examples]:
        mark = "ok " if row["correct"] else "bad" if row["correct"] is not None else "   "
        user = row["prompt"].rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]
        reply = " | ".join(row["turns"]) if "turns" in row else row["reply"]
        print(f"  [{mark}|{'fmt' if row['format_ok'] else '   '}] {user!r} -> {reply!r}")

    result = {
        "source": source, "data_path": data, "temperature": args.temperature, "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens, "samples_per_prompt": args.samples_per_prompt, "seed": args.seed,
        "reward_model_path": rm_path,
        "ref_weights": args.ref_weights or args.ref_hf_path, "seconds": round(elapsed, 1), **metrics,
        "examples": rows[: args.examples],
    }
    if args.replies_out:
        sources = ([{"conversations": r.messages, "task": t} for r, t in zip(records, tasks or [None] * len(records))]
                   if args.reasoning_gym else source_rows(args.data_path, records))
        write_replies(args.replies_out, sources, rows)
        print(f"wrote {len(rows)} replies to {args.replies_out}")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
