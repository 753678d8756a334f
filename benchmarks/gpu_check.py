"""Everything CUDA-specific in one command, ending in one table to paste into the README.

    python benchmarks/gpu_check.py                                   # on a CUDA machine (minutes)
    python benchmarks/gpu_check.py --minimind_dir /path/to/minimind  # + MiniMind's own trainer at the same work
    python benchmarks/gpu_check.py --allow_cpu                       # no GPU: the same checks on the CPU, tiny sizes

Each check runs in its own subprocess (one failing never hides the others); its command is printed as it
starts, so any row can be rerun alone. Sizes below are the GPU run's; --allow_cpu (a smoke test of this
script, used by tests/test_gpu_check.py) runs 64x2 models, 1-2 steps, a few tokens, everything on the CPU.

  gpu tests      python -m pytest -q -m gpu: tests/test_gpu.py and any other `gpu`-marked test.
  bench          benchmarks/bench_ppo.py --device cuda at 512x8, bf16, batch 8, 64 prompt + 64 new tokens,
                 --steps timed steps: median s/step, its generate / score / update split, and the peak
                 allocated CUDA memory (torch.cuda.max_memory_allocated) of the run.
  deterministic  train_ppo.py --deterministic 1 twice (random-init 512x8, bf16, 3 steps): the saved policy
                 .pth and the last resume file's fp32 actor and critic compared tensor by tensor (torch.equal).
  fast decode    sample() with the fast decode path on and off, same seed, bf16 autocast on the GPU (the
                 shipped 128x4 demo policy, 8 demo prompts, 64 tokens): rows that come out identical, and
                 the largest |log-prob difference| over each row's common prefix. PASS: <= 0.1 nats.
  logprob gap    benchmarks/measure_logprob_gap.py --device cuda --sizes 512x8:none --dtypes bfloat16
                 --lora_r 0,16 --seeds 0,1: the sampler's log-probs against the update's forward without
                 and with LoRA (means over seeds). PASS: no token clipped on rounding alone (A_clipfrac 0).
  2 processes    torchrun --nproc_per_node 2 train_ppo.py. With 2+ GPUs: --device cuda (NCCL, one GPU per
                 rank). With one GPU: the trainer has no two-ranks-on-one-GPU mode (--device cuda picks
                 NCCL, which refuses a shared GPU, and rank 1 asks for cuda:1), so the 2 ranks run with
                 --device cpu over gloo, and 2 ranks with --device cuda are checked to stop with rank 1's
                 line naming the cause (only 1 GPU visible).
  minimind       benchmarks/time_minimind.py (MiniMind's trainer/train_ppo.py, unmodified) at 512x8 with
                 --steps timed steps, on the GPU (--device cuda:0), against the bench row's s/step, with our
                 root off its path (peer_env). Needs --minimind_dir.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# nats: a few bf16 rounding steps of the demo policy's logits, well under the clip threshold log 1.2 = 0.18;
# a decoding bug (mask, rotary, weight layout) is off by whole nats.
FAST_DECODE_TOL = 0.1


@dataclass(frozen=True)
class Sizes:
    """What each check runs at: the GPU run's sizes, or --allow_cpu's tiny ones."""

    device: str
    dtype: str
    model: tuple[int, int]  # bench, deterministic, logprob gap (HIDDEN, LAYERS)
    batch: int
    prompt_len: int
    gen_len: int
    steps: int  # timed bench steps
    train_steps: int  # deterministic and 2-process runs
    seeds: str
    lora_r: int


def sizes_for(smoke: bool, steps: int) -> Sizes:
    if smoke:
        return Sizes("cpu", "bfloat16", (64, 2), 2, 8, 4, 2, 1, "0", 4)
    return Sizes("cuda", "bfloat16", (512, 8), 8, 64, 64, steps, 3, "0,1", 16)


# ------------------------------------------------------------------------------------ running commands
def shown(cmd: list[str]) -> str:
    """The command as one can type it: `python` where that is this interpreter."""
    exe = shutil.which("python")
    same = exe is not None and Path(exe).resolve() == Path(sys.executable).resolve()
    return shlex.join(["python" if same and c == sys.executable else c for c in cmd])


def child_env(smoke: bool) -> dict[str, str]:
    """Our checks' environment: the repository root first on PYTHONPATH, the entries already there kept after it
    (e.g. where carried wheels were installed: `pip install --target`)."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not _is_root(p)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", SWANLAB_MODE="disabled",
               PYTHONPATH=os.pathsep.join([str(ROOT), *kept]))
    if smoke:  # everything on the CPU, also on a machine that has a GPU
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _is_root(entry: str) -> bool:
    try:
        return (ROOT / entry).resolve() == ROOT  # '' and relative entries: from the root, where the checks run
    except (OSError, RuntimeError):
        return False


