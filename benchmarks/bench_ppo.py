"""Benchmark PPO steps of the real trainer code (`train_ppo.make_experience` + `train_ppo.ppo_update`).

    python benchmarks/bench_ppo.py                          # demo 128x4 and 512x8, fp32 vs bf16, old-actor 0 vs 1
    python benchmarks/bench_ppo.py --quick                  # 128x4, bf16, 2 steps: a smoke run
    python benchmarks/bench_ppo.py --sizes 512x8 --dtypes bfloat16 --num_threads 1,2 --use_compile 0,1 \
        --frozen_low_precision 0,1 --json bench.json     # levers: every comma list expands the matrix
    python benchmarks/bench_ppo.py --sizes 256x8,512x8 --interleave 1   # fp32 and bf16 of a size in one process,
                                                         # steps alternated (A/B on a shared machine)
    python benchmarks/bench_ppo.py --actor_path out/smollm2_135m_instruct --dtypes float32,bfloat16 --lora_r 0,16 \
        --batch_size 4 --prompt_len 80 --gen_len 64 --update_old_actor_freq 0 --reward_model none --interleave 1 \
        --extra "--advantage_estimator grpo --num_generations 4 --mini_batch_size 16"   # a pretrained HF model's levers
    python benchmarks/bench_ppo.py --actor_path out/smollm2_135m_instruct --dtypes bfloat16 --batch_size 4 --prompt_len 150 \
        --gen_len 64 --update_old_actor_freq 0 --reward_model none \
        --extra "--advantage_estimator grpo --num_generations 8 --mini_batch_size 32 --accumulation_steps 2"
                                                         # the SmolLM2 IFEval preset's step shape, against its floors
    python benchmarks/bench_ppo.py --actor_path out/smollm2_135m_instruct --dtypes float32 --procs 2 --strategy ddp,fsdp2 \
        --num_threads 1 --batch_size 2 --prompt_len 32 --gen_len 32 --reward_model none --update_old_actor_freq 0
                                                         # each config under torchrun: what each rank holds
    python benchmarks/bench_ppo.py --sizes 512x8 --dtypes bfloat16 --minimind_s_per_step 8.8
                                                         # our speed-up against MiniMind measured beside it
    python benchmarks/bench_ppo.py --sizes 896x2 --vocab_size 151936 --dtypes float32 --update_old_actor_freq 0 \
        --batch_size 1 --prompt_len 64 --gen_len 1024 --reward_model none --steps 2 --num_threads 1 \
        --logprob_chunk_size 0,-1 --extra "--advantage_estimator grpo --num_generations 4"
                                                         # Qwen2.5-0.5B's width and vocabulary: the [rows, tokens,
                                                         # vocab] logits path (0) against model/logprobs.py's chunks

What is measured. Every configuration (with --interleave 1: every group of one size) runs in a fresh subprocess
(so peak RSS is per config), builds
the run with `trainer.run.setup.setup`, as `train_ppo.main()` does, from a namespace made by
`train_ppo.parse_args` (random init: `--from_weight none`), then runs `--warmup` untimed steps and
`--steps` timed steps of `make_experience` + `ppo_update`, refreshing the old actor like main()'s
loop. The work per step is fixed: `--batch_size` prompts of exactly `--prompt_len` tokens,
`--gen_len` new tokens with EOS suppressed (train_ppo's hidden `--suppress_eos 1`), one update epoch
of one minibatch. Prompts: `random` = uniform token ids in [3, vocab) (no special tokens, no padding);
`demo` = real prompts from dataset/demo_train.jsonl rendered by RLAIFDataset and left-padded to
exactly `--prompt_len` columns (same FLOPs, exercises the padding-mask path). The reward model is a
negligible 1-layer, hidden-32 sequence classifier (`--reward_model tiny`) or none.

Phase timers are the trainer's own: make_experience and ppo_update take a timer (trainer/run/timing.py)
and time their phases with it; the bench passes one that also sums CPU seconds and counts FLOPs.
Reported per step (medians over the timed steps):
  generate           sampling with KV cache (generate_rollout)
  score_old          old log-probs + entropy (actor itself, or the frozen old-actor copy)
  score_ref          reference log-probs
  score_critic       critic values
  score_reward       decode + rule rewards + reward model (compute_rewards)
  score_other        the rest of make_experience (KL, GAE, whitening, metrics)
  update_actor_fwd / update_critic_fwd / update_optimizer (grad clipping + AdamW steps) / update_backward
                     (the rest: losses, backward)
  sync_old           old_actor.load_state_dict(actor.state_dict()) when --update_old_actor_freq > 0
  engine_sync        with --extra "--rollout_engine vllm --engine_url URL": the weight push after the update (the
                     server must serve a model of the same shape; the bench pushes its weights before the first step)
With --parallel_update on (train_ppo's default for CPU bf16), the actor's and the critic's forward
overlap in time: each is its own thread's wall time, so the remainder update_backward is understated;
`update` itself is exact.
The same split is kept in process CPU seconds (`cpu_s`); the table's cpu/wall column is the noise
check: on a quiet machine it is close to the thread count, far below it the process waited for a core.

Update-phase FLOPs are analytic (documented in `forward_flops`): a forward costs 2 FLOP per
multiply-accumulate of every linear layer at every position, plus 4*T^2*head_dim*heads per layer per
row for attention (QK^T and AV, full square as the counters count it), plus the LM head only at the
R+1 kept positions; training = 3x forward (backward ~ 2x) for the actor (2x under LoRA: the frozen
base gets no weight gradients) and the critic (2x when its forward ran in scoring with --reuse_values,
the update then runs only its backward). The warm-up step is also counted with
torch.utils.flop_counter.FlopCounterMode (without --use_compile) as a check (`flops.counted`; at 64x2
its update equals the analytic figure within 0.01%; it counts no attention where it has no formula
for the kernel, nor the fast decoder's oneDNN bf16 linears (mkldnn._linear_pointwise: its decode
steps), and under --parallel_update nothing of the update, whose forwards run in other threads).
Achieved FLOP/s = update FLOPs / update time, as a share of this machine's torch.mm peak measured
in the same run (1024 and 2048 squares, before and after the configs, the better of the two) at the
same thread count and for the matching dtype (fp32 configs against the fp32 peak, bf16 against bf16).

Generation against the memory-bandwidth limit: a decode step multiplies every row by every weight
matrix of the layers and the LM head, so each generated token streams those weights once
(`generate_weight_mb_per_token`: layer matmul weights + head, in the compute dtype: 2 bytes under
bf16, as model/fast_decode.py casts them once per rollout, 4 in fp32). The limit is that x gen_len /
the machine's copy bandwidth (a large tensor copy, read + write bytes, measured in the same run
before and after the configs, the better of the two); `generate_bandwidth_share` = limit / measured
generate time (KV-cache and activation traffic are left out, so it is an upper bound on what
streaming explains). The summary prints it next to the update's share of the matmul peak, the
phase split in percent, and, given MiniMind's s/step measured in the same run for the same work
(`--minimind_s_per_step`), our speed-up against it for every config of that size (`--minimind_size`).

Floors per phase (`phase_floors`, JSON `floors`, the summary's "floors per phase" block): what each phase would take
if it ran only its matmuls at the dtype-matched peak, or only its compulsory memory traffic at the copy
bandwidth where that is the larger, both measured in the same run at the config's thread count:
  generate  prefill of the distinct prompts only (--batch_size rows: a GRPO group's prompt prefilled
            once), then gen_len - 1 decode steps of all rows, each max(FLOPs: every row through every
            layer matmul and the LM head, plus attention over the cached positions; bytes: the weights
            once, each distinct prompt's cached keys and values once and every row's decoded ones, in the
            compute dtype)
  score     the scoring forwards that ran (old policy only with an old-actor copy or --rollout_logprobs 0,
            reference, critic), every row prompt_len + gen_len long; reward model and the rest count 0
  update    the update FLOPs above
  step      the sum (the old-actor copy and an engine's weight push count 0)
Each phase prints measured / floor ("x floor"), and the phase furthest from its floor (by that ratio,
and by seconds above it where another phase loses more). Left out, so the floors sit below what any
implementation reaches: elementwise work (norms, rotary, activations, softmax, casts, AdamW),
sampling and activation traffic. Two things go the other
way: attention counts the full T x T square (a causal kernel may skip the masked half, ~3% of the
preset's forward FLOPs), and rows count as full (with `--prompts demo`, padding-free runs fewer tokens).

Memory: peak RSS (ru_maxrss of the child) is split into the process baseline after imports, the
parameter bytes of each model, gradients (actor + critic, fp32), AdamW state (2 fp32 tensors per
trained parameter) and the remainder (activations, allocator slack, temporaries). The budget line is
baseline + 4 fp32 model copies + 2 AdamW states (= 8 x fp32 actor bytes).

On a shared machine prefer `--num_threads 1` (two threads that must meet at every parallel region
stall whenever another process holds a core) and read `cpu_s` alongside the wall times.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from trainer.run.hardware import cpu_native_bf16
from trainer.run.timing import PhaseTimer

MB = 1024 * 1024
# MiniMind train_ppo.py, 512x8, same work, fp32, on another machine (an AMD EPYC): a fallback only. Scaling it by
# the fp32 matmul peak does not carry over between CPUs (docs/speed-and-memory.md, "Against MiniMind"), so compare
# against a same-machine figure (--minimind_s).
MINIMIND_REFERENCE_S = 5.9
TIME_KEYS = ("step", "generate", "score", "score_old", "score_ref", "score_critic", "score_reward", "score_other",
             "update", "update_actor_fwd", "update_critic_fwd", "update_optimizer", "update_backward", "sync_old",
             "engine_sync")
RESULT_KEYS = ("config", "ok", "error", "params", "time_s", "time_s_all", "cpu_s", "first_step_s", "build_s",
               "tokens_per_s_generate", "tokens_per_s_step", "flops", "update_tflops_per_s", "update_peak_share",
               "generate_weight_mb_per_token", "generate_bandwidth_limit_s", "generate_bandwidth_share",
               "step_shape", "floors", "phase_share", "minimind_ratio", "memory_mb")
TOP_KEYS = ("machine", "date", "matmul_peak_gflops", "memory_bandwidth_gbs", "settings", "results",
            "minimind_reference_s", "minimind_here_s")


# ------------------------------------------------------------------------------------ helpers
def parse_size(text: str) -> tuple[int, int]:
    """'512x8' -> (hidden 512, layers 8)."""
    try:
        h, l = text.lower().split("x")
        return int(h), int(l)
    except ValueError:
        raise SystemExit(f"error: --sizes entry {text!r} must look like HIDDENxLAYERS, e.g. 512x8") from None


def rss_now_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    """This process's peak RSS: /proc's VmHWM, which starts afresh at exec. Not ru_maxrss: Linux
    carries it across fork/vfork + exec, so a child would report the parent's peak (the bench's own
    512 MB bandwidth test) whenever that is larger than its own."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB; macOS: bytes (rough)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def matmul_peak(dtype: torch.dtype, sizes: tuple[int, ...] = (1024, 2048), reps: int = 8) -> dict[str, float]:
    """GFLOP/s of torch.mm on square matrices: median of `reps` timed calls per size; peak = best size."""
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        for _ in range(2):
            torch.mm(a, b)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t)
        out[str(n)] = 2 * n**3 / statistics.median(times) / 1e9
    out["peak"] = max(out.values())
    return out


