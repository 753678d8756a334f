"""Full-parameter SFT of a small MiniMind model from random init: the demo's starting policy.

Rebuild the shipped artifact (from the repository root; how long it takes: docs/demo.md):

    python builders/train_sft.py --num_threads 1    # -> out/full_sft_128.pth (MiniMind native format, fp16)

The defaults are the shipped recipe (hidden 128 x 4 layers, 4 heads / 2 kv heads, batch 32, 3000 steps,
lr 1e-3 with cosine decay, seed 42; the shipped file was trained with `--num_threads 1`, which makes it
bit-reproducible). `dataset/demo_sft.jsonl` mixes full reasoning replies and plain answers 50/50; the
shipped policy, greedy on the 500 held-out prompts, uses the reasoning format on 15% of them and is
right on 39% (57% when it reasons, 36% when it answers plainly): room for PPO to win on both.
Arithmetic is learned late: at this size held-out accuracy stayed under 15% for the first ~1200 steps.

The tool demo's starting policy (configs/demo_tools.yaml) continues from that file on calculator episodes:

    python builders/train_sft.py --num_threads 2 --data_path dataset/demo_tools_sft.jsonl --tools dataset/demo_tools.py \
        --init_from out/full_sft_128.pth --save_weight tool_sft --max_seq_len 320 --max_steps 1000 \
        --learning_rate 5e-4 --warmup_steps 20    # -> out/tool_sft_128.pth

Tokenisation matches PPO's generation prompts exactly: the prompt part is the chat template with
add_generation_prompt=True and open_thinking=True (ending in "<think>\\n"), tokenised on its own
like dataset/rlaif.py does; the target is the assistant content after that "<think>\\n" prefix plus
the `<|im_end|>` EOS token. Loss is taken on target tokens only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np
import torch
import torch.nn.functional as F

from dataset.rlaif import render_prompt
from model.loader import build_minimind, load_tokenizer
from model.weights import WeightsError, load_native_weights, native_weight_path, save_native_weights
from trainer.multiturn import observation
from trainer.run.hardware import cpu_bf16_faster
from trainer.tools import ToolError, load_tools

IGNORE_INDEX = -100
THINK_PREFIX = "<think>\n"


def encode_sft_example(tokenizer: Any, conversations: list[dict], where: str = "",
                       tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for one conversation ending with the assistant turn to learn.

    input_ids = prompt tokens (as PPO renders them, ending in "<think>\\n") + target tokens + EOS;
    labels are IGNORE_INDEX on the prompt so only the reply (and its EOS) is learned. A tool episode (assistant,
    tool, ..., assistant) is tokenised as the multi-turn rollout builds it (trainer/multiturn.py): every assistant
    turn is a target, the tools' replies and the template around them are context.
    """
    if not conversations or conversations[-1].get("role") != "assistant":
        raise ValueError(f"{where}: the conversation must end with the assistant reply to learn")
    first = next(k for k, m in enumerate(conversations) if m.get("role") == "assistant")
    history = [{"role": m["role"], "content": m["content"]} for m in conversations[:first]]
    prompt = render_prompt(tokenizer, history, open_thinking=True, tools=tools)
    if not prompt.endswith(THINK_PREFIX):
        raise ValueError(f"the tokenizer's chat template does not end generation prompts with {THINK_PREFIX!r}; "
                         "use the project tokenizer (model/)")
    ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    labels = [IGNORE_INDEX] * len(ids)
    k = first
    while k < len(conversations):
        msg = conversations[k]
        if msg.get("role") == "assistant":
            reply = msg.get("content")
            if not isinstance(reply, str) or not reply.startswith(THINK_PREFIX):
                raise ValueError(
                    f"{where}: the assistant content must start with {THINK_PREFIX!r} (the prefix the chat "
                    "template forces with open_thinking); regenerate the data with builders/make_demo_data.py"
                )
            target = list(tokenizer.encode(reply[len(THINK_PREFIX):], add_special_tokens=False)) + [tokenizer.eos_token_id]
            ids, labels = ids + target, labels + target
            history.append({"role": "assistant", "content": reply})
            k += 1
            continue
        replies = []
        while k < len(conversations) and conversations[k].get("role") == "tool":
            replies.append(dict(conversations[k]))
            k += 1
        if not replies:
            raise ValueError(f"{where}: after the first assistant turn only assistant and tool messages may follow")
        text, prefix = observation(tokenizer, history, replies, tools, open_thinking=True)
        if prefix != THINK_PREFIX:
            raise ValueError(f"{where}: the chat template does not open the next turn with {THINK_PREFIX!r}")
        context = list(tokenizer.encode(text, add_special_tokens=False))
        ids, labels = ids + context, labels + [IGNORE_INDEX] * len(context)
        history += replies
    return ids, labels