def peer_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a peer's own code (MiniMind, TRL): our root taken off PYTHONPATH, every other entry kept.
    MiniMind's `trainer/` has no __init__.py: our `trainer` package anywhere on its path would shadow it
    (benchmarks/time_minimind.py also takes the root off sys.path itself)."""
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not _is_root(p)]
    out = dict(env)
    if kept:
        out["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        out.pop("PYTHONPATH", None)
    return out


class CheckFailed(Exception):
    """A check's one-line failure (the table's figures column)."""


def run(cmd: list[str], env: dict[str, str], timeout: int, expect_ok: bool = True) -> subprocess.CompletedProcess:
    """Run `cmd` from the repository root, its command line printed first. A non-zero exit (when
    `expect_ok`) or a timeout is a CheckFailed naming the last line of what it printed."""
    print(f"$ {shown(cmd)}", flush=True)
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"timed out after {timeout} s (--timeout)") from None
    if expect_ok and r.returncode != 0:
        raise CheckFailed(f"exit {r.returncode}: {last_line(r.stderr if r.stderr.strip() else r.stdout)}")
    return r


def last_line(text: str) -> str:
    """The last `error: ...` line (the project's one-line errors; torchrun prints its own summary after
    them), else the last Python exception line (`RuntimeError: ...`: a peer's traceback, which a progress bar may
    follow), else the last line that says something (not a blank line or a banner of = or *)."""
    lines = [l.strip() for l in text.splitlines() if any(ch.isalnum() for ch in l)]
    errors = [l for l in lines if l.startswith("error: ")]
    raised = [l for l in lines if re.match(r"[\w.]+(Error|Exception|Interrupt|Exit): ", l)]
    return (errors or raised or lines or ["(no output)"])[-1][:300]


def train_flags(work: Path, name: str, hidden: int, layers: int, batch: int, gen_len: int, steps: int) -> list[str]:
    """train_ppo.py flags for a short run whose files all land under work/name (random-init policy,
    the demo prompts and reward model, no evaluation, no swanlab)."""
    d = work / name
    return ["--from_weight", "none", "--hidden_size", str(hidden), "--num_hidden_layers", str(layers),
            "--batch_size", str(batch), "--mini_batch_size", str(batch), "--max_gen_len", str(gen_len),
            "--max_steps", str(steps), "--save_interval", str(steps), "--eval_data_path", "none",
            "--swanlab_mode", "disabled", "--save_dir", str(d / "out"), "--checkpoint_dir", str(d / "ckpt"),
            "--run_dir", str(d / "run")]


# ------------------------------------------------------------------------------------ the checks
class Context:
    def __init__(self, o: argparse.Namespace, smoke: bool, work: Path):
        self.o, self.smoke, self.work = o, smoke, work
        self.sz = sizes_for(smoke, o.steps)
        self.env = child_env(smoke)
        self.py = sys.executable
        self.bench_s_per_step: float | None = None  # the bench row's figure, for the MiniMind ratio


def check_gpu_tests(c: Context) -> tuple[str, str]:
    r = run([c.py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"], c.env, c.o.timeout, expect_ok=False)
    summary = last_line(r.stdout)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", summary)}
    figures = re.sub(r",? ?\d+ deselected", "", summary).strip(" =")
    if r.returncode == 5 or not any(counts.get(k) for k in ("passed", "failed", "skipped", "error", "errors")):
        return "FAIL", f"no gpu-marked tests collected ({figures})"
    if r.returncode != 0 or counts.get("failed") or counts.get("error") or counts.get("errors"):
        return "FAIL", figures
    if not counts.get("passed"):
        return "SKIP", f"{figures} (no CUDA)"
    return "PASS", figures


def check_bench(c: Context) -> tuple[str, str]:
    sz, out = c.sz, c.work / "bench.json"
    h, l = sz.model
    cmd = [c.py, "benchmarks/bench_ppo.py", "--device", sz.device, "--sizes", f"{h}x{l}", "--dtypes", sz.dtype,
           "--update_old_actor_freq", "0", "--batch_size", str(sz.batch), "--prompt_len", str(sz.prompt_len),
           "--gen_len", str(sz.gen_len), "--steps", str(sz.steps), "--warmup", "1", "--json", str(out)]
    if c.smoke:
        cmd += ["--quick", "--num_threads", "1"]
    run(cmd, c.env, c.o.timeout)
    (res,) = json.loads(out.read_text())["results"]
    if not res.get("ok"):
        raise CheckFailed(f"bench failed: {res.get('error')}")
    t, mem = res["time_s"], res["memory_mb"]
    c.bench_s_per_step = t["step"]
    peak = (f"peak allocated {mem['cuda_peak_allocated']:.0f} MB" if mem.get("cuda_peak_allocated") is not None
            else f"peak RSS {mem['peak_rss']:.0f} MB (CPU)")
    return "PASS", (f"{h}x{l} {sz.dtype}, batch {sz.batch}, {sz.prompt_len}+{sz.gen_len} tokens: {t['step']:.3f} s/step "
                    f"(median of {sz.steps}; generate {t['generate']:.3f} / score {t['score']:.3f} / update "
                    f"{t['update']:.3f} s); {peak}")


def check_deterministic(c: Context) -> tuple[str, str]:
    import torch

    from trainer.run.checkpoint import list_resume_files, read_resume

    sz = c.sz
    h, l = sz.model
    tensors: list[dict[str, torch.Tensor]] = []
    for name in ("det_a", "det_b"):
        flags = train_flags(c.work, name, h, l, sz.batch, sz.gen_len, sz.train_steps)
        run([c.py, "train_ppo.py", "--device", sz.device, "--dtype", sz.dtype, "--deterministic", "1", *flags],
            c.env, c.o.timeout)
        d = c.work / name
        policy = torch.load(d / "out" / f"ppo_actor_{h}.pth", map_location="cpu", weights_only=True)
        files = list_resume_files(d / "ckpt", f"ppo_actor_{h}_resume")
        if not files:
            raise CheckFailed(f"{name}: no resume file in {d / 'ckpt'}")
        state = read_resume(files[0])
        tensors.append({**{f"policy/{k}": v for k, v in policy.items()},
                        **{f"actor/{k}": v for k, v in state["actor"].items()},
                        **{f"critic/{k}": v for k, v in (state["critic"] or {}).items()}})
    a, b = tensors
    if a.keys() != b.keys():
        raise CheckFailed(f"the two runs saved different tensors: {sorted(set(a) ^ set(b))[:3]}")
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    steps = f"{sz.train_steps} step{'s' if sz.train_steps != 1 else ''}"
    what = f"{len(a)} tensors (policy .pth + fp32 actor/critic), {steps} each at {h}x{l} {sz.dtype}"
    if differ:
        worst = max(differ, key=lambda k: (a[k].float() - b[k].float()).abs().max().item())
        return "FAIL", (f"{len(differ)} of {what} differ (largest in {worst}: "
                        f"{(a[worst].float() - b[worst].float()).abs().max().item():.2e})")
    return "PASS", f"identical: {what}"


def check_fast_decode(c: Context) -> tuple[str, str]:
    out = c.work / "fast_decode.json"
    gen = 64 if not c.smoke else 16
    run([c.py, "benchmarks/gpu_check.py", "--_child", "fast_decode", "--device", c.sz.device, "--gen_len", str(gen),
         "--json", str(out)], c.env, c.o.timeout)
    r = json.loads(out.read_text())
    figures = (f"128x4 demo policy, bf16, {r['rows']} rows x {gen} tokens: {r['identical_rows']}/{r['rows']} rows "
               f"identical; log-prob difference over {r['tokens_compared']} tokens of common prefix: max "
               f"{r['max_abs_dlogprob']:.2e}, mean {r['mean_abs_dlogprob']:.2e} nats (PASS <= {FAST_DECODE_TOL})")
    if not r["fast_decoder_used"]:
        return "FAIL", "the fast decoder declined this model: nothing compared"
    return ("PASS" if r["max_abs_dlogprob"] <= FAST_DECODE_TOL else "FAIL"), figures


def check_logprob_gap(c: Context) -> tuple[str, str]:
    sz = c.sz
    h, l = sz.model
    cmd = [c.py, "benchmarks/measure_logprob_gap.py", "--device", sz.device, "--sizes", f"{h}x{l}:none", "--dtypes", sz.dtype,
           "--lora_r", f"0,{sz.lora_r}", "--seeds", sz.seeds]
    if c.smoke:
        cmd += ["--batch_size", "4", "--gen_len", "8"]
    r = run(cmd, c.env, c.o.timeout)
    lines = [l.split() for l in r.stdout.splitlines() if l.strip()]
    header = next((f for f in lines if f[:4] == ["size", "dtype", "lora", "seed"]), None)
    if header is None:
        raise CheckFailed("measure_logprob_gap.py printed no table")
    means = {f[2]: dict(zip(header[4:], map(float, f[4:]))) for f in lines if len(f) == len(header) and f[3] == "mean"}
    if set(means) != {"0", str(sz.lora_r)}:
        raise CheckFailed(f"expected mean rows for lora 0 and {sz.lora_r}, got {sorted(means)}")

    def part(label: str, m: dict[str, float]) -> str:
        return (f"{label}: A_logr {m['A_logr']:.2e}, A_clipfrac {m['A_clipfrac']:.2g}, A_max {m['A_max']:.2e}, "
                f"move {m['move']:.2e}")
    figures = (f"{h}x{l} {sz.dtype}, seeds {sz.seeds}; " + part("no LoRA", means["0"]) + "; "
               + part(f"LoRA r{sz.lora_r}", means[str(sz.lora_r)]))
    clipped = any(m["A_clipfrac"] > 0 for m in means.values())
    return ("WARN" if clipped else "PASS"), figures


def check_two_processes(c: Context) -> tuple[str, str]:
    import torch

    n_gpus = torch.cuda.device_count() if not c.smoke else 0
    env = dict(c.env, OMP_NUM_THREADS="1")

    def torchrun(name: str, device: str, dtype: str, expect_ok: bool = True) -> tuple[subprocess.CompletedProcess, float]:
        with socket.socket() as s:  # a free port for this launch's rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        flags = train_flags(c.work, name, 64, 2, 2, 8, 2)
        cmd = [c.py, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), "train_ppo.py",
               "--device", device, "--dtype", dtype, "--num_threads", "1", *flags]
        t0 = time.perf_counter()
        r = run(cmd, env, c.o.timeout, expect_ok=expect_ok)
        if expect_ok and not (c.work / name / "out" / "ppo_actor_64.pth").is_file():
            raise CheckFailed(f"{name}: finished without writing its policy")
        return r, time.perf_counter() - t0

    if n_gpus >= 2:
        _, wall = torchrun("ddp_nccl", "cuda", "bfloat16")
        return "PASS", f"NCCL, 2 ranks on cuda:0 and cuda:1, 2 steps at 64x2 bf16 in {wall:.0f} s (with start-up)"
    _, wall = torchrun("ddp_gloo", "cpu", "float32")
    figures = (f"gloo with --device cpu, 2 ranks, 2 steps at 64x2 in {wall:.0f} s (with start-up); the trainer runs "
               f"no 2 ranks on one GPU (NCCL refuses it)")
    if c.smoke:
        return "PASS", figures + "; the one-GPU refusal needs a GPU: not checked"
    r, _ = torchrun("ddp_one_gpu", "cuda", "bfloat16", expect_ok=False)
    said = [l.strip() for l in (r.stdout + r.stderr).splitlines() if "GPUs are visible" in l]
    if r.returncode == 0 or not said:
        return "FAIL", figures + f"; 2 ranks with --device cuda on 1 GPU were not refused clearly (exit {r.returncode})"
    return "PASS", figures + f"; --device cuda on 1 GPU refused: \"{said[0][:160]}\""


def check_fsdp2(c: Context) -> tuple[str, str]:
    """--strategy fsdp2 under torchrun: on the GPUs (NCCL, bf16 MixedPrecisionPolicy; on one GPU also with
    --cpu_offload 1), or 2 gloo ranks in the CPU smoke run."""
    import torch

    n_gpus = torch.cuda.device_count() if not c.smoke else 0
    procs, device, dtype = (min(n_gpus, 2), "cuda", "bfloat16") if n_gpus else (2, "cpu", "float32")
    figures = []
    for name, extra in (("fsdp2", []), *([("fsdp2_offload", ["--cpu_offload", "1"])] if n_gpus else [])):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [c.py, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port", str(port), "train_ppo.py",
               "--device", device, "--dtype", dtype, "--num_threads", "1", "--strategy", "fsdp2", *extra,
               *train_flags(c.work, name, 64, 2, 2, 8, 2)]
        t0 = time.perf_counter()
        run(cmd, dict(c.env, OMP_NUM_THREADS="1"), c.o.timeout)
        if not (c.work / name / "out" / "ppo_actor_64.pth").is_file() or not list((c.work / name / "ckpt").glob("*.dcp")):
            raise CheckFailed(f"{name}: finished without its policy or its DCP shards")
        figures.append(f"{' '.join(extra) or 'sharded'}: 2 steps in {time.perf_counter() - t0:.0f} s")
    where = f"NCCL, {procs} rank(s) on GPUs, bf16" if n_gpus else "gloo with --device cpu, 2 ranks, fp32"
    untested = (" NOT exercised on one GPU: NCCL all-gathers / reduce-scatters across ranks (a world of one runs no "
                "collective), HSDP's 2-D mesh, resharding to another world size" if n_gpus == 1 else "")
    return "PASS", f"{where}, 64x2: " + "; ".join(figures) + " (with start-up; policy and DCP shards written)." + untested


def check_cuda_graphs(c: Context) -> tuple[str, str]:
    out = c.work / "cuda_graphs.json"
    run([c.py, "benchmarks/gpu_check.py", "--_child", "cuda_graphs", "--device", c.sz.device, "--json", str(out)],
        c.env, c.o.timeout)
    return cuda_graphs_figures(json.loads(out.read_text()))


def cuda_graphs_figures(r: dict) -> tuple[str, str]:
    """The cuda graphs row from the child's JSON: PASS where the graph gives its eager step's bits."""
    shape = f"{r['size']} {r['dtype']}, batch {r['batch']}, {r['prompt_len']}+{r['gen_len']} tokens"
    loop = (f"against the CPU's decode loop: {r['loop_identical_rows']}/{r['batch']} rows identical, max |d log-prob| "
            f"{r['loop_max_abs_dlogprob']:.1e}")
    if not r["cuda"]:
        return "PASS", (f"no CUDA: graphs not exercised; the static step run eagerly, {shape}: {loop}; "
                        f"{r['eager_ms_per_token']:.2f} ms per token")
    same = r["graph_identical"] and r["graphs_captured"] == 2
    if not r["graphs_captured"]:
        return "FAIL", f"{shape}: the decode step was not captured (it ran eagerly; the run's warning says why)"
    # A steady run: graphs kept per shape bucket (none captured in its second half) and no reserved memory growth.
    before, after = r["steady_reserved_mb"]
    late = r["steady_captures"] - r["steady_captures_first_half"]
    steady = late == 0 and after <= before
    figures = (f"{shape}: graph replay {'bit-identical to' if same else 'DIFFERS from'} the eager step (tokens, "
               f"log-probs, entropies; greedy and seeded); {r['graph_ms_per_token']:.2f} ms per decode token with graphs, "
               f"{r['eager_ms_per_token']:.2f} eager ({r['eager_ms_per_token'] / r['graph_ms_per_token']:.1f}x; the "
               f"prefill included, the graph kept from an earlier run, target <= 1.0 at 768x8); steady run of "
               f"{r['steady_runs']} rollouts over {r['steady_buckets']} shape buckets: {r['steady_captures']} captures "
               f"({r['steady_captures'] / r['steady_runs']:.2f} per run), {late} in its second half; reserved "
               f"{before:.0f} MB after {r['steady_runs'] // 2} rollouts and {after:.0f} MB after all"
               f"{'' if after <= before else ' (GROWS)'}; {loop}")
    return ("PASS" if same and steady else "FAIL"), figures


def check_minimind(c: Context) -> tuple[str, str]:
    if not c.o.minimind_dir:
        return "SKIP", "no --minimind_dir given"
    sz = c.sz
    h, l = sz.model
    out = c.work / "minimind.json"
    device = "cuda:0" if sz.device == "cuda" else "cpu"
    run([c.py, "benchmarks/time_minimind.py", "--minimind_dir", str(c.o.minimind_dir), "--size", f"{h}x{l}",
         "--steps", str(sz.steps), "--device", device, "--json", str(out)], peer_env(c.env), c.o.timeout)
    med = json.loads(out.read_text())["median_s"]
    figures = (f"MiniMind's trainer/train_ppo.py on {device}, {h}x{l}, batch 8, 64+64 tokens: {med:.3f} s/step "
               f"(median of {sz.steps})")
    if c.bench_s_per_step:
        figures += f"; ours {c.bench_s_per_step:.3f} s/step (bench row): MiniMind takes {med / c.bench_s_per_step:.2f}x as long"
    return "PASS", figures


CHECKS: list[tuple[str, Callable[[Context], tuple[str, str]]]] = [
    ("gpu tests", check_gpu_tests), ("bench", check_bench), ("deterministic", check_deterministic),
    ("fast decode", check_fast_decode), ("logprob gap", check_logprob_gap), ("2 processes", check_two_processes),
    ("fsdp2", check_fsdp2), ("minimind", check_minimind), ("cuda graphs", check_cuda_graphs),
]


def child_cuda_graphs(o: argparse.Namespace) -> None:
    """sample() at the peers' PPO shape (random-init 768x8, bf16 autocast, batch 8, 64 random prompt tokens, 64 new
    tokens, EOS suppressed) with the decode step replayed from a CUDA graph, launched eagerly, and by the CPU's loop;
    on a CPU (smoke) 64x2 fp32, 8 + 8 tokens, the static step eager against the loop. Seeded sampling and greedy.
    On CUDA then a steady run (20 rollouts, prompts of 64/40/100/150 tokens in turn): the graphs it captures (once
    per shape bucket, and again where a larger bucket's K/V buffer replaced the one a graph read) and the memory
    torch reserves after 10 rollouts and after all 20."""
    import torch

    from model.generation import DecodeOptions, sample
    from model.loader import build_minimind

    device = torch.device(o.device)
    cuda = device.type == "cuda"
    (h, l), P, R, dtype = ((768, 8), 64, 64, torch.bfloat16) if cuda else ((64, 2), 8, 8, None)
    torch.manual_seed(0)
    model = build_minimind(h, l).to(device).eval()
    ids = torch.randint(3, model.config.vocab_size, (8, P), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=R, eos_token_id=2, pad_token_id=0, temperature=0.8, suppress_eos=True, return_logprobs=True)
    cast = (lambda: torch.autocast("cuda", dtype=dtype)) if cuda else (lambda: torch.autocast("cpu", enabled=False))
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def draw(greedy: bool, **mode):
        torch.manual_seed(1)
        with cast():
            return sample(model, ids, mask, greedy=greedy, **kw, **mode)

    def ms_per_token(**mode) -> float:
        times = []
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            draw(False, **mode)
            sync()
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times[1:]) / R

    from model.generation import StaticDecode

    graph_mode = dict(cuda_graphs=True)
    eager_mode = dict(cuda_graphs=False) if cuda else dict(decode=DecodeOptions(static_step=True))
    captured, same = StaticDecode.captured, True
    for greedy in (True, False):
        a, b = draw(greedy, **graph_mode), draw(greedy, **eager_mode)
        same &= bool(torch.equal(a.sequences, b.sequences) and torch.equal(a.logprobs, b.logprobs)
                     and torch.equal(a.entropy, b.entropy))
    captured = StaticDecode.captured - captured  # 2 on a GPU: both graph runs replayed a graph
    a, c = draw(False, **eager_mode), draw(False, decode=DecodeOptions(static_step=False))
    rows_same = [bool(torch.equal(a.sequences[i], c.sequences[i])) for i in range(ids.shape[0])]
    common = (a.sequences[:, P:] == c.sequences[:, P:]).long().cumprod(1).bool()
    d = (a.logprobs - c.logprobs).abs()[common]
    graph_ms = ms_per_token(**graph_mode) if cuda else None
    steady: dict = {}
    if cuda:  # PPO's shape over 20 rollouts, prompts of 4 lengths (3 buckets): captures and reserved memory
        from model.decode_graphs import graph_shape, graph_stats

        lengths, runs, reserved, half = (P, 40, 100, 150), 20, [], 0
        start = graph_stats(device)["captures"]
        for i in range(runs):
            p = torch.randint(3, model.config.vocab_size, (8, lengths[i % 4]), generator=torch.Generator().manual_seed(i))
            with cast():
                sample(model, p.to(device), torch.ones_like(p).to(device), **kw)
            sync()
            if i in (runs // 2 - 1, runs - 1):
                reserved.append(torch.cuda.memory_reserved(device) / 2**20)
            if i == runs // 2 - 1:
                half = graph_stats(device)["captures"] - start
        steady = {"steady_runs": runs, "steady_captures": graph_stats(device)["captures"] - start,
                  "steady_captures_first_half": half, "steady_buckets": len({graph_shape(8, n + R) for n in lengths}),
                  "steady_reserved_mb": reserved}
    Path(o.json).write_text(json.dumps({
        "cuda": cuda, "size": f"{h}x{l}", "dtype": "bf16" if cuda else "fp32", "batch": ids.shape[0], "prompt_len": P,
        "gen_len": R, "graph_identical": same if cuda else None, "graphs_captured": captured,
        "graph_ms_per_token": graph_ms, "eager_ms_per_token": ms_per_token(**eager_mode),
        "loop_identical_rows": sum(rows_same), "loop_max_abs_dlogprob": d.max().item() if d.numel() else float("nan"),
        **steady}))


# ------------------------------------------------------------------------------------ peers (--peers)
# Qwen2.5-0.5B's width, random init, in our (Qwen3-style) layout: q/k RMSNorm, no q/k/v bias, tied embeddings.
WIDE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
            vocab_size=151936)
WIDE_SMOKE = dict(hidden_size=112, num_hidden_layers=2, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=256, vocab_size=151936)
MINIMIND_WIDE_SKIP = ("MiniMind's command line sets only --hidden_size and --num_hidden_layers (8 heads, 4 KV heads, its "
                      "FFN rule, vocab 6400): it cannot build 14/2 heads, FFN 4864, vocab 151,936")
POLICIES = {
    "ours": ("bf16 autocast over fp32 master weights (--dtype bfloat16); reference held in bf16 (bench_ppo's "
             "--frozen_low_precision 1); old log-probs taken from the sampling pass (--rollout_logprobs 1: no extra "
             "forward); PPO: the critic's scoring forward reused by the update (--reuse_values auto); decode by "
             "model/fast_decode.py{graphs}"),
    "MiniMind": ("its own: rollout and actor update under bf16 autocast over fp32 weights; critic (PPO) and reference "
                 "forwards in fp32 (outside autocast); an extra forward after generate() for the old log-probs "
                 "(rollout_engine.compute_per_token_logps); GRPO's default loss (cispo); samples with its generate()'s "
                 "top-k 50 / top-p 0.85 at temperature 0.8 (ours and TRL: temperature 0.8, no top-k/top-p)"),
    "TRL": ("GRPOTrainer, bf16=True (accelerate's bf16 autocast over fp32 weights, the reference loaded again in "
            "fp32), transformers' generate() (min_new_tokens = max), num_iterations 1 (old log-probs = the update's "
            "own, no extra forward), gradient checkpointing off, a reward function returning 0"),
}


@dataclass(frozen=True)
class PeerSizes:
    device: str
    main: tuple[int, int]  # HIDDEN x LAYERS of the MiniMind-3 shape
    wide: dict
    prompt_len: int
    gen_len: int
    steps: int
    warmup: int


def peer_sizes(smoke: bool, steps: int) -> PeerSizes:
    if smoke:
        return PeerSizes("cpu", (64, 2), WIDE_SMOKE, 8, 4, 1, 1)
    return PeerSizes("cuda", (768, 8), WIDE, 64, 64, steps, 2)


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def _peer_available(c: "Context", modules: str) -> str | None:
    """None where `import <modules>` works in a peer's environment, else why not (one line)."""
    r = subprocess.run([c.py, "-c", f"import {modules}"], cwd=ROOT, env=peer_env(c.env), capture_output=True, text=True)
    return None if r.returncode == 0 else last_line(r.stderr)


def peer_models(c: "Context", ps: PeerSizes, minimind_dir: Path | None) -> dict[str, Path]:
    """The weights every framework starts from: MiniMind's native file of the main shape (random init, seed 0, by
    model.loader.build_minimind: the same tensor names as MiniMind's own model) in <minimind_dir>/out where MiniMind
    reads it (kept if already there), and HF directories (our tokenizer) of it and of the wide shape for TRL and ours."""
    import torch

    from model.hf_convert import policy_to_hf
    from model.loader import build_minimind, load_policy, load_tokenizer

    h, l = ps.main
    out = (minimind_dir / "out") if minimind_dir else c.work / "weights"
    out.mkdir(parents=True, exist_ok=True)
    native = out / f"full_sft_{h}.pth"
    if not native.exists():
        torch.manual_seed(0)
        torch.save(build_minimind(h, l).state_dict(), native)
    tok = load_tokenizer()
    paths = {"native_dir": out, "hf_main": c.work / f"hf_{h}x{l}", "hf_wide": c.work / "hf_wide"}
    if not paths["hf_main"].exists():
        policy, _ = load_policy(weights=native, hidden_size=h, num_hidden_layers=l)
        policy_to_hf(policy, tok, paths["hf_main"])
    if not paths["hf_wide"].exists():
        torch.manual_seed(0)
        policy_to_hf(build_minimind(**ps.wide), tok, paths["hf_wide"])
    return paths


def ours_row(c: "Context", ps: PeerSizes, algo: str, model: list[str], train_flags: list[str], label: str,
             rows: tuple[int, int]) -> dict:
    """benchmarks/bench_ppo.py on the peers' work: `model` its model flags, `train_flags` more of train_ppo's (they
    travel in --extra, split at spaces), `rows` (prompts, samples each)."""
    prompts, gens = rows
    out = c.work / f"ours_{algo}_{label}.json"
    extra = [*train_flags, "--cuda_graphs", str(c.o.cuda_graphs)]
    if algo == "GRPO":  # 2 prompts x 4, one optimizer step per rollout (as MiniMind's and TRL's), KL coefficient 0.1
        extra += ["--advantage_estimator", "grpo", "--num_generations", str(gens), "--kl_coef", "0.1", "--mini_batch_size", "0"]
    cmd = [c.py, "benchmarks/bench_ppo.py", "--device", ps.device, *model, "--dtypes", "bfloat16",
           "--update_old_actor_freq", "0", "--batch_size", str(prompts), "--prompt_len", str(ps.prompt_len),
           "--gen_len", str(ps.gen_len), "--steps", str(ps.steps), "--warmup", str(ps.warmup), "--reward_model", "none",
           "--count_flops", "0", "--json", str(out), "--extra", " ".join(extra)]
    if c.smoke:
        cmd += ["--num_threads", "1"]
    run(cmd, c.env, c.o.timeout)
    (res,) = json.loads(out.read_text())["results"]
    if not res.get("ok"):
        raise CheckFailed(f"bench failed: {res.get('error')}")
    t, mem = res["time_s_all"], res["memory_mb"]
    return {"step_s": t["step"], "generate_s": t["generate"], "score_s": t["score"], "update_s": t["update"],
            "params": res["params"]["actor"], "peak_allocated_mb": mem.get("cuda_peak_allocated"),
            "peak_reserved_mb": mem.get("cuda_peak_reserved")}


def minimind_row(c: "Context", ps: PeerSizes, script: str, mm: Path) -> dict:
    h, l = ps.main
    out = c.work / f"minimind_{script}.json"
    cmd = [c.py, "benchmarks/time_minimind.py", "--minimind_dir", str(mm), "--script", script, "--size", f"{h}x{l}",
           "--steps", str(ps.steps), "--warmup", str(ps.warmup), "--device", "cuda:0" if ps.device == "cuda" else "cpu",
           "--dtype", "bfloat16", "--json", str(out)]
    if c.smoke:
        cmd += ["--num_threads", "1"]
    run(cmd, peer_env(c.env), c.o.timeout)
    r = json.loads(out.read_text())
    commit = (mm / "MINIMIND_COMMIT").read_text().strip()[:10] if (mm / "MINIMIND_COMMIT").is_file() else "checkout"
    return {"step_s": r["steps_s"], "generate_s": r["generate_s"], "peak_allocated_mb": r.get("peak_allocated_mb"),
            "peak_reserved_mb": r.get("peak_reserved_mb"), "version": f"MiniMind {commit}"}


def trl_row(c: "Context", ps: PeerSizes, model_dir: Path, cache: str | None) -> dict:
    out = c.work / f"trl_{model_dir.name}_{cache or 'dynamic'}.json"
    cmd = [c.py, "benchmarks/trl_peer.py", "--work", "zero", "--device", ps.device, "--model", str(model_dir),
           "--prompts", "2", "--num_generations", "4", "--prompt_len", str(ps.prompt_len), "--gen_len", str(ps.gen_len),
           "--beta", "0.1", "--steps", str(ps.steps), "--warmup", str(ps.warmup), "--json", str(out)]
    if cache:
        cmd += ["--cache_implementation", cache]
    run(cmd, peer_env(c.env), c.o.timeout)
    r = json.loads(out.read_text())
    w = r["warmup"]
    return {"step_s": r["step_s"][w:], "generate_s": r["generate_s"], "params": r["params"],
            "peak_allocated_mb": r.get("peak_allocated_mb"), "peak_reserved_mb": r.get("peak_reserved_mb"),
            "version": f"TRL {r['trl']}, transformers {r['transformers']}"}


def peers_table(rows: list[dict]) -> str:
    head = ["framework", "algorithm", "shape (params)", "rows x tokens", "s/step median [min-max]",
            "generate / score / update s", "ms per decode token", "tokens/s", "peak alloc / reserved MB", "x ours"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("skip") or r.get("fail"):
            cells = [r["framework"], r["algorithm"], r["shape"], "", f"{'SKIP' if r.get('skip') else 'FAIL'}: "
                     f"{r.get('skip') or r.get('fail')}", "", "", "", "", ""]
        else:
            med = statistics.median(r["step_s"])
            gen = statistics.median(r["generate_s"]) if r.get("generate_s") else None
            parts = ([f"{gen:.3f}" if gen is not None else "-"]
                     + [f"{statistics.median(r[k]):.3f}" if r.get(k) else "-" for k in ("score_s", "update_s")])
            if "score_s" not in r:
                parts[1:] = [f"rest {med - gen:.3f}" if gen is not None else "-"]
            mem = (f"{r['peak_allocated_mb']:.0f} / {r['peak_reserved_mb']:.0f}" if r.get("peak_allocated_mb") is not None
                   else "- (CPU)")
            params = f" ({r['params'] / 1e6:.1f}M)" if r.get("params") else ""
            cells = [r["framework"], r["algorithm"], r["shape"] + params, f"{r['rows']} x {r['tokens']}", _spread(r["step_s"]),
                     " / ".join(parts), f"{1000 * gen / r['tokens']:.2f}" if gen is not None else "-",
                     f"{r['rows'] * r['tokens'] / med:.0f}", mem, f"{r['ratio']:.2f}x" if r.get("ratio") else "-"]
        lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |")
    return "\n".join(lines)


def run_peers(c: Context) -> list[dict]:
    """Every --peers row: ours, MiniMind's own trainers and TRL's GRPOTrainer on the same work (module docstring)."""
    ps = peer_sizes(c.smoke, c.o.peer_steps)
    h, l = ps.main
    mm = Path(c.o.minimind_dir) if c.o.minimind_dir else (ROOT / "peers" / "minimind")
    mm_ok = (mm / "trainer" / "train_ppo.py").is_file()
    trl_missing = _peer_available(c, "trl, datasets")
    paths = peer_models(c, ps, mm if mm_ok else None)
    main = f"{h}x{l}"
    wide = (f"{ps.wide['hidden_size']}x{ps.wide['num_hidden_layers']}, {ps.wide['num_attention_heads']}/"
            f"{ps.wide['num_key_value_heads']} heads, FFN {ps.wide['intermediate_size']}, vocab {ps.wide['vocab_size']}")
    ours_main = (["--sizes", main], ["--save_dir", str(paths["native_dir"]), "--from_weight", "full_sft"])
    plan: list[tuple[str, str, str, tuple[int, int], Callable[[], dict] | str]] = [
        ("ours", "PPO", main, (8, 1), lambda: ours_row(c, ps, "PPO", *ours_main, main, (8, 1))),
        ("MiniMind", "PPO", main, (8, 1),
         (lambda: minimind_row(c, ps, "ppo", mm)) if mm_ok else f"no MiniMind at {mm} (benchmarks/prepare_peers.sh)"),
        ("ours", "GRPO", main, (2, 4), lambda: ours_row(c, ps, "GRPO", *ours_main, main, (2, 4))),
        ("MiniMind", "GRPO", main, (2, 4),
         (lambda: minimind_row(c, ps, "grpo", mm)) if mm_ok else f"no MiniMind at {mm} (benchmarks/prepare_peers.sh)"),
        ("TRL", "GRPO", main, (2, 4), trl_missing or (lambda: trl_row(c, ps, paths["hf_main"], None))),
        ("TRL, static cache", "GRPO", main, (2, 4), trl_missing or (lambda: trl_row(c, ps, paths["hf_main"], "static"))),
        ("ours", "GRPO", wide, (2, 4), lambda: ours_row(c, ps, "GRPO", ["--actor_path", str(paths["hf_wide"])], [], "wide", (2, 4))),
        ("TRL", "GRPO", wide, (2, 4), trl_missing or (lambda: trl_row(c, ps, paths["hf_wide"], None))),
        ("MiniMind", "GRPO", wide, (2, 4), MINIMIND_WIDE_SKIP),
    ]
    rows: list[dict] = []
    t_start = time.perf_counter()
    for framework, algo, shape, (prompts, gens), how in plan:
        row = {"framework": framework, "algorithm": algo, "shape": shape, "rows": prompts * gens, "tokens": ps.gen_len}
        print(f"\n== peers: {framework} {algo} {shape}", flush=True)
        spent = time.perf_counter() - t_start
        if isinstance(how, str):
            row["skip"] = how
        elif framework == "TRL, static cache" and spent > c.o.peers_budget_s:
            row["skip"] = f"time budget: {spent:.0f} s spent of --peers_budget_s {c.o.peers_budget_s}"
        else:
            try:
                row.update(how())
            except CheckFailed as e:
                row["fail"] = str(e)
            except Exception as e:  # noqa: BLE001 - one row's crash is its row; the others still run
                row["fail"] = f"{type(e).__name__}: {last_line(str(e))}"
        if framework == "ours":
            row["version"] = f"minippo {_git_rev()}"
        row["framework"] = f"{framework} ({row['version']})" if row.get("version") and framework != "ours" else (
            f"ours ({row['version']})" if framework == "ours" else framework)
        ref = next((r for r in rows if r["framework"].startswith("ours") and r["algorithm"] == algo and r["shape"] == shape
                    and r.get("step_s")), None)
        if ref and row.get("step_s"):
            row["ratio"] = statistics.median(row["step_s"]) / statistics.median(ref["step_s"])
        if row.get("params") is None and ref:
            row["params"] = ref.get("params")
        said = (f"SKIP: {row['skip']}" if row.get("skip") else f"FAIL: {row['fail']}" if row.get("fail")
                else f"{_spread(row['step_s'])} s/step")
        print(said, flush=True)
        rows.append(row)
    return rows


def _git_rev() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else "(no git)"


# ------------------------------------------------------------------------------------ children
def child_fast_decode(o: argparse.Namespace) -> None:
    """sample() of the shipped demo policy with fast decode on and off, one seed, bf16 autocast on --device."""
    import torch

    from dataset.rlaif import RLAIFDataset, collate_left_pad, read_rlaif_jsonl
    from model.fast_decode import fast_decoder
    from model.generation import sample
    from model.loader import eos_token_ids, load_policy

    device = torch.device(o.device)
    model, tok = load_policy(weights=ROOT / "out" / "full_sft_128.pth", hidden_size=128, num_hidden_layers=4, device=device)
    model.eval()
    records, _ = read_rlaif_jsonl(ROOT / "dataset" / "demo_train.jsonl")
    ds = RLAIFDataset(records[:8], tok, max_prompt_len=64, seed=0)
    batch = collate_left_pad([ds[i] for i in range(8)], pad_id=tok.pad_token_id)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    kw = dict(max_new_tokens=o.gen_len, eos_token_id=eos_token_ids(model, tok), pad_token_id=tok.pad_token_id,
              temperature=0.8, return_logprobs=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        used = fast_decoder(model, device.type) is not None
        runs = []
        for fast in (True, False):
            torch.manual_seed(0)  # the same draws both ways (CPU and CUDA streams)
            runs.append(sample(model, ids, mask, fast_decode=fast, **kw))
    a, b = runs
    P, R = ids.shape[1], min(a.logprobs.shape[1], b.logprobs.shape[1])
    rows_same = [bool(torch.equal(a.sequences[i], b.sequences[i])) if a.sequences.shape == b.sequences.shape else False
                 for i in range(ids.shape[0])]
    common = (a.sequences[:, P:P + R] == b.sequences[:, P:P + R]).long().cumprod(1).bool() & a.response_mask[:, :R].bool()
    d = (a.logprobs[:, :R] - b.logprobs[:, :R]).abs()[common]
    Path(o.json).write_text(json.dumps({
        "rows": ids.shape[0], "identical_rows": sum(rows_same), "tokens_compared": int(d.numel()),
        "max_abs_dlogprob": d.max().item() if d.numel() else float("nan"),
        "mean_abs_dlogprob": d.mean().item() if d.numel() else float("nan"), "fast_decoder_used": used}))


# ------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minimind_dir", default=None,
                   help="a checkout of github.com/jingyaogong/minimind: also time MiniMind's own trainer at the bench's work")
    p.add_argument("--steps", type=int, default=20, help="timed steps of the bench row (and of MiniMind's)")
    p.add_argument("--allow_cpu", action="store_true",
                   help="where no CUDA device is found, run every check on the CPU at tiny sizes (a smoke test of this "
                        "script) instead of exiting with status 2")
    p.add_argument("--timeout", type=int, default=1200, help="seconds each check's subprocess may take")
    p.add_argument("--peers", action="store_true",
                   help="instead of the checks: ours against MiniMind's own trainers and TRL's GRPOTrainer on the same work "
                        "(one table, every step time in --peers_json; docs/distributed.md)")
    p.add_argument("--peer_steps", type=int, default=10, help="--peers: timed steps per row (after 2 warm-up steps)")
    p.add_argument("--peers_budget_s", type=int, default=420,
                   help="--peers: the optional TRL static-cache row is skipped once this many seconds have gone")
    p.add_argument("--peers_json", default=str(ROOT / "peers" / "result.json"), help="--peers: write every row here")
    p.add_argument("--cuda_graphs", type=int, default=1, choices=[0, 1],
                   help="our rows' train_ppo --cuda_graphs (decode steps replayed from CUDA graphs on a GPU)")
    p.add_argument("--workdir", default=None, help="where the runs write their files (default: a temporary folder, removed)")
    p.add_argument("--_child", default=None, choices=["fast_decode", "cuda_graphs"], help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)  # children only
    p.add_argument("--gen_len", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    return p


def markdown_table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| check | result | figures |", "|---|---|---|"]
    for check, result, figures in rows:
        cell = figures.replace("|", "\\|")  # a | inside a cell would end it
        lines.append(f"| {check} | {result} | {cell} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    o = build_parser().parse_args(argv)
    if o._child == "fast_decode":
        return child_fast_decode(o)
    if o._child == "cuda_graphs":
        return child_cuda_graphs(o)
    if o.steps < 1 or o.timeout < 1 or o.peer_steps < 1:
        raise SystemExit("error: --steps, --peer_steps and --timeout must be >= 1")
    if o.minimind_dir and not (Path(o.minimind_dir) / "trainer" / "train_ppo.py").is_file():
        raise SystemExit(f"error: --minimind_dir {o.minimind_dir}: no trainer/train_ppo.py there (clone jingyaogong/minimind)")
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not o.allow_cpu:
        print("error: no CUDA device here (torch.cuda.is_available() is False); run this on a GPU machine, "
              "or add --allow_cpu for a CPU smoke run at tiny sizes", file=sys.stderr)
        raise SystemExit(2)
    smoke = not cuda
    if cuda:
        where = (f"{torch.cuda.get_device_name(0)} (cuda:0 of {torch.cuda.device_count()}), torch {torch.__version__}, "
                 f"CUDA {torch.version.cuda}")
    else:
        where = f"no GPU: --allow_cpu smoke run on the CPU at tiny sizes, torch {torch.__version__}, CUDA none"
    started = _dt.datetime.now().isoformat(timespec="seconds")
    work = Path(o.workdir) if o.workdir else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Context(o, smoke, work)
    if o.peers:
        try:
            return main_peers(ctx, started, where)
        finally:
            if not o.workdir:
                shutil.rmtree(work, ignore_errors=True)
    rows = []
    try:
        for name, fn in CHECKS:
            print(f"\n== {name}", flush=True)
            t0 = time.perf_counter()
            try:
                result, figures = fn(ctx)
            except CheckFailed as e:
                result, figures = "FAIL", str(e)
            except Exception as e:  # noqa: BLE001 - one check's crash is its row, the others still run
                result, figures = "FAIL", f"{type(e).__name__}: {last_line(str(e))}"
            print(f"{result}: {figures} ({time.perf_counter() - t0:.0f} s)", flush=True)
            rows.append((name, result, figures))
    finally:
        if not o.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nminippo gpu_check, {started}: {where}\n")
    print(markdown_table(rows))
    if any(r == "FAIL" for _, r, _ in rows):
        raise SystemExit(1)


def main_peers(ctx: Context, started: str, where: str) -> None:
    """--peers: the table, its notes and the JSON of every step time."""
    t0 = time.perf_counter()
    rows = run_peers(ctx)
    print("\n== peers: cuda graphs (ours, decode step replayed against launched)", flush=True)
    try:
        graph_row = check_cuda_graphs(ctx)
    except Exception as e:  # noqa: BLE001 - reported, the table stands
        graph_row = ("FAIL", f"{type(e).__name__}: {last_line(str(e))}")
    graphs = ", its decode steps replayed from CUDA graphs (--cuda_graphs 1)" if ctx.o.cuda_graphs and not ctx.smoke else ""
    notes = [f"- {name}: {text.format(graphs=graphs)}" for name, text in POLICIES.items()]
    print(f"\nminippo gpu_check --peers, {started}: {where}; {time.perf_counter() - t0:.0f} s\n")
    print(peers_table(rows))
    print("\nWhat each framework runs (dtype policy, extra forwards):\n" + "\n".join(notes))
    print("- x ours: the row's median s/step over ours at the same algorithm and shape (> 1: slower than ours); "
          "ms per decode token = generate time / new tokens (the prefill included)")
    print(f"\ncuda graphs: {graph_row[0]}: {graph_row[1]}")
    out = Path(ctx.o.peers_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"started": started, "where": where, "rows": rows, "notes": notes,
                               "cuda_graphs": {"result": graph_row[0], "figures": graph_row[1]}}, indent=1))
    print(f"\nevery step time: {out}")
    # A peer's row that fails is reported (its line says why: its own stack); the exit status is ours.
    if any(r.get("fail") for r in rows if r["framework"].startswith("ours")) or graph_row[0] == "FAIL":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
