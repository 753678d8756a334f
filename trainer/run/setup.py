"""Everything a PPO run is built from, in one call: the resolved config, threads, seeds, the five
models, prompt data, optimizers, KL controller, DDP/compile. Shared by train_ppo.py and benchmarks/bench_ppo.py.

`setup(raw, info)` resolves the flags once (trainer/config.py `resolve`): everything downstream reads
the frozen `Config` it returns; where this rank computes lands in a `Runtime`.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoTokenizer

from dataset import rgym
from dataset.rlaif import TOOLS_UNSEEN, DataError, PromptRecord, RLAIFDataset, read_rlaif_jsonl, template_renders_tools, tool_name
from model import logprobs
from model.critic import CriticModel
from model.loader import eos_token_ids, load_policy, load_reward_model
from model.lora import AdapterSnapshot, AdaptersOff, add_lora
from model.weights import WeightsError, native_weight_path
from trainer import verifier
from trainer.config import Config
from trainer.dist import DistInfo, all_gather_objects
from trainer.distill import TeacherError, connect_teacher, load_teacher
from trainer.http_client import server_index
from trainer.ppo import AdaptiveKLController, FixedKLController, RewardNormalizer
from trainer.reward_model import RewardModelScorer
from trainer.reward_server import RemoteRewardModel, RewardFunctionServer, exits_on_reward_error
from trainer.rewards import load_reward_fn
from trainer.run.cli import resolve, validate
from trainer.run.distributed import failing_together, gpu_identity, in_turn, init_distributed, keep_until_exit, stop_all
from trainer.run.engine_sync import connect_engine
from trainer.run.hardware import layer_matmul_params, model_config, resolve_precision
from trainer.run.seeding import seed_everything
from trainer.run.sharding import device_mesh, shard, shard_models, use_hsdp
from trainer.runtime import DTYPES, Models, Optim, Runtime
from trainer.sections import OptimConfig
from trainer.tools import Toolbox, ToolRunner, load_tools

# torch 2.13 renamed DDP's broadcast_buffers (deprecated, a warning on every rank) to forward_sync_buffers.
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})


@dataclass
class Setup:
    cfg: Config  # resolved
    runtime: Runtime
    models: Models
    optim: Optim
    kl_ctl: FixedKLController | AdaptiveKLController
    dataset: RLAIFDataset
    custom_fns: dict[str, Callable]  # --reward_fn, by function name
    n_bad_lines: int  # malformed prompt lines skipped (--skip_bad_lines)
    eval_records: list  # held-out prompts evaluated during training (empty: no evaluation)
    reward_norm: RewardNormalizer = field(default_factory=lambda: RewardNormalizer("none"))  # --reward_norm's running moments
    tools: ToolRunner | None = None  # --tools: runs the policy's tool calls (None: single-turn rollouts)


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


def actor_weights_path(cfg: Config) -> Path | None:
    """The native .pth --from_weight names (None for --actor_path or --from_weight none)."""
    if cfg.actor_path or cfg.from_weight == "none":
        return None
    return native_weight_path(cfg.save_dir, cfg.from_weight, cfg.hidden_size, bool(cfg.use_moe))


def frozen_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    m = copy.deepcopy(getattr(model, "module", model)).to(dtype).eval()
    return m.requires_grad_(False)




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
        if "+" in flag:
            if own is None:
                raise SystemExit(f"error: {where}: cuda:+K counts from the rank's own GPU, but the actor is on {info.device}; "
                                 f"give cuda:N")
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


def model_devices(cfg: Config, info: DistInfo) -> dict[str, torch.device]:
    """Where the reference, critic and reward model live (seed 001's two-GPU layout: the frozen models on
    a second GPU; per rank under torchrun with cuda:+K). Empty flag = the actor's device."""
    return {name: model_device(getattr(cfg, f"{name}_device"), name, info) for name in ("ref", "critic", "reward")}


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



