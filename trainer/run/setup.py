"""Everything a PPO run is built from, in one call: threads, seeds, precision, the five models,
prompt data, optimizers, KL controller, DDP/compile. Shared by train_ppo.py and scripts/bench_ppo.py.

`setup(args, info)` reads the flags once; what it derives (dtype, the frozen models' dtype, the
step count, the output names...) lands in a frozen `Settings`, so nothing rewrites `args` later.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import math
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dataset.rlaif import DataError, RLAIFDataset, read_rlaif_jsonl
from model.critic import CriticModel
from model.loader import eos_token_ids, load_policy, load_reward_model
from model.lora import AdapterSnapshot, AdaptersOff, add_lora
from model.weights import WeightsError, native_weight_path
from trainer.ppo import GROUP_ESTIMATORS, AdaptiveKLController, FixedKLController
from trainer.rewards import RewardModelScorer, load_reward_fn
from trainer.run.checkpoint import seed_everything
from trainer.run.distributed import DistInfo, all_gather_objects, failing_together, gpu_identity, init_distributed, stop_all
from trainer.run.parallel import check_parallel_update, use_parallel_update

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# torch 2.13 renamed DDP's broadcast_buffers (deprecated, a warning on every rank) to forward_sync_buffers.
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})


@dataclass(frozen=True)
class Settings:
    """Values derived from the flags once, at start-up. The loop reads these; `args` stays as parsed."""

    info: DistInfo
    dtype_name: str  # --dtype with `auto` resolved
    frozen_dtype: torch.dtype  # reference, reward model and old actor (--frozen_low_precision resolved)
    hidden_size: int  # names the output files: the flag, or an --actor_path model's own
    total_steps: int
    parallel_update: bool  # --parallel_update resolved for this device, dtype and thread count
    train_attn: str | None  # attention kernel of the update's forward/backward (None = the model's own)
    sample_temperature: float  # the distribution log-probs are taken under (1.0 under --greedy)
    sample_interval: int  # steps between sample tables (MiniMind's --debug_mode 1 uses --debug_interval)
    ref_device: torch.device  # --ref_device / --critic_device / --reward_device, default the actor's device
    critic_device: torch.device
    reward_device: torch.device
    kl_placement: str  # "reward" or "loss" (--kl_placement auto resolved for the estimator)
    kl_estimator: str  # k1 / k2 / k3 (--kl_estimator auto resolved for the estimator)
    clip_epsilon_high: float  # --clip_epsilon_high, default --clip_epsilon
    reuse_values: bool  # GAE with one epoch of one minibatch: the critic's scoring forward is the update's
    eval_data_path: str | None  # held-out prompts evaluated during training (None = no evaluation)
    flags: dict  # the flags with derived values filled in: run.json and resume files record these
    # (--dtype, frozen models' dtype) per device type the run uses: a reference on the CPU beside a CUDA
    # actor computes as a CPU should, not in the GPU's bf16. The actor's type holds (dtype_name, frozen_dtype).
    precisions: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    def autocast(self, device: torch.device | None = None) -> ContextManager:
        """The one autocast context of the run (a no-op in fp32), for the actor's device or `device`, in
        that device type's precision."""
        device = device or self.device
        name = self.precisions.get(device.type, (self.dtype_name,))[0]
        if name == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=DTYPES[name])

    @property
    def cuda_devices(self) -> list[torch.device]:
        """Every GPU this rank computes on (the actor's and any --ref/--critic/--reward_device)."""
        devices = (self.device, self.ref_device, self.critic_device, self.reward_device)
        return sorted({d for d in devices if d.type == "cuda"}, key=str)


