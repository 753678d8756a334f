"""A rollout engine's part of the run (--rollout_engine vllm / sglang; trainer/engine.py speaks to the servers):
connect every rank to its engine at start, push the policy's weights before the first rollout (the start or the
resumed weights: `start_engine`) and whenever the run's rollout source says (`push_weights`; its schedule, every
--engine_sync_interval updates, is trainer/run/rollout_source.py's), and check once that the engine samples the policy.

Who talks to whom: the ranks split into n contiguous blocks over the n engines of --engine_url, block i sampling from
engine i (one engine per node, listed in node order: each rank uses its node's; one engine may serve every rank: it
batches their requests). Rank 0 alone writes the weights once into --engine_shared_path and has every engine reload
them, while the other ranks wait outside the training group (as for a save: a reload may outlast --ddp_timeout); the
folder must be readable by every engine (one node: /dev/shm; several nodes: a shared filesystem path) and is the
trainer's own (trainer/engine.py own_folder: this user's, writable by no one else; the default one private, its files
removed after each push: `push_folder`). Under --strategy fsdp2 every rank takes part in gathering the whole weights to
rank 0 first.

A LoRA actor (--lora_r > 0) pushes its adapters alone where every engine serves adapters (vLLM started with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True --enable-lora: LORA_RANK=R scripts/serve_engine.sh): the engine keeps the base
(the start weights, pushed in full once at start: `start_engine`) and loads each push's adapter under a
new name that requests name (trainer/engine.py load_adapter); megabytes a push instead of the whole model. Elsewhere
(SGLang, a vLLM without the adapter routes, --strategy fsdp2) it pushes its merged weights (W + B A scale: the
engine serves a plain model), with one warning line saying why.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from model.config import MiniMindConfig, stock_hf_config
from model.forward import policy_forward
from model.loader import DEFAULT_TOKENIZER_DIR, load_tokenizer
from model.lora import adapter_export, base_of, is_lora, merged_state_dict
from trainer import dist as D
from trainer.config import Config
from trainer.engine import (
    ENGINES,
    Engine,
    EngineError,
    connect,
    exits_on_engine_error,
    model_mismatch,
    own_folder,
    write_adapter,
    write_weights,
)
from trainer.rollout import draw
from trainer.run.cli import engine_shared_path
from trainer.run.distributed import failing_together, main_writes, on_main
from trainer.run.sharding import full_state_dict, is_sharded
from trainer.runtime import Models, Runtime

_CLIENTS: dict[str, Engine] = {}  # rank 0's clients of the other engines it pushes to
_DEFAULT_FOLDERS: set[Path] = set()  # the default push folders rank 0 checked as its own (removed at the end)

# Mean |log-prob gap| per token on the start-up probe above which the engine is not sampling the policy (far above
# what a bf16 or fp32 engine that samples it measures: docs/engines.md), and above which, when the gap at T = 1 is
# less than half of it, the engine's log-probs are before temperature.
PROBE_LIMIT = 0.5
RAW_LIMIT = 0.01


def connect_engine(cfg: Config, info: D.DistInfo) -> Engine | None:
    """This rank's engine, reachable (None: --rollout_engine torch). A rank that cannot reach its engine stops every rank,
    and so does one whose engine cannot finish the requests in flight before a reload when --async_rollouts >= 2 has
    pushes land while batches are sampled (vLLM without a pause that waits would abort or mix them)."""
    if cfg.rollout_engine == "torch":
        return None
    urls = (cfg.engine_url or "").split(",")
    engine = None
    with failing_together(info), exits_on_engine_error():
        engine = connect(cfg.rollout_engine, urls, info.rank, info.world_size, cfg.engine_timeout)
        limit = engine.max_model_len()
        need = cfg.max_total_len if cfg.tools else cfg.max_seq_len + cfg.max_gen_len
        if limit is not None and limit < need:
            raise EngineError(f"the {cfg.rollout_engine} engine at {engine.url} serves at most {limit} tokens per "
                              f"sequence; this run needs {need} (prompt + response): start it with "
                              f"{engine.context_flag(need)}")
        why = engine.unfenced() if cfg.async_rollouts >= 2 else None
        if why:
            raise EngineError(f"--async_rollouts {cfg.async_rollouts} has weight pushes land while batches are sampled, "
                              f"and {why}; start vLLM 0.12 or later with VLLM_SERVER_DEV_MODE=1 (scripts/serve_engine.sh "
                              f"does), or use --async_rollouts 1 (nothing is in flight during a push)")
    return engine


def _config_json(actor: torch.nn.Module) -> dict:
    """The served model's config.json: an HF actor's own, a native MiniMind actor's stock Qwen3 / Llama config."""
    conf = base_of(actor).config
    if isinstance(conf, MiniMindConfig):
        conf = stock_hf_config(conf)
    return json.loads(conf.to_json_string(use_diff=False))