def check_same_precision(dtype_name: str, frozen_dtype: torch.dtype, info: DistInfo) -> None:
    """`--dtype auto` is decided per rank from its own CPU's flags: CPU nodes that differ in native bf16
    would train one model in two precisions. Every rank stops, with one line naming the first odd rank."""
    mine = (dtype_name, str(frozen_dtype).removeprefix("torch."))
    per_rank = all_gather_objects(mine, info)
    odd = next((r for r, p in enumerate(per_rank) if p != per_rank[0]), None)
    stop_all(None if odd is None else
             f"ranks chose different precisions (rank 0: {'/'.join(per_rank[0])}, rank {odd}: {'/'.join(per_rank[odd])}; "
             f"--dtype auto follows each CPU's native bf16): give --dtype and --frozen_low_precision explicitly", info)


def build_models(cfg: Config, device: torch.device, frozen_dtype: torch.dtype,
                 devices: dict[str, torch.device] | None = None, frozen_dtypes: dict[str, torch.dtype] | None = None) -> Models:
    """Actor, reward model, reference, critic (GAE only), old actor, in this order (random inits draw
    from the seeded generator, so the order is part of a run's determinism). `--from_weight none`
    gives a random-init actor (benchmarks). `frozen_dtypes` ("ref", "reward"): the frozen models' dtype
    on their own device where it differs from `frozen_dtype` (the actor device's)."""
    frozen_dtypes = frozen_dtypes or {}
    actor, tok = load_policy(
        weights=actor_weights_path(cfg), hf_path=cfg.actor_path, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers, use_moe=bool(cfg.use_moe), arch=cfg.arch,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        tokenizer_path=cfg.tokenizer_path, device=device, trust_remote_code=bool(cfg.trust_remote_code),
    )
    rm_scorer = None  # --reward_model_url: connect_reward_servers scores on a server instead
    if cfg.rm_weight and cfg.reward_model_path not in (None, "none") and not cfg.reward_model_url:
        devices = devices or {"ref": device, "critic": device, "reward": device}
        rm_model, rm_tok = load_reward_model(cfg.reward_model_path, dtype=frozen_dtypes.get("reward", frozen_dtype),
                                             device=devices["reward"], trust_remote_code=bool(cfg.trust_remote_code))
        rm_scorer = RewardModelScorer(rm_model, rm_tok)
    actor.config.use_cache = True
    devices = devices or {"ref": device, "critic": device, "reward": device}
    if cfg.lora_r > 0:
        return _build_lora_models(cfg, actor, tok, rm_scorer, devices)
    ref = frozen_copy(actor, frozen_dtypes.get("ref", frozen_dtype)).to(devices["ref"])
    critic = CriticModel.from_policy(actor).to(devices["critic"]) if not cfg.critic_free else None
    # The old actor scores with the actor's own numerics (its weights' dtype), or the ratio would not be 1
    # before the first update; the reference may be held in low precision (its KL at step 0 is then the
    # rounding gap, logged as kl_ref).
    old_actor = frozen_copy(actor, next(actor.parameters()).dtype) if cfg.update_old_actor_freq > 0 else None
    return Models(actor=actor, critic=critic, ref=ref, old_actor=old_actor, rm_scorer=rm_scorer, tok=tok,
                  eos_ids=eos_token_ids(actor, tok))


def _build_lora_models(cfg: Config, actor: nn.Module, tok: Any, rm_scorer: RewardModelScorer | None,
                       devices: dict[str, torch.device]) -> Models:
    """--lora_r > 0: the critic copies the plain trunk, then the actor gets peft adapters; the reference
    is the actor with its adapters off and the old actor a copy of the adapters (model/lora.py)."""
    critic = CriticModel.from_policy(actor).to(devices["critic"]) if not cfg.critic_free else None
    actor = add_lora(actor, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
    old_actor = AdapterSnapshot(actor) if cfg.update_old_actor_freq > 0 else None
    return Models(actor=actor, critic=critic, ref=AdaptersOff(actor), old_actor=old_actor, rm_scorer=rm_scorer, tok=tok,
                  eos_ids=eos_token_ids(actor, tok))


def build_optim(optim: OptimConfig, models: Models, total_steps: int, dtype: torch.dtype, device: torch.device) -> Optim:
    """AdamW for actor and critic (if any), each with warm-up + cosine LR over total_steps."""
    optims = {
        # Fused AdamW: one kernel for all parameters instead of a loop over them (faster, the same math to rounding).
        # Trained parameters only: with LoRA, the adapters (every parameter otherwise, in the same order).
        "actor": torch.optim.AdamW([p for p in models.actor.parameters() if p.requires_grad], lr=optim.learning_rate,
                                   weight_decay=optim.weight_decay, fused=True),
    }
    if models.critic is not None:
        optims["critic"] = torch.optim.AdamW(models.critic.parameters(), lr=optim.critic_learning_rate,
                                             weight_decay=optim.weight_decay, fused=True)
    scheds = {k: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(optim.warmup_steps, total_steps)) for k, o in optims.items()}
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


