"""The hardware rules: what "auto" means on this machine. --dtype auto (bf16 on GPUs that compute it natively,
on CPUs whose bf16 matmul measures faster than their fp32 for models large enough to gain), the frozen models'
precision, and whether the actor and critic update side by side (--parallel_update auto). trainer/run/cli.py's
resolve() applies them.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.runtime import DTYPES

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from trainer.config import Config

# --dtype auto / --frozen_low_precision -1 on a CPU: bf16 from this many matmul weights in the transformer
# layers (embeddings and LM head not counted) on a CPU with native bf16 (crossover: docs/speed-and-memory.md).
BF16_CPU_MIN_LAYER_PARAMS = 5_000_000
# ... and only where this CPU's bf16 matmul measures at least this many times its fp32 rate. The flags alone do not
# say: AVX512-BF16's dot product does as many multiply-adds a cycle as fp32 FMA on Intel cores, so a Xeon with
# AVX512-BF16 and no AMX multiplies bf16 at 0.55x its fp32 rate (the casts cost the rest), while AMX, and AMD's
# AVX512-BF16, are faster in bf16 (docs/speed-and-memory.md#bf16-on-a-cpu-measured-not-read-from-the-flags). The
# margin keeps a noisy measurement from flipping the choice: the CPUs measured sit far from 1 on either side.
BF16_CPU_MIN_SPEEDUP = 1.2


def cpu_native_bf16(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> bool:
    """True when the CPU multiplies bf16 natively (AMX-BF16 or AVX512-BF16). Without either, oneDNN
    emulates bf16 by converting to fp32, which is slower than fp32 itself. Read from the kernel's CPU
    flags; where there are none (not Linux), torch's own capability checks."""
    try:
        flags = {f for line in Path(cpuinfo).read_text().splitlines() if line.startswith("flags")
                 for f in line.split(":", 1)[-1].split()}
    except OSError:
        flags = set()
    if flags:
        return bool(flags & {"amx_bf16", "avx512_bf16"})
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(bool(c()) for c in checks if c is not None)