def on(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on `device` (no copy where they already are)."""
    return tuple(t.to(device) for t in tensors)


@dataclass
class Models:
    """The run's models. `*_train` are what the update calls (DDP / compiled wrappers); sampling and
    scoring use the plain modules."""

    actor: nn.Module
    critic: nn.Module | None  # None with a critic-free --advantage_estimator
    ref: nn.Module
    old_actor: nn.Module | None  # MiniMind's frozen copy (--update_old_actor_freq N), else None
    rm_scorer: RewardModelScorer | None
    tok: object
    eos_ids: list[int]  # HF chat models may stop on several ids (tokenizer EOS + generation_config)
    actor_train: nn.Module | None = None
    critic_train: nn.Module | None = None


@dataclass
class Optim:
    """AdamW + LR schedule per trained model, and the fp16 loss scaler (disabled otherwise: a no-op)."""

    optims: dict[str, torch.optim.Optimizer]
    scheds: dict[str, torch.optim.lr_scheduler.LRScheduler]
    scaler: torch.amp.GradScaler

    def zero_grad(self) -> None:
        for o in self.optims.values():
            o.zero_grad(set_to_none=True)


@dataclass
class Setup:
    settings: Settings
    models: Models
    optim: Optim
    kl_ctl: FixedKLController | AdaptiveKLController
    dataset: RLAIFDataset
    custom_fns: dict[str, Callable]  # --reward_fn, by function name
    n_bad_lines: int  # malformed prompt lines skipped (--skip_bad_lines)
    eval_records: list  # held-out prompts evaluated during training (empty: no evaluation)


# --dtype auto / --frozen_low_precision -1 on a CPU: bf16 from this many matmul weights in the transformer
# layers (embeddings and LM head not counted) on a CPU with native bf16. Crossover measured with
# scripts/bench_ppo.py --interleave 1 (README "Speed and memory"): 256x8 (6.7M) bf16 1.56x faster,
# 256x4 (3.3M) even, 128x4 (0.9M, the demo) faster on an AVX512-BF16 EPYC but slower on an AMX Xeon.
BF16_CPU_MIN_LAYER_PARAMS = 5_000_000


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


def layer_matmul_params(cfg: object) -> int:
    """Matmul weights of the transformer layers (q/k/v/o and the MLP; active experts only for MoE):
    what sets a step's bf16 gain. Embeddings and the LM head are left out (the head runs only at
    response positions and the embedding is a lookup)."""
    cfg = getattr(cfg, "text_config", None) or cfg
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or H // heads
    inter = getattr(cfg, "moe_intermediate_size", None) if getattr(cfg, "num_experts", 0) else None
    inter = (inter or cfg.intermediate_size) * (getattr(cfg, "num_experts_per_tok", 1) if inter else 1)
    return L * (2 * H * heads * hd + 2 * H * kv * hd + 3 * H * inter)


def policy_layer_params(args: argparse.Namespace) -> int | None:
    """layer_matmul_params of the actor the flags describe, from its config alone (nothing loaded):
    --actor_path's config.json, or a MiniMind config from the shape flags. None when it cannot be
    read (loading reports that properly later)."""
    try:
        if args.actor_path:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(args.actor_path, trust_remote_code=bool(args.trust_remote_code))
        else:
            from model.config import MiniMindConfig

            heads = {k: getattr(args, k) for k in ("num_attention_heads", "num_key_value_heads") if getattr(args, k, 0)}
            cfg = MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                                 use_moe=bool(args.use_moe), arch="qwen3" if args.arch == "auto" else args.arch,
                                 **heads).to_hf_config()
        return layer_matmul_params(cfg)
    except Exception:  # noqa: BLE001 - any unreadable config: the size is unknown, auto stays fp32 on CPU
        return None


def cuda_auto_dtype(device: torch.device) -> str:
    """--dtype auto on a GPU: bf16 where the GPU computes it natively (compute capability 8.0 on: Ampere,
    Hopper, ...); fp16 with loss scaling on Volta and Turing (V100, T4), whose tensor cores take fp16 but
    emulate bf16 more slowly than fp32; fp32 on older GPUs."""
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 8 and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bfloat16"
    return "float16" if major >= 7 else "float32"


def auto_dtype(device: torch.device, layer_params: int | None) -> str:
    """The auto rule. CUDA: `cuda_auto_dtype`. CPU: bf16 only with native bf16 and a model large enough
    that its matmuls gain more than the casts and elementwise work lose; else fp32."""
    if device.type == "cuda":
        return cuda_auto_dtype(device)
    big = layer_params is not None and layer_params >= BF16_CPU_MIN_LAYER_PARAMS
    return "bfloat16" if device.type == "cpu" and big and cpu_native_bf16() else "float32"


def resolve_precision(args: argparse.Namespace, device: torch.device,
                      layer_params: int | None = None) -> tuple[str, torch.dtype]:
    """(--dtype resolved, dtype of the frozen models) on `device`. The one home of both rules.

    auto and --frozen_low_precision -1 follow `auto_dtype`: bf16 on Ampere and later GPUs, fp16 on
    Volta/Turing; on a CPU bf16 for models of at least BF16_CPU_MIN_LAYER_PARAMS layer weights
    (`layer_params`, None = unknown: fp32) on a CPU with native bf16. An explicit low-precision --dtype
    where auto would pick fp32 keeps the frozen models in fp32 unless --frozen_low_precision 1. On a CPU
    (a --ref_device cpu beside a GPU actor) fp16 becomes fp32: CPUs have no fast fp16 and no loss scaler runs there."""
    auto = auto_dtype(device, layer_params)
    name = args.dtype if args.dtype != "auto" else auto
    if device.type == "cpu" and name == "float16":
        name = "float32"
    low = args.frozen_low_precision if args.frozen_low_precision >= 0 else int(auto != "float32")
    return name, (DTYPES[name] if low else torch.float32)


def reuses_values(args: argparse.Namespace) -> bool:
    """One PPO epoch of one minibatch in one micro-batch (MiniMind's shape): the critic's scoring forward
    and the update's first forward see the same weights and rows, so one forward with grad serves both."""
    rows = args.batch_size * args.num_generations
    return (uses_critic(args) and args.ppo_update_iters == 1 and args.mini_batch_size == rows
            and args.accumulation_steps == 1)


def eval_data_path(args: argparse.Namespace) -> str | None:
    """--eval_data_path resolved: auto = the demo's held-out file beside the demo's training prompts."""
    if args.eval_data_path == "none":
        return None
    if args.eval_data_path != "auto":
        return args.eval_data_path
    held_out = Path(args.data_path).with_name("demo_eval.jsonl")
    return str(held_out) if Path(args.data_path).name == "demo_train.jsonl" and held_out.is_file() else None


def set_deterministic(enabled: bool, device: torch.device) -> None:
    """--deterministic: torch's deterministic kernels everywhere (an op without one raises), and the
    cuBLAS workspace setting those need on CUDA (read when cuBLAS starts, so set before any matmul)."""
    if not enabled:
        return
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up then cosine decay to 10% of the peak, indexed by PPO step."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def actor_weights_path(args: argparse.Namespace) -> Path | None:
    """The native .pth --from_weight names (None for --actor_path or --from_weight none)."""
    if args.actor_path or args.from_weight == "none":
        return None
    return native_weight_path(args.save_dir, args.from_weight, args.hidden_size, bool(args.use_moe))


def frozen_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    m = copy.deepcopy(getattr(model, "module", model)).to(dtype).eval()
    return m.requires_grad_(False)


DEVICE_FLAG = re.compile(r"cpu|cuda(:\+?\d+)?|")  # --ref_device / --critic_device / --reward_device


def model_device(flag: str, name: str, info: DistInfo) -> torch.device:
    """One of --ref_device / --critic_device / --reward_device resolved for this rank (`name`: ref, critic,
    reward). Empty = the actor's device; cuda:+K = K GPUs after the rank's own (the per-rank form: under
    torchrun with 4 ranks per node on cuda:0-3, cuda:+4 gives each its own cuda:4-7); cuda:N = that GPU
    (one rank per node, or one process); cuda = the rank's own GPU."""
    where = f"--{name}_device {flag}"
    if not flag:
        device = info.device
    elif flag == "cpu":
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit(f"error: {where}: CUDA is not available on this machine; use cpu or leave it empty (the actor's device)")
        own = info.device.index if info.device.type == "cuda" else None
        if "+" in flag and own is None:
            raise SystemExit(f"error: {where}: cuda:+K counts from the rank's own GPU, but the actor is on {info.device}; "
                             f"give cuda:N")
        if "+" in flag:
            index = own + int(flag.split("+")[1])
        elif ":" in flag:
            index = int(flag.split(":")[1])
        else:
            index = own if own is not None else info.local_rank
        n = torch.cuda.device_count()
        if index >= n:
            mine = f" (rank {info.rank}'s own GPU is cuda:{own})" if "+" in flag else ""
            raise SystemExit(f"error: {where}: cuda:{index}{mine} but only {n} GPUs are visible to this process; "
                             f"lower the offset or torchrun's --nproc_per_node")
        device = torch.device("cuda", index)
    if name == "critic" and device.type == "cpu" and info.enabled and info.comm_device.type == "cuda":
        raise SystemExit(f"error: {where}: the critic trains under DDP, and NCCL all-reduces GPU tensors only; keep the "
                         f"critic on a GPU (e.g. --critic_device cuda:+1) or leave --critic_device empty")
    return device


def model_devices(args: argparse.Namespace, info: DistInfo) -> dict[str, torch.device]:
    """Where the reference, critic and reward model live (seed 001's two-GPU layout: the frozen models on
    a second GPU; per rank under torchrun with cuda:+K). Empty flag = the actor's device."""
    return {name: model_device(getattr(args, f"{name}_device"), name, info) for name in ("ref", "critic", "reward")}


def check_devices_per_rank(devices: dict[str, torch.device], info: DistInfo) -> None:
    """Under torchrun every rank's GPUs must be its own: two ranks on one GPU would share its memory
    and serialise on it (NCCL refuses it outright). GPUs are compared by identity (`gpu_identity`), so
    ranks 0 and 8 of a two-node job, each on its node's cuda:0, do not clash. Every rank stops, with one
    line naming the ranks, the device and the host."""
    mine = sorted({(gpu_identity(d), str(d)) for d in (info.device, *devices.values()) if d.type == "cuda"})
    per_rank = all_gather_objects((socket.gethostname(), mine), info)
    owner: dict[str, int] = {}
    clash = None
    for rank, (host, gpus) in enumerate(per_rank):
        for ident, name in gpus:
            if owner.setdefault(ident, rank) != rank and clash is None:
                clash = (owner[ident], rank, name, host)
    stop_all(None if clash is None else
             f"ranks {clash[0]} and {clash[1]} both use {clash[2]} on {clash[3]}: give each rank its own GPUs "
             f"(--ref_device/--critic_device/--reward_device cuda:+K put a rank's models K GPUs after its own, "
             f"e.g. 4 ranks per node on cuda:0-3 with --ref_device cuda:+4 on cuda:4-7)", info)


def uses_critic(args: argparse.Namespace) -> bool:
    return args.advantage_estimator == "gae"


def check_same_precision(dtype_name: str, frozen_dtype: torch.dtype, info: DistInfo) -> None:
    """`--dtype auto` is decided per rank from its own CPU's flags: CPU nodes that differ in native bf16
    would train one model in two precisions. Every rank stops, with one line naming the first odd rank."""
    mine = (dtype_name, str(frozen_dtype).removeprefix("torch."))
    per_rank = all_gather_objects(mine, info)
    odd = next((r for r, p in enumerate(per_rank) if p != per_rank[0]), None)
    stop_all(None if odd is None else
             f"ranks chose different precisions (rank 0: {'/'.join(per_rank[0])}, rank {odd}: {'/'.join(per_rank[odd])}; "
             f"--dtype auto follows each CPU's native bf16): give --dtype and --frozen_low_precision explicitly", info)


def build_models(args: argparse.Namespace, device: torch.device, frozen_dtype: torch.dtype,
                 devices: dict[str, torch.device] | None = None, frozen_dtypes: dict[str, torch.dtype] | None = None) -> Models:
    """Actor, reward model, reference, critic (GAE only), old actor, in this order (random inits draw
    from the seeded generator, so the order is part of a run's determinism). `--from_weight none`
    gives a random-init actor (benchmarks). `frozen_dtypes` ("ref", "reward"): the frozen models' dtype
    on their own device where it differs from `frozen_dtype` (the actor device's)."""
    frozen_dtypes = frozen_dtypes or {}
    actor, tok = load_policy(
        weights=actor_weights_path(args), hf_path=args.actor_path, hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers, use_moe=bool(args.use_moe), arch=args.arch,
        num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
        tokenizer_path=args.tokenizer_path, device=device, trust_remote_code=bool(args.trust_remote_code),
    )
    rm_scorer = None
    if args.rm_weight and args.reward_model_path not in (None, "none"):
        devices = devices or {"ref": device, "critic": device, "reward": device}
        rm_model, rm_tok = load_reward_model(args.reward_model_path, dtype=frozen_dtypes.get("reward", frozen_dtype), device=devices["reward"],
                                             trust_remote_code=bool(args.trust_remote_code))
        rm_scorer = RewardModelScorer(rm_model, rm_tok)
    actor.config.use_cache = True
    devices = devices or {"ref": device, "critic": device, "reward": device}
    if args.lora_r > 0:
        return _build_lora_models(args, actor, tok, rm_scorer, devices)
    ref = frozen_copy(actor, frozen_dtypes.get("ref", frozen_dtype)).to(devices["ref"])
    critic = CriticModel.from_policy(actor).to(devices["critic"]) if uses_critic(args) else None
    # The old actor scores with the actor's own numerics (its weights' dtype), or the ratio would not be 1
    # before the first update; the reference may be held in low precision (its KL at step 0 is then the
    # rounding gap, logged as kl_ref).
    old_actor = frozen_copy(actor, next(actor.parameters()).dtype) if args.update_old_actor_freq > 0 else None
    return Models(actor=actor, critic=critic, ref=ref, old_actor=old_actor, rm_scorer=rm_scorer, tok=tok,
                  eos_ids=eos_token_ids(actor, tok))


def _build_lora_models(args: argparse.Namespace, actor: nn.Module, tok: object, rm_scorer: RewardModelScorer | None,
                       devices: dict[str, torch.device]) -> Models:
    """--lora_r > 0: the critic copies the plain trunk, then the actor gets peft adapters; the reference
    is the actor with its adapters off and the old actor a copy of the adapters (model/lora.py)."""
    critic = CriticModel.from_policy(actor).to(devices["critic"]) if uses_critic(args) else None
    actor = add_lora(actor, args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules)
    old_actor = AdapterSnapshot(actor) if args.update_old_actor_freq > 0 else None
    return Models(actor=actor, critic=critic, ref=AdaptersOff(actor), old_actor=old_actor, rm_scorer=rm_scorer, tok=tok,
                  eos_ids=eos_token_ids(actor, tok))


def build_optim(args: argparse.Namespace, models: Models, total_steps: int, dtype: torch.dtype, device: torch.device) -> Optim:
    """AdamW for actor and critic (if any), each with warm-up + cosine LR over total_steps."""
    optims = {
        # Fused AdamW: one kernel for all parameters (~4x faster step on CPU, same math to ~1e-8).
        # Trained parameters only: with LoRA, the adapters (every parameter otherwise, in the same order).
        "actor": torch.optim.AdamW([p for p in models.actor.parameters() if p.requires_grad], lr=args.learning_rate,
                                   weight_decay=args.weight_decay, fused=True),
    }
    if models.critic is not None:
        optims["critic"] = torch.optim.AdamW(models.critic.parameters(), lr=args.critic_learning_rate,
                                             weight_decay=args.weight_decay, fused=True)
    scheds = {k: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(args.warmup_steps, total_steps)) for k, o in optims.items()}
    # fp16 needs loss scaling; bf16 and fp32 do not, and a disabled scaler passes everything through.
    return Optim(optims, scheds, torch.amp.GradScaler(device.type, enabled=dtype == torch.float16))