def memory_bandwidth(mb: int = 512, reps: int = 5) -> float:
    """GB/s of a large fp32 tensor copy (bytes read + bytes written), median of `reps`: the rate a
    decode step can at best stream its weights at. `mb` well above the last-level cache."""
    src = torch.ones(mb * MB // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def _heads(cfg: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head width): the config's head_dim where it names one (Qwen3's may differ
    from hidden / heads), else hidden / heads."""
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return heads, kv, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


def layer_macs(cfg: Any) -> int:
    """Multiply-accumulates of one layer's linears for one position: q, k, v, o and the gated MLP (active experts
    only for MoE, the router ignored)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    heads, kv, hd = _heads(cfg)
    if getattr(cfg, "use_moe", False):
        I = I * getattr(cfg, "num_experts_per_tok", 1)
    return H * heads * hd + 2 * H * kv * hd + heads * hd * H + 3 * H * I


def forward_flops(cfg: Any, rows: int, seq: int, head_positions: int) -> float:
    """Analytic FLOPs of one forward: 2 x MACs of every linear at every position, attention
    QK^T + AV over the full T x T square, and the LM head on `head_positions` positions per row."""
    H, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    heads, _, hd = _heads(cfg)
    attn = 4 * heads * hd * seq * seq
    return rows * seq * L * 2 * layer_macs(cfg) + rows * L * attn + 2 * H * V * rows * head_positions


def shared_forward_flops(cfg: Any, prompts: int, rows: int, prompt_len: int, gen_len: int, head_positions: int) -> float:
    """forward_flops of `rows` rows whose `prompts` distinct prompts run once each (Packing.mask: a group's
    prompt, then its rows' responses): the linears at prompts x P + rows x R positions, attention over the
    prompt's P x P square once per prompt and each response's R x (P + R) rectangle, the head as forward_flops."""
    H, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    heads, _, hd = _heads(cfg)
    P, R = prompt_len, gen_len
    attn = 4 * heads * hd * (prompts * P * P + rows * R * (P + R))
    return (prompts * P + rows * R) * L * 2 * layer_macs(cfg) + L * attn + 2 * H * V * rows * head_positions


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one step computes, for its floors (`phase_floors`): the model's shape, the rows, and which forwards ran.
    The child fills it from the run it built (JSON: `step_shape`); the parent adds the peak and bandwidth."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rows: int  # sampled rows per step: --batch_size x --num_generations
    prompts: int  # distinct prompts (--batch_size): a group's prompt prefilled once
    prompt_len: int
    gen_len: int  # every row runs to it (EOS suppressed)
    itemsize: int  # bytes per weight and cached key/value in the compute dtype (2 under bf16, 4 in fp32)
    decode_weight_params: int  # what a decode step streams: layer matmuls + LM head
    score_old: bool = False  # a scoring forward of the old policy ran (a frozen old-actor copy, or --rollout_logprobs 0)
    score_ref: bool = True  # the reference's forward ran
    score_critic: bool = False  # the critic's forward ran in scoring (with --reuse_values its graph serves the update)
    update_actor_passes: int = 3  # forward multiples: forward + backward (~2x), 2 with LoRA (no weight grads of the base)
    update_critic_passes: int = 0  # 3, 2 when its forward ran in scoring (--reuse_values), 0 without a critic
    update_iters: int = 1  # --ppo_update_iters: epochs over the rows
    shared_prompts: bool = False  # scoring and update run a group's prompt once (padding-free, model.forward.shares_prompts)
    use_moe: bool = False
    num_experts_per_tok: int = 1


