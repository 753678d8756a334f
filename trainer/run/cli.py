"""The command line of train_ppo.py: the parser generated from trainer/config.py's fields, --config presets,
MiniMind's flag names (one table), validation, and `resolve` (every `auto` filled in for this rank's device).

    raw = parse_args(argv)        # flags, over an optional --config preset (YAML or Python, nanoGPT's idea)
    cfg = resolve(raw, info)      # validated, every `auto` filled in for this rank's device: frozen

Nothing downstream reads a raw flag: the run is built from `cfg`.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import inspect
import math
import os
import re
import runpy
import sys
import textwrap
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import torch

from dataset import rgym
from dataset.rlaif import TOOLS_PLACEHOLDER
from trainer.config import GAE_ONLY_FLAGS, GROUPS, Config
from trainer.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, EstimatorSpec, PolicyLossSpec, estimator_spec, policy_loss_spec
from trainer.run.hardware import layer_matmul_params, model_config, resolve_precision, use_parallel_update
from trainer.runtime import DistInfo


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source, as CleanRL's tyro does)."""
    cls_def = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(cls_def, ast.ClassDef)
    body = cls_def.body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _kind(hint: Any) -> tuple[type, list | None, bool]:
    """(value type, choices, is a list) of a field's type hint."""
    origin, targs = get_origin(hint), get_args(hint)
    if origin is Literal:
        return type(targs[0]), list(targs), False
    if origin is tuple:
        return targs[0], None, True
    if targs and type(None) in targs:  # X | None
        inner = next(a for a in targs if a is not type(None))
        return (type(get_args(inner)[0]), list(get_args(inner)), False) if get_origin(inner) is Literal else (inner, None, False)
    return hint, None, False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train_ppo.py", description="minippo: PPO for small causal LMs (MiniMind flag names)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a preset (YAML or Python file, e.g. configs/grpo_demo.yaml) whose settings become the defaults; "
                        "flags on the command line override it")
    for _, (cls, title) in GROUPS.items():
        g = p.add_argument_group(title)
        docs, hints = field_docs(cls), _hints(cls)
        for f in fields(cls):
            typ, choices, is_list = _kind(hints[f.name])
            meta = f.metadata
            if "choices" in meta:
                choices = meta["choices"]()
            helptext = argparse.SUPPRESS if meta.get("hidden") else docs[f.name].replace("%", "%%")
            kw: dict[str, Any] = {"default": f.default, "help": helptext, "dest": f.name}
            if is_list:
                kw.update(action="append", default=[], type=typ, metavar="MODULE:FN")
            else:
                kw.update(type=typ, choices=choices)
                if "const" in meta:
                    kw.update(nargs="?", const=meta["const"])
            g.add_argument(f"--{f.name}", **kw)
    return p


