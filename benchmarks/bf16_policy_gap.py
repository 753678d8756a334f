"""bf16 under fsdp2 against DDP's bf16: the log-prob gap to fp32 of

  (a) autocast bf16 over fp32 parameters (DDP's bf16: fp32 weights, norms and residual adds), and
  (b) every parameter in bf16 (FSDP2's MixedPrecisionPolicy(param_dtype=bf16) on GPUs: embeddings, norms and the
      residual stream in bf16),

on the shipped demo policy and a random-init 512x8 MiniMind, over the same token rows.

    python benchmarks/bf16_policy_gap.py       # CPU, seconds; figures in docs/distributed.md
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.forward import policy_forward
from model.loader import build_minimind, load_policy


def gaps(model: torch.nn.Module, rows: int, length: int, scored: int) -> dict[str, tuple[float, float]]:
    """(mean, max) |log-prob - fp32 log-prob| over `scored` positions of `rows` random rows, for (a) and (b)."""
    seqs = torch.randint(5, 6000, (rows, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(seqs)
    with torch.no_grad():
        ref, _ = policy_forward(model, seqs, mask, scored, 1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto, _ = policy_forward(model, seqs, mask, scored, 1.0)
        whole_bf16, _ = policy_forward(copy.deepcopy(model).to(torch.bfloat16), seqs, mask, scored, 1.0)
    out = {}
    for label, lp in (("autocast, fp32 parameters (ddp)", auto), ("bf16 parameters (fsdp2 policy)", whole_bf16)):
        d = (lp.float() - ref).abs()
        out[label] = (float(d.mean()), float(d.max()))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8, help="token rows scored")
    p.add_argument("--length", type=int, default=96, help="tokens per row")
    p.add_argument("--scored", type=int, default=64, help="last positions of each row whose log-probs are compared")
    o = p.parse_args(argv)
    torch.set_num_threads(1)
    policy, _ = load_policy(weights=str(ROOT / "out" / "full_sft_128.pth"), hidden_size=128, num_hidden_layers=4)
    torch.manual_seed(0)
    for name, model in (("demo 128x4 (trained)", policy), ("512x8 (random init)", build_minimind(512, 8))):
        for label, (mean, mx) in gaps(model.eval(), o.rows, o.length, o.scored).items():
            print(f"{name:22s} {label:32s} mean |dlogp| {mean:.2e}  max {mx:.2e}")


if __name__ == "__main__":
    main()