def wrap_for_training(cfg: Config, models: Models, info: DistInfo) -> None:
    """DDP (only the trained models; sampling and scoring use the plain modules) and torch.compile. Under
    --strategy fsdp2 the sharded models train as they are."""
    actor_train, critic_train = models.actor, models.critic
    if info.enabled and cfg.strategy == "ddp":
        # No buffer sync before each forward: training changes no buffer (the only ones are rotary
        # inv_freq tables, fixed by the config; a dynamic RoPE recomputes them inside each forward from
        # that rank's own lengths), so DDP's broadcast of every buffer from rank 0 is wasted traffic.
        # gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets, not a second copy of them
        # (4 bytes per parameter per trained model less; the same sums).
        def ddp(model: nn.Module) -> DDP:
            dev = next(model.parameters()).device  # the critic may sit on --critic_device
            return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                       find_unused_parameters=bool(cfg.use_moe), gradient_as_bucket_view=True, **NO_FORWARD_BUFFER_SYNC)
        actor_train, critic_train = ddp(actor_train), None if critic_train is None else ddp(critic_train)
    if cfg.use_compile:
        actor_train = torch.compile(actor_train)
        critic_train = None if critic_train is None else torch.compile(critic_train)
    models.actor_train, models.critic_train = actor_train, critic_train



def setup(raw: Config, info: DistInfo | None = None) -> Setup:
    """Build a run from parsed flags; info None = from torchrun's environment (one process without it).
    Bad input is a one-line SystemExit; a failure on some ranks only (a file missing on one node) stops
    every rank with its line."""
    if info is None:
        validate(raw)  # before the process group and the device exist
        info = init_distributed(raw.device, timeout_s=raw.ddp_timeout, cpu_collectives=bool(raw.cpu_offload),
                                wait_timeout_s=raw.save_timeout,
                                group_of_one=raw.strategy == "fsdp2")
    if raw.strategy != "fsdp2":
        with failing_together(info):  # rank-local work only: no collective runs inside
            built = _build(raw, info)
    else:
        built = _build_sharded(raw, info)
    rt, cfg = built.runtime, built.cfg
    if info.enabled:
        check_devices_per_rank({"ref": rt.ref_device, "critic": rt.critic_device, "reward": rt.reward_device}, info)
        check_same_precision(cfg.dtype, cfg.frozen_dtype, info)
    if cfg.strategy == "fsdp2":  # sharding replaced the parameters: the optimizers are built over the shards
        built.optim = build_optim(cfg.optim, built.models, rt.total_steps, DTYPES[cfg.dtype], info.device)
    wrap_for_training(cfg, built.models, info)  # DDP's constructor broadcasts rank 0's weights
    built.models.engine = connect_engine(cfg, info)  # --rollout_engine vllm / sglang: this rank's, reachable
    connect_reward_servers(cfg, built.models, info)  # --reward_model_url / --reward_url: this rank's, checked
    if cfg.teacher_url:  # --teacher_url: this rank's teacher server, checked against the actor's tokenizer
        with failing_together(info):
            try:
                built.models.teacher = connect_teacher(cfg, built.models.tok, info.rank, info.world_size)
            except TeacherError as e:
                raise SystemExit(f"error: {e}") from None
    if info.enabled:
        keep_until_exit(built)  # freed by the process's exit, not by returning from main (a gloo hang)
    return built