def phase_floors(s: StepShape, peak_gflops: float, bandwidth_gbs: float) -> dict[str, Any]:
    """Each phase's floor on this machine: its matmul FLOPs at the dtype-matched matmul peak, or its compulsory
    memory traffic at the copy bandwidth where that is the larger. Seconds, plus the FLOPs they came from.

    generate = prefill + decode. The prefill runs the distinct prompts only (`s.prompts`: with GRPO groups a
    prompt repeats num_generations times and a sampler can prefill it once), the LM head at the last position;
    it is max(FLOPs / peak, weights / bandwidth). Then gen_len - 1 decode steps (the first token comes from the
    prefill's logits), step t (1..gen_len-1) at max(compute, streaming): compute = every row through every layer
    matmul and the head (2 x rows x decode_weight_params) plus attention over the P + t cached positions;
    streaming = the weights once plus the cached keys and values at the copy bandwidth: each distinct prompt's once
    (a group's rows share them: model.fast_decode.SharedPrefix reads them once) and every row's own decoded ones.
    score = the scoring forwards that ran (old policy, reference: head at gen_len + 1 positions; critic: no head),
    every row P + gen_len long (`shared_prompts`: each distinct prompt once, shared_forward_flops); the reward
    model (negligible here) and the elementwise rest count 0.
    update = its forward multiples (`update_*_passes`) x the forwards x update_iters.
    step = generate + score + update (the old-actor copy and an engine push count 0)."""
    peak, bw = peak_gflops * 1e9, bandwidth_gbs * 1e9
    B, P, R, L = s.rows, s.prompt_len, s.gen_len, s.num_hidden_layers
    heads, kv, hd = _heads(s)
    weight_bytes = s.decode_weight_params * s.itemsize
    prefill_flops = forward_flops(s, s.prompts, P, 1)
    prefill_s = max(prefill_flops / peak, weight_bytes / bw)
    decode_flops = decode_bytes = 0.0
    decode_s = 0.0
    compute_bound = 0
    for t in range(1, R):
        flops = 2 * B * s.decode_weight_params + B * L * 4 * heads * hd * (P + t)
        nbytes = weight_bytes + L * 2 * kv * hd * (s.prompts * P + B * t) * s.itemsize
        decode_flops += flops
        decode_bytes += nbytes
        decode_s += max(flops / peak, nbytes / bw)
        compute_bound += flops / peak >= nbytes / bw
    seq = P + R
    if s.shared_prompts and s.prompts < B:
        policy_fwd, critic_fwd = (shared_forward_flops(s, s.prompts, B, P, R, R + 1),
                                  shared_forward_flops(s, s.prompts, B, P, R, 0))
    else:
        policy_fwd, critic_fwd = forward_flops(s, B, seq, R + 1), forward_flops(s, B, seq, 0)
    flops_of = {"generate_prefill": prefill_flops, "generate_decode": decode_flops,
                "score_old": policy_fwd if s.score_old else 0.0, "score_ref": policy_fwd if s.score_ref else 0.0,
                "score_critic": critic_fwd if s.score_critic else 0.0,
                "update": (s.update_actor_passes * policy_fwd + s.update_critic_passes * critic_fwd) * s.update_iters}
    floor = {"generate_prefill": prefill_s, "generate_decode": decode_s, "generate": prefill_s + decode_s,
             **{k: flops_of[k] / peak for k in ("score_old", "score_ref", "score_critic", "update")}}
    floor["score"] = floor["score_old"] + floor["score_ref"] + floor["score_critic"]
    floor["step"] = floor["generate"] + floor["score"] + floor["update"]
    return {"peak_gflops": peak_gflops, "bandwidth_gbs": bandwidth_gbs, "floor_s": floor, "flops": flops_of,
            "decode_bytes": decode_bytes, "decode_steps": R - 1, "decode_compute_bound_steps": compute_bound}


FLOOR_PHASES = ("generate", "score", "update")  # the step's three phases, each against its floor
FLOOR_KEYS = ("generate", "generate_prefill", "generate_decode", "score", "score_old", "score_ref", "score_critic",
              "update", "step")


def floors_against(floors: dict[str, Any], time_s: dict[str, float]) -> dict[str, Any]:
    """`phase_floors`' figures with the measured phase times: measured s, and measured / floor ("x floor") for every
    phase with a floor above 0; `furthest`: of generate, score and update, the one with the largest x floor and the
    one with the most seconds above its floor."""
    floor = floors["floor_s"]
    measured = {k: time_s[k] for k in FLOOR_KEYS if k in time_s}
    x = {k: measured[k] / floor[k] for k in measured if floor.get(k, 0) > 0}
    main = [k for k in FLOOR_PHASES if k in x]
    furthest = {"by_ratio": max(main, key=lambda k: x[k]) if main else None,
                "by_seconds": max(main, key=lambda k: measured[k] - floor[k]) if main else None}
    return {**floors, "measured_s": measured, "x_floor": x, "furthest": furthest}


# ------------------------------------------------------------------------------------ child
def now() -> tuple[float, float]:
    """(wall, process CPU) seconds. CPU time is the noise check on a shared machine: with N threads
    on a quiet machine cpu ~ N x wall; much less means the process waited for a core."""
    return time.perf_counter(), time.process_time()


class BenchTimer(PhaseTimer):
    """The trainer's phase timer (wall seconds per phase), plus process CPU seconds and, on the
    warm-up step, FLOPs of the phases that do not nest another counted one."""

    FLOP_PHASES = ("generate", "score_old", "score_ref", "score_critic", "score_reward", "update")

    def __init__(self, count_flops: bool = False, cuda_devices: Iterable[torch.device] = ()) -> None:
        super().__init__(cuda_devices)
        self.cpu: dict[str, float] = {}
        self.flops: dict[str, float] = {}
        self.count_flops = count_flops

    @contextlib.contextmanager
    def __call__(self, name: str):
        counter = None
        if self.count_flops and name in self.FLOP_PHASES:
            from torch.utils.flop_counter import FlopCounterMode

            counter = FlopCounterMode(display=False)
        self._sync()  # on a GPU every phase, sub-phases too, starts and ends with its kernels done (the split needs it)
        start = now()
        try:
            with counter or contextlib.nullcontext():
                yield
        finally:
            self._sync()
            end = now()
            self.add(name, end[0] - start[0])
            with self._lock:
                self.cpu[name] = self.cpu.get(name, 0.0) + end[1] - start[1]
            if counter is not None:
                self.flops[name] = self.flops.get(name, 0.0) + counter.get_total_flops()


def split_step(acc: dict[str, float]) -> dict[str, float]:
    """One step's TIME_KEYS from a timer's per-phase sums (wall or CPU seconds)."""
    rec = {k: acc.get(k, 0.0) for k in TIME_KEYS}
    rec["score"] = rec["step"] - rec["sync_old"] - rec["generate"] - rec["update"] - rec["engine_sync"]  # the rest of make_experience
    rec["score_other"] = rec["score"] - rec["score_old"] - rec["score_ref"] - rec["score_critic"] - rec["score_reward"]
    rec["update_backward"] = rec["update"] - rec["update_actor_fwd"] - rec["update_critic_fwd"] - rec["update_optimizer"]
    return rec


def make_batch(tok: Any, batch_size: int, prompt_len: int, kind: str, seed: int) -> dict:
    """A prompt batch of exactly `prompt_len` columns in collate_left_pad's format."""
    from dataset.rlaif import RLAIFDataset, collate_left_pad, read_rlaif_jsonl

    if kind == "random":
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, len(tok), (batch_size, prompt_len), generator=g)
        texts = [tok.decode(r.tolist()) for r in ids]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "prompt": texts,
                "messages": [[{"role": "user", "content": t}] for t in texts], "reference": [None] * batch_size,
                "assistant_prefix": [""] * batch_size, "index": list(range(batch_size)), "num_truncated": [0] * batch_size}
    records, _ = read_rlaif_jsonl(ROOT / "dataset" / "demo_train.jsonl")
    ds = RLAIFDataset(records, tok, max_prompt_len=prompt_len, seed=seed)
    batch = collate_left_pad([ds[i] for i in range(batch_size)], pad_id=tok.pad_token_id)
    extra = prompt_len - batch["input_ids"].shape[1]
    if extra > 0:  # pad every row further on the left: exactly prompt_len columns
        batch["input_ids"] = torch.cat([torch.full((batch_size, extra), tok.pad_token_id), batch["input_ids"]], 1)
        batch["attention_mask"] = torch.cat([torch.zeros(batch_size, extra, dtype=torch.long), batch["attention_mask"]], 1)
    return batch