def read_sft_jsonl(path: str | Path, tokenizer: Any, max_seq_len: int,
                   tools: list[dict] | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Encode every line of an SFT jsonl ({"conversations": [...]}); too-long rows are an error."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"--data_path {path}: no such file (build it with: python builders/make_demo_data.py)")
    inputs, labels = [], []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                conv = json.loads(line)["conversations"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SystemExit(f"{where}: not a JSON object with 'conversations' ({type(e).__name__})") from None
            try:
                ids, labs = encode_sft_example(tokenizer, conv, where, tools)
            except ValueError as e:
                raise SystemExit(str(e)) from None
            if len(ids) > max_seq_len:
                # Cutting would drop the EOS the policy must learn to emit: refuse instead.
                raise SystemExit(f"{where}: {len(ids)} tokens > --max_seq_len {max_seq_len}; raise --max_seq_len")
            inputs.append(ids)
            labels.append(labs)
    if not inputs:
        raise SystemExit(f"--data_path {path}: no conversations")
    return inputs, labels


def collate_right_pad(inputs: list[list[int]], labels: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest row: input_ids [B, T] (pad_id), labels [B, T] (IGNORE_INDEX).

    Right pads come after every real token, so causal attention needs no padding mask."""
    width = max(len(x) for x in inputs)
    input_ids = torch.full((len(inputs), width), pad_id, dtype=torch.long)
    target = torch.full((len(inputs), width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, labs) in enumerate(zip(inputs, labels)):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        target[row, : len(labs)] = torch.tensor(labs, dtype=torch.long)
    return input_ids, target


def epoch_batches(n: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """One epoch of uniformly random batches (the ragged tail is dropped).

    Not length-bucketed on purpose: bucketing puts the short plain replies and the long reasoning
    replies in different batches, and with Adam those alternating one-style updates learned far
    slower here (docs/demo.md)."""
    order = rng.permutation(n)
    return [order[b : b + batch_size] for b in range(0, n - batch_size + 1, batch_size)]


def split_by_length(idx: np.ndarray, lengths: list[int], micro_batches: int) -> list[np.ndarray]:
    """Sort one batch by length and cut it into `micro_batches` pieces: the step's gradient is the
    same (losses are summed), but short rows are no longer padded to the batch's longest row."""
    idx = idx[np.argsort([lengths[i] for i in idx], kind="stable")]
    return [part for part in np.array_split(idx, micro_batches) if len(part)]


def lr_at(step: int, total_steps: int, warmup_steps: int, base_lr: float, min_lr_ratio: float) -> float:
    """Linear warmup to base_lr, then cosine decay to base_lr * min_lr_ratio at total_steps."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (betas 0.9 / 0.95) with no weight decay on norms and embeddings (1-D gains; the tied
    embedding is also the head)."""
    decays = [p.ndim >= 2 and "embed_tokens" not in name for name, p in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    return torch.optim.AdamW(
        [{"params": [p for p, d in zip(params, decays) if d], "weight_decay": weight_decay},
         {"params": [p for p, d in zip(params, decays) if not d], "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )


def sft_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
             tokens_per_batch: float | None = None) -> torch.Tensor:
    """Next-token cross-entropy over target tokens; logits only where a target exists.

    Divided by `tokens_per_batch` (a constant) instead of this batch's token count when given, so
    micro-batch losses add up to the batch's loss and every target token weighs the same in every
    batch, whatever its mix of short plain and long reasoning replies."""
    hidden = model.model(input_ids=input_ids).last_hidden_state  # [B, T, H]
    targets = labels[:, 1:]  # [B, T-1]: position t predicts token t+1
    keep = targets != IGNORE_INDEX
    # Prompt positions need no vocabulary projection: skipping them saves most of the head's FLOPs.
    logits = model.lm_head(hidden[:, :-1][keep])  # [N, V]
    if tokens_per_batch is None:
        return F.cross_entropy(logits.float(), targets[keep])
    return F.cross_entropy(logits.float(), targets[keep], reduction="sum") / tokens_per_batch


def add_dtype_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="autocast dtype on CPU; auto = bfloat16 where this CPU's bf16 matmul measures faster than its "
                        "fp32 (AMX; AMD's AVX512-BF16), else float32")


def resolve_dtype(flag: str) -> str:
    """--dtype auto -> bfloat16 where this CPU's bf16 matmul measures faster than its fp32, else float32."""
    return flag if flag != "auto" else ("bfloat16" if cpu_bf16_faster() else "float32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Full SFT of a MiniMind model on the demo data (CPU, bf16 autocast).")
    p.add_argument("--data_path", default="dataset/demo_sft.jsonl")
    p.add_argument("--tokenizer_path", default=None, help="tokenizer directory (default: model/)")
    p.add_argument("--save_dir", default="out")
    p.add_argument("--save_weight", default="full_sft", help="file prefix: <save_dir>/<save_weight>_<hidden>.pth")
    p.add_argument("--init_from", default=None,
                   help="start from these weights (a MiniMind .pth, e.g. out/full_sft_128.pth) instead of random init")
    p.add_argument("--tools", default=None,
                   help="a tool module (as train_ppo.py --tools): every conversation's prompt lists its tools, and tool "
                        "episodes (assistant, tool, assistant) are learned turn by turn")
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--num_attention_heads", type=int, default=4, help="4 heads of 32 dims at hidden 128 (see below)")
    p.add_argument("--num_key_value_heads", type=int, default=2)
    p.add_argument("--use_moe", type=int, default=0, choices=(0, 1))
    p.add_argument("--arch", default="qwen3", choices=("qwen3", "llama"))
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--max_steps", type=int, default=3000, help="stop after this many optimizer steps (0 = all epochs)")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--min_lr_ratio", type=float, default=0.1, help="cosine floor as a share of --learning_rate")
    p.add_argument("--warmup_steps", type=int, default=50)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--max_seq_len", type=int, default=128)
    p.add_argument("--micro_batches", type=int, default=2,
                   help="split each batch by length into this many forward/backward passes (less padding)")
    add_dtype_flag(p)
    p.add_argument("--num_threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log_interval", type=int, default=50)
    p.add_argument("--save_interval", type=int, default=0, help="also save every N steps (0 = only at the end)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for flag in ("batch_size", "epochs", "hidden_size", "num_hidden_layers", "max_seq_len"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be >= 1")
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    t0 = time.time()

    try:
        tokenizer = load_tokenizer(args.tokenizer_path)
    except (WeightsError, OSError) as e:  # e.g. the RM's out/rm_tokenizer not made yet
        raise SystemExit(f"error: {e}")
    try:
        tools = load_tools(args.tools).schema_list() if args.tools else None
    except ToolError as e:
        raise SystemExit(f"error: {e}")
    inputs, labels = read_sft_jsonl(args.data_path, tokenizer, args.max_seq_len, tools)
    n = len(inputs)
    lengths = [len(x) for x in inputs]
    tokens_per_batch = args.batch_size * sum(sum(t != IGNORE_INDEX for t in lab) for lab in labels) / n
    steps_per_epoch = n // args.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(f"--batch_size {args.batch_size} is larger than the {n} conversations in {args.data_path}")
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)

    model = build_minimind(args.hidden_size, args.num_hidden_layers, bool(args.use_moe), args.arch,
                           vocab_size=len(tokenizer), num_attention_heads=args.num_attention_heads,
                           num_key_value_heads=args.num_key_value_heads)
    # Eager attention: at these sizes torch's CPU SDPA (flash) backward under bf16 autocast is slower than the
    # whole rest of the step (docs/demo.md); eager is as fast as SDPA in fp32. Inference is unaffected.
    if args.init_from:
        try:
            load_native_weights(model, args.init_from)
        except (WeightsError, OSError) as e:
            raise SystemExit(f"error: --init_from: {e}")
    model.set_attn_implementation("eager")
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = adamw(model, args.learning_rate, args.weight_decay)
    dtype = resolve_dtype(args.dtype)
    amp_dtype = torch.bfloat16 if dtype == "bfloat16" else None
    print(f"SFT: {n} conversations, {n_params / 1e6:.2f}M parameters, {total_steps} steps of {args.batch_size} "
          f"({total_steps * args.batch_size / n:.2f} epochs), lr {args.learning_rate}, {dtype}, {torch.get_num_threads()} threads")

    path = native_weight_path(args.save_dir, args.save_weight, args.hidden_size, bool(args.use_moe))
    step, running, t_train = 0, 0.0, time.time()
    for epoch in range(args.epochs):
        for idx in epoch_batches(n, args.batch_size, np.random.default_rng([args.seed, epoch])):
            if step >= total_steps:
                break
            lr = lr_at(step, total_steps, args.warmup_steps, args.learning_rate, args.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            loss = 0.0
            for part in split_by_length(idx, lengths, args.micro_batches):
                input_ids, target = collate_right_pad([inputs[i] for i in part], [labels[i] for i in part],
                                                      tokenizer.pad_token_id)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp_dtype is not None):
                    part_loss = sft_loss(model, input_ids, target, tokens_per_batch)
                part_loss.backward()
                loss += part_loss.detach()
            if not torch.isfinite(loss):
                raise SystemExit(f"non-finite loss at step {step}: lower --learning_rate")
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            running += loss.item()
            step += 1
            if step % args.log_interval == 0 or step == total_steps:
                k = args.log_interval if step % args.log_interval == 0 else step % args.log_interval
                elapsed = time.time() - t_train
                print(f"step {step:5d}/{total_steps}  epoch {epoch + 1}  loss {running / k:.4f}  lr {lr:.2e}  "
                      f"{elapsed / step:.3f} s/step  eta {(total_steps - step) * elapsed / step:.0f} s", flush=True)
                running = 0.0
            if args.save_interval > 0 and step % args.save_interval == 0 and step < total_steps:
                save_native_weights(model, path)

    model.eval()
    save_native_weights(model, path)
    print(f"saved {path} ({path.stat().st_size / 1e6:.1f} MB) after {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