def tokenizer_dir(cfg: Config) -> Path | None:
    """The tokenizer whose files go with every push: MiniMind's --sglang_model_path (its tokenizer path, default
    ../model from MiniMind's trainer/: MiniMind's tokenizer folder), here by default the actor's own (--tokenizer_path,
    model/ for native weights, the --actor_path directory); None for vLLM without the flag."""
    if cfg.sglang_model_path:
        return Path(cfg.sglang_model_path)
    if cfg.rollout_engine != "sglang":
        return None
    return Path(cfg.tokenizer_path or cfg.actor_path or DEFAULT_TOKENIZER_DIR)


def _extra_files(cfg: Config) -> list[Path]:
    """The tokenizer's files (`tokenizer_dir`) that go with every push, as MiniMind's push saves its tokenizer beside
    the weights: never a model's weights, config or generation config."""
    d = tokenizer_dir(cfg)
    if d is None or not d.is_dir():
        return []
    return sorted(f for f in d.iterdir() if f.is_file() and (
        f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "added_tokens.json", "vocab.json",
                                                     "merges.txt") or f.suffix in (".jinja", ".tiktoken")))


def check_tokenizer(cfg: Config, tok: Any) -> None:
    """--sglang_model_path given: its tokenizer must be the actor's (MiniMind stops the engine at its EOS and decodes
    with it; here the actor's tokenizer encodes the prompts and its EOS ids stop the engine)."""
    if not cfg.sglang_model_path:
        return
    other = load_tokenizer(cfg.sglang_model_path, trust_remote_code=bool(cfg.trust_remote_code))
    mine, theirs = (len(tok), tok.eos_token_id), (len(other), other.eos_token_id)
    if mine != theirs:
        raise SystemExit(f"error: --sglang_model_path {cfg.sglang_model_path}: its tokenizer (vocabulary {theirs[0]}, "
                         f"EOS id {theirs[1]}) is not the actor's (vocabulary {mine[0]}, EOS id {mine[1]}): give the "
                         f"actor's tokenizer directory, or leave the flag out (the actor's is the default)")


def push_folder(cfg: Config) -> tuple[Path, bool]:
    """Where rank 0 writes the weights, and whether it is the default folder (trainer/run/cli.py engine_shared_path:
    /dev/shm/minippo_engine_HOST_PORT, a name anyone on the machine can guess). The default is the trainer's alone
    (0700, nobody else's bits); its files are removed after every push, once the engines have loaded them, so it
    holds no memory between pushes whatever ends the run, and the empty folder at the end (`remove_push_folders`).
    It is kept between pushes: another user could take the name in between. A folder given is kept, its files
    replaced by each push."""
    folder = Path(cfg.engine_shared_path or "")
    default = engine_shared_path(cfg.replace(engine_shared_path=None, sglang_shared_path=None))
    return folder, default is not None and folder == Path(default)


def _empty(folder: Path) -> None:
    """Remove what is in `folder` (the trainer's own, checked), never following a link."""
    for f in folder.iterdir():
        with contextlib.suppress(OSError):
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f)
            else:
                f.unlink()


def remove_push_folders() -> None:
    """Remove the default push folders this process made its own (empty after each push). Run by atexit; a process
    that leaves by os._exit (torchrun's ranks: trainer/run/distributed.py exit_after) skips atexit and leaves the
    empty folder behind unless the run's end calls this. Safe to call again, on any rank."""
    while _DEFAULT_FOLDERS:
        shutil.rmtree(_DEFAULT_FOLDERS.pop(), ignore_errors=True)  # rmtree refuses a link in place of the folder


atexit.register(remove_push_folders)


def _client(cfg: Config, url: str, engine: Engine) -> Engine:
    """Rank 0's client of the engine at `url`: this rank's own, or one per other engine for the run (what it learnt
    of its server, vLLM's fence, its adapters, is asked once)."""
    if url.rstrip("/") == engine.url:
        return engine
    return _CLIENTS.setdefault(url, ENGINES[cfg.rollout_engine](url, cfg.engine_timeout))