def make_tiny_rm(path: Path, vocab: int, pad_id: int) -> None:
    """A 1-layer hidden-32 sequence classifier: stands in for a negligible reward model."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from model.loader import load_tokenizer

    torch.manual_seed(0)
    rm = Qwen3ForSequenceClassification(Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_labels=1, pad_token_id=pad_id, tie_word_embeddings=True))
    rm.save_pretrained(path)
    load_tokenizer().save_pretrained(path)


class ConfigRun:
    """One configuration's run: built by the trainer's own set-up, stepped by `step`, summarised by
    `result`. A fresh process holds one (run_config), or several stepped in turn (--interleave)."""

    def __init__(self, cfg: dict) -> None:
        import train_ppo as T
        from model.loader import load_tokenizer
        from trainer.dist import DistInfo
        from trainer.run.distributed import resolve_device
        from trainer.run.setup import setup

        load_tokenizer()
        self.rss_base = rss_now_mb()  # torch + transformers + project imported, tokenizer loaded, no model yet
        hidden, layers = cfg["hidden"], cfg["layers"]
        model = (["--actor_path", cfg["actor_path"]] if cfg.get("actor_path") else
                 ["--hidden_size", str(hidden), "--num_hidden_layers", str(layers), "--from_weight", "none"])
        if cfg.get("vocab_size"):  # a random MiniMind of that vocabulary, read as --from_weight (which sets the vocab)
            self._weights = tempfile.TemporaryDirectory()
            from model.loader import build_minimind

            torch.manual_seed(cfg["seed"])
            torch.save(build_minimind(hidden, layers, vocab_size=cfg["vocab_size"]).state_dict(),
                       Path(self._weights.name) / f"bench_{hidden}.pth")
            model = ["--hidden_size", str(hidden), "--num_hidden_layers", str(layers), "--save_dir", self._weights.name,
                     "--from_weight", "bench"]
        argv = [*model, "--batch_size", str(cfg["batch_size"]), "--mini_batch_size", str(cfg["batch_size"]),
                "--ppo_update_iters", "1", "--max_gen_len", str(cfg["gen_len"]), "--max_seq_len", str(cfg["prompt_len"]),
                "--dtype", cfg["dtype"], "--update_old_actor_freq", str(cfg["update_old_actor_freq"]),
                "--frozen_low_precision", str(cfg["frozen_low_precision"]), "--use_compile", str(cfg["use_compile"]),
                "--num_threads", str(cfg["num_threads"]), "--parallel_update", str(cfg.get("parallel_update", -1)),
                "--suppress_eos", "1", "--seed", str(cfg["seed"]),
                "--warmup_steps", "0", "--max_steps", str(cfg["warmup"] + cfg["steps"] + 1),
                "--rm_weight", "0.5" if cfg["reward_model"] else "0", "--lora_r", str(cfg.get("lora_r", 0)),
                "--reward_model_path", cfg["reward_model"] or "none", "--device", cfg.get("device", "cpu"),
                # 0: the two-pass path the trainer takes with more than one minibatch
                "--reuse_values", "-1" if cfg.get("reuse_values", 1) else "0", "--strategy", cfg.get("strategy", "ddp"),
                "--padding_free", str(cfg.get("padding_free", 1)), *cfg.get("extra_args", [])]
        self.T, self.cfg = T, cfg
        raw = T.parse_args(argv)
        # ---- the run, built by the trainer's own set-up (models, optimizers, precision, compile)
        t_build = time.perf_counter()
        # Under torchrun (--procs N): the process group from its environment, as train_ppo.py builds it.
        self.built = setup(raw, None if int(os.environ.get("WORLD_SIZE", "1")) > 1 else DistInfo(device=resolve_device(raw.device)))
        self.args = args = self.built.cfg  # resolved
        self.build_s = time.perf_counter() - t_build
        self.rss_models = rss_now_mb()
        if os.environ.get("BENCH_BUILT_DIR"):  # tells the parent's NodeRSS this rank's build is over
            Path(os.environ["BENCH_BUILT_DIR"], f"built.{os.environ.get('RANK', '0')}").touch()
        if self.args.rollout_engine != "torch":  # --extra "--rollout_engine vllm --engine_url URL": as main() starts it
            from trainer.run.engine_sync import start_engine

            print(start_engine(self.args, self.built.models, self.built.runtime, 0), file=sys.stderr)
        self.batch = make_batch(self.built.models.tok, args.batch_size, cfg["prompt_len"], cfg["prompts"], args.seed)
        self.per_step: list[dict[str, float]] = []
        self.per_step_cpu: list[dict[str, float]] = []
        self.first_step_s = float("nan")
        self.flops_counted: dict[str, float] = {}
        self.flops_unavailable: str | None = None  # why FlopCounterMode counted nothing
        self.phases_run: set[str] = set()  # every phase a step timed: which scoring forwards ran
        self.error: str | None = None

    def step(self, step: int) -> None:
        """train_ppo.main's loop body, with a timer that also counts CPU time and FLOPs."""
        if self.error is not None:
            return
        T, cfg, args, b = self.T, self.cfg, self.args, self.built
        s, m, opt, kl_ctl = b.runtime, b.models, b.optim, b.kl_ctl
        from model import logprobs

        logprobs.CHUNK_SIZE = cfg.get("logprob_chunk_size", -1)  # the log-prob path of this config (0: plain logits)
        try:
            counting = (step == 0 < cfg["warmup"] and cfg["count_flops"] and not args.use_compile
                        and self.flops_unavailable is None)
            timer = BenchTimer(count_flops=counting, cuda_devices=s.cuda_devices)
            from trainer.run.phases import phases

            phase = phases(timer, s)
            with timer("step"):
                with timer("sync_old"):
                    if m.old_actor is not None and step % args.update_old_actor_freq == 0:
                        m.old_actor.load_state_dict(m.actor.state_dict())
                exp = T.make_experience(args, self.batch, m, s, kl_ctl.value, {}, phase)
                with timer("update"):
                    T.ppo_update(args, exp.rollout, m, opt, step, s, kl_ctl.value, phase)
                if m.engine is not None:  # the engine samples the updated policy next (train_ppo.main's push)
                    from trainer.run.engine_sync import push_weights

                    with timer("engine_sync"):
                        push_weights(args, m, s, version=step + 1)
            ro = exp.rollout
            if counting:
                self.flops_counted = dict(timer.flops)
            if ro.sequences.shape[1] != cfg["prompt_len"] + cfg["gen_len"]:
                raise RuntimeError(f"response length {ro.response_len} != --gen_len {cfg['gen_len']} (EOS not suppressed?)")
            recs = split_step(timer.wall), split_step(timer.cpu)
            self.phases_run |= set(timer.wall)
            if step == 0:
                self.first_step_s = recs[0]["step"]
            if step >= cfg["warmup"]:
                self.per_step.append(recs[0])
                self.per_step_cpu.append(recs[1])
        except AssertionError as e:
            if not (counting and "flop" in str(e)):
                self.error = f"AssertionError: {str(e).splitlines()[0] if str(e) else ''}"
                return
            # FlopCounterMode's own formula refused a kernel's shapes (torch 2.11's SDPA counter and grouped-query
            # attention on CUDA, seen on an H200): the counted check is dropped, the warm-up step runs again uncounted.
            self.flops_unavailable = str(e).splitlines()[0]
            self.step(step)
        except Exception as e:  # noqa: BLE001 - reported in the table, the other configs still run
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def result(self) -> dict:
        """The result dict (RESULT_KEYS)."""
        cfg, args, built, error = self.cfg, self.args, self.built, self.error
        per_step, per_step_cpu, flops_counted = self.per_step, self.per_step_cpu, self.flops_counted
        first_step_s, build_s, rss_base, rss_models = self.first_step_s, self.build_s, self.rss_base, self.rss_models
        m = built.models
        actor, critic, ref, old_actor, rm_scorer, optims = m.actor, m.critic, m.ref, m.old_actor, m.rm_scorer, built.optim.optims
        # ---- figures
        from model.forward import shares_prompts
        from trainer.dist import local  # this rank's part of a sharded (--strategy fsdp2) tensor

        def nparams(m):
            return sum(p.numel() for p in m.parameters()) if m is not None else 0

        def pbytes(m):
            return sum(local(p).numel() * p.element_size() for p in m.parameters()) if m is not None else 0

        params = {"actor": nparams(actor), "critic": nparams(critic), "ref": nparams(ref), "old_actor": nparams(old_actor),
                  "reward_model": nparams(rm_scorer.model) if rm_scorer is not None and hasattr(rm_scorer, "model") else 0}
        adam_bytes = sum(local(t).numel() * t.element_size() for o in optims.values() for s in o.state.values()
                         for t in s.values() if isinstance(t, torch.Tensor))
        grad_bytes = sum(local(p).numel() * 4 for m in (actor, critic) if m is not None for p in m.parameters() if p.requires_grad)
        param_mb = {"actor": pbytes(actor) / MB, "critic": pbytes(critic) / MB, "ref": pbytes(ref) / MB,
                    "old_actor": pbytes(old_actor) / MB,
                    "reward_model": pbytes(rm_scorer.model) / MB if rm_scorer is not None and hasattr(rm_scorer, "model") else 0.0}
        peak = peak_rss_mb()
        fp32_copy_mb = params["actor"] * 4 / MB
        accounted = rss_base + sum(param_mb.values()) + grad_bytes / MB + adam_bytes / MB
        memory = {
            "peak_rss": peak, "baseline_imports": rss_base, "after_models": rss_models, "params": param_mb,
            "grads": grad_bytes / MB, "adamw": adam_bytes / MB, "activations_other": peak - accounted,
            "fp32_model_copy": fp32_copy_mb, "budget_4_copies_2_adamw": rss_base + 8 * fp32_copy_mb,
        }
        memory["within_budget"] = bool(peak <= memory["budget_4_copies_2_adamw"])
        # What this rank holds of the trained models: parameters, fp32 gradients and AdamW state (1/world under fsdp2).
        memory["trained_state"] = (param_mb["actor"] + param_mb["critic"]) + grad_bytes / MB + adam_bytes / MB
        dev = built.runtime.device  # on a GPU: the most its allocator handed out at once, builds and steps together
        memory["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(dev) / MB if dev.type == "cuda" else None
        memory["cuda_peak_reserved"] = torch.cuda.max_memory_reserved(dev) / MB if dev.type == "cuda" else None

        med = {k: statistics.median(r[k] for r in per_step) for k in TIME_KEYS} if per_step else {}
        B, P, R = args.batch_size * args.num_generations, cfg["prompt_len"], cfg["gen_len"]  # rows
        mcfg = getattr(actor.config, "text_config", None) or actor.config
        from trainer.run.hardware import layer_matmul_params
        from trainer.runtime import DTYPES

        heads, kv, hd = _heads(mcfg)
        # Weights one decode step streams: every layer matmul and the LM head, in the compute dtype.
        decode_params = layer_matmul_params(mcfg) + mcfg.vocab_size * mcfg.hidden_size
        itemsize = DTYPES[built.cfg.dtype].itemsize
        weight_mb = decode_params * itemsize / MB
        # The forwards the step ran, read off the phases it timed: the old policy's scoring forward runs only with a
        # frozen old-actor copy or --rollout_logprobs 0 (else the sampler's log-probs serve); the critic's, with
        # --reuse_values, carries its graph into the update, which then runs only its backward.
        ran = self.phases_run
        shape = StepShape(
            hidden_size=mcfg.hidden_size, num_hidden_layers=mcfg.num_hidden_layers, intermediate_size=mcfg.intermediate_size,
            vocab_size=mcfg.vocab_size, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
            rows=B, prompts=args.batch_size, prompt_len=P, gen_len=R, itemsize=itemsize, decode_weight_params=decode_params,
            score_old="score_old" in ran, score_ref="score_ref" in ran, score_critic="score_critic" in ran,
            update_actor_passes=2 if args.lora_r > 0 else 3,
            update_critic_passes=0 if critic is None else 2 if args.reuse_values else 3,
            update_iters=args.ppo_update_iters,
            shared_prompts=bool(args.padding_free) and args.batch_size < B and shares_prompts(actor) is not None,
            use_moe=bool(getattr(mcfg, "use_moe", False)), num_experts_per_tok=int(getattr(mcfg, "num_experts_per_tok", 1) or 1))
        analytic = phase_floors(shape, 1.0, 1.0)["flops"]  # the floors' FLOPs: what the step ran, phase by phase
        # What the sampler runs: a prefill of each distinct prompt, then gen_len - 1 decode steps over the cache.
        gen = analytic["generate_prefill"] + analytic["generate_decode"]
        flops = {
            "update_analytic": analytic["update"],  # actor 3x (2x under LoRA), critic 3x, 2x when its forward ran in scoring
            "score_analytic": analytic["score_old"] + analytic["score_ref"] + analytic["score_critic"],  # the forwards that ran
            "generate_analytic": gen,
            "counted": flops_counted,  # FlopCounterMode on the warm-up step (matmuls + SDPA); {} when compiled
            "counted_unavailable": self.flops_unavailable,  # torch's counter refused a kernel: why
        }
        flops["step_analytic"] = flops["update_analytic"] + flops["score_analytic"] + gen
        upd_rate = flops["update_analytic"] / med["update"] / 1e12 if med else float("nan")
        return {
            "config": cfg, "ok": error is None and bool(per_step), "error": error, "params": params,
            "time_s": med, "time_s_all": {k: [r[k] for r in per_step] for k in TIME_KEYS},
            "cpu_s": ({k: statistics.median(r[k] for r in per_step_cpu) for k in TIME_KEYS} if per_step_cpu else {}),
            "first_step_s": first_step_s, "build_s": build_s,
            "tokens_per_s_generate": B * R / med["generate"] if med else float("nan"),
            "tokens_per_s_step": B * R / med["step"] if med else float("nan"),
            "flops": flops, "update_tflops_per_s": upd_rate, "update_peak_share": None,  # filled by the parent
            "generate_weight_mb_per_token": weight_mb, "generate_bandwidth_limit_s": None, "generate_bandwidth_share": None,
            "step_shape": dataclasses.asdict(shape), "floors": None,  # floors: filled by the parent (CPU configs)
            # Shares of the summed step time (medians of the phases would not add up to the step's).
            "phase_share": ({k: sum(r[k] for r in per_step) / sum(r["step"] for r in per_step)
                             for k in ("generate", "score", "update", "sync_old", "engine_sync")} if per_step else {}),
            "minimind_ratio": None,
            "memory_mb": memory,
        }




def run_config(cfg: dict) -> dict:
    """One configuration, in this (fresh) process, or this rank's part of it under torchrun (--procs). Returns the
    result dict (RESULT_KEYS)."""
    run = ConfigRun(cfg)
    for step in range(cfg["warmup"] + cfg["steps"]):
        run.step(step)
    result = run.result()
    if run.built.runtime.info.enabled:  # every rank's result, then leave together (the trainer's own way out)
        from trainer import dist as D
        from trainer.run import distributed

        info = run.built.runtime.info
        result["rank"] = info.rank
        result["per_rank"] = D.all_gather_objects({"trained_state": result["memory_mb"]["trained_state"],
                                                   "peak_rss": result["memory_mb"]["peak_rss"], "error": result["error"]}, info)
        distributed.cleanup(info)
    return result


def run_interleaved(cfgs: list[dict]) -> list[dict]:
    """Several configurations in this one process, their steps taken in turn (A B A B ...): an A/B
    comparison that sees the same machine on a shared host. Peak RSS is then the process's, all
    configurations together."""
    runs = [ConfigRun(c) for c in cfgs]
    for step in range(max(c["warmup"] + c["steps"] for c in cfgs)):
        for r in runs:
            if step < r.cfg["warmup"] + r.cfg["steps"]:
                r.step(step)
    return [{**r.result(), "interleaved_with": [c["dtype"] for c in cfgs]} for r in runs]


# ------------------------------------------------------------------------------------ parent
def _die_with_parent() -> None:
    """Linux: a config's process ends with the bench (no orphan hogging a shared machine)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark minippo PPO steps (the real trainer code path)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--sizes", default=None, help="comma list of HIDDENxLAYERS (default 128x4,512x8; --quick: 128x4)")
    a("--actor_path", default=None,
      help="a local HF causal-LM directory (e.g. out/smollm2_135m_instruct), benchmarked with its own weights instead of --sizes")
    a("--dtypes", default=None, help="comma list of float32,bfloat16 (default both; --quick: bfloat16)")
    a("--update_old_actor_freq", default=None,
      help="comma list of old-actor modes: 0 = no copy, N = frozen copy refreshed every N steps (default 0,1; --quick: 0)")
    a("--frozen_low_precision", default="1", help="comma list of 0/1: reference/old actor/RM held in --dtype")
    a("--use_compile", default="0", help="comma list of 0/1: torch.compile the training forward (actor_train, critic_train)")
    a("--num_threads", default="0", help="comma list of torch thread counts (0 = torch default)")
    a("--parallel_update", default="-1",
      help="comma list of -1/0/1: actor and critic update side by side on one core each (-1 = train_ppo's auto)")
    a("--reuse_values", default="1",
      help="comma list of 1/0: with one epoch of one minibatch (the bench's shape) the critic's scoring forward is the "
           "update's (1, the trainer's rule) or the update runs its own (0)")
    a("--padding_free", default="1", help="comma list of 0/1: score and update on rows packed without pad tokens")
    a("--vocab_size", type=int, default=0,
      help="with --sizes: the models' vocabulary (0 = the tokenizer's 6,400; 151936 = Qwen2.5's). Ids past the "
           "tokenizer's decode to nothing: use --reward_model none")
    a("--logprob_chunk_size", default="-1",
      help="comma list: tokens per chunk of model/logprobs.py's log-prob path (-1 = its default, 0 = the plain "
           "[rows, tokens, vocab] logits path)")
    a("--lora_r", default="0", help="comma list of LoRA ranks of the actor (0 = full fine-tuning; --extra sets --lora_alpha etc.)")
    a("--procs", type=int, default=1,
      help="processes per config: > 1 runs each config under torchrun (gloo on CPU, NCCL on GPUs), every rank the same "
           "batch, and reports what each rank holds of the trained models and its peak RSS")
    a("--strategy", default="ddp", help="comma list of ddp,fsdp2 (train_ppo's --strategy; with --procs > 1)")
    a("--batch_size", type=int, default=8)
    a("--prompt_len", type=int, default=64)
    a("--gen_len", type=int, default=64)
    a("--prompts", default="random", choices=["random", "demo"], help="random ids, or demo prompts left-padded to --prompt_len")
    a("--reward_model", default="tiny", choices=["tiny", "none"], help="a negligible 1-layer RM, or no RM (rm_weight 0)")
    a("--steps", type=int, default=None, help="timed steps per config (default 5; --quick: 2)")
    a("--warmup", type=int, default=1, help="untimed steps first (the first also counts FLOPs)")
    a("--count_flops", type=int, default=1, choices=[0, 1], help="FlopCounterMode on the warm-up step")
    a("--seed", type=int, default=42)
    a("--timeout", type=int, default=900, help="seconds per config")
    a("--quick", action="store_true", help="smoke run: one small config, 2 steps")
    a("--interleave", type=int, default=0, choices=[0, 1],
      help="1 = all configs of one size (and thread count) in one process, their steps taken in turn: A/B "
           "comparisons on a shared machine see the same load (peak RSS is then the group's)")
    a("--json", default=None, help="write all results to this file")
    a("--minimind_s_per_step", "--minimind_s", dest="minimind_s", type=float, default=None,
      help="MiniMind's train_ppo.py median s/step for the same work, measured on this machine in the same run "
           "(interleaved with this bench; README: how); the summary prints our speed-up against it")
    a("--minimind_size", default="512x8", help="the HIDDENxLAYERS MiniMind's figure was measured at")
    a("--device", default="cpu",
      help="cpu, cuda or cuda:N: where every config runs (benchmarks/gpu_check.py runs it on cuda). On a GPU the summary "
           "adds peak allocated CUDA memory and leaves out the matmul-peak and bandwidth shares, which are the CPU's")
    a("--extra", default="", help="extra train_ppo flags for every config, e.g. \"--temperature 1.0\"")
    a("--_child", default=None, help=argparse.SUPPRESS)
    return p


def expand_configs(o: argparse.Namespace) -> list[dict]:
    if o.actor_path and o.sizes:
        raise SystemExit("error: give --sizes (MiniMind models of those shapes) or --actor_path (one HF model), not both")
    if o.vocab_size and (o.actor_path or o.reward_model != "none"):
        raise SystemExit("error: --vocab_size needs --sizes and --reward_model none (the tiny RM reads the tokenizer's ids)")
    sizes = [(0, 0)] if o.actor_path else [parse_size(s) for s in (o.sizes or ("128x4" if o.quick else "128x4,512x8")).split(",")]

    def ints(s):
        return [int(x) for x in str(s).split(",")]

    dtypes = (o.dtypes or ("bfloat16" if o.quick else "float32,bfloat16")).split(",")
    for d in dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            raise SystemExit(f"error: --dtypes entry {d!r}: use float32, bfloat16 or float16")
    old_modes = ints(o.update_old_actor_freq or ("0" if o.quick else "0,1"))
    steps = o.steps if o.steps is not None else (2 if o.quick else 5)
    if steps < 1 or o.warmup < 0:
        raise SystemExit("error: --steps must be >= 1 and --warmup >= 0")
    # Every comma list expands the matrix (the last list varies fastest).
    strategies = o.strategy.split(",")
    if any(x not in ("ddp", "fsdp2") for x in strategies):
        raise SystemExit(f"error: --strategy {o.strategy}: a comma list of ddp, fsdp2")
    if o.procs < 1 or (o.procs > 1 and o.interleave):
        raise SystemExit("error: --procs must be >= 1, and --interleave 1 needs --procs 1 (one torchrun per config)")
    matrix = itertools.product(sizes, ints(o.num_threads), ints(o.use_compile), ints(o.frozen_low_precision),
                               dtypes, old_modes, ints(o.parallel_update), ints(o.lora_r), ints(o.reuse_values), strategies,
                               ints(o.padding_free), ints(o.logprob_chunk_size))
    return [{
        "name": Path(o.actor_path).name if o.actor_path else f"{h}x{l}" + (f"v{o.vocab_size}" if o.vocab_size else ""),
        "hidden": h, "vocab_size": o.vocab_size, "logprob_chunk_size": lpc, "layers": l, "actor_path": o.actor_path,
        "dtype": d, "update_old_actor_freq": old,
        "frozen_low_precision": flp, "use_compile": comp, "num_threads": threads, "parallel_update": par,
        "batch_size": o.batch_size, "prompt_len": o.prompt_len, "gen_len": o.gen_len,
        "prompts": o.prompts, "steps": steps, "warmup": o.warmup, "count_flops": o.count_flops,
        "seed": o.seed, "reward_model": None, "extra_args": o.extra.split() if o.extra else [], "lora_r": lora,
        "reuse_values": reuse, "device": o.device, "strategy": strategy, "procs": o.procs, "padding_free": pf,
    } for (h, l), threads, comp, flp, d, old, par, lora, reuse, strategy, pf, lpc in matrix]


def run_child(cfgs: list[dict], timeout: int) -> list[dict]:
    """The configurations in one fresh process (one, or several interleaved): their results."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT), BENCH_BUILT_DIR=d)
        out = Path(d) / "result.json"
        job = ["--_child", json.dumps({"cfgs": cfgs, "out": str(out)})]
        procs = cfgs[0].get("procs", 1)
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port",
                     str(_free_port())] if procs > 1 else [sys.executable])
        cmd = [*launcher, str(Path(__file__).resolve()), *job]
        with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
            node = NodeRSS(proc.pid, Path(d), procs) if procs > 1 else None  # the ranks' RSS summed: the node's host memory
            try:
                _, stderr = proc.communicate(timeout=timeout * len(cfgs))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                return [{"config": c, "ok": False, "error": f"timeout after {timeout * len(cfgs)} s"} for c in cfgs]
            finally:
                node_peaks = node.stop() if node is not None else (None, None)
        if proc.returncode != 0 or not out.exists():
            tail = (stderr.strip().splitlines() or ["(no output)"])[-1]
            return [{"config": c, "ok": False, "error": f"exit {proc.returncode}: {tail}"} for c in cfgs]
        results = json.loads(out.read_text())
        for r in results:
            r["node_peak_rss_mb"], r["node_build_peak_rss_mb"] = node_peaks
        return results


