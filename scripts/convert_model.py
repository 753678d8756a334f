"""Convert MiniMind `.pth` weights <-> a standard Hugging Face model directory.

    # native -> HF: a stock transformers directory (Qwen3 / Llama / Qwen3-MoE), safetensors, tokenizer
    python scripts/convert_model.py to_hf --weights out/ppo_actor_128.pth --hidden_size 128 \\
        --num_hidden_layers 4 --out_dir out/ppo_actor_128_hf
    # ... and the PPO critic from a resume file, as a stock token-classification model
    python scripts/convert_model.py to_hf --weights out/ppo_actor_128.pth --hidden_size 128 \\
        --num_hidden_layers 4 --out_dir out/ppo_actor_128_hf \\
        --critic_resume checkpoints/ppo_actor_128_resume_step00000250.pth
    # HF -> native (Qwen3, Llama or Qwen3-MoE directories whose shapes MiniMind can express)
    python scripts/convert_model.py to_native --hf_dir out/ppo_actor_128_hf --out out/ppo_actor_128.pth

The conversions and their checks are model/hf_convert.py's; this is their command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from model.hf_convert import DTYPES, ConvertError, critic_to_hf, hf_to_native, policy_to_hf, read_critic_state
from model.loader import load_policy, load_tokenizer
from model.weights import WeightsError


# --------------------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="MiniMind .pth <-> standard Hugging Face directory (weights are always full, merged: "
                    "no LoRA adapters are used or produced).")
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("to_hf", help="native .pth (+ critic) -> stock transformers directory")
    h.add_argument("--weights", required=True, help="native MiniMind .pth (fp16/fp32 state dict)")
    h.add_argument("--hidden_size", type=int, default=128)
    h.add_argument("--num_hidden_layers", type=int, default=4)
    h.add_argument("--use_moe", type=int, default=0, choices=(0, 1))
    h.add_argument("--arch", default="auto", choices=("auto", "qwen3", "llama"), help="auto reads the file (q_norm -> qwen3)")
    h.add_argument("--tokenizer_path", default=None, help="tokenizer dir (default: model/)")
    h.add_argument("--out_dir", required=True)
    h.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="safetensors dtype; float32 gives logits identical to load_policy's fp32 model")
    h.add_argument("--critic_resume", default=None,
                   help="also export the critic: a resume file (checkpoints/..._resume_stepN.pth) or a critic state dict")
    h.add_argument("--critic_out_dir", default=None, help="critic directory (default: <out_dir>_critic)")
    n = sub.add_parser("to_native", help="stock qwen3 / llama / qwen3_moe directory -> native .pth")
    n.add_argument("--hf_dir", required=True)
    n.add_argument("--out", required=True, help="e.g. out/full_sft_128.pth (MiniMind naming: <weight>_<hidden>[_moe].pth)")
    n.add_argument("--dtype", default="float16", choices=list(DTYPES), help="MiniMind files are fp16; float32 is lossless")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        if args.cmd == "to_hf":
            policy, tok = load_policy(weights=args.weights, hidden_size=args.hidden_size,
                                      num_hidden_layers=args.num_hidden_layers, use_moe=bool(args.use_moe),
                                      arch=args.arch, tokenizer_path=args.tokenizer_path)
            diff = policy_to_hf(policy, tok, args.out_dir, DTYPES[args.dtype])
            print(f"wrote {args.out_dir} ({policy.config.to_hf_config().model_type}, {args.dtype}); "
                  f"max |logit difference| {diff:.3g}" + (f" (weights rounded to {args.dtype})" if diff else ""))
            if args.critic_resume:
                out = args.critic_out_dir or f"{str(args.out_dir).rstrip('/')}_critic"
                diff = critic_to_hf(read_critic_state(args.critic_resume), policy.config, tok, out, DTYPES[args.dtype])
                print(f"wrote {out} (critic, token classification, num_labels=1); max |value difference| {diff:.3g}"
                      + (f" (weights rounded to {args.dtype})" if diff else ""))
        else:
            mm, diff = hf_to_native(args.hf_dir, args.out, DTYPES[args.dtype])
            flags = f"--hidden_size {mm.hidden_size} --num_hidden_layers {mm.num_hidden_layers}" + \
                    (" --use_moe 1" if mm.use_moe else "") + f" --arch {mm.arch}"
            note = ""
            if (Path(args.hf_dir) / "tokenizer.json").is_file():
                mine = load_tokenizer()
                theirs = load_tokenizer(args.hf_dir)
                if mine.get_vocab() != theirs.get_vocab():
                    note = f" --tokenizer_path {args.hf_dir}"
            print(f"wrote {args.out} ({args.dtype}); max |logit difference| {diff:.3g}; load it with {flags}{note}")
    except (ConvertError, WeightsError, OSError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