@functools.cache
def cpu_bf16_speedup(threads: int) -> float:
    """This CPU's bf16 matmul rate over its fp32 rate at `threads` torch threads: best of 3 alternated timings of a
    [256, 1024] x [1024, 2048] linear (a 0.5B model's layer matmul at a short sequence) in each dtype, ~0.1 s in
    all. Measured once per process."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(256, 1024, generator=gen), torch.randn(2048, 1024, generator=gen)
        pairs = {dt: (x.to(dt), w.to(dt)) for dt in (torch.float32, torch.bfloat16)}
        best = dict.fromkeys(pairs, float("inf"))
        for round_ in range(4):  # the first round warms oneDNN's kernels up and is not counted
            for dt, (a, b) in pairs.items():
                t0 = time.perf_counter()
                for _ in range(3):
                    torch.nn.functional.linear(a, b)
                if round_:
                    best[dt] = min(best[dt], time.perf_counter() - t0)
        return best[torch.float32] / best[torch.bfloat16]
    finally:
        torch.set_num_threads(before)


def cpu_bf16_faster(threads: int | None = None) -> bool:
    """True where bf16 pays on this CPU: native bf16 in its flags and a bf16 matmul measured at least
    BF16_CPU_MIN_SPEEDUP times its fp32 rate (`threads`: the run's torch threads, None = torch's current)."""
    return cpu_native_bf16() and cpu_bf16_speedup(threads or torch.get_num_threads()) >= BF16_CPU_MIN_SPEEDUP


def layer_matmul_params(cfg: Any) -> int:
    """Matmul weights of the transformer layers (q/k/v/o and the MLP; active experts only for MoE):
    what sets a step's bf16 gain. Embeddings and the LM head are left out (the head runs only at
    response positions and the embedding is a lookup). `cfg`: a transformers config of any family
    (or anything with its shape fields), read by field name, the optional ones with defaults."""
    cfg = getattr(cfg, "text_config", None) or cfg
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or H // heads
    inter = getattr(cfg, "moe_intermediate_size", None) if getattr(cfg, "num_experts", 0) else None
    inter = (inter or cfg.intermediate_size) * (getattr(cfg, "num_experts_per_tok", 1) if inter else 1)
    return L * (2 * H * heads * hd + 2 * H * kv * hd + 3 * H * inter)


def model_config(cfg: Config) -> PreTrainedConfig | None:
    """The actor's transformers config from the settings alone (nothing loaded): --actor_path's config.json,
    or a MiniMind config from the shape flags. None when it cannot be read (loading reports that later)."""
    try:
        if cfg.actor_path:
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(cfg.actor_path, trust_remote_code=bool(cfg.trust_remote_code))
        from model.config import MiniMindConfig

        heads = {k: getattr(cfg, k) for k in ("num_attention_heads", "num_key_value_heads") if getattr(cfg, k, 0)}
        return MiniMindConfig(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                              use_moe=bool(cfg.use_moe), arch="qwen3" if cfg.arch == "auto" else cfg.arch,
                              **heads).to_hf_config()
    except Exception:  # noqa: BLE001 - any unreadable config: the size is unknown, auto stays fp32 on CPU
        return None


def policy_layer_params(cfg: Config) -> int | None:
    """layer_matmul_params of the actor the settings describe (None: unknown)."""
    mc = model_config(cfg)
    return None if mc is None else layer_matmul_params(mc)


def cuda_auto_dtype(device: torch.device) -> str:
    """--dtype auto on a GPU: bf16 where the GPU computes it natively (compute capability 8.0 on: Ampere,
    Hopper, ...); fp16 with loss scaling on Volta and Turing (V100, T4), whose tensor cores take fp16 but
    emulate bf16 more slowly than fp32; fp32 on older GPUs."""
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 8 and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bfloat16"
    return "float16" if major >= 7 else "float32"


def auto_dtype(device: torch.device, layer_params: int | None, threads: int | None = None) -> str:
    """The auto rule. CUDA: `cuda_auto_dtype`. CPU: bf16 only where its bf16 matmul is measured faster
    (`cpu_bf16_faster` at `threads`) and the model is large enough that its matmuls gain more than the casts
    and elementwise work lose; else fp32."""
    if device.type == "cuda":
        return cuda_auto_dtype(device)
    big = layer_params is not None and layer_params >= BF16_CPU_MIN_LAYER_PARAMS
    return "bfloat16" if device.type == "cpu" and big and cpu_bf16_faster(threads) else "float32"


def resolve_precision(cfg: Config, device: torch.device, layer_params: int | None = None) -> tuple[str, torch.dtype]:
    """(--dtype resolved, dtype of the frozen models) on `device`. The one home of both rules.

    auto and --frozen_low_precision -1 follow `auto_dtype`. An explicit low-precision --dtype where auto
    would pick fp32 keeps the frozen models in fp32 unless --frozen_low_precision 1. On a CPU (a --ref_device
    cpu beside a GPU actor) fp16 becomes fp32: CPUs have no fast fp16 and no loss scaler runs there."""
    auto = auto_dtype(device, layer_params, cfg.num_threads or None)
    name = cfg.dtype if cfg.dtype != "auto" else auto
    if device.type == "cpu" and name == "float16":
        name = "float32"
    low = cfg.frozen_low_precision if cfg.frozen_low_precision >= 0 else int(auto != "float32")
    return name, (DTYPES[name] if low else torch.float32)


def use_parallel_update(flag: int, device: torch.device, distributed: bool, cpu_bf16: bool,
                        reuse_values: bool = False, threads: int | None = None) -> bool:
    """`--parallel_update`: 1/0 as given; -1 (auto) = on for single-process CPU runs under bf16 autocast with
    >= 2 torch threads, where the benchmark shows it pays (docs/speed-and-memory.md), unless the update reuses the critic's scoring
    forward (then the critic's share is a backward alone and the actor's core does most of the work).
    DDP stays sequential: its gradient hooks would issue collectives from two threads in an order no other
    rank shares, so 1 is refused there."""
    if flag == 1 and (distributed or device.type != "cpu"):
        raise SystemExit("error: --parallel_update 1 is for single-process CPU runs (use -1 or 0 under torchrun or on CUDA)")
    if flag >= 0:
        return bool(flag)
    return (not distributed and device.type == "cpu" and cpu_bf16 and not reuse_values
            and (threads or torch.get_num_threads()) >= 2)
