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
    them), else the last line that says something (not a blank line or a banner of = or *)."""
    lines = [l.strip() for l in text.splitlines() if any(ch.isalnum() for ch in l)]
    errors = [l for l in lines if l.startswith("error: ")]
    return (errors or lines or ["(no output)"])[-1][:300]


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
    ("fsdp2", check_fsdp2), ("minimind", check_minimind),
]


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
    p.add_argument("--workdir", default=None, help="where the runs write their files (default: a temporary folder, removed)")
    p.add_argument("--_child", default=None, choices=["fast_decode"], help=argparse.SUPPRESS)
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
    if o.steps < 1 or o.timeout < 1:
        raise SystemExit("error: --steps and --timeout must be >= 1")
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


if __name__ == "__main__":
    main()
