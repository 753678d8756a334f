"""Train the demo's small reward model: a stock `Qwen3ForSequenceClassification` (num_labels=1)
fitted with the Bradley-Terry loss -logsigmoid(r_chosen - r_rejected) on preference pairs.

Rebuild the shipped artifact (from the repository root; times in docs/demo.md). The RM is larger
than the policy it judges (hidden 256 vs 128) and reads numbers digit by digit: it has to check the
arithmetic it scores. Its tokenizer is a copy of the project's with numbers split into single
digits (same vocabulary), and its trunk starts from a 256-wide SFT model trained by the project's
SFT script on the same data with that tokenizer:

    python builders/train_tokenizer.py --split_digits --out_dir out/rm_tokenizer   # -> out/rm_tokenizer/
    python builders/train_sft.py --num_threads 1 --hidden_size 256 --num_attention_heads 8 \
        --num_key_value_heads 4 --tokenizer_path out/rm_tokenizer --save_weight rm_base   # -> out/rm_base_256.pth (not shipped)
    python builders/train_reward_model.py --num_threads 1                # -> out/demo_rm/ (config.json, model.safetensors, tokenizer)

Starting from an SFT model (--init_from) is InstructGPT's recipe; a random init learns far slower.

Pairs file rows: {"conversations": [user...], "chosen": reply, "rejected": reply, "kind": ...}.
Each side is scored on the conversation + {"role": "assistant", "content": reply}, rendered with the
tokenizer's chat template without a generation prompt and tokenised exactly as
trainer.reward_model.RewardModelScorer does at PPO time, so training and use see the same tokens.
The output directory loads with `AutoModelForSequenceClassification.from_pretrained(dir)` (no
remote code) and with `model.loader.load_reward_model(dir)`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaForSequenceClassification, Qwen3Config, Qwen3ForSequenceClassification

from builders.train_sft import adamw, add_dtype_flag, lr_at, resolve_dtype
from dataset.jsonl import jsonl_lines
from model.loader import load_policy, load_reward_model, load_tokenizer
from model.weights import WeightsError, read_state_dict
from trainer.reward_model import RewardModelScorer, pad_ids


def encode_conversations(tokenizer: Any, conversations: list[list[dict]], max_length: int) -> list[list[int]]:
    """Token ids of chats ending with the assistant reply, as RewardModelScorer encodes them
    (chat template without generation prompt, no extra special tokens, keep the last max_length)."""
    texts = [tokenizer.apply_chat_template(conv, tokenize=False) for conv in conversations]
    return [list(ids)[-max_length:] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def read_pairs(path: str | Path, tokenizer: Any, max_length: int) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """(chosen ids, rejected ids, kind) per line of a pairs jsonl."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (build it with: python builders/make_demo_data.py)")
    chosen, rejected, kinds = [], [], []  # conversations first, tokenised in one batched call
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                conv = [{"role": m["role"], "content": m["content"]} for m in row["conversations"]]
                good, bad = row["chosen"], row["rejected"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{lineno}: expected {{'conversations': [...], 'chosen': str, 'rejected': str}} "
                                 f"({type(e).__name__}: {e})") from None
            if not isinstance(good, str) or not isinstance(bad, str):
                raise SystemExit(f"{path}:{lineno}: 'chosen' and 'rejected' must be strings (the assistant replies)")
            chosen.append(conv + [{"role": "assistant", "content": good}])
            rejected.append(conv + [{"role": "assistant", "content": bad}])
            kinds.append(str(row.get("kind", "all")))
    if not chosen:
        raise SystemExit(f"{path}: no pairs")
    return encode_conversations(tokenizer, chosen, max_length), encode_conversations(tokenizer, rejected, max_length), kinds


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, center_coef: float = 0.0) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected), averaged over pairs, plus center_coef * mean((r_chosen + r_rejected)^2).

    The BT term only sees differences, so scores may drift to any offset; the centering term
    (reward centering) pins each pair's midpoint near 0, which keeps scores inside PPO's clip range."""
    loss = -F.logsigmoid(r_chosen - r_rejected).mean()
    if center_coef:
        loss = loss + center_coef * (r_chosen + r_rejected).pow(2).mean()
    return loss


def calibration_scale(scores: torch.Tensor, clip: float, quantile: float = 0.98, fill: float = 0.8) -> float:
    """Factor (<= 1) that brings the `quantile` of |scores| down to fill * clip.

    PPO clips RM scores to [-clip, clip]; replies whose raw scores both exceed the bound would tie.
    Scaling the (bias-free) score head changes no ranking, only the spread."""
    q = torch.quantile(scores.abs().float(), quantile).item()
    return min(1.0, fill * clip / q) if q > 0 else 1.0


def rewards_of(model: torch.nn.Module, rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """Scalar reward per row [N] (fp32)."""
    input_ids, attention_mask = pad_ids(rows, pad_id)  # right-padded, as the scorer pads by default
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].float()


def pair_accuracy(margins: torch.Tensor, kinds: list[str]) -> dict[str, float]:
    """Share of pairs with r_chosen > r_rejected, overall ("all") and per kind."""
    wins = (margins > 0).tolist()
    groups: dict[str, list[bool]] = defaultdict(list)
    for w, k in zip(wins, kinds):
        groups[k].append(w)
    out = {"all": sum(wins) / len(wins)}
    out.update({k: sum(v) / len(v) for k, v in sorted(groups.items())})
    return out


def build_reward_model(tokenizer: Any, hidden_size: int, num_hidden_layers: int, num_heads: int,
                       max_length: int, rope_theta: float = 1e4) -> Qwen3ForSequenceClassification:
    """A randomly initialised stock Qwen3 classifier sized for the demo (seed torch first)."""
    if hidden_size % num_heads:
        raise SystemExit(f"--hidden_size {hidden_size} is not divisible by --num_attention_heads {num_heads}")
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=math.ceil(hidden_size * math.pi / 64) * 64,  # MiniMind's FFN width rule
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max(512, max_length),
        rms_norm_eps=1e-6,
        # Unlike the policy, the RM is free of MiniMind's 1e6: a small base keeps every rotary
        # frequency useful over these short sequences, which position-based heads need.
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=False,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,  # the classifier reads the last non-pad token
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        use_cache=False,
    )
    return Qwen3ForSequenceClassification(config)


def reward_model_from_policy(weights: str | Path, tokenizer: Any) -> Qwen3ForSequenceClassification:
    """A stock classifier whose trunk is a copy of a native MiniMind policy's (qwen3 or llama arch),
    with a fresh score head. As in InstructGPT, the RM starts from the SFT model: it already reads
    the task (here: it can do the arithmetic it has to judge), so pair accuracy climbs far faster."""
    if not Path(weights).is_file():
        raise SystemExit(f"--init_from {weights}: no such file; build the RM's starting model first: python builders/train_sft.py "
                         f"--num_threads 1 --hidden_size 256 --num_attention_heads 8 --num_key_value_heads 4 "
                         f"--tokenizer_path out/rm_tokenizer --save_weight rm_base "
                         f"(or --init_from none for a randomly initialised RM)")
    try:
        state = read_state_dict(weights)
    except (OSError, WeightsError) as e:
        raise SystemExit(f"--init_from {weights}: {e} (use --init_from none for a randomly initialised RM)")
    if "model.embed_tokens.weight" not in state:
        raise SystemExit(f"--init_from {weights}: not a MiniMind policy file (no model.embed_tokens.weight)")
    if any(".mlp.experts." in k or ".mlp.gate." in k for k in state):
        raise SystemExit(f"--init_from {weights}: MoE policies are not supported as RM initialisers")
    hidden = state["model.embed_tokens.weight"].shape[1]
    layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
    policy, _ = load_policy(weights=weights, hidden_size=hidden, num_hidden_layers=layers, tokenizer_path=None)
    config = policy.config.to_hf_config()
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id  # the classifier reads the last non-pad token
    config.use_cache = False
    config.tie_word_embeddings = False
    model = Qwen3ForSequenceClassification(config) if config.model_type == "qwen3" else LlamaForSequenceClassification(config)
    model.model.load_state_dict(policy.model.state_dict())
    return model


def score_pairs(scorer: Any, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of each pair row's chosen and rejected reply through a RewardModelScorer (PPO's path)."""
    convs = [[{"role": m["role"], "content": m["content"]} for m in row["conversations"]] for row in rows]
    s_chosen = scorer.score([c + [{"role": "assistant", "content": row["chosen"]}] for c, row in zip(convs, rows)])
    s_rejected = scorer.score([c + [{"role": "assistant", "content": row["rejected"]}] for c, row in zip(convs, rows)])
    return s_chosen, s_rejected


