"""trainer/run/cli.py: the command line generated from the config, presets, MiniMind's names, validation, resolve()."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dataset import rgym
from trainer import config as config_mod
from trainer.registry import ADVANTAGE_ESTIMATORS, policy_loss_spec
from trainer.run import cli as C
from trainer.runtime import DistInfo

ROOT = Path(__file__).resolve().parents[1]
FLAGS_V1 = json.loads((ROOT / "tests" / "fixtures" / "flags_v1.json").read_text())


def _flat(cfg: config_mod.Config) -> dict:
    out = cfg.flat()
    out.pop("config")
    return out


def _as_before(flat: dict) -> dict:
    """Settings that became `auto` since flags_v1, as resolve() fills them (the value the old parser gave)."""
    if flat["loss_agg_mode"] == "auto":
        flat = {**flat, "loss_agg_mode": policy_loss_spec(flat["policy_loss"]).loss_agg}
    return flat


def test_every_flag_of_the_previous_parser_parses_to_the_same_value():
    """tests/fixtures/flags_v1.json was written by the hand-written parser this config replaced: its
    defaults, a MiniMind command line, and every flag set to a non-default value one at a time."""
    new_defaults = _as_before(_flat(C.parse_args([])))
    old = FLAGS_V1["defaults"]
    assert {k: new_defaults[k] for k in old} == old
    for name, case in FLAGS_V1["cases"].items():
        got = _as_before(_flat(C.parse_args(case["argv"])))
        assert {k: got[k] for k in case["changed"]} == case["changed"], name
        assert all(got[k] == old[k] for k in old if k not in case["changed"]), name


def test_new_settings_default_to_the_previous_behaviour():
    added = set(_flat(C.parse_args([]))) - set(FLAGS_V1["defaults"])
    losses = {"clip_ratio_c", "cispo_max_weight", "gspo_clip_low", "gspo_clip_high", "gmpo_clip", "clip_cov_ratio", "clip_cov_lb",
              "clip_cov_ub", "kl_cov_ratio", "kl_cov_coef", "sapo_tau_pos", "sapo_tau_neg"}
    minimind_grpo = {"loss_type", "beta", "epsilon", "epsilon_high"}
    assert added == {"policy_loss", "reuse_values", "mask_truncated", "adv_std_unbiased", "adv_eps", "reward_norm",
                     "reward_clip", "ifeval_weight", "strategy", "shard_frozen", "cpu_offload", *losses, *minimind_grpo,
                     "tools", "max_turns", "max_total_len", "tool_timeout", "tool_error_penalty", "save_timeout", "hsdp",
                     "tools_system_prompt", "tool_ok_weight", "ifeval_partial_weight",
                     "engine_url", "engine_sync_interval", "engine_shared_path", "engine_timeout", "rollout_is", "rollout_is_cap",
                     "async_rollouts",
                     "reasoning_gym", "reasoning_gym_size", "cuda_graphs", "padding_free",
                     "reward_model_url", "reward_url", "reward_url_weight", "reward_timeout",
                     "max_tool_calls", "reward_max_abs", "verifier_timeout", "logprob_chunk_size",
                     "teacher_model_path", "teacher_url", "distill_coef", "eos_placement", "ifeval_repairs"}
    cfg = C.resolve(C.parse_args([]), DistInfo())
    assert cfg.policy_loss == "vanilla" and cfg.reuse_values == 0 and cfg.loss_agg_mode == "token_mean"
    assert (cfg.mask_truncated, cfg.adv_std_unbiased, cfg.adv_eps, cfg.reward_norm, cfg.reward_clip) == (0, 1, 1e-6, "none", 0.0)
    assert all(getattr(cfg, k) is None for k in minimind_grpo)
    assert (cfg.strategy, cfg.cpu_offload) == ("ddp", 0)  # DDP as before; --shard_frozen only matters under fsdp2
    assert cfg.tools is None  # single-turn rollouts as before; the other tool settings only matter with --tools
    assert cfg.tools_system_prompt is None and cfg.tool_ok_weight == 0  # tools through the template, no call bonus
    assert cfg.rollout_engine == "torch" and cfg.engine_url is None  # sampling in this process; engine settings unread
    assert cfg.async_rollouts == 0  # sampling, scoring and updating take turns
    assert cfg.reasoning_gym is None  # prompts from --data_path; --reasoning_gym_size only matters with --reasoning_gym
    assert cfg.reward_model_url is None and cfg.reward_url is None  # rewards in this process; the weight, timeout unread
    # cuda_graphs (on) changes nothing on a CPU (tests/test_generation.py::test_cpu_sampling_keeps_its_decode_loop)
    assert cfg.padding_free == 1  # the same math on packed rows (tests/test_padding_free.py: equal to rounding)
    # Bounds on what others send (docs/security.md): rewards within 1e4 pass unchanged, as before; the call cap and the
    # verifier's time limit only matter with --tools / --reasoning_gym.
    assert (cfg.reward_max_abs, cfg.max_tool_calls, cfg.verifier_timeout) == (1e4, 8, 10.0)
    assert cfg.eos_placement == "reward"  # the EOS penalty is a term of the reward, as before


def test_yaml_preset_is_overridden_by_flags(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("advantage_estimator: grpo\nnum_generations: 4\nppo:\n  clip_epsilon: 0.1\nfast_decode: false\n"
                 "reward_fn: [a:f]\n")
    cfg = C.parse_args(["--config", str(p), "--num_generations", "8"])
    assert (cfg.advantage_estimator, cfg.num_generations, cfg.clip_epsilon, cfg.fast_decode) == ("grpo", 8, 0.1, 0)
    assert cfg.reward_fn == ("a:f",) and cfg.config == str(p)
    assert cfg.flat()["config"] == str(p)


def test_python_preset(tmp_path):
    p = tmp_path / "p.py"
    p.write_text("import math\nbatch_size = 8\nmini_batch_size = 8\n_private = 1\nlearning_rate = 1e-5 * math.sqrt(4)\n")
    cfg = C.parse_args(["--config", str(p)])
    assert (cfg.batch_size, cfg.mini_batch_size, cfg.learning_rate) == (8, 8, 2e-5)


@pytest.mark.parametrize("text,msg", [
    ("cliprange: 0.1\n", "unknown setting 'cliprange' (did you mean cliprange_value?)"),
    ("advantage_estimator: ppo2\n", "advantage_estimator: 'ppo2' is not one of"),
    ("batch_size: 2.5\n", "batch_size: 2.5 is not a valid int"),
    ("- a\n- b\n", "expected a mapping"),
    ("a: [\n", "cannot read it"),
])
def test_bad_presets_are_one_line(tmp_path, text, msg):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(SystemExit) as e:
        C.parse_args(["--config", str(p)])
    assert str(e.value).startswith(f"error: --config {p}: ") and msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_missing_preset_is_one_line_from_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, "train_ppo.py", "--config", "nope.yaml"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip() == "error: --config nope.yaml: file not found"


def test_shipped_presets_parse_and_resolve(tmp_path):
    from tests.tiny_hf import save_tiny_causal_lm

    stand_in = tmp_path / "hf"  # a preset's --actor_path is imported by the user first (not in a fresh clone)
    save_tiny_causal_lm(stand_in)
    presets = sorted((ROOT / "configs").glob("*.yaml"))
    assert {p.name for p in presets} >= {"demo.yaml", "grpo_demo.yaml", "smollm2_ifeval.yaml"}
    for p in presets:
        args = C.parse_args(["--config", str(p)])
        if args.actor_path and not Path(args.actor_path).is_dir():
            args = C.parse_args(["--config", str(p), "--actor_path", str(stand_in)])
        if args.reasoning_gym and not rgym.available():  # the package is optional: tests/test_reasoning_gym.py
            args = args.replace(reasoning_gym=None)  # checks the preset with it; its other settings resolve here
        cfg = C.resolve(args, DistInfo())
        assert cfg.resolved and cfg.max_steps > 0, p


def test_resolve_fills_every_auto_and_is_frozen():
    cfg = C.resolve(C.parse_args([]), DistInfo())
    flat = cfg.flat()
    # --arch auto is read off the weights file as it loads (model/loader.py), not a rule to resolve here.
    assert {k for k, v in flat.items() if v == "auto"} == {"arch"}
    assert -1 not in (flat["parallel_update"], flat["save_merged"], flat["reuse_values"], flat["frozen_low_precision"])
    assert (cfg.dtype, cfg.kl_placement, cfg.kl_estimator, cfg.clip_epsilon_high) == ("float32", "reward", "k1", 0.2)
    assert cfg.eval_data_path == "dataset/demo_eval.jsonl" and cfg.save_merged == 1 and cfg.train_attn is None
    assert C.resolve(cfg, DistInfo()) is cfg  # once


@pytest.mark.parametrize("est", list(ADVANTAGE_ESTIMATORS))
def test_kl_defaults_come_from_the_registry(est):
    cfg = C.resolve(C.parse_args(["--advantage_estimator", est, "--num_generations", "2"]), DistInfo())
    spec = ADVANTAGE_ESTIMATORS[est]
    assert (cfg.kl_placement, cfg.kl_estimator) == (spec.kl_placement, spec.kl_estimator)
    assert cfg.critic_free == (not spec.needs_critic)


def test_minimind_debug_mode_and_use_wandb_resolve():
    cfg = C.resolve(C.parse_args(["--debug_mode", "--debug_interval", "7", "--use_wandb", "0"]), DistInfo())
    assert cfg.sample_interval == 7 and cfg.swanlab_mode == "disabled"


def test_reuse_values_auto_and_refused_where_it_cannot_hold():
    one = C.resolve(C.parse_args(["--batch_size", "4", "--mini_batch_size", "4"]), DistInfo())
    assert one.reuse_values == 1
    assert C.resolve(C.parse_args([]), DistInfo()).reuse_values == 0
    with pytest.raises(SystemExit, match="--reuse_values 1 needs"):
        C.resolve(C.parse_args(["--reuse_values", "1"]), DistInfo())


def test_a_resumed_run_compares_resolved_values():
    """An explicit value equal to what auto resolves to is the same run (a resume accepts it)."""
    a = C.resolve(C.parse_args([]), DistInfo()).flat()
    b = C.resolve(C.parse_args(["--kl_placement", "reward", "--dtype", "float32", "--clip_epsilon_high", "0.2"]), DistInfo()).flat()
    assert {k: v for k, v in a.items() if a[k] != b[k]} == {}


def test_the_reference_in_docs_is_the_configs_own():
    """docs/configuration.md lists every setting as the dataclasses define it (regenerate with
    trainer.run.cli.reference_markdown() after changing a field)."""
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert C.reference_markdown() in text


@pytest.mark.parametrize("argv, says", [
    (["--strategy", "fsdp2", "--lora_r", "8"], "--lora_r 8 under --strategy fsdp2"),
    (["--strategy", "fsdp2", "--use_moe", "1"], "--use_moe 1 under --strategy fsdp2"),
    (["--strategy", "fsdp2", "--use_compile", "1"], "--use_compile 1 under --strategy fsdp2"),
    (["--strategy", "fsdp2", "--parallel_update", "1"], "--parallel_update 1 under --strategy fsdp2"),
    (["--strategy", "fsdp2", "--ref_device", "cpu"], "--critic_device / --reward_device under --strategy fsdp2"),
    (["--strategy", "fsdp2", "--cpu_offload", "1", "--device", "cpu"], "a CPU run has nothing to offload"),
    (["--cpu_offload", "1"], "--cpu_offload 1 offloads FSDP2's shards: it needs --strategy fsdp2"),
    (["--hsdp", "1"], "--hsdp 1 shards within a node and replicates across nodes: it needs --strategy fsdp2"),
])
def test_what_fsdp2_does_not_combine_with_is_one_line(argv, says):
    with pytest.raises(SystemExit) as e:
        C.validate(C.parse_args(argv))
    assert str(e.value).startswith("error: ") and says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("argv, says", [
    (["--tools_system_prompt", "Tools: {tools}"], "--tools_system_prompt lists the --tools: give --tools MODULE.py"),
    (["--tools", "dataset/demo_tools.py", "--tools_system_prompt", "You can call a calculator."],
     "--tools_system_prompt has no {tools}, where the tools' JSON schemas go"),
    (["--tools", "dataset/demo_tools.py", "--tool_ok_weight", "-1"], "--tool_ok_weight -1.0 must be a finite number >= 0"),
])
def test_bad_tool_settings_are_one_line(argv, says):
    with pytest.raises(SystemExit) as e:
        C.validate(C.parse_args(argv + ["--max_total_len", "2048"]))
    assert str(e.value).startswith("error: ") and says in str(e.value) and "\n" not in str(e.value)
    C.validate(C.parse_args(["--tools", "dataset/demo_tools.py", "--tools_system_prompt", "Tools: {tools}",
                             "--tool_ok_weight", "0.5", "--max_total_len", "2048"]))


def test_eos_placement_advantage_needs_a_group_estimator():
    with pytest.raises(SystemExit) as e:
        C.validate(C.parse_args(["--eos_placement", "advantage", "--advantage_estimator", "gae"]))
    assert str(e.value).startswith("error: --eos_placement advantage") and "\n" not in str(e.value)
    C.validate(C.parse_args(["--eos_placement", "advantage", "--advantage_estimator", "grpo", "--num_generations", "4"]))


def test_fsdp2_turns_the_side_by_side_update_off():
    """Auto --parallel_update would run the actor's and critic's sharded backwards in two threads: off under fsdp2
    even for one CPU process under bf16."""
    import torch

    info = DistInfo(device=torch.device("cpu"))
    assert C.resolve(C.parse_args(["--dtype", "bfloat16", "--num_threads", "2"]), info, None).parallel_update == 1
    assert C.resolve(C.parse_args(["--dtype", "bfloat16", "--num_threads", "2", "--strategy", "fsdp2"]), info, None).parallel_update == 0


def test_minimind_flags_not_acted_on_say_so_in_one_line(capsys):
    """MiniMind's --num_workers and --debug_log_ratio are accepted so its command lines run; set to anything but a
    value that changes nothing (ours or MiniMind's default), each prints one line saying it is not acted on."""
    for argv in ([], ["--num_workers", "8"], ["--num_workers", "0"]):
        assert C.warn_unused(C.parse_args(argv)) == []
    assert capsys.readouterr().err == ""
    lines = C.warn_unused(C.parse_args(["--num_workers", "4", "--debug_log_ratio"]))
    assert len(lines) == 2 and "--num_workers 4 is accepted for MiniMind's command lines and not acted on" in lines[0]
    assert "--debug_log_ratio 1" in lines[1] and "ppo/ratio" in lines[1]
    err = capsys.readouterr().err.splitlines()
    assert err.count(lines[0]) == 2 and err.count(lines[1]) == 2  # printed by parse_args, then by the call