def _urls(cfg: Config) -> list[str]:
    return list(dict.fromkeys((cfg.engine_url or "").split(",")))  # every engine once, this rank's too


def adapter_pushes(cfg: Config, m: Models, rt: Runtime) -> bool:
    """Whether this run pushes adapters alone (decided at the first push, the same on every rank): a LoRA actor, not
    sharded, and every engine serves adapters; else merged weights, with one warning line (a LoRA actor) saying why."""
    engine = m.engine
    assert engine is not None
    if engine.adapter_pushes is None:
        def decide() -> bool:
            if not is_lora(m.actor):
                return False
            why = "--strategy fsdp2 gathers the merged weights" if is_sharded(m.actor) else None
            with exits_on_engine_error():
                for url in _urls(cfg):
                    why = why or _client(cfg, url, engine).adapter_support()
            if why:
                print(f"warning: --lora_r {cfg.lora_r}: pushing the merged weights (the whole model) to the engine, not "
                      f"the adapters alone: {why}", file=sys.stderr, flush=True)
            return why is None
        engine.adapter_pushes = bool(on_main(decide, rt.info))
    return engine.adapter_pushes


@contextlib.contextmanager
def _written(cfg: Config, what: str, write: Callable[[Path, bool], Path]) -> Iterator[Path]:
    """Rank 0's push: `write(folder, private)` the `what` into the push folder (checked as the trainer's own first)
    and yield where they are for the engines to load; the default folder is emptied afterwards, whatever happened
    (the engines hold the files by then: the memory is freed at once). A write that fails is one line."""
    folder, default = push_folder(cfg)
    mine = False  # the folder passed own_folder's checks: only then may it be emptied
    try:
        try:
            own_folder(folder, default)
            mine = True
            if default:
                _DEFAULT_FOLDERS.add(folder)
            path = write(folder, default)
        except OSError as e:
            raise SystemExit(f"error: writing the {what} for the engine to {folder} failed: "
                             f"{e.strerror or e}; give --engine_shared_path a folder of yours with room") from None
        yield path
    finally:
        if default and mine:
            _empty(folder)


def push_weights(cfg: Config, m: Models, rt: Runtime, version: int, base: bool = False) -> None:
    """Make every engine serve the actor's current weights as weight version `version` (the number of updates in
    them). Every rank calls this at the same point; a failure on rank 0 (a full disk, an engine that refuses the
    weights) stops every rank with one line, and nothing else is written. A LoRA actor's adapters alone where the
    engines serve adapters (`adapter_pushes`); `base`: its base weights in full instead (see start_engine)."""
    engine = m.engine
    assert engine is not None
    engine.next_version = version  # a batch sampled ahead may see the new version before this returns
    if adapter_pushes(cfg, m, rt) and not base:
        _push_adapter(cfg, m, rt, version)
        return
    if is_sharded(m.actor):
        state = full_state_dict(m.actor)  # a collective: every rank takes part; rank 0 receives the whole weights
    elif rt.info.is_main:
        state = merged_state_dict(m.actor, adapters=not base) if is_lora(m.actor) else base_of(m.actor).state_dict()
    else:
        state = {}
    def write_and_reload() -> None:
        def write(folder: Path, private: bool) -> Path:
            return write_weights(state, _config_json(m.actor), folder, _extra_files(cfg), private=private)

        with exits_on_engine_error(), _written(cfg, "weights", write) as folder:
            for url in _urls(cfg):
                _client(cfg, url, engine).load_weights(folder, version)

    main_writes(write_and_reload, rt.info)
    engine.version = version  # every rank expects its engine to sample version `version` from now on


def _push_adapter(cfg: Config, m: Models, rt: Runtime, version: int) -> None:
    """push_weights for adapter-only pushes: rank 0 writes the adapters (peft's format) into the push folder's
    adapter subfolder and has every engine load them under a new name (trainer/engine.py load_adapter), then removes
    the files (the default folder); every rank's client names its engine's adapter in its requests from now on."""
    engine = m.engine
    assert engine is not None
    names: dict[str, str] = {}

    def write_and_load() -> None:
        tensors, config = adapter_export(m.actor)

        def write(folder: Path, private: bool) -> Path:
            return write_adapter(tensors, config, folder, private=private)

        with exits_on_engine_error(), _written(cfg, "adapters", write) as path:
            for url in _urls(cfg):
                client = _client(cfg, url, engine)
                names[client.url] = client.load_adapter(path, version)

    main_writes(write_and_load, rt.info)
    names = D.broadcast_object(names, rt.info)
    if not rt.info.is_main:
        with exits_on_engine_error():
            engine.use_adapter(names[engine.url], version)
    engine.version = version