class NodeRSS:
    """The peak of the summed RSS of a process tree (torchrun and its ranks), sampled every 20 ms in a thread: what
    one node's host memory holds at once. Each rank's own peak (VmHWM) cannot say this: ranks that peak at different
    times (the fsdp2 build in turns) add up to less than their peaks' sum. The build's peak is the one before every
    rank has written `built.<rank>` into `built_dir`."""

    def __init__(self, pid: int, built_dir: Path, ranks: int, every_s: float = 0.02) -> None:
        import threading

        self.pid, self.built_dir, self.ranks, self.every_s = pid, built_dir, ranks, every_s
        self.peak_mb = self.build_peak_mb = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        pids, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{pid}/task"):
                    todo += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        return pids

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            total = 0.0
            for pid in self._tree():
                with contextlib.suppress(OSError):
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1]) / 1024
            self.peak_mb = max(self.peak_mb, total)
            if len(list(self.built_dir.glob("built.*"))) < self.ranks:
                self.build_peak_mb = max(self.build_peak_mb, total)

    def stop(self) -> tuple[float, float]:
        """(the peak over the whole run, the peak while the ranks built their models), MB."""
        self._done.set()
        self._thread.join()
        return self.peak_mb, self.build_peak_mb


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_groups(cfgs: list[dict], interleave: bool) -> list[list[dict]]:
    """One config per process, or with --interleave every config of one size and thread count in one
    process (their steps alternate), in the matrix's order."""
    if not interleave:
        return [[c] for c in cfgs]
    groups: dict[tuple, list[dict]] = {}
    for c in cfgs:
        groups.setdefault((c["name"], c["num_threads"]), []).append(c)
    return list(groups.values())