def allow_tf32(device: torch.device) -> None:
    """On CUDA, fp32 matmuls and cuDNN convolutions may use TF32 tensor cores: several times the fp32
    matmul throughput from Ampere on, with 10-bit-mantissa products and fp32 accumulation. This speeds
    up --dtype float32 runs; matmuls under bf16 autocast are bf16 already. Never on CPU: the demo's
    numerics stay exact.

    The allow_tf32 flags, not their alternatives in torch 2.13: set_float32_matmul_precision("high")
    also turns on TF32 for CPU oneDNN matmuls (torch.backends.mkldnn.matmul.fp32_precision), and after
    the newer torch.backends.cuda.matmul.fp32_precision = "tf32" reading the older flags or
    torch.get_float32_matmul_precision() (torch.compile's inductor does) raises a mixed-API error."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def wrap_for_training(args: argparse.Namespace, models: Models, info: DistInfo) -> None:
    """DDP (only the trained models; sampling and scoring use the plain modules) and torch.compile."""
    actor_train, critic_train = models.actor, models.critic
    if info.enabled:
        # No buffer sync before each forward: training changes no buffer (the only ones are rotary
        # inv_freq tables, fixed by the config; a dynamic RoPE recomputes them inside each forward from
        # that rank's own lengths), so DDP's broadcast of every buffer from rank 0 is wasted traffic.
        def ddp(model: nn.Module) -> DDP:
            dev = next(model.parameters()).device  # the critic may sit on --critic_device
            return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                       find_unused_parameters=bool(args.use_moe), **NO_FORWARD_BUFFER_SYNC)
        actor_train, critic_train = ddp(actor_train), None if critic_train is None else ddp(critic_train)
    if args.use_compile:
        actor_train = torch.compile(actor_train)
        critic_train = None if critic_train is None else torch.compile(critic_train)
    models.actor_train, models.critic_train = actor_train, critic_train


def validate_flags(args: argparse.Namespace) -> None:
    """One-line errors for flags that would otherwise fail deep inside the run."""
    rows = args.batch_size * args.num_generations
    checks = [
        (args.batch_size >= 1, "--batch_size must be >= 1"),
        (args.num_generations >= 1, "--num_generations must be >= 1"),
        (args.mini_batch_size >= 1 and rows % args.mini_batch_size == 0,
         f"--mini_batch_size {args.mini_batch_size} must divide --batch_size x --num_generations = {rows}"),
        (args.accumulation_steps >= 1 and args.mini_batch_size % args.accumulation_steps == 0,
         f"--accumulation_steps {args.accumulation_steps} must divide --mini_batch_size {args.mini_batch_size}"),
        (args.max_gen_len >= 1, "--max_gen_len must be >= 1"),
        (args.max_seq_len >= 8, "--max_seq_len must be >= 8"),
        (args.temperature > 0 or args.greedy, "--temperature must be > 0 (or use --greedy 1)"),
        (0 < args.top_p <= 1, "--top_p must be in (0, 1]"),
        (args.ppo_update_iters >= 1, "--ppo_update_iters must be >= 1"),
        (0 <= args.thinking_ratio <= 1, "--thinking_ratio must be in [0, 1]"),
        (args.epochs >= 1, "--epochs must be >= 1"),
        (args.save_interval >= 1, "--save_interval must be >= 1"),
        (Path(args.data_path).is_file(), f"--data_path {args.data_path}: file not found"),
        (args.reward_model_path in (None, "none") or Path(args.reward_model_path).is_dir() or args.rm_weight == 0,
         f"--reward_model_path {args.reward_model_path}: not a directory (use 'none' or --rm_weight 0 to run without a reward model)"),
        (args.actor_path is None or Path(args.actor_path).is_dir(), f"--actor_path {args.actor_path}: not a directory"),
        (args.rollout_engine == "torch", "--rollout_engine sglang is not supported: minippo samples with the policy "
                                         "in-process (--rollout_engine torch, the default); drop the --sglang_* flags"),
        (args.ddp_timeout > 0, "--ddp_timeout must be > 0 seconds"),
        (args.num_generations >= 2 or args.advantage_estimator not in GROUP_ESTIMATORS,
         f"--advantage_estimator {args.advantage_estimator} compares the --num_generations responses to each prompt: "
         f"give --num_generations >= 2 (e.g. 4)"),
        (args.num_generations >= 2 or not args.filter_groups,
         "--filter_groups 1 drops groups of --num_generations responses with equal rewards: give --num_generations >= 2"),
        (args.filter_max_rounds >= 1, "--filter_max_rounds must be >= 1"),
        (args.critic_warmup_steps == 0 or args.advantage_estimator == "gae",
         f"--critic_warmup_steps trains the critic, but --advantage_estimator {args.advantage_estimator} has none: drop it"),
        (0 <= args.overlong_buffer_len < args.max_gen_len,
         f"--overlong_buffer_len {args.overlong_buffer_len} must be in [0, --max_gen_len {args.max_gen_len})"),
        (args.eval_interval >= 1 and args.eval_samples >= 1, "--eval_interval and --eval_samples must be >= 1"),
        (args.eval_data_path in ("auto", "none") or Path(args.eval_data_path).is_file(),
         f"--eval_data_path {args.eval_data_path}: file not found (or 'none' to train without evaluation)"),
        (args.lora_r >= 0, f"--lora_r {args.lora_r} must be >= 0 (0 = no LoRA, full fine-tuning)"),
        (math.isfinite(args.lora_alpha) and args.lora_alpha > 0, f"--lora_alpha {args.lora_alpha} must be a finite number > 0"),
        (0 <= args.lora_dropout < 1, f"--lora_dropout {args.lora_dropout} must be in [0, 1)"),
        (args.lora_r == 0 or not args.ref_device,
         f"--ref_device {args.ref_device}: with --lora_r > 0 the reference is the actor with its adapters off, on the "
         f"actor's device; drop --ref_device"),
        # torch.device() would take "tpu"/"mps" and fail later with a traceback.
        (re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device) is not None,
         f"--device {args.device}: expected one of auto, cpu, cuda, cuda:N"),
        *[(DEVICE_FLAG.fullmatch(getattr(args, f)) is not None,
           f"--{f} {getattr(args, f)}: expected cpu, cuda, cuda:N or cuda:+K (K GPUs after the rank's own), "
           f"or nothing (the actor's device)")
          for f in ("ref_device", "critic_device", "reward_device")],
    ]
    # nan compares False with everything, so "x > 0" alone would let it through.
    for flag, lowest in (("learning_rate", "> 0"), ("critic_learning_rate", "> 0"), ("grad_clip", "> 0"),
                         ("clip_epsilon", "> 0"), ("kl_coef", ">= 0"), ("clip_epsilon_high", "> 0"), ("overlong_penalty", ">= 0")):
        v = getattr(args, flag)
        if v is None:  # --clip_epsilon_high not given
            continue
        checks.append((math.isfinite(v) and (v > 0 if lowest == "> 0" else v >= 0),
                       f"--{flag} {v} must be a finite number {lowest}"))

    def blocking_file(path: str) -> Path | None:
        """The file standing where `path` or one of its parents must be a directory (found here, not
        at the first save after a step of work)."""
        for p in (Path(path), *Path(path).parents):
            if p.exists():
                return None if p.is_dir() else p
        return None

    # No --run_dir means runs/<save_weight>_<hidden>: "runs" must then be a directory.
    for label, value in ((f"--checkpoint_dir {args.checkpoint_dir}", args.checkpoint_dir),
                         (f"--save_dir {args.save_dir}", args.save_dir),
                         (f"--run_dir {args.run_dir}" if args.run_dir else "--run_dir (default runs/...)",
                          args.run_dir or "runs")):
        f = blocking_file(value)
        where = "is a file" if f == Path(value) else f"{f} is a file"
        checks.append((f is None, f"{label}: {where}, not a directory; give a directory path (created if missing)"))
    for ok, msg in checks:
        if not ok:
            raise SystemExit(f"error: {msg}")


def setup(args: argparse.Namespace, info: DistInfo | None = None) -> Setup:
    """Build a run from parsed flags; info None = from torchrun's environment (one process without it).
    Bad input is a one-line SystemExit; a failure on some ranks only (a file missing on one node) stops
    every rank with its line."""
    if info is None:
        validate_flags(args)  # before the process group and the device exist
        info = init_distributed(args.device, timeout_s=args.ddp_timeout)
    with failing_together(info):  # rank-local work only: no collective runs inside
        built = _build(args, info)
    s = built.settings
    if info.enabled:
        check_devices_per_rank({"ref": s.ref_device, "critic": s.critic_device, "reward": s.reward_device}, info)
        check_same_precision(s.dtype_name, s.frozen_dtype, info)
    wrap_for_training(args, built.models, info)  # DDP's constructor broadcasts rank 0's weights
    return built


def _build(args: argparse.Namespace, info: DistInfo) -> Setup:
    validate_flags(args)
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    allow_tf32(info.device)
    try:
        check_parallel_update(args.parallel_update, info.device, info.enabled)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    set_deterministic(bool(args.deterministic), info.device)
    seed_everything(args.seed)  # the same random-init models (--from_weight none, value head) on every rank
    layer_params = policy_layer_params(args)
    dtype_name, frozen_dtype = resolve_precision(args, info.device, layer_params)
    devices = model_devices(args, info)
    precisions = {d.type: resolve_precision(args, d, layer_params) for d in devices.values() if d.type != info.device.type}
    precisions[info.device.type] = (dtype_name, frozen_dtype)
    try:
        models = build_models(args, info.device, frozen_dtype, devices,
                              frozen_dtypes={k: precisions[d.type][1] for k, d in devices.items()})
        if info.rank > 0:  # then each rank samples differently (rank 0 keeps the single-process stream)
            seed_everything(args.seed + info.rank)
        custom_fns = {spec.split(":")[-1]: load_reward_fn(spec) for spec in args.reward_fn}
        records, n_bad = read_rlaif_jsonl(args.data_path, skip_bad_lines=bool(args.skip_bad_lines))
        eval_path = eval_data_path(args)
        eval_records = read_rlaif_jsonl(eval_path)[0][:args.eval_samples] if eval_path else []
    except (WeightsError, DataError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}")
    kl_ctl = AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon) if args.adaptive_kl else FixedKLController(args.kl_coef)
    try:  # e.g. an --actor_path tokenizer without a chat template: one line, not a traceback
        ds = RLAIFDataset(records, models.tok, max_prompt_len=args.max_seq_len, thinking_ratio=args.thinking_ratio,
                          system_prompt_ratio=args.system_prompt_ratio, seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    steps_per_epoch = len(ds) // (args.batch_size * info.world_size)
    if steps_per_epoch == 0:
        raise SystemExit(f"error: --data_path has {len(ds)} prompts, fewer than one global batch "
                         f"({args.batch_size} x {info.world_size} processes)")
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)
    optim = build_optim(args, models, total_steps, DTYPES[dtype_name], info.device)

    cpu_bf16 = info.device.type == "cpu" and dtype_name == "bfloat16" and not args.use_compile
    train_attn = args.train_attn_implementation
    if train_attn == "auto":  # torch's CPU flash-attention backward under bf16 is slow at PPO's short sequences
        train_attn = "eager" if cpu_bf16 else None
    hidden_size = models.actor.config.hidden_size if args.actor_path else args.hidden_size
    kl_placement = args.kl_placement
    if kl_placement == "auto":  # GRPO and Dr. GRPO put the KL in the loss, so every token of a response shares its advantage
        kl_placement = "loss" if args.advantage_estimator in ("grpo", "dr_grpo") else "reward"
    kl_estimator = args.kl_estimator  # auto: GRPO's k3 for grpo/dr_grpo, k1 (Ziegler et al.) otherwise
    if kl_estimator == "auto":
        kl_estimator = "k3" if args.advantage_estimator in ("grpo", "dr_grpo") else "k1"
    clip_high = args.clip_epsilon if args.clip_epsilon_high is None else args.clip_epsilon_high
    settings = Settings(
        info=info, dtype_name=dtype_name, frozen_dtype=frozen_dtype, hidden_size=hidden_size, total_steps=total_steps,
        parallel_update=use_parallel_update(args.parallel_update, info.device, info.enabled, cpu_bf16, reuses_values(args)),
        train_attn=train_attn, sample_temperature=1.0 if args.greedy else args.temperature,
        sample_interval=args.debug_interval if args.debug_mode else args.sample_interval,
        ref_device=info.device if args.lora_r > 0 else devices["ref"],  # LoRA: the reference is the actor itself
        critic_device=devices["critic"], reward_device=devices["reward"],
        kl_placement=kl_placement, kl_estimator=kl_estimator, clip_epsilon_high=clip_high, reuse_values=reuses_values(args),
        eval_data_path=eval_path, precisions=precisions,
        flags={**vars(args), "dtype": dtype_name, "hidden_size": hidden_size, "kl_placement": kl_placement, "kl_estimator": kl_estimator,
               "clip_epsilon_high": clip_high, "eval_data_path": eval_path},
    )
    return Setup(settings, models, optim, kl_ctl, ds, custom_fns, n_bad, eval_records)