@torch.no_grad()
def probe_engine(cfg: Config, m: Models, rt: Runtime) -> float:
    """Once, after the first push: a few samples of the engine scored by the trainer. A mean |log-prob gap| over
    PROBE_LIMIT means the engine is not sampling the policy: vLLM's raw log-probs (before temperature: the gap
    vanishes at T = 1) or another model. Returns the gap. Every rank probes its engine."""
    engine = m.engine
    assert engine is not None
    temp = cfg.sample_temperature
    text = "Hello! Please tell me one short fact about the sea."
    ids = torch.tensor([m.tok.encode(text)[:32]], device=rt.device)
    gaps: dict[float, float] = {}
    with D.unsharded(m.actor), failing_together(rt.info):
        s = draw(engine, ids, torch.ones_like(ids), max_new_tokens=16, eos_token_id=m.eos_ids or m.tok.eos_token_id,
                 pad_token_id=m.tok.pad_token_id if m.tok.pad_token_id is not None else 0, temperature=temp,
                 num_generations=4, generator=torch.Generator().manual_seed(cfg.seed))
        mask = torch.cat([torch.ones_like(ids).repeat(4, 1), s.response_mask.long()], dim=1)
        R = s.response_mask.shape[1]
        for t in {temp, 1.0}:
            with rt.autocast():
                lp, _ = policy_forward(m.actor, s.sequences, mask, R, t)
            gaps[t] = float(((lp.float() - s.logprobs).abs() * s.response_mask).sum() / s.response_mask.sum().clamp(min=1))
        if temp != 1.0 and gaps[temp] > RAW_LIMIT and gaps[1.0] < gaps[temp] / 2:
            raise SystemExit(f"error: the {cfg.rollout_engine} engine at {engine.url} returns log-probs before temperature "
                             f"(vLLM's default --logprobs-mode raw_logprobs): start it with --logprobs-mode "
                             f"processed_logprobs (scripts/serve_engine.sh does)")
        if gaps[temp] > PROBE_LIMIT:
            raise SystemExit(f"error: the {cfg.rollout_engine} engine at {engine.url} does not sample the actor after a weight "
                             f"push (mean |log-prob gap| {gaps[temp]:.3g} per token on a probe): does it serve another model "
                             f"or tokenizer than --actor_path / --from_weight?")
    return gaps[temp]


def start_engine(cfg: Config, m: Models, rt: Runtime, step: int) -> str:
    """Before the first rollout: push the weights the run starts from (version `step`: the updates in them, a
    resumed run's too) and probe the engine once. Returns the line to log."""
    with failing_together(rt.info), exits_on_engine_error():  # every rank's engine, where its directory is readable
        check_tokenizer(cfg, m.tok)
        served = m.engine.served_config()
        why = model_mismatch(served, _config_json(m.actor)) if served else None
        if why:
            raise SystemExit(f"error: the {cfg.rollout_engine} engine at {m.engine.url} does not serve the actor: {why}; start it "
                             f"on the actor's model directory (scripts/convert_model.py to_hf writes one for MiniMind weights)")
    if adapter_pushes(cfg, m, rt):
        # Adapters alone leave the base to the engine, and its base may not be the actor's: started on another
        # checkpoint, or reloaded by an earlier run's full pushes (its model directory cannot tell). One full push of
        # the base (the start weights, which LoRA never changes) makes it the actor's; only adapters follow.
        push_weights(cfg, m, rt, version=step, base=True)
    push_weights(cfg, m, rt, version=step)
    gap = probe_engine(cfg, m, rt)
    what = "adapters" if m.engine.adapter_pushes else "weights"
    return (f"engine: {cfg.rollout_engine} at {cfg.engine_url} samples weight version {step} ({what} pushed to "
            f"{cfg.engine_shared_path}); probe log-prob gap {gap:.2e} per token")