def fmt_row(r: dict) -> str:
    c = r["config"]
    label = (f"{c['name']:>6} {c['dtype'][:4]:>4} old={c['update_old_actor_freq']} flp={c['frozen_low_precision']} "
             f"cmp={c['use_compile']} thr={c['num_threads'] or 'def'} par={c.get('parallel_update', -1)} lora={c.get('lora_r', 0)}"
             f"{'' if c.get('reuse_values', 1) else ' 2pass'}{'' if c.get('padding_free', 1) else ' padded'}"
             f"{'' if c.get('logprob_chunk_size', -1) == -1 else ' lpc=' + str(c['logprob_chunk_size'])}"
             f"{' ' + c.get('strategy', 'ddp') + 'x' + str(c['procs']) if c.get('procs', 1) > 1 else ''}")
    if not r.get("ok"):
        return f"{label} | FAILED: {r.get('error')}"
    t, m = r["time_s"], r["memory_mb"]
    score_parts = f"{t['score_old']:.2f}/{t['score_ref']:.2f}/{t['score_critic']:.2f}/{t['score_reward']:.2f}"
    share = r.get("update_peak_share")
    return (f"{label} | {t['step']:6.2f} {t['generate']:6.2f} {t['score']:6.2f} ({score_parts}) {t['update']:6.2f} "
            f"{t['sync_old']:5.2f} | {r['tokens_per_s_generate']:6.0f} | {r['update_tflops_per_s'] * 1000:6.1f} "
            f"{(share or float('nan')) * 100:5.1f}% | {m['peak_rss']:6.0f} {m['budget_4_copies_2_adamw']:6.0f} | "
            f"{r['cpu_s']['step'] / t['step']:4.2f}")