def shard_teacher(cfg: Config, models: Models, info: DistInfo, mesh: object) -> None:
    """--strategy fsdp2: the --teacher_model_path teacher sharded as the reference is (--shard_frozen 1), else moved whole
    to the rank's device."""
    if not isinstance(models.teacher, nn.Module):
        return
    if cfg.shard_frozen:
        shard(models.teacher, mesh, offload=CPUOffloadPolicy() if cfg.cpu_offload else None)
    else:
        models.teacher.to(info.device)


def connect_reward_servers(cfg: Config, models: Models, info: DistInfo) -> None:
    """--reward_model_url: this rank's reward-model server (the ranks in contiguous blocks over the URLs), checked against
    --reward_model_path (trainer/reward_server.py RemoteRewardModel.connect), as models.rm_scorer; --reward_url: the
    reward function's server, checked with an empty batch. A rank whose server fails a check stops every rank."""
    if not (cfg.reward_model_url or cfg.reward_url):
        return
    with failing_together(info), exits_on_reward_error():
        if cfg.reward_model_url:
            urls = [u.strip() for u in cfg.reward_model_url.split(",") if u.strip()]
            url = urls[server_index(info.rank, info.world_size, len(urls))]
            try:
                tok = AutoTokenizer.from_pretrained(cfg.reward_model_path, trust_remote_code=bool(cfg.trust_remote_code))
            except (OSError, ValueError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise SystemExit(f"error: --reward_model_path {cfg.reward_model_path}: no loadable tokenizer there "
                                 f"({first}); --reward_model_url renders the text with it") from None
            models.rm_scorer = RemoteRewardModel(url, tok, cfg.reward_model_path, timeout=cfg.reward_timeout).connect()
        if cfg.reward_url:
            models.reward_url = RewardFunctionServer(cfg.reward_url, cfg.reward_timeout).check()


def _build_sharded(raw: Config, info: DistInfo) -> Setup:
    """--strategy fsdp2: each rank builds its models whole in host memory and shards them (fully_shard is a local
    step: each rank keeps its slice). Under torchrun the ranks of a node take turns, so a node's host memory holds
    one rank's whole models at a time (all at once: 8 x actor, critic, reference and reward model, fp32, hundreds of
    GB at 3B), while the others wait outside the training group's collective timeout."""
    mesh = device_mesh(info, use_hsdp(raw.hsdp, info))  # a collective: every rank, before the turns
    turns = (info.local_world_size or info.world_size) if info.enabled else 1
    built: list[Setup] = []

    def build_and_shard() -> None:
        b = _build(raw, info)
        shard_models(b.cfg, b.models, info, mesh)
        shard_teacher(b.cfg, b.models, info, mesh)
        built.append(b)

    if turns == 1:
        with failing_together(info):
            build_and_shard()
    for turn in range(turns if turns > 1 else 0):
        in_turn(build_and_shard, info, info.local_rank == turn)
    return built[0]


def _rewards_beside(cfg: Config, custom_fns: dict, component: str) -> bool:
    """Whether any reward other than `component` ("ifeval" or "accuracy") is on (the reward model, rules, custom
    functions)."""
    rm = cfg.rm_weight if cfg.reward_model_path not in (None, "none") else 0.0
    rules = {"format": cfg.format_weight, "tags": cfg.tag_weight, "accuracy": cfg.accuracy_weight, "eos": cfg.eos_penalty}
    rules.pop(component, None)
    return (any((rm, *rules.values())) or bool(custom_fns) or bool(cfg.overlong_buffer_len and cfg.overlong_penalty)
            or bool(cfg.reward_url and cfg.reward_url_weight))


def read_prompts(cfg: Config) -> tuple[list[PromptRecord], int, list[PromptRecord]]:
    """The training prompts (--data_path's, or --reasoning_gym's generated rows), the malformed lines skipped, and the
    first --eval_samples held-out prompts."""
    if cfg.reasoning_gym:
        records, n_bad = rgym.training(cfg.reasoning_gym, cfg.reasoning_gym_size, cfg.seed), 0
    else:
        records, n_bad = read_rlaif_jsonl(cfg.data_path, skip_bad_lines=bool(cfg.skip_bad_lines))
    if cfg.eval_data_path == rgym.HELD_OUT and cfg.reasoning_gym:  # validate pairs the two
        return records, n_bad, rgym.held_out(cfg.reasoning_gym, cfg.eval_samples)
    return records, n_bad, read_rlaif_jsonl(cfg.eval_data_path)[0][:cfg.eval_samples] if cfg.eval_data_path else []


def _build(raw: Config, info: DistInfo) -> Setup:
    mc = model_config(raw)  # the actor's config, read once: the precision rules size the model from it
    cfg = resolve(raw, info, mc)  # validates; every auto filled in for this rank's device
    if cfg.strategy == "fsdp2" and cfg.dtype == "float16":
        raise SystemExit("error: --strategy fsdp2 with --dtype float16 (fp16 loss scaling over sharded gradients) is not "
                         "supported: use --dtype bfloat16 on GPUs that have it, float32 otherwise, or --strategy ddp")
    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    logprobs.CHUNK_SIZE = cfg.logprob_chunk_size  # process-wide, like the thread count
    allow_tf32(info.device)
    set_deterministic(bool(cfg.deterministic), info.device)
    seed_everything(cfg.seed)  # the same random-init models (--from_weight none, value head) on every rank
    devices = model_devices(cfg, info)
    # Frozen models on a device of another type follow that type's rule (from the flags as given).
    layer_params = None if mc is None else layer_matmul_params(mc)
    precisions = {d.type: resolve_precision(raw, d, layer_params) for d in devices.values() if d.type != info.device.type}
    precisions[info.device.type] = (cfg.dtype, cfg.frozen_dtype)
    try:
        # --strategy fsdp2: built in host memory; sharding then moves each rank's shards to its device, so a GPU
        # never holds a trained model whole (fully_shard moves CPU-built modules to the mesh's device).
        build_on = torch.device("cpu") if cfg.strategy == "fsdp2" else info.device
        models = build_models(cfg, build_on, cfg.frozen_dtype, {k: build_on for k in devices} if cfg.strategy == "fsdp2" else devices,
                              frozen_dtypes={k: precisions[d.type][1] for k, d in devices.items()})
        # --teacher_model_path: held like the reference (frozen, --ref_device, its dtype); fsdp2: in host memory, sharded next
        models.teacher = load_teacher(cfg, models.tok, build_on if cfg.strategy == "fsdp2" else devices["ref"],
                                      precisions[devices["ref"].type][1])
        if info.rank > 0:  # then each rank samples differently (rank 0 keeps the single-process stream)
            seed_everything(cfg.seed + info.rank)
        custom_fns = {spec.split(":")[-1]: load_reward_fn(spec) for spec in cfg.reward_fn}
        records, n_bad, eval_records = read_prompts(cfg)
        if cfg.reasoning_gym:  # its answers are scored in a bounded worker, --verifier_timeout seconds each
            verifier.configure(cfg.verifier_timeout)
        toolbox = load_tools(cfg.tools) if cfg.tools else None
        check_tool_rows(records + eval_records, toolbox)
    except (WeightsError, DataError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}")
    if (toolbox or any(r.tools for r in records)) and cfg.tools_system_prompt is None and not template_renders_tools(models.tok):
        raise SystemExit(f"error: {TOOLS_UNSEEN}")
    kl_ctl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl else FixedKLController(cfg.kl_coef)
    try:  # e.g. an --actor_path tokenizer without a chat template: one line, not a traceback
        ds = RLAIFDataset(records, models.tok, max_prompt_len=cfg.max_seq_len, thinking_ratio=cfg.thinking_ratio,
                          system_prompt_ratio=cfg.system_prompt_ratio, seed=cfg.seed,
                          tools=toolbox.schema_list() if toolbox else None, tools_system_prompt=cfg.tools_system_prompt)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    if cfg.ifeval_weight and not ds.has_constraints and not _rewards_beside(cfg, custom_fns, "ifeval"):
        raise SystemExit(f"error: {cfg.data_path} has no row with \"constraints\", and the ifeval reward is the only one on "
                         f"(--ifeval_weight): every reward would be 0. Use a prompt file written by "
                         f"builders/make_ifeval_data.py or builders/make_ifeval_pool.py (docs/models.md), or turn on "
                         f"another reward.")
    if cfg.ifeval_partial_weight and not ds.has_constraints:
        raise SystemExit(f"error: --ifeval_partial_weight {cfg.ifeval_partial_weight:g} scores a row's \"constraints\", and "
                         f"{cfg.data_path} has none: it would add nothing. Use a prompt file written by "
                         f"builders/make_ifeval_data.py, or leave it at 0.")
    if cfg.ifeval_repairs and not ds.has_constraints:
        raise SystemExit(f"error: --ifeval_repairs {cfg.ifeval_repairs} rewrites replies to meet a row's \"constraints\", and "
                         f"{cfg.data_path} has none: it would do nothing. Use a prompt file written by "
                         f"builders/make_ifeval_pool.py, or leave it at 0.")
    if (cfg.accuracy_weight and not any(r.reference is not None or r.gt or r.rg for r in records)
            and not _rewards_beside(cfg, custom_fns, "accuracy")
            and not ((cfg.ifeval_weight or cfg.ifeval_partial_weight) and ds.has_constraints)):
        raise SystemExit(f"error: {cfg.data_path} has no row with an answer to check (a reference in the final assistant "
                         f"turn, \"gt\", or a --reasoning_gym row), and the accuracy reward is the only one on "
                         f"(--accuracy_weight): every reward would be 0. Give --reasoning_gym TASK (docs/reasoning_gym.md), "
                         f"a prompt file with answers, or turn on another reward.")
    steps_per_epoch = len(ds) // (cfg.batch_size * info.world_size)
    if steps_per_epoch == 0:
        source = f"--reasoning_gym_size {cfg.reasoning_gym_size}" if cfg.reasoning_gym else "--data_path"
        raise SystemExit(f"error: {source} has {len(ds)} prompts, fewer than one global batch "
                         f"({cfg.batch_size} x {info.world_size} processes)")
    total_steps = steps_per_epoch * cfg.epochs
    if cfg.max_steps > 0:
        total_steps = min(total_steps, cfg.max_steps)
    # fsdp2: no optimizer yet. fully_shard replaces each parameter (moving the original to the device in place); an
    # optimizer built now would hold the whole original parameters, on every GPU, until rebuilt. setup() builds it
    # over the shards.
    optim = (Optim({}, {}, torch.amp.GradScaler(enabled=False)) if cfg.strategy == "fsdp2"
             else build_optim(cfg.optim, models, total_steps, DTYPES[cfg.dtype], info.device))
    runtime = Runtime(info=info, ref_device=info.device if cfg.lora_r > 0 else devices["ref"],  # LoRA: the reference is the actor
                      critic_device=devices["critic"], reward_device=devices["reward"], total_steps=total_steps,
                      precisions=precisions)
    return Setup(cfg, runtime, models, optim, kl_ctl, ds, custom_fns, n_bad, eval_records,
                 RewardNormalizer(cfg.reward_norm, cfg.reward_clip),
                 ToolRunner(toolbox, cfg.tool_timeout, cfg.max_tool_calls) if toolbox else None)


def check_tool_rows(records: list, toolbox: Toolbox | None) -> None:
    """Rows that offer tools (MiniMind agent rows) need a --tools module that implements every one of them."""
    for r in records:
        if not r.tools:
            continue
        names = [n for t in r.tools if (n := tool_name(t)) is not None]  # every one has a name (read_rlaif_jsonl checks)
        if toolbox is None:
            raise DataError(f"{r.where}: the row offers tools ({', '.join(names)}); give --tools MODULE.py with a "
                            f"function for each")
        missing = [n for n in names if n not in toolbox.schemas]
        if missing:
            raise DataError(f"{r.where}: the row offers {', '.join(missing)}, which --tools {toolbox.path} does not "
                            f"define; add them to the module")
