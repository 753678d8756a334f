"""Tiny local models and data for trainer tests: nothing is downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def make_tiny_world(tmp: Path, hidden: int = 64, layers: int = 2, n_prompts: int = 64, seed: int = 0) -> dict:
    """Random tiny MiniMind policy (native .pth), tiny sequence-classifier RM (HF dir), prompt file."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from model.loader import build_minimind, load_tokenizer
    from model.weights import save_native_weights

    torch.manual_seed(seed)
    out = tmp / "out"
    policy = build_minimind(hidden, layers)
    save_native_weights(policy, out / f"full_sft_{hidden}.pth", dtype=torch.float32)
    tok = load_tokenizer()
    rm = Qwen3ForSequenceClassification(Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_labels=1, pad_token_id=tok.pad_token_id, tie_word_embeddings=True))
    rm.save_pretrained(tmp / "rm")
    tok.save_pretrained(tmp / "rm")
    lines = (ROOT / "dataset" / "demo_train.jsonl").read_text(encoding="utf-8").splitlines()[:n_prompts]
    (tmp / "prompts.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"save_dir": str(out), "rm": str(tmp / "rm"), "data": str(tmp / "prompts.jsonl"), "hidden": hidden, "layers": layers}


def tiny_flags(world: dict, tmp: Path, **over) -> list[str]:
    flags = {
        "save_dir": world["save_dir"], "reward_model_path": world["rm"], "data_path": world["data"],
        "hidden_size": world["hidden"], "num_hidden_layers": world["layers"], "checkpoint_dir": str(tmp / "ckpt"),
        "run_dir": str(tmp / "run"), "batch_size": 4, "mini_batch_size": 2, "max_gen_len": 8, "max_seq_len": 64,
        "max_steps": 3, "save_interval": 1, "swanlab_mode": "disabled", "dtype": "float32", "num_threads": 1,
        "sample_interval": 1, "warmup_steps": 0,
    }
    flags.update(over)
    out = []
    for k, v in flags.items():
        if isinstance(v, list):
            for x in v:
                out += [f"--{k}", str(x)]
        else:
            out += [f"--{k}", str(v)]
    return out


def run_train(flags: list[str], cwd: Path, timeout: int = 300, torchrun_procs: int = 0, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", SWANLAB_MODE="disabled")
    if torchrun_procs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(torchrun_procs),
               "--master_port", str(29500 + os.getpid() % 1000), str(ROOT / "train_ppo.py"), *flags]
    else:
        cmd = [sys.executable, str(ROOT / "train_ppo.py"), *flags]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"train_ppo failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return r


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