def summary_line(r: dict, o: argparse.Namespace) -> str:
    """One config's phase split, bandwidth and matmul shares, and the MiniMind ratio when given."""
    c, t, ps = r["config"], r["time_s"], r["phase_share"]
    line = (f"{c['name']} {c['dtype']} old={c['update_old_actor_freq']} cmp={c['use_compile']} "
            f"threads={c['num_threads'] or 'def'}: {t['step']:.2f} s/step; of the summed steps generate {ps['generate']:.0%} + "
            f"score {ps['score']:.0%} + update {ps['update']:.0%}"
            + (f" + sync {ps['sync_old']:.0%}" if ps["sync_old"] >= 0.005 else "")
            + (f" + engine weight push {ps['engine_sync']:.0%} ({t['engine_sync']:.2f} s)" if t.get("engine_sync") else ""))
    if r.get("generate_bandwidth_share") is not None:  # CPU configs: against the CPU's measured limits
        line += (f"; generate {t['generate']:.2f} s = {r['generate_bandwidth_share']:.1%} bandwidth-bound "
                 f"({r['generate_weight_mb_per_token']:.0f} MB/token x {c['gen_len']} tokens at "
                 f"{r['generate_weight_mb_per_token'] * c['gen_len'] / 1024 / r['generate_bandwidth_limit_s']:.1f} GB/s "
                 f"= {r['generate_bandwidth_limit_s']:.2f} s); update {t['update']:.2f} s at "
                 f"{r['update_peak_share']:.0%} of the {c['dtype']} matmul peak")
    if r.get("floors"):  # CPU configs: the phases against their floors (the floors block below: how they count)
        x = r["floors"]["x_floor"]
        line += ("; x floor: " + ", ".join(f"{k} {x[k]:.1f}" for k in FLOOR_PHASES if k in x)
                 + f" (step {r['floors']['floor_s']['step']:.3g} s floor, {x['step']:.1f}x)")
    if r["memory_mb"].get("cuda_peak_allocated") is not None:
        line += f"; peak allocated {r['memory_mb']['cuda_peak_allocated']:.0f} MB on {c['device']}"
    if r.get("minimind_ratio"):
        line += f"; {r['minimind_ratio']:.2f}x MiniMind's {o.minimind_s} s/step (same run, --minimind_s_per_step)"
    elif c["name"] == "512x8" and c.get("device", "cpu") == "cpu":  # a CPU figure
        line += f"; {MINIMIND_REFERENCE_S / t['step']:.2f}x MiniMind's {MINIMIND_REFERENCE_S} s/step on another machine"
    return line


def floor_line(r: dict) -> str:
    """One config's phases against their floors (`phase_floors`, `floors_against`)."""
    c, f = r["config"], r["floors"]
    m, fl, x = f["measured_s"], f["floor_s"], f["x_floor"]

    def g(v):  # 3 figures: a tiny model's floors are milliseconds
        return f"{v:.3g}"

    def part(k):
        return f"{g(m[k])} / {g(fl[k])} s = {x[k]:.1f}x" if k in x else f"{g(m[k])} s, floor 0"

    shape = r["step_shape"]
    steps, bound = f["decode_steps"], f["decode_compute_bound_steps"]
    kind = ("compute-bound" if bound == steps else "bandwidth-bound" if bound == 0
            else f"{bound} of them compute-bound")
    subs = [f"{k[6:]} {part(k)}" for k in ("score_old", "score_ref", "score_critic") if k in x]
    rest = m["score"] - sum(m[k] for k in ("score_old", "score_ref", "score_critic"))
    fur = f["furthest"]
    a, b = fur["by_ratio"], fur["by_seconds"]
    furthest = ("none" if a is None else f"{a} ({x[a]:.1f}x its floor, {g(m[a] - fl[a])} s above it)"
                + ("" if b == a else f"; most seconds above its floor: {b} ({g(m[b] - fl[b])} s)"))
    return (f"{c['name']} {c['dtype']} old={c['update_old_actor_freq']} threads={c['num_threads'] or 'def'} "
            f"({f['peak_gflops']:.0f} GFLOP/s, {f['bandwidth_gbs']:.1f} GB/s): "
            f"generate {part('generate')} (prefill of {shape['prompts']} prompts x {shape['prompt_len']} {g(fl['generate_prefill'])} s + "
            f"{steps} decode steps of {shape['rows']} rows {g(fl['generate_decode'])} s, {kind}); "
            f"score {part('score')} (" + ", ".join(subs + [f"reward + rest {g(rest)} s"]) + "); "
            f"update {part('update')}; step {part('step')}; furthest from its floor: {furthest}")


