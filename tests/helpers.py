"""Tiny local models and data for trainer tests: nothing is downloaded."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

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


def own_save_dir(world: dict, tmp: Path) -> str:
    """<tmp>/out with the world's starting weights linked in: each test's runs export their own policy (a new run
    refuses to write over another run's exported policy)."""
    out = Path(tmp) / "out"
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(world["save_dir"]).glob("full_sft_*.pth"):
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    return str(out)


def tiny_flags(world: dict, tmp: Path, **over) -> list[str]:
    flags = {
        "save_dir": over.get("save_dir") or own_save_dir(world, tmp), "reward_model_path": world["rm"], "data_path": world["data"],
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



def scramble(m: torch.nn.Module, seed: int, std: float = 0.2) -> torch.nn.Module:
    """Large random weights (1-d tensors ~ 1 + 0.2 N(0, 1), the rest ~ std N(0, 1)), in place: at the default
    init (std 0.02) a tiny model just repeats its last token, its log-probs are near uniform and values near 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.ndim == 1 else std * torch.randn(p.shape, generator=g))
    return m


def byte_level_bpe(corpus: list[str], vocab_size: int, special_tokens: list[str]):
    """A `tokenizers.Tokenizer`: byte-level BPE (no prefix space, byte-level decoder) trained here on `corpus`
    with the full byte alphabet and `special_tokens` first (ids 0, 1, ...). Wrap it in a
    PreTrainedTokenizerFast for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok

# ------------------------------------------------------------------------------------------------
# In-process adapters into train_ppo's update loop.
#
# Every test that builds models, makes experience or runs an update in-process goes through the
# functions below, never through train_ppo's internals directly: when the signatures of
# make_experience / ppo_update / build_models / build_optimizers / lr_lambda change, only these
# adapters change. Tests read the update's stats dict, the Rollout's fields and the parameters.

UPDATE_BASE_FLAGS = [
    "--hidden_size", "64", "--num_hidden_layers", "2", "--from_weight", "none", "--reward_model_path", "none",
    "--rm_weight", "0", "--batch_size", "4", "--mini_batch_size", "2", "--max_gen_len", "8", "--warmup_steps", "0",
]


class UpdateWorld:
    """Everything one in-process PPO step needs (a random 64x2 MiniMind policy by default): the run as
    trainer.run.setup builds it for train_ppo.main, and a batch of demo prompts."""

    def __init__(self, built, batch):
        self.built, self.batch = built, batch
        self.cfg, self.runtime, self.models, self.optim, self.kl_ctl = built.cfg, built.runtime, built.models, built.optim, built.kl_ctl

    @property
    def args(self):  # the resolved config (flat access: world.args.clip_epsilon)
        return self.cfg

    @property
    def actor(self) -> torch.nn.Module:
        return self.models.actor

    @property
    def critic(self) -> torch.nn.Module:
        return self.models.critic


def build_update_world(extra_flags: list[str] | None = None, dtype: str = "float32", n_prompts: int = 4,
                       total_steps: int = 10) -> UpdateWorld:
    """Parse UPDATE_BASE_FLAGS + extra_flags (later flags win), build the run with trainer.run.setup
    exactly as train_ppo's main does (one process), and collate the first `n_prompts` demo prompts
    (left-padded, max 48 prompt tokens) as the batch."""
    import train_ppo as T
    from dataset.rlaif import RLAIFDataset, collate_left_pad, read_rlaif_jsonl
    from trainer.dist import DistInfo
    from trainer.run.setup import setup

    args = T.parse_args([*UPDATE_BASE_FLAGS, "--dtype", dtype, "--max_steps", str(total_steps), *(extra_flags or [])])
    built = setup(args, DistInfo())
    records, _ = read_rlaif_jsonl(ROOT / "dataset" / "demo_train.jsonl")
    ds = RLAIFDataset(records[:n_prompts], built.models.tok, max_prompt_len=48, seed=0)
    batch = collate_left_pad([ds[i] for i in range(n_prompts)], pad_id=built.models.tok.pad_token_id)
    return UpdateWorld(built, batch)


def run_experience(world: UpdateWorld):
    """Rollout + scoring + rewards + advantages of world.batch: returns (Rollout, metrics dict)."""
    import train_ppo as T

    exp = T.make_experience(world.cfg, world.batch, world.models, world.runtime, world.kl_ctl.value,
                            world.built.custom_fns, phase_for(world))
    return exp.rollout, exp.metrics


def run_update(world: UpdateWorld, ro, step: int = 0) -> dict:
    """One PPO update (all epochs and minibatches) on `ro` at PPO step `step`; returns its stats dict."""
    import train_ppo as T

    return T.ppo_update(world.cfg, ro, world.models, world.optim, step, world.runtime, world.kl_ctl.value, phase_for(world))


def phase_for(world: UpdateWorld, timer=None):
    """The Phase the step functions run their work in, as train_ppo.main builds it (timing into `timer`)."""
    from trainer.run.phases import phases
    from trainer.run.timing import PhaseTimer

    return phases(timer or PhaseTimer(), world.runtime)


def lr_schedule(warmup: int, total: int):
    """The LR multiplier as a function of the PPO step (the trainer's scheduler lambda)."""
    from trainer.run.setup import lr_lambda

    return lr_lambda(warmup, total)


def policy_logprobs(world: UpdateWorld, ro, with_entropy: bool = False):
    """The actor's current per-token log-probs [B, R] of ro's responses (and entropy), WITH grad, at the
    temperature the update uses."""
    from model.forward import policy_forward

    temp = world.cfg.sample_temperature
    with world.runtime.autocast():
        return policy_forward(world.actor, ro.sequences, ro.attention_mask, ro.response_len, temp,
                              with_entropy=with_entropy)


def critic_values(world: UpdateWorld, ro) -> torch.Tensor:
    """The critic's current values [B, R] for ro's responses, WITH grad."""
    from model.forward import critic_forward

    with world.runtime.autocast():
        return critic_forward(world.critic, ro.sequences, ro.attention_mask, ro.response_len)


def param_snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of every parameter, by name."""
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def run_main(flags: list[str]) -> tuple[object, str]:
    """train_ppo.main in this process (saves the interpreter + transformers start-up of a subprocess),
    without the end-of-run PNGs (matplotlib's time, not under test here).
    Returns (SystemExit code or None, stdout + stderr)."""
    from train_ppo import main

    buf, threads, code = io.StringIO(), torch.get_num_threads(), None
    no_plots = mock.patch("trainer.run.plots.plot_run", side_effect=ValueError("not drawn in tests"))
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), no_plots:
            main(flags)
    except SystemExit as e:
        code = e.code
    finally:
        torch.set_num_threads(threads)  # --num_threads 1 must not slow the rest of the suite
    return code, buf.getvalue()


def spawn_train(flags: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", SWANLAB_MODE="disabled")
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, str(ROOT / "train_ppo.py"), *flags], cwd=cwd, env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def sigkill_after(proc: subprocess.Popen, saved: Path, delay: float, timeout: float = 240) -> None:
    """Wait until `saved` exists (step k's resume file), let the run go on for `delay` s, then SIGKILL
    it while it is still running: no handler, no cleanup, exactly like an OOM kill or preemption."""
    t_end = time.monotonic() + timeout
    while not saved.exists():
        assert proc.poll() is None, f"run ended (rc {proc.returncode}) before {saved.name} was written"
        assert time.monotonic() < t_end, f"timed out waiting for {saved}"
        time.sleep(0.01)
    time.sleep(delay)
    assert proc.poll() is None, "the run finished before it could be killed; the kill would test nothing"
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def deep_equal(a, b, where: str = "") -> list[str]:
    """Paths where two resume-file trees differ (tensors compared bit for bit with torch.equal)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in deep_equal(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} len"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in deep_equal(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


@contextlib.contextmanager
def fake_cuda(n_gpus: int = 8, node: str = "node0", capability: tuple[int, int] = (9, 0)):
    """torch.cuda as a CUDA machine would answer it, for the device logic only (no kernel runs): `n_gpus`
    visible GPUs whose UUIDs name `node` (two processes with different `node`s stand for two hosts),
    of compute capability `capability`. synchronize calls are recorded in the yielded list."""
    from types import SimpleNamespace

    synced: list = []

    def props(d=None):
        i = d.index if isinstance(d, torch.device) else (0 if d is None else int(d))
        return SimpleNamespace(uuid=f"{node}-gpu{i}", name="Fake GPU", major=capability[0], minor=capability[1])

    with contextlib.ExitStack() as stack:
        patches = dict(is_available=lambda: True, device_count=lambda: n_gpus, get_device_properties=props,
                       get_device_capability=lambda d=None: capability, set_device=lambda d: None, current_device=lambda: 0,
                       is_bf16_supported=lambda including_emulation=True: capability[0] >= 8 or including_emulation,
                       synchronize=lambda d=None: synced.append(d))
        for name, fn in patches.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, fn))
        yield synced


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, nprocs: int, out_dir: Path, timeout: float, what: str, *extra) -> None:
    """Start `nprocs` processes running worker(rank, nprocs, port, out_dir, *extra) (they join a gloo group
    themselves) and wait for them; a hang fails the test instead of the suite."""
    import pytest
    import torch.multiprocessing as mp

    ctx = mp.spawn(worker, args=(nprocs, free_port(), str(out_dir), *extra), nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"{what} hung")


def resume_state(path: Path) -> dict:
    """A resume file's state with its models and optimizer state whole, also for a sharded run (--strategy fsdp2),
    whose DCP folder is joined here as one process would hold it ("actor", "critic", "optim/actor", ...)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("shards"):
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(Path(path).with_name(state["shards"]), Path(tmp) / "whole.pt")
            state.update(torch.load(Path(tmp) / "whole.pt", weights_only=True))
    return state