@torch.no_grad()
def evaluate_pairs(model: torch.nn.Module, chosen: list[list[int]], rejected: list[list[int]], kinds: list[str],
                   pad_id: int, batch_size: int = 256) -> dict[str, float]:
    was_training = model.training
    model.eval()
    margins = []
    for s in range(0, len(chosen), batch_size):
        r = rewards_of(model, chosen[s : s + batch_size] + rejected[s : s + batch_size], pad_id)
        k = len(chosen[s : s + batch_size])
        margins.append(r[:k] - r[k:])
    model.train(was_training)
    return pair_accuracy(torch.cat(margins), kinds)


def heap_trimmer() -> Callable[[], None]:
    """glibc's malloc_trim(0): hand the heap's free pages back to the OS (a no-op without glibc).
    Why: every step frees gigabytes of activations whose shapes change with the batch's padded length;
    glibc keeps them, fragmented, so RSS climbs over the run (docs/demo.md has the figures). Live tensors
    are untouched, so training is bit-identical."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train the demo reward model (Bradley-Terry, CPU, bf16 autocast).")
    p.add_argument("--data_path", default="dataset/demo_pairs.jsonl")
    p.add_argument("--eval_data_path", default="dataset/demo_pairs_eval.jsonl")
    p.add_argument("--tokenizer_path", default="out/rm_tokenizer",
                   help="tokenizer directory, saved with the RM; must be the one --init_from was trained with "
                        "(default: the digit-split copy, made by train_tokenizer.py --split_digits)")
    p.add_argument("--save_path", default="out/demo_rm", help="output Hugging Face directory")
    p.add_argument("--init_from", default="out/rm_base_256.pth",
                   help="native policy weights to start the RM trunk from (the SFT model; its shape then "
                        "overrides the size flags below); 'none' = random init")
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--num_attention_heads", type=int, default=4)
    p.add_argument("--rope_theta", type=float, default=1e4)
    p.add_argument("--epochs", type=int, default=1,
                   help="one pass over 60k fresh pairs beat three over 20k (88.5%% vs 87.2%% held-out, before digit tokens)")
    p.add_argument("--max_steps", type=int, default=0, help="stop after this many optimizer steps (0 = all epochs)")
    p.add_argument("--batch_size", type=int, default=32, help="pairs per step")
    p.add_argument("--learning_rate", type=float, default=7e-4, help="7e-4 beat 1e-3 and 2e-3 from the 256-wide SFT trunk")
    p.add_argument("--min_lr_ratio", type=float, default=0.05)
    p.add_argument("--warmup_steps", type=int, default=50)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--center_coef", type=float, default=0.01, help="weight of the (r_chosen + r_rejected)^2 term")
    p.add_argument("--clip", type=float, default=3.0, help="PPO's RM score clip: scores are scaled to fit inside it")
    p.add_argument("--max_length", type=int, default=512, help="tokens per scored conversation (end kept)")
    add_dtype_flag(p)
    p.add_argument("--num_threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--malloc_trim_interval", type=int, default=1,
                   help="every N steps give freed heap memory back to the OS (glibc malloc_trim; 0 = never). Peak RSS "
                        "over the first 250 steps at 1 thread: 0: 4.7 GB and climbing (7.8 GB after all 1,875 steps), "
                        "10: 3.6 GB and climbing, 1: 2.5 GB, flat from step 100, for ~7-10%% more time per step")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log_interval", type=int, default=50)
    p.add_argument("--eval_interval", type=int, default=500)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    try:
        tokenizer = load_tokenizer(args.tokenizer_path)
    except (WeightsError, OSError) as e:
        raise SystemExit(f"error: {e}; make the RM's digit-split tokenizer with `python builders/train_tokenizer.py "
                         f"--split_digits --out_dir {args.tokenizer_path}` (or pass the tokenizer the --init_from model "
                         f"was trained with, e.g. --tokenizer_path model)")
    pad_id = tokenizer.pad_token_id
    chosen, rejected, kinds = read_pairs(args.data_path, tokenizer, args.max_length)
    ev_chosen, ev_rejected, ev_kinds = read_pairs(args.eval_data_path, tokenizer, args.max_length)
    n = len(chosen)
    steps_per_epoch = n // args.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(f"--batch_size {args.batch_size} is larger than the {n} pairs in {args.data_path}")
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)

    if args.init_from in (None, "", "none"):
        model = build_reward_model(tokenizer, args.hidden_size, args.num_hidden_layers, args.num_attention_heads,
                                   args.max_length, args.rope_theta)
    else:
        model = reward_model_from_policy(args.init_from, tokenizer)
    # Eager attention: torch's CPU SDPA (flash) backward under bf16 autocast is slower than everything else
    # at these sizes (docs/demo.md). Switched back to SDPA before saving (inference is fine).
    model.set_attn_implementation("eager")
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = adamw(model, args.learning_rate, args.weight_decay)
    use_amp = resolve_dtype(args.dtype) == "bfloat16"
    print(f"RM: {n} train pairs, {len(ev_chosen)} eval pairs, {n_params / 1e6:.2f}M parameters, {total_steps} steps "
          f"of {args.batch_size} pairs ({total_steps * args.batch_size / n:.2f} epochs), lr {args.learning_rate}")

    trim_heap = heap_trimmer()
    step, running, running_acc, t_train = 0, 0.0, 0.0, time.time()
    for epoch in range(args.epochs):
        order = np.random.default_rng([args.seed, epoch]).permutation(n)
        for b in range(steps_per_epoch):
            if step >= total_steps:
                break
            idx = order[b * args.batch_size : (b + 1) * args.batch_size]
            lr = lr_at(step, total_steps, args.warmup_steps, args.learning_rate, args.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_amp):
                # Both sides in one forward: one padded batch [2B, T] is cheaper than two.
                r = rewards_of(model, [chosen[i] for i in idx] + [rejected[i] for i in idx], pad_id)
            r_chosen, r_rejected = r[: len(idx)], r[len(idx) :]
            loss = bradley_terry_loss(r_chosen, r_rejected, args.center_coef)
            if not torch.isfinite(loss):
                raise SystemExit(f"non-finite loss at step {step}: lower --learning_rate")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            running += loss.item()
            running_acc += (r_chosen > r_rejected).float().mean().item()
            step += 1
            if args.malloc_trim_interval > 0 and step % args.malloc_trim_interval == 0:
                trim_heap()
            if step % args.log_interval == 0:
                elapsed = time.time() - t_train
                print(f"step {step:5d}/{total_steps}  loss {running / args.log_interval:.4f}  "
                      f"train acc {running_acc / args.log_interval:.3f}  lr {lr:.2e}  {elapsed / step:.3f} s/step", flush=True)
                running = running_acc = 0.0
            if args.eval_interval > 0 and step % args.eval_interval == 0 and step < total_steps:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_amp):
                    acc = evaluate_pairs(model, ev_chosen, ev_rejected, ev_kinds, pad_id)
                print(f"  held-out pair accuracy {acc['all']:.3f}", flush=True)
    train_time = time.time() - t_train

    save = Path(args.save_path)
    save.mkdir(parents=True, exist_ok=True)
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_amp):
        sub = np.random.default_rng([args.seed, 999]).permutation(n)[:2000]
        train_scores = torch.cat([rewards_of(model, [side[i] for i in sub[s : s + 250]], pad_id)
                                  for side in (chosen, rejected) for s in range(0, len(sub), 250)])
    scale = calibration_scale(train_scores, args.clip)
    with torch.no_grad():
        model.score.weight.mul_(scale)
    print(f"score scale {scale:.3f} (98th percentile of |training scores| was {torch.quantile(train_scores.abs(), 0.98):.2f}; "
          f"clip +-{args.clip:g})")
    model.set_attn_implementation("sdpa")
    # fp16 on disk halves the size of a file that ships in git; loaders upcast (load_reward_model: fp32).
    model.to(torch.float16).save_pretrained(save)
    model.float()
    tokenizer.save_pretrained(save)

    # Held-out accuracy through the exact PPO path: reload from disk, score with RewardModelScorer.
    rm, rm_tok = load_reward_model(save)
    scorer = RewardModelScorer(rm, rm_tok, max_length=args.max_length, batch_size=256, clip=float("inf"))
    ev_rows = [json.loads(line) for line in jsonl_lines(args.eval_data_path) if line.strip()]
    s_chosen, s_rejected = score_pairs(scorer, ev_rows)
    ev_kinds = [str(r.get("kind", "all")) for r in ev_rows]
    acc = pair_accuracy(s_chosen - s_rejected, ev_kinds)
    # What PPO sees: scores clipped at +-clip, where a tie at the bound is a miss.
    acc_clipped = pair_accuracy(s_chosen.clamp(-args.clip, args.clip) - s_rejected.clamp(-args.clip, args.clip), ev_kinds)
    size_mb = sum(f.stat().st_size for f in save.iterdir()) / 1e6
    print(f"held-out pair accuracy (reloaded, RewardModelScorer, fp32): {acc['all']:.3f}  "
          + "  ".join(f"{k} {v:.3f}" for k, v in acc.items() if k != "all"))
    print(f"  with scores clipped to +-{args.clip:g}: {acc_clipped['all']:.3f}")
    both = torch.cat([s_chosen, s_rejected])
    print(f"scores: chosen mean {s_chosen.mean():.2f}, rejected mean {s_rejected.mean():.2f}, "
          f"{(both.abs() > args.clip).float().mean():.1%} outside +-{args.clip:g}")
    print(f"saved {save}/ ({size_mb:.1f} MB) ; train {train_time:.0f} s, total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