def parse_args(argv: list[str] | None = None) -> Config:
    """The command line (over a --config preset) as a Config, not yet resolved. Bad flags exit with argparse's
    one-line usage error; a bad preset with one line naming the file and setting."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    preset_path = p.parse_known_args(argv)[0].config
    preset = load_preset(preset_path, p) if preset_path else {}
    p.set_defaults(**preset)
    ns = vars(p.parse_args(argv))
    if any(ns[k] is not None for k in MINIMIND_GRPO_FLAGS):  # MiniMind's train_grpo.py command line: its defaults
        p.set_defaults(**{k: v for k, v in minimind_grpo(ns, given_flags(argv)).items() if k not in preset})
        ns = vars(p.parse_args(argv))
    cfg = Config(config=ns.pop("config")).replace(**{k: tuple(v) if isinstance(v, list) else v for k, v in ns.items()})
    warn_unused(cfg)
    return cfg


# ---- MiniMind's names, in one table each
# train_grpo.py's names for our settings: (its flag, ours, its default).
MINIMIND_ALIASES = (("beta", "kl_coef", 0.1), ("epsilon", "clip_epsilon", 0.2), ("epsilon_high", "cispo_max_weight", 5.0))
MINIMIND_GRPO_FLAGS = ("loss_type", *(theirs for theirs, _, _ in MINIMIND_ALIASES))
MINIMIND_LOSS_TYPES = {"grpo": "vanilla", "cispo": "cispo"}  # MiniMind's --loss_type -> our --policy_loss
# MiniMind flags accepted and not acted on: the values that change nothing (ours, MiniMind's default), and why.
MINIMIND_NOT_ACTED_ON = {
    "num_workers": ((0, 8), "prompts are tokenised in-process, no DataLoader workers are started"),
    "debug_log_ratio": ((0,), "ppo/ratio and ppo/approx_kl are logged every step anyway"),
}
_UNSET = object()
# Settings only a rollout engine reads (--rollout_engine torch ignores them, with a warning).
ENGINE_ONLY_FLAGS = ("engine_url", "engine_sync_interval", "engine_shared_path", "engine_timeout", "rollout_is", "rollout_is_cap",
                     "sglang_base_url", "sglang_model_path", "sglang_shared_path")


def given_flags(argv: list[str]) -> set[str]:
    """The settings given on the command line itself (not defaults, not a preset's)."""
    p = build_parser()
    p.set_defaults(**{a.dest: None if isinstance(a, argparse._AppendAction) else _UNSET
                      for a in p._actions if a.option_strings and a.dest != "help"})
    return {k for k, v in vars(p.parse_args(argv)).items() if v is not _UNSET and v is not None}


def minimind_grpo(ns: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """MiniMind's trainer/train_grpo.py as settings: GRPO advantages with its population std + 1e-4, the k3 KL in
    the loss at --beta, each response's token mean then the batch mean, one update over the whole batch, 6
    responses per prompt, its output name (grpo); --loss_type cispo (its default) = --policy_loss cispo capped at
    --epsilon_high, grpo = the clipped surrogate at --epsilon (symmetric). A flag given beside its MiniMind name is
    refused."""
    ours: dict[str, Any] = {}
    for theirs, name, default in MINIMIND_ALIASES:
        if name in given and theirs in given:
            raise SystemExit(f"error: --{theirs} is MiniMind's name for --{name}: give one of them")
        ours[name] = default if ns[theirs] is None else ns[theirs]
    return dict(advantage_estimator="grpo", policy_loss=MINIMIND_LOSS_TYPES[ns["loss_type"] or "cispo"],
                num_generations=6, kl_placement="loss", kl_estimator="k3", **ours, clip_epsilon_high=ours["clip_epsilon"],
                loss_agg_mode="seq_mean_token_mean", adv_std_unbiased=0, adv_eps=1e-4, ppo_update_iters=1, mini_batch_size=0,
                save_weight="grpo")


def warn_unused(cfg: Config) -> list[str]:
    """One line each, not an error, for settings given and not acted on: critic settings a critic-free estimator
    ignores (a command line may switch estimators), and MiniMind flags set to a value that changes nothing here.
    Printed on rank 0; returned."""
    lines = []
    defaults = Config()
    unused = [f"--{k}" for k in GAE_ONLY_FLAGS if getattr(cfg, k) != getattr(defaults, k)] if cfg.critic_free else []
    if unused:
        lines.append(f"warning: --advantage_estimator {cfg.advantage_estimator} builds no critic: {', '.join(unused)} "
                     f"{'is' if len(unused) == 1 else 'are'} ignored")
    if cfg.rollout_engine == "torch":
        given = [f"--{k}" for k in ENGINE_ONLY_FLAGS if getattr(cfg, k) != getattr(defaults, k)]
        if given:
            lines.append(f"warning: {', '.join(given)} {'is' if len(given) == 1 else 'are'} not acted on: the policy samples "
                         f"in this process (--rollout_engine torch); give --rollout_engine vllm / sglang to use an engine")
    for flag, (inert, why) in MINIMIND_NOT_ACTED_ON.items():
        if getattr(cfg, flag) not in inert:
            lines.append(f"warning: --{flag} {getattr(cfg, flag)} is accepted for MiniMind's command lines and not acted on: {why}")
    if os.environ.get("RANK", "0") == "0":
        for line in lines:
            print(line, file=sys.stderr)
    return lines


def load_preset(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """A preset's settings, checked as flags are: a YAML mapping (flat, or by group: `ppo: {clip_epsilon: 0.1}`)
    or a Python file whose top-level names are settings (nanoGPT's config/*.py)."""
    where = f"--config {path}"
    if not Path(path).is_file():
        raise SystemExit(f"error: {where}: file not found")
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        elif path.endswith(".py"):
            raw = {k: v for k, v in runpy.run_path(path).items()
                   if not k.startswith("_") and not inspect.ismodule(v) and not callable(v)}
        else:
            raise SystemExit(f"error: {where}: expected a .yaml, .yml or .py file")
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - a syntax error in the user's file: one line naming it
        raise SystemExit(f"error: {where}: cannot read it: {type(e).__name__}: {' '.join(str(e).split())}") from None
    if not isinstance(raw, dict):
        raise SystemExit(f"error: {where}: expected a mapping of settings (name: value)")
    flat: dict[str, Any] = {}
    for k, v in raw.items():
        if k in GROUPS and isinstance(v, dict):
            flat.update(v)
        else:
            flat[k] = v
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    out = {}
    for k, v in flat.items():
        a = actions.get(k)
        if a is None or k in ("config", "help"):
            near = difflib.get_close_matches(str(k), list(actions), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise SystemExit(f"error: {where}: unknown setting {k!r}{hint}; settings are the flags of train_ppo.py --help")
        out[k] = _preset_value(where, k, v, a)
    return out


def _preset_value(where: str, name: str, v: Any, a: argparse.Action) -> Any:
    """A preset value as the flag's type (YAML booleans for 0/1 flags), in its choices; a list for a repeatable flag."""
    typ = a.type if callable(a.type) else None  # the parser's types are callables (int, float, str)
    if isinstance(a, argparse._AppendAction):
        return [_coerce(where, name, x, typ, None) for x in (v if isinstance(v, list) else [v])]
    return None if v is None else _coerce(where, name, v, typ, None if a.choices is None else list(a.choices))


def _coerce(where: str, name: str, v: Any, typ: Callable[[Any], Any] | None, choices: list | None) -> Any:
    if isinstance(v, bool):
        v = int(v)
    try:
        if typ is int and isinstance(v, float) and not v.is_integer():
            raise ValueError
        v = typ(v) if typ is not None else v
    except (TypeError, ValueError):
        raise SystemExit(f"error: {where}: {name}: {v!r} is not a valid {getattr(typ, '__name__', 'value')}") from None
    if choices is not None and v not in choices:
        raise SystemExit(f"error: {where}: {name}: {v!r} is not one of {', '.join(map(str, choices))}")
    return v


# --------------------------------------------------------------------------------------- resolve
def eval_data_path(cfg: Config) -> str | None:
    """--eval_data_path resolved: auto = the demo's held-out file beside the demo's training prompts, or with
    --reasoning_gym its held-out rows (rgym.HELD_OUT)."""
    if cfg.eval_data_path in (None, "none"):
        return None
    if cfg.eval_data_path != "auto":
        return cfg.eval_data_path
    if reasoning_gym(cfg):
        return rgym.HELD_OUT
    held_out = Path(cfg.data_path).with_name("demo_eval.jsonl")
    return str(held_out) if Path(cfg.data_path).name == "demo_train.jsonl" and held_out.is_file() else None


def reasoning_gym(cfg: Config) -> str | None:
    """The --reasoning_gym spec, None when off (unset or 'none')."""
    return None if cfg.reasoning_gym in (None, "", "none") else cfg.reasoning_gym


def reasoning_gym_checks(cfg: Config) -> list[tuple[bool, str]]:
    """--reasoning_gym: the package, the task names and their settings (one line each), and --data_path unused."""
    spec = reasoning_gym(cfg)
    if spec is None:
        return [(Path(cfg.data_path).is_file(), f"--data_path {cfg.data_path}: file not found")]
    try:
        rgym.parse_spec(spec)
        problem = None
    except rgym.ReasoningGymError as e:
        problem = str(e)
    default_data = next(f.default for f in fields(Config) if f.name == "data_path")
    return [
        (problem is None, problem or ""),
        (cfg.data_path == default_data,
         f"--data_path {cfg.data_path} and --reasoning_gym {spec} both give the training prompts: drop one "
         f"(--reasoning_gym none reads --data_path)"),
        (cfg.reasoning_gym_size >= 1, "--reasoning_gym_size must be >= 1"),
    ]


_UNREAD = object()


def resolve(raw: Config, info: DistInfo, mc: object | None = _UNREAD) -> Config:
    """`raw` validated and every `auto` filled in for this rank's device: --device, --dtype, --frozen_low_precision,
    --kl_placement / --kl_estimator (the estimator's own), --clip_epsilon_high, --loss_agg_mode (the loss's own),
    --mini_batch_size 0 (every row), --eval_data_path, --reasoning_gym ('none' = None),
    --train_attn_implementation, --parallel_update, --save_merged, --hidden_size (an --actor_path model's
    own), --sample_interval (MiniMind's --debug_mode uses --debug_interval), --swanlab_mode (--use_wandb 0),
    --engine_url / --engine_shared_path (MiniMind's --sglang_* names, the defaults)."""
    if raw.resolved:
        return raw
    validate(raw)
    device = info.device
    if mc is _UNREAD:  # the actor's transformers config (None: unreadable), if the caller has not read it
        mc = model_config(raw)
    dtype, frozen = resolve_precision(raw, device, None if mc is None else layer_matmul_params(mc))
    est = estimator_spec(raw.advantage_estimator)
    cpu_bf16 = device.type == "cpu" and dtype == "bfloat16" and not raw.use_compile
    attn = raw.train_attn_implementation
    if attn == "auto":  # torch's CPU flash-attention backward under bf16 is slow at PPO's short sequences
        attn = "eager" if cpu_bf16 else "model"
    hidden = getattr(mc, "hidden_size", None) if raw.actor_path else None
    reuse = raw.can_reuse_values if raw.reuse_values == -1 else raw.reuse_values
    return raw.replace(
        device=device.type if raw.device == "auto" else raw.device, reuse_values=int(reuse),
        dtype=dtype, frozen_low_precision=int(frozen != torch.float32),
        kl_placement=est.kl_placement if raw.kl_placement == "auto" else raw.kl_placement,
        kl_estimator=est.kl_estimator if raw.kl_estimator == "auto" else raw.kl_estimator,
        clip_epsilon_high=raw.loss.clip_epsilon_high,  # --clip_epsilon where not given
        loss_agg_mode=policy_loss_spec(raw.policy_loss).loss_agg if raw.loss_agg_mode == "auto" else raw.loss_agg_mode,
        mini_batch_size=raw.minibatch_rows,
        eval_data_path=eval_data_path(raw), reasoning_gym=reasoning_gym(raw), train_attn_implementation=attn,
        parallel_update=int(use_parallel_update(raw.parallel_update, device, info.enabled or raw.strategy == "fsdp2", cpu_bf16, bool(reuse),
                                                    raw.num_threads or None)),
        save_merged=raw.save_merged if raw.save_merged >= 0 else int(not raw.actor_path),
        hidden_size=hidden or raw.hidden_size, sample_interval=raw.debug_interval if raw.debug_mode else raw.sample_interval,
        swanlab_mode=raw.swanlab_mode if raw.use_wandb else "disabled",
        engine_url=",".join(engine_urls(raw)) or None, engine_shared_path=engine_shared_path(raw),
    )._resolved()


DEVICE_FLAG = re.compile(r"cpu|cuda(:\+?\d+)?|")  # --ref_device / --critic_device / --reward_device


def seq_advantage_checks(cfg: Config, est: EstimatorSpec | None, loss: PolicyLossSpec | None) -> list[tuple[bool, str]]:
    """A loss that needs one advantage per response (gspo, gmpo: the registry's seq_advantages) against what would
    make the estimator's advantage vary per token: the KL in the reward (the KL to go differs per token) or a
    discount (the score discounted back from the last token). GMPO would average it silently."""
    if est is None or loss is None or not loss.seq_advantages:
        return []
    need = f"--policy_loss {cfg.policy_loss} needs one advantage per response:"
    placement = est.kl_placement if cfg.kl_placement == "auto" else cfg.kl_placement
    who = f"--advantage_estimator {cfg.advantage_estimator}" if cfg.kl_placement == "auto" else "--kl_placement reward"
    kl_free = cfg.kl_coef == 0 and not cfg.adaptive_kl  # a KL reward of 0 x KL varies nothing
    return [
        (placement != "reward" or kl_free,
         f"{need} {who} puts the KL in the reward (per token); {'add' if cfg.kl_placement == 'auto' else 'use'} "
         f"--kl_placement loss"),
        (cfg.gamma == 1, f"{need} --gamma {cfg.gamma} discounts the score per token; use --gamma 1"),
    ]


def fsdp2_checks(cfg: Config) -> list[tuple[bool, str]]:
    """What --strategy fsdp2 does not combine with, as validate's (ok, message) pairs."""
    if cfg.strategy != "fsdp2":
        return [(not cfg.cpu_offload, "--cpu_offload 1 offloads FSDP2's shards: it needs --strategy fsdp2"),
                (cfg.hsdp != 1, "--hsdp 1 shards within a node and replicates across nodes: it needs --strategy fsdp2")]
    why = "under --strategy fsdp2"
    return [
        (cfg.lora_r == 0, f"--lora_r {cfg.lora_r} {why}: LoRA adapters are small enough for --strategy ddp; use that"),
        (not cfg.use_moe, f"--use_moe 1 {why} is not supported (experts a rank does not route to have no gradient "
                          f"there); use --strategy ddp"),
        (not cfg.use_compile, f"--use_compile 1 {why} is not supported yet; drop it"),
        (cfg.parallel_update != 1, f"--parallel_update 1 {why}: the sharded backward all-gathers and reduce-scatters "
                                   f"per layer, which two threads would issue in different orders on different ranks"),
        (not (cfg.ref_device or cfg.critic_device or cfg.reward_device),
         f"--ref_device / --critic_device / --reward_device {why}: every model is sharded over the ranks' own devices; "
         f"drop them (--shard_frozen 1 shards the frozen models instead of moving them)"),
        (not cfg.cpu_offload or cfg.device != "cpu",
         "--cpu_offload 1 moves a GPU run's shards to host memory; a CPU run has nothing to offload: drop it"),
    ]


def engine_checks(cfg: Config) -> list[tuple[bool, str]]:
    """What a rollout engine needs and does not combine with, as validate's (ok, message) pairs."""
    if cfg.rollout_engine == "torch":
        return [(not cfg.async_rollouts,
                 f"--async_rollouts {cfg.async_rollouts} needs --rollout_engine vllm / sglang: with torch the policy "
                 f"samples in the trainer's own process, so there is nothing to sample beside the update")]
    eng = f"--rollout_engine {cfg.rollout_engine}"
    why = "" if cfg.engine_shared_path or cfg.sglang_shared_path else shared_default_unreadable(cfg)
    return [
        (cfg.rollout_engine != "vllm" or bool(cfg.engine_url),
         f"{eng} needs --engine_url http://HOST:PORT of a running vLLM server (scripts/serve_engine.sh vllm MODEL_DIR "
         f"starts one; docs/engines.md)"),
        (cfg.rollout_engine != "vllm" or not (cfg.sglang_base_url or cfg.sglang_shared_path),
         f"{eng}: --sglang_base_url / --sglang_shared_path are SGLang's; give --engine_url / --engine_shared_path"),
        (not (cfg.engine_url and cfg.sglang_base_url),
         "--sglang_base_url is MiniMind's name for --engine_url: give one of them"),
        (not (cfg.engine_shared_path and cfg.sglang_shared_path),
         "--sglang_shared_path is MiniMind's name for --engine_shared_path: give one of them"),
        (all(re.fullmatch(r"https?://[^\s,/]+(/\S*)?", u) for u in engine_urls(cfg)),
         f"--engine_url {cfg.engine_url or cfg.sglang_base_url}: expected http://HOST:PORT (comma-separated for several)"),
        (cfg.engine_sync_interval >= 1, "--engine_sync_interval must be >= 1 (updates between weight pushes)"),
        (cfg.async_rollouts >= 0, "--async_rollouts must be >= 0 (batches the engine samples ahead; 0 = take turns)"),
        (not (cfg.async_rollouts and cfg.filter_groups),
         f"--async_rollouts {cfg.async_rollouts} with --filter_groups 1: the extra prompt batches a step draws are not "
         f"sampled ahead; use one of them"),
        (not (cfg.async_rollouts and cfg.tools),
         f"--async_rollouts {cfg.async_rollouts} with --tools: multi-turn episodes run tools between their engine calls "
         f"and are not sampled ahead; use one of them"),
        (not (cfg.async_rollouts and estimator_spec(cfg.advantage_estimator).needs_baseline_rollout),
         f"--async_rollouts {cfg.async_rollouts} with --advantage_estimator {cfg.advantage_estimator}: its greedy "
         f"baseline rollout is not sampled ahead; use another estimator (grpo, rloo, ...) or --async_rollouts 0"),
        (math.isfinite(cfg.engine_timeout) and cfg.engine_timeout > 0, "--engine_timeout must be a number of seconds > 0"),
        (math.isfinite(cfg.rollout_is_cap) and cfg.rollout_is_cap >= 1,
         f"--rollout_is_cap {cfg.rollout_is_cap} must be a finite number >= 1 (an on-policy token's weight is 1)"),
        (cfg.rollout_engine != "sglang" or cfg.rollout_is == "none" or bool(cfg.greedy) or (cfg.top_k <= 0 and cfg.top_p >= 1),
         f"{eng} with --top_k {cfg.top_k} / --top_p {cfg.top_p}: SGLang returns log-probs over the whole vocabulary, not "
         f"over the tokens top-k / top-p keep, so the --rollout_is weights cannot be exact; use --rollout_engine vllm, drop "
         f"--top_k / --top_p, or pass --rollout_is none (measured, not applied)"),
        (cfg.sglang_model_path is None or any((Path(cfg.sglang_model_path) / f).is_file() for f in TOKENIZER_FILES),
         f"--sglang_model_path {cfg.sglang_model_path}: no tokenizer there (MiniMind's meaning: the tokenizer "
         f"directory, e.g. model/; it goes with every weight push)"),
        (not why,
         f"--engine_shared_path is needed: {why}, and the default folder is in rank 0's memory (/dev/shm) where "
         f"that engine cannot read the pushed weights; give --engine_shared_path a folder that rank 0 and every engine "
         f"can read (a shared filesystem path)"),
    ]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
LOOPBACK = re.compile(r"localhost|127(\.\d+){3}|\[?::1\]?|0\.0\.0\.0")


def _host(url: str) -> str:
    return re.sub(r":\d+$", "", url.split("://", 1)[-1].split("/", 1)[0]).strip("[]").lower()


def shared_default_unreadable(cfg: Config) -> str:
    """Why the default push folder (in rank 0's /dev/shm) cannot serve every engine ('' where it can): a run over
    several nodes (each node's engine reads its own machine's memory), or an engine on another host. Decided from the
    flags and torchrun's environment alone, so every rank decides the same before the process group exists."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    nodes = world // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    if nodes > 1:
        return f"this run spans {nodes} nodes"
    import socket

    here = {socket.gethostname().lower(), socket.gethostname().lower().split(".")[0]}
    remote = [u for u in engine_urls(cfg) if not (LOOPBACK.fullmatch(_host(u)) or _host(u) in here)]
    return f"the engine at {remote[0]} is on another host" if remote else ""


URL = re.compile(r"https?://[^\s,/]+(/\S*)?")


def reward_server_checks(cfg: Config) -> list[tuple[bool, str]]:
    """--reward_model_url / --reward_url (trainer/reward_server.py), as validate's (ok, message) pairs."""
    rm_urls = [u.strip() for u in (cfg.reward_model_url or "").split(",") if u.strip()]
    no_rm = cfg.reward_model_path in (None, "none")
    return [
        (all(URL.fullmatch(u) for u in rm_urls) and (cfg.reward_model_url is None or bool(rm_urls)),
         f"--reward_model_url {cfg.reward_model_url}: expected http://HOST:PORT (comma-separated for several)"),
        (not rm_urls or not no_rm,
         "--reward_model_url needs --reward_model_path, the reward model's directory: its tokenizer and chat template "
         "render the text here (the server loads its weights)"),
        (not rm_urls or cfg.rm_weight != 0,
         "--reward_model_url scores the reward model, and --rm_weight is 0: give --rm_weight, or drop --reward_model_url"),
        (cfg.reward_url is None or URL.fullmatch(cfg.reward_url) is not None,
         f"--reward_url {cfg.reward_url}: expected http://HOST:PORT/PATH"),
        (math.isfinite(cfg.reward_url_weight), f"--reward_url_weight {cfg.reward_url_weight} must be a finite number"),
        (not (rm_urls or cfg.reward_url) or math.isfinite(cfg.reward_timeout) and 0 < cfg.reward_timeout < cfg.ddp_timeout,
         f"--reward_timeout {cfg.reward_timeout} must be a number of seconds > 0 and below --ddp_timeout "
         f"{cfg.ddp_timeout} (the other ranks wait that long for a rank's rewards)"),
    ]


def distill_checks(cfg: Config) -> list[tuple[bool, str]]:
    """On-policy distillation (--distill_coef, --teacher_model_path / --teacher_url; trainer/distill.py), as validate's
    (ok, message) pairs."""
    teacher = cfg.teacher_model_path or cfg.teacher_url
    urls = [u.strip() for u in (cfg.teacher_url or "").split(",") if u.strip()]
    loss = POLICY_LOSSES.get(cfg.policy_loss)
    return [
        (math.isfinite(cfg.distill_coef) and cfg.distill_coef >= 0, f"--distill_coef {cfg.distill_coef} must be a finite number >= 0"),
        (not (cfg.teacher_model_path and cfg.teacher_url), "--teacher_model_path and --teacher_url name one teacher two ways: give one"),
        (bool(teacher) or not cfg.distill_coef,
         f"--distill_coef {cfg.distill_coef} distills from a teacher: give --teacher_model_path (an HF directory or a MiniMind "
         f".pth) or --teacher_url (a vLLM server of it)"),
        (not teacher or cfg.distill_coef != 0,
         f"--{'teacher_model_path' if cfg.teacher_model_path else 'teacher_url'} is scored only for --distill_coef, which is "
         f"0: give --distill_coef (e.g. 1), or drop the teacher"),
        (cfg.teacher_url is None or (bool(urls) and all(URL.fullmatch(u) for u in urls)),
         f"--teacher_url {cfg.teacher_url}: expected http://HOST:PORT (comma-separated for several)"),
        (cfg.teacher_url is None or cfg.sample_temperature == 1,
         f"--teacher_url scores at temperature 1 (vLLM's prompt log-probs are the raw log-softmax) and the actor samples at "
         f"--temperature {cfg.temperature}: use --temperature 1, or a local teacher (--teacher_model_path)"),
        (not cfg.distill_coef or loss is None or not loss.seq_advantages,
         f"--policy_loss {cfg.policy_loss} needs one advantage per response, and --distill_coef puts the reverse KL in the "
         f"reward per token: use a per-token loss (vanilla, cispo, ...)"),
    ]


def engine_urls(cfg: Config) -> list[str]:
    """The engines' URLs: --engine_url (comma-separated), for sglang --sglang_base_url or MiniMind's default."""
    raw = cfg.engine_url or cfg.sglang_base_url or ("http://localhost:8998" if cfg.rollout_engine == "sglang" else "")
    return [u.strip() for u in raw.split(",") if u.strip()]


def engine_shared_path(cfg: Config) -> str | None:
    """Where pushed weights go: the flag, or a folder in /dev/shm (memory, no disk write) named after the first
    engine's host and port, or under --checkpoint_dir where there is no /dev/shm. The default's name is one anyone on
    the machine can guess: rank 0 makes it its own (0700) or refuses it, and empties it after each push
    (trainer/run/engine_sync.py push_folder)."""
    if cfg.rollout_engine == "torch":
        return cfg.engine_shared_path
    given = cfg.engine_shared_path or cfg.sglang_shared_path
    if given:
        return given
    tag = re.sub(r"[^A-Za-z0-9]+", "_", engine_urls(cfg)[0].split("://", 1)[-1]).strip("_")
    shm = Path("/dev/shm")
    return str(shm / f"minippo_engine_{tag}") if shm.is_dir() else str(Path(cfg.checkpoint_dir) / f"engine_{tag}")


def validate(cfg: Config) -> None:
    """One-line errors for settings that would otherwise fail deep inside the run."""
    rows = cfg.rows
    est = ADVANTAGE_ESTIMATORS.get(cfg.advantage_estimator)
    loss = POLICY_LOSSES.get(cfg.policy_loss)
    mb = cfg.minibatch_rows
    checks = [
        (est is not None, f"--advantage_estimator {cfg.advantage_estimator}: expected one of {', '.join(ADVANTAGE_ESTIMATORS)}"),
        (loss is not None, f"--policy_loss {cfg.policy_loss}: expected one of {', '.join(POLICY_LOSSES)}"),
        (cfg.batch_size >= 1, "--batch_size must be >= 1"),
        (cfg.num_generations >= 1, "--num_generations must be >= 1"),
        (mb >= 1 and rows % mb == 0,
         f"--mini_batch_size {cfg.mini_batch_size} must divide --batch_size x --num_generations = {rows} (or be 0: all)"),
        (cfg.accumulation_steps >= 1 and mb % cfg.accumulation_steps == 0,
         f"--accumulation_steps {cfg.accumulation_steps} must divide --mini_batch_size {mb}"),
        (cfg.max_gen_len >= 1, "--max_gen_len must be >= 1"),
        (cfg.max_seq_len >= 8, "--max_seq_len must be >= 8"),
        (cfg.temperature > 0 or cfg.greedy, "--temperature must be > 0 (or use --greedy 1)"),
        (0 < cfg.top_p <= 1, "--top_p must be in (0, 1]"),
        (cfg.ppo_update_iters >= 1, "--ppo_update_iters must be >= 1"),
        (0 <= cfg.thinking_ratio <= 1, "--thinking_ratio must be in [0, 1]"),
        (cfg.epochs >= 1, "--epochs must be >= 1"),
        (cfg.save_interval >= 1, "--save_interval must be >= 1"),
        *reasoning_gym_checks(cfg),
        (cfg.reward_model_path in (None, "none") or Path(cfg.reward_model_path).is_dir() or cfg.rm_weight == 0,
         f"--reward_model_path {cfg.reward_model_path}: not a directory (use 'none' or --rm_weight 0 to run without a reward model)"),
        (cfg.actor_path is None or Path(cfg.actor_path).is_dir(), f"--actor_path {cfg.actor_path}: not a directory"),
        (cfg.ddp_timeout > 0, "--ddp_timeout must be > 0 seconds"),
        (cfg.save_timeout > 0, "--save_timeout must be > 0 seconds"),
        (cfg.num_generations >= 2 or est is None or not est.needs_groups,
         f"--advantage_estimator {cfg.advantage_estimator} compares the --num_generations responses to each prompt: "
         f"give --num_generations >= 2 (e.g. 4)"),
        (cfg.ifeval_repairs >= 0, f"--ifeval_repairs {cfg.ifeval_repairs} must be >= 0 (rewritten samples per group; 0 = off)"),
        (not cfg.ifeval_repairs or cfg.ifeval_repairs < cfg.num_generations,
         f"--ifeval_repairs {cfg.ifeval_repairs} replaces samples of a group of --num_generations {cfg.num_generations} by "
         f"rewrites of its others: give --num_generations above it (e.g. 8)"),
        (not (cfg.ifeval_repairs and cfg.tools), "--ifeval_repairs rewrites single replies; --tools episodes are several turns: drop one"),
        (cfg.eos_placement == "reward" or est is None or est.needs_groups,
         f"--eos_placement advantage centres the EOS penalty within each group of responses: --advantage_estimator "
         f"{cfg.advantage_estimator} has none; use a group estimator (e.g. grpo) or --eos_placement reward"),
        (cfg.num_generations >= 2 or loss is None or not loss.needs_groups,
         f"--policy_loss {cfg.policy_loss} compares the --num_generations responses to each prompt: give --num_generations >= 2"),
        (loss is None or loss.estimators is None or cfg.advantage_estimator in loss.estimators,
         f"--policy_loss {cfg.policy_loss} pairs with --advantage_estimator {' / '.join((loss and loss.estimators) or ())} only "
         f"(it needs one advantage per response, compared within its group)"),
        *seq_advantage_checks(cfg, est, loss),
        (loss is None or not loss.agg_fixed or cfg.loss_agg_mode in ("auto", loss.loss_agg),
         f"--loss_agg_mode {cfg.loss_agg_mode}: --policy_loss {cfg.policy_loss} is defined per response "
         f"({loss.loss_agg if loss else ''}); drop --loss_agg_mode"),
        (cfg.clip_epsilon_high is None or not cfg.clip_epsilon_high < cfg.clip_epsilon,
         f"--clip_epsilon_high {cfg.clip_epsilon_high} is below --clip_epsilon {cfg.clip_epsilon}: the upper clip is "
         f"1 + --clip_epsilon_high (clip-higher raises it)"),
        (not cfg.gspo_clip_high < cfg.gspo_clip_low,
         f"--gspo_clip_high {cfg.gspo_clip_high} is below --gspo_clip_low {cfg.gspo_clip_low}"),
        (not cfg.clip_ratio_c <= 1, f"--clip_ratio_c {cfg.clip_ratio_c} must be > 1 (the dual clip bounds -A x c above PPO's clip)"),
        (not cfg.cispo_max_weight < 1, f"--cispo_max_weight {cfg.cispo_max_weight} must be >= 1 (an on-policy token's weight is 1)"),
        (cfg.clip_cov_lb < cfg.clip_cov_ub, f"--clip_cov_lb {cfg.clip_cov_lb} must be below --clip_cov_ub {cfg.clip_cov_ub}"),
        (0 < cfg.clip_cov_ratio <= 1 and 0 < cfg.kl_cov_ratio <= 1, "--clip_cov_ratio and --kl_cov_ratio must be in (0, 1]"),
        (cfg.num_generations >= 2 or not cfg.filter_groups,
         "--filter_groups 1 drops groups of --num_generations responses with equal rewards: give --num_generations >= 2"),
        (cfg.filter_max_rounds >= 1, "--filter_max_rounds must be >= 1"),
        (cfg.max_turns >= 1, "--max_turns must be >= 1"),
        (cfg.max_total_len > cfg.max_seq_len or not cfg.tools,
         f"--max_total_len {cfg.max_total_len} must exceed --max_seq_len {cfg.max_seq_len} (the prompt) to leave room for turns"),
        (math.isfinite(cfg.tool_timeout) and cfg.tool_timeout > 0, f"--tool_timeout {cfg.tool_timeout} must be a number of seconds > 0"),
        (cfg.max_tool_calls >= 1, f"--max_tool_calls {cfg.max_tool_calls} must be at least 1"),
        (cfg.logprob_chunk_size >= -1, f"--logprob_chunk_size {cfg.logprob_chunk_size}: give -1 (auto), 0 (off) or tokens"),
        (not cfg.tools or Path(cfg.tools).is_file(), f"--tools {cfg.tools}: file not found; give a .py module of tool functions"),
        (cfg.tools_system_prompt is None or bool(cfg.tools), "--tools_system_prompt lists the --tools: give --tools MODULE.py"),
        (cfg.tools_system_prompt is None or TOOLS_PLACEHOLDER in cfg.tools_system_prompt,
         "--tools_system_prompt has no {tools}, where the tools' JSON schemas go: put it where the model should read them"),
        (cfg.reuse_values != 1 or cfg.can_reuse_values,
         "--reuse_values 1 needs --advantage_estimator gae with one PPO epoch (--ppo_update_iters 1) of one minibatch "
         "(--mini_batch_size = --batch_size x --num_generations, --accumulation_steps 1)"),
        (cfg.critic_warmup_steps == 0 or est is None or est.needs_critic,
         f"--critic_warmup_steps trains the critic, but --advantage_estimator {cfg.advantage_estimator} has none: drop it"),
        (0 <= cfg.overlong_buffer_len < cfg.max_gen_len,
         f"--overlong_buffer_len {cfg.overlong_buffer_len} must be in [0, --max_gen_len {cfg.max_gen_len})"),
        (cfg.eval_interval >= 1 and cfg.eval_samples >= 1, "--eval_interval and --eval_samples must be >= 1"),
        (cfg.eval_data_path in ("auto", "none", None) or Path(cfg.eval_data_path).is_file()
         or (cfg.eval_data_path == rgym.HELD_OUT and reasoning_gym(cfg) is not None),
         f"--eval_data_path {cfg.eval_data_path}: file not found (or 'none' to train without evaluation)"),
        (cfg.lora_r >= 0, f"--lora_r {cfg.lora_r} must be >= 0 (0 = no LoRA, full fine-tuning)"),
        (math.isfinite(cfg.lora_alpha) and cfg.lora_alpha > 0, f"--lora_alpha {cfg.lora_alpha} must be a finite number > 0"),
        (0 <= cfg.lora_dropout < 1, f"--lora_dropout {cfg.lora_dropout} must be in [0, 1)"),
        (cfg.lora_r == 0 or not cfg.ref_device,
         f"--ref_device {cfg.ref_device}: with --lora_r > 0 the reference is the actor with its adapters off, on the "
         f"actor's device; drop --ref_device"),
        # torch.device() would take "tpu"/"mps" and fail later with a traceback.
        (re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device) is not None,
         f"--device {cfg.device}: expected one of auto, cpu, cuda, cuda:N"),
        *[(DEVICE_FLAG.fullmatch(getattr(cfg, f)) is not None,
           f"--{f} {getattr(cfg, f)}: expected cpu, cuda, cuda:N or cuda:+K (K GPUs after the rank's own), "
           f"or nothing (the actor's device)")
          for f in ("ref_device", "critic_device", "reward_device")],
        *fsdp2_checks(cfg),
        *engine_checks(cfg),
        *reward_server_checks(cfg),
        *distill_checks(cfg),
    ]
    # nan compares False with everything, so "x > 0" alone would let it through.
    for flag, lowest in (("beta", ">= 0"), ("epsilon", "> 0"), ("epsilon_high", "> 0"), ("learning_rate", "> 0"),
                         ("critic_learning_rate", "> 0"), ("grad_clip", "> 0"),
                         ("clip_epsilon", "> 0"), ("kl_coef", ">= 0"), ("clip_epsilon_high", "> 0"), ("overlong_penalty", ">= 0"),
                         ("gspo_clip_low", "> 0"), ("gspo_clip_high", "> 0"), ("gmpo_clip", "> 0"), ("kl_cov_coef", ">= 0"),
                         ("sapo_tau_pos", "> 0"), ("sapo_tau_neg", "> 0"), ("adv_eps", ">= 0"), ("reward_clip", ">= 0"),
                         ("tool_error_penalty", ">= 0"), ("tool_ok_weight", ">= 0"), ("reward_max_abs", "> 0"),
                         ("verifier_timeout", "> 0")):
        v = getattr(cfg, flag)
        if v is None:  # --clip_epsilon_high or a MiniMind name not given
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
    for label, value in ((f"--checkpoint_dir {cfg.checkpoint_dir}", cfg.checkpoint_dir),
                         (f"--save_dir {cfg.save_dir}", cfg.save_dir),
                         (f"--run_dir {cfg.run_dir}" if cfg.run_dir else "--run_dir (default runs/...)",
                          cfg.run_dir or "runs")):
        f = blocking_file(value)
        where = "is a file" if f == Path(value) else f"{f} is a file"
        checks.append((f is None, f"{label}: {where}, not a directory; give a directory path (created if missing)"))
    for ok, msg in checks:
        if not ok:
            raise SystemExit(f"error: {msg}")


def reference_markdown() -> str:
    """Every setting by group, as docs/configuration.md lists it (tests/test_cli.py keeps the two equal)."""
    out = []
    for _, (cls, title) in GROUPS.items():
        docs, hints = field_docs(cls), _hints(cls)
        out += [f"### {title}", "", "| flag | default | what it does |", "|---|---|---|"]
        for f in fields(cls):
            if f.metadata.get("hidden"):
                continue
            choices = f.metadata["choices"]() if "choices" in f.metadata else _kind(hints[f.name])[1]
            default = f"`{f.default!r}`" + (f" ({' / '.join(map(str, choices))})" if choices else "")
            out.append(f"| `--{f.name}` | {default} | {docs[f.name].replace('|', '/')} |")
        out.append("")
    return "\n".join(out)