HEADER = ("config                                   |   step    gen  score (old/ref/critic/reward)      update  sync  "
          "| gen t/s | upd GF/s %peak | peakMB budgetMB | cpu/wall")


def main(argv: list[str] | None = None) -> None:
    o = build_parser().parse_args(argv)
    if o._child:
        _die_with_parent()
        job = json.loads(o._child)
        cfgs = job["cfgs"]
        res = [run_config(cfgs[0])] if len(cfgs) == 1 else run_interleaved(cfgs)
        if res[0].get("rank", 0) == 0:
            Path(job["out"]).write_text(json.dumps(res))
        if "rank" in res[0]:  # torchrun: out before interpreter shutdown, where a gloo group can hang
            sys.stdout.flush()
            os._exit(0)
        return
    try:
        from trainer.run.distributed import resolve_device

        resolve_device(o.device)  # a bad or absent device: one line here, not one failed row per config
    except SystemExit as e:
        raise SystemExit(f"error: {e.code}") from None
    cfgs = expand_configs(o)
    default_threads = torch.get_num_threads()
    thread_counts = sorted({c["num_threads"] for c in cfgs})
    # bf16's peak is context only where the CPU computes bf16 natively; emulated, a 2048^2 product takes minutes.
    peak_dtypes = sorted({"float32"} | ({"bfloat16"} if cpu_native_bf16() else set()) | {c["dtype"] for c in cfgs})
    peak_kw = {"sizes": (1024,), "reps": 3} if o.quick else {}
    # A config's own dtype is measured even where it is emulated (its floor is that rate), at a size that takes a
    # second, not minutes: emulated, the rate is flat in the size (~1 GFLOP/s per core at 256-1024 on an AVX2 EPYC).
    emulated_kw = {"sizes": (512,), "reps": 3}
    emulated = set() if cpu_native_bf16() else {"bfloat16"}
    bw_kw = {"mb": 128, "reps": 3} if o.quick else {}

    def measure_peaks() -> dict[str, dict[str, dict[str, float]]]:
        """{threads: {dtype: {size: GFLOP/s, "peak": best}, "bandwidth_gbs": copy GB/s}} at every
        thread count the configs use."""
        out = {}
        for t in thread_counts:
            torch.set_num_threads(t if t > 0 else default_threads)
            out[str(t)] = {d: matmul_peak(getattr(torch, d), **(emulated_kw if d in emulated else peak_kw))
                           for d in peak_dtypes}
            out[str(t)]["bandwidth_gbs"] = memory_bandwidth(**bw_kw)
        torch.set_num_threads(default_threads)
        return out

    def show_peaks(peaks: dict, when: str) -> None:
        for t, pk in peaks.items():
            print(f"matmul peak{when} ({t if t != '0' else default_threads} threads): "
                  + ", ".join(f"{d} {pk[d]['peak']:.0f}" for d in peak_dtypes)
                  + f" GFLOP/s; memory copy {pk['bandwidth_gbs']:.1f} GB/s", flush=True)

    t_all = time.perf_counter()
    peaks_before = measure_peaks()
    show_peaks(peaks_before, "")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        rm_path = None
        if o.reward_model == "tiny":
            from model.loader import load_tokenizer

            tok = load_tokenizer()
            rm_path = str(Path(tmp) / "tiny_rm")
            make_tiny_rm(Path(rm_path), len(tok), tok.pad_token_id)
        print(HEADER, flush=True)
        for group in child_groups(cfgs, o.interleave):
            for cfg in group:
                cfg["reward_model"] = rm_path
            for r in run_child(group, o.timeout):
                results.append(r)
                print(fmt_row(r) if r.get("ok") else fmt_row({**r, "ok": False}), flush=True)
    peaks_after = measure_peaks()
    # The better of before/after: on a shared machine the lower one is the noise, not the hardware.
    peaks = {t: {d: max(peaks_before[t][d]["peak"], peaks_after[t][d]["peak"]) for d in peak_dtypes} for t in peaks_before}
    bandwidth = {t: max(peaks_before[t]["bandwidth_gbs"], peaks_after[t]["bandwidth_gbs"]) for t in peaks_before}
    for r in results:
        if r.get("ok") and r["config"].get("device", "cpu") == "cpu":  # the peaks are the CPU's
            c = r["config"]
            r["update_peak_share"] = r["update_tflops_per_s"] * 1000 / peaks[str(c["num_threads"])][c["dtype"]]
            r["matmul_peak_gflops"] = peaks[str(c["num_threads"])][c["dtype"]]
            limit = r["generate_weight_mb_per_token"] * MB * c["gen_len"] / (bandwidth[str(c["num_threads"])] * 1e9)
            r["generate_bandwidth_limit_s"] = limit
            r["generate_bandwidth_share"] = limit / r["time_s"]["generate"]
            r["floors"] = floors_against(phase_floors(StepShape(**r["step_shape"]), r["matmul_peak_gflops"],
                                                      bandwidth[str(c["num_threads"])]), r["time_s"])
        if r.get("ok"):
            c = r["config"]
            if o.minimind_s and c["name"] == o.minimind_size:
                r["minimind_ratio"] = o.minimind_s / r["time_s"]["step"]
            c["reward_model"] = o.reward_model
    show_peaks(peaks_after, " after")
    print("(shares use the better of before/after)")
    print("\nshares of the update phase against the dtype-matched peak:")
    print(HEADER)
    for r in results:
        print(fmt_row(r))
    print("\nwhere the time goes (phase split of a step; generation against the weight-streaming limit, "
          "the update against the matmul peak):")
    for r in results:
        if r.get("ok"):
            print(summary_line(r, o))
    floored = [r for r in results if r.get("ok") and r.get("floors")]
    if floored:
        print("\nfloors per phase (measured s / floor s = x floor; FLOPs at the dtype-matched matmul peak, decode steps "
              "at the larger of that and their weight + KV-cache streaming at the copy bandwidth, of this run):")
        for r in floored:
            print(floor_line(r))
    spread = [r for r in results if r.get("ok") and r.get("per_rank")]
    if spread:
        print("\nper rank (--procs): parameters + fp32 gradients + AdamW state of the trained models, and peak RSS:")
        for r in spread:
            c = r["config"]
            print(f"{c['name']} {c['dtype']} {c['strategy']} x {c['procs']}: trained state "
                  + ", ".join(f"{x['trained_state']:.1f}" for x in r["per_rank"]) + " MB; peak RSS "
                  + ", ".join(f"{x['peak_rss']:.0f}" for x in r["per_rank"]) + " MB; node peak (ranks summed, "
                  + f"sampled) {r.get('node_peak_rss_mb') or float('nan'):.0f} MB, while building "
                  + f"{r.get('node_build_peak_rss_mb') or float('nan'):.0f} MB")
    print(f"total bench time {time.perf_counter() - t_all:.0f} s")
    report = {
        "machine": {"cpu": cpu_name(), "logical_cpus": os.cpu_count(), "torch": torch.__version__,
                    "python": platform.python_version(), "torch_default_threads": default_threads,
                    "loadavg_end": os.getloadavg()},
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "matmul_peak_gflops": {**peaks[str(thread_counts[0])], "by_threads": peaks,
                               "before": peaks_before, "after": peaks_after},
        "memory_bandwidth_gbs": {"copy": bandwidth[str(thread_counts[0])], "by_threads": bandwidth},
        "settings": {k: v for k, v in vars(o).items() if k != "_child"},
        "results": results,
        "minimind_reference_s": MINIMIND_REFERENCE_S,
        "minimind_here_s": o.minimind_s,
    }
    if o.json:
        Path(o.json).parent.mkdir(parents=True, exist_ok=True)
        Path(o.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {o.json}")


if __name__ == "__main__":
    main()
