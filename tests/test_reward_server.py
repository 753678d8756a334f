"""Rewards scored by servers (trainer/reward_server.py): --reward_model_url against a stand-in of vLLM's pooling server
(tests/reward_standin.py, vLLM 0.32.0's shapes) serving the demo's reward model, and --reward_url against a small
stdlib HTTP reward function. The real vLLM server: tests/test_engine_vllm.py (scripts/engine_check.sh)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from tests.helpers import ROOT, free_port, make_tiny_world, read_metrics, run_main, tiny_flags
from tests.reward_standin import start_fn, start_rm
from trainer.reward_model import RewardModelScorer, conversation_ids
from trainer.reward_server import RemoteRewardModel, RewardFunctionServer, RewardServerError
from trainer.rewards import compute_rewards

DEMO_RM = ROOT / "out" / "demo_rm"


def _conversations(n: int = 6) -> list[list[dict]]:
    """Demo prompts with replies of several lengths (one far past 64 tokens: it is cut to its end)."""
    rows = [json.loads(line) for line in (ROOT / "dataset" / "demo_train.jsonl").read_text(encoding="utf-8").splitlines()[:n]]
    replies = ["<think>\nlet me count\n</think>\n<answer>\n2\n</answer>", "2", "I do not know.",
               "<think>\n" + "so many words here, " * 12 + "\n</think>\n<answer>\n7\n</answer>"]
    return [[r["conversations"][0], {"role": "assistant", "content": replies[i % len(replies)]}] for i, r in enumerate(rows)]


@pytest.fixture(scope="module")
def demo_rm():
    from model.loader import load_reward_model

    model, tok = load_reward_model(DEMO_RM)
    return model, tok


@pytest.fixture(scope="module")
def served():
    server = start_rm(DEMO_RM)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_world(tmp_path_factory.mktemp("rs_world"))


def _remote(url: str, tok, **kw) -> RemoteRewardModel:
    return RemoteRewardModel(url, tok, DEMO_RM, timeout=30, **kw)


# --------------------------------------------------------------------------------------- --reward_model_url
def test_served_scores_equal_the_in_process_scores(demo_rm, served):
    """The served reward model scores every conversation as the in-process one (fp32 both: float rounding apart), from
    the same token IDs (the RM's own chat template, cut to its last max_length tokens), raw logits (not vLLM's default
    sigmoid), all rows in one /classify request."""
    model, tok = demo_rm
    convs = _conversations()
    for max_length in (512, 64):
        ours = RewardModelScorer(model, tok, max_length=max_length, clip=100.0).score(convs)
        remote = _remote(served.url, tok, max_length=max_length, clip=100.0).connect()
        served.requests.clear()
        theirs = remote.score(convs)
        classify = [body for path, body in served.requests if path == "/classify"]
        assert len(classify) == 1 and classify[0]["use_activation"] is False
        assert classify[0]["input"] == conversation_ids(tok, convs, max_length)
        assert any(len(r) == max_length for r in classify[0]["input"]) == (max_length == 64)
        assert torch.allclose(theirs, ours, atol=1e-4), (theirs, ours)
        assert (ours < 0).any(), "raw logits: some demo scores are negative (a sigmoid would not be)"


def test_served_scores_are_clipped_and_weighted_as_in_process(demo_rm, served):
    """compute_rewards with the served model: the rm component (--reasoning 1: 0.4 x the whole reply + 0.6 x its
    <answer>) and the weighted total equal the in-process ones."""
    model, tok = demo_rm
    convs = _conversations(4)
    messages = [c[:1] for c in convs]
    replies = [c[1]["content"] for c in convs]
    kw = dict(prompts=["p"] * 4, messages=messages, replies=replies, references=[None] * 4, has_eos=[True] * 4,
              weights={"format": 1.0, "rm": 0.5}, reasoning=True, custom_fns={})
    total_in, comps_in = compute_rewards(rm=RewardModelScorer(model, tok, clip=2.0), **kw)
    total_srv, comps_srv = compute_rewards(rm=_remote(served.url, tok, clip=2.0).connect(), **kw)
    assert torch.allclose(comps_srv["rm"], comps_in["rm"], atol=1e-4)
    assert torch.allclose(total_srv, total_in, atol=1e-4)
    assert comps_in["rm"].abs().max() <= 2.0


@pytest.fixture
def quick_retries(monkeypatch):
    """trainer/http_client.py's retry waits cut to ~10 ms (a refused connection is tried 5 times: ~4-7 s otherwise)."""
    from trainer import http_client as H

    monkeypatch.setattr(H, "RETRY_BASE_S", 0.01)
    monkeypatch.setattr(H, "RETRY_CAP_S", 0.05)


def test_unreachable_server_is_one_line(demo_rm, quick_retries):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RewardServerError) as e:
        _remote(url, demo_rm[1]).connect()
    msg = str(e.value)
    assert "\n" not in msg and f"--reward_model_url {url} is not reachable" in msg
    assert "scripts/serve_reward_model.sh" in msg


def test_a_server_that_goes_away_mid_run_says_how_to_continue(demo_rm, quick_retries):
    server = start_rm(DEMO_RM)
    remote = _remote(server.url, demo_rm[1]).connect()
    assert remote.score(_conversations(2)).shape == (2,)
    server.stop()
    with pytest.raises(RewardServerError, match=r"not reachable .*restart the server, then continue with --from_resume 1"):
        remote.score(_conversations(2))


@pytest.mark.parametrize("case, standin, expect", [
    ("another model", "served_root", r"serves another model \(.*rm: Qwen3ForSequenceClassification, vocab 6400, 1 layers x 32"),
    ("another tokenizer", "tokenizer_dir", r"serves a model with another tokenizer than --reward_model_path"),
    ("a generative model", "classify", r"serves no classification model \(.*HTTP 404.*\): start the reward model with "
                                       r"scripts/serve_reward_model.sh"),
    ("a short context", "max_model_len", r"takes at most 32 tokens per sequence; the reward model scores the last 512: "
                                         r"start it with MAX_MODEL_LEN=512"),
])
def test_a_server_of_another_model_is_refused_in_one_line(demo_rm, tiny, case, standin, expect):
    """What the start-up check catches: the served directory's config (readable on one machine), the tokenizer (a
    probe text tokenized by both: a remote server too), no /classify route, a context shorter than the scorer's."""
    kw = {"served_root": {"served_root": tiny["rm"]},  # another reward model: another shape, the policy's tokenizer
          "tokenizer_dir": {"tokenizer_dir": ROOT / "model"},
          "classify": {"classify": False}, "max_model_len": {"max_model_len": 32}}[standin]
    server = start_rm(DEMO_RM, **kw)
    try:
        with pytest.raises(RewardServerError) as e:
            _remote(server.url, demo_rm[1]).connect()
    finally:
        server.stop()
    assert "\n" not in str(e.value), case
    assert re.search(expect, str(e.value)), str(e.value)


# --------------------------------------------------------------------------------------- --reward_url
def _length_reward(prompt: str, reply: str, reference: str | None) -> float:
    return len(reply) / 100 + (1.0 if reference is not None and reference in reply else 0.0)


def test_reward_url_posts_the_batch_and_reads_one_float_per_reply():
    server = start_fn(_length_reward)
    try:
        fn = RewardFunctionServer(server.url + "/reward", timeout=30).check()
        assert server.requests == [("/reward", {"prompts": [], "replies": [], "references": []})]
        got = fn(["p1", "p2", "p3"], ["abc", "7", ""], ["7", "7", None])
        assert got == [0.03, 1.01, 0.0]
        assert server.requests[-1][1] == {"prompts": ["p1", "p2", "p3"], "replies": ["abc", "7", ""],
                                          "references": ["7", "7", None]}
    finally:
        server.stop()


@pytest.mark.parametrize("answer, expect", [
    (lambda p, r, ref: "high", r"answered 'high' for row 0 \(prompt: 'p'\); every reward must be a number"),
    (lambda p, r, ref: True, r"answered True for row 0"),
    (None, r"answered 1 rewards for 2 replies"),
    ("not a dict", r"it must answer \{\"rewards\": \[one number per reply\]\}"),
])
def test_reward_url_answers_outside_the_contract_are_one_line(answer, expect):
    server = start_fn(answer if callable(answer) else _length_reward)
    if answer is None:
        server.reward = lambda body: (200, {"rewards": [1.0]})  # type: ignore[method-assign]
    elif isinstance(answer, str):
        server.reward = lambda body: (200, [1.0, 2.0])  # type: ignore[method-assign]
    try:
        fn = RewardFunctionServer(server.url + "/reward", timeout=30)
        with pytest.raises(RewardServerError) as e:
            fn(["p", "q"], ["a", "b"], [None, None])
    finally:
        server.stop()
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--reward_url {server.url}/reward ")
    assert re.search(expect, str(e.value)), str(e.value)


def test_a_stalled_reward_server_is_one_line_within_the_timeout():
    """A server that accepts the request and never answers in time: one line after --reward_timeout, not a hang."""
    import time

    server = start_fn(lambda p, r, ref: time.sleep(3) or 1.0)
    try:
        fn = RewardFunctionServer(server.url + "/reward", timeout=0.5)
        t0 = time.monotonic()
        with pytest.raises(RewardServerError) as e:
            fn(["p"], ["x"], [None])
        took = time.monotonic() - t0
    finally:
        server.stop()
    assert took < 2.5 and "\n" not in str(e.value)
    assert f"--reward_url {server.url}/reward did not answer the batch within 0.5 s (--reward_timeout)" in str(e.value)


def test_reward_url_http_error_and_nan():
    server = start_fn(lambda p, r, ref: math.nan if r == "nan" else 1.0, fail_on=(2,))
    try:
        fn = RewardFunctionServer(server.url + "/reward", timeout=30)
        assert math.isnan(fn(["p"], ["nan"], [None])[0])  # passed on: the trainer skips that step, as for --reward_fn
        with pytest.raises(RewardServerError, match=r"refused the batch: HTTP 500 the stand-in fails request 2 on purpose"):
            fn(["p"], ["x"], [None])
    finally:
        server.stop()


# --------------------------------------------------------------------------------------- the trainer
def _rewards_by_step(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k.startswith("reward/")} for r in read_metrics(run_dir) if "reward/rm" in r]


def test_training_with_both_servers_equals_in_process_scoring(tiny, tmp_path):
    """train_ppo with --reward_model_url (the tiny world's RM served) and --reward_url beside --rollout_engine torch:
    every step's rm component and total equal the run that scores the RM in-process (same seed: the same samples),
    and reward/url, the served function's, enters reward/total weighted by --reward_url_weight."""
    fn_server = start_fn(_length_reward)
    rm_server = start_rm(tiny["rm"])
    url = dict(reward_url=fn_server.url + "/reward", reward_url_weight=0.5)
    try:
        runs = {}
        for name, flags in (("no_url", {}), ("local", url), ("served", {**url, "reward_model_url": rm_server.url})):
            code, out = run_main(tiny_flags(tiny, tmp_path / name, max_steps=2, eval_data_path="none", rm_weight=1.0,
                                            save_weight=f"ppo_rs_{name}", **flags))  # each run its own policy file
            assert code in (None, 0), out[-2000:]
            runs[name] = _rewards_by_step(tmp_path / name / "run")
    finally:
        fn_server.stop()
        rm_server.stop()
    assert [len(r) for r in runs.values()] == [2, 2, 2]
    for a, b in zip(runs["local"], runs["served"]):
        assert b["reward/rm"] == pytest.approx(a["reward/rm"], abs=1e-5) and a["reward/rm"] != 0
        assert b["reward/url"] == pytest.approx(a["reward/url"]) and b["reward/format"] == a["reward/format"]
        assert b["reward/total"] == pytest.approx(a["reward/total"], abs=1e-5)
    first, plain = runs["served"][0], runs["no_url"][0]  # step 1 samples the same replies with or without --reward_url
    assert first["reward/url"] > 0 and first["reward/total"] == pytest.approx(plain["reward/total"] + 0.5 * first["reward/url"], abs=1e-5)
    batches = [body for path, body in fn_server.requests if body["replies"]]
    assert len(batches) == 4 and all(len(b["replies"]) == 4 for b in batches)  # one request per step and run: --batch_size 4
    assert len([1 for path, _ in rm_server.requests if path == "/classify"]) == 1 + 2  # the start-up probe, one per step


def test_training_stops_in_one_line_when_the_reward_server_fails(tiny, tmp_path):
    server = start_fn(_length_reward, fail_on=(3,))  # the check, step 1, then step 2 fails
    try:
        code, out = run_main(tiny_flags(tiny, tmp_path, max_steps=3, eval_data_path="none", reward_url=server.url + "/reward",
                                        save_weight="ppo_rs_fails"))
    finally:
        server.stop()
    assert isinstance(code, str) and "\n" not in code.strip(), (code, out[-2000:])
    assert code.startswith(f"error: --reward_url {server.url}/reward refused the batch: HTTP 500"), code
    assert "Traceback" not in out
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "reward/url" in r] == [1]


@pytest.mark.parametrize("flags, expect", [
    ({"reward_model_url": "localhost:8001"}, "--reward_model_url localhost:8001: expected http://HOST:PORT"),
    ({"reward_model_url": "http://h:1", "reward_model_path": "none"}, "--reward_model_url needs --reward_model_path"),
    ({"reward_model_url": "http://h:1", "rm_weight": 0}, "--reward_model_url scores the reward model, and --rm_weight is 0"),
    ({"reward_url": "ftp://x"}, "--reward_url ftp://x: expected http://HOST:PORT/PATH"),
    ({"reward_url": "http://h:1/r", "reward_timeout": 1800},
     "--reward_timeout 1800.0 must be a number of seconds > 0 and below --ddp_timeout 1800"),
])
def test_bad_reward_server_flags_are_one_line(flags, expect):
    from trainer.run import cli as C

    argv = [x for k, v in flags.items() for x in (f"--{k}", str(v))]
    with pytest.raises(SystemExit) as e:
        C.validate(C.parse_args(argv))
    assert str(e.value).startswith("error: ") and expect in str(e.value) and "\n" not in str(e.value)


def test_reward_timeout_is_unread_without_a_reward_server():
    """A run without a reward server never reads --reward_timeout: a short --ddp_timeout alone is not refused."""
    from trainer.run import cli as C

    C.validate(C.parse_args(["--ddp_timeout", "60"]))


def test_a_stalled_reward_server_gives_up_at_the_ranks_deadline():
    """Under torchrun the rank-local block's deadline (--ddp_timeout less a margin) bounds the wait, not only
    --reward_timeout: the other ranks wait in a collective for this one no longer than that."""
    import time

    from trainer import dist as D

    server = start_fn(lambda p, r, ref: time.sleep(3) or 1.0)
    try:
        fn = RewardFunctionServer(server.url + "/reward", timeout=300)
        t0 = time.monotonic()
        with D.rank_local_deadline(0.5, "--ddp_timeout 6"), pytest.raises(RewardServerError) as e:
            fn(["p"], ["x"], [None])
        took = time.monotonic() - t0
    finally:
        server.stop()
    assert took < 2.5 and "\n" not in str(e.value)
    assert "(--ddp_timeout 6, less a margin)" in str(e.value), str(e.value)


def test_a_dead_reward_server_stops_the_run_before_any_step(tiny, tmp_path, quick_retries):
    url = f"http://127.0.0.1:{free_port()}"
    code, out = run_main(tiny_flags(tiny, tmp_path, reward_model_url=url))
    assert isinstance(code, str) and "\n" not in code.strip(), (code, out[-2000:])
    assert code.startswith(f"error: --reward_model_url {url} is not reachable") and "serve_reward_model.sh" in code
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


# --------------------------------------------------------------------------------------- under DDP
@pytest.mark.slow  # two ranks started as torchrun would start them (~20 s each)
def test_two_ranks_each_score_their_own_rows_on_their_own_server(tiny, tmp_path):
    """2 gloo ranks, --reward_model_url with two servers (one per "node": rank 0 the first, rank 1 the second) and one
    --reward_url: each rank sends its own rows, one request per step each, and the run finishes."""
    from tests.test_distributed import _spawn_ranks

    rms = [start_rm(tiny["rm"]), start_rm(tiny["rm"])]
    fn_server = start_fn(_length_reward)
    try:
        flags = tiny_flags(tiny, tmp_path, max_steps=2, batch_size=2, mini_batch_size=2, device="cpu", eval_data_path="none",
                           reward_model_url=",".join(s.url for s in rms), reward_url=fn_server.url + "/reward",
                           save_weight="ppo_rs_ddp")  # its own policy file: the tiny world's out/ is shared
        results = _spawn_ranks([flags, flags], tmp_path)
    finally:
        for s in (*rms, fn_server):
            s.stop()
    assert all(code == 0 for code, _, _ in results), [r[2][-2000:] for r in results]
    for s in rms:  # the start-up probe, then one request of 2 rows per step on each rank's own server
        sizes = [len(body["input"]) for path, body in s.requests if path == "/classify"]
        assert sizes == [1, 2 * 2, 2 * 2], sizes  # --reasoning 1: the whole reply and its answer, 2 rows each
    batches = [len(body["replies"]) for _, body in fn_server.requests]
    assert sorted(batches) == [0, 0, 2, 2, 2, 2]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows if "reward/url" in r] == [1, 2]


@pytest.mark.slow
def test_a_reward_server_failing_for_one_rank_stops_every_rank_with_one_line(tiny, tmp_path):
    """The reward function's server fails one request of step 2 (whichever rank sent it): every rank stops, rank 0
    says the one line, no traceback, step 1's checkpoint is whole."""
    from tests.test_distributed import _only_line, _spawn_ranks

    server = start_fn(_length_reward, fail_on=(5,))  # 2 checks, 2 requests in step 1, then step 2's first
    try:
        flags = tiny_flags(tiny, tmp_path, max_steps=3, batch_size=2, mini_batch_size=2, device="cpu", eval_data_path="none",
                           reward_url=server.url + "/reward", save_weight="ppo_rs_ddp_fails")
        results = _spawn_ranks([flags, flags], tmp_path)
    finally:
        server.stop()
    line = _only_line(results)
    print(line)
    assert re.fullmatch(rf"error: rank [01]: --reward_url {server.url}/reward refused the batch: HTTP 500 the stand-in fails "
                        rf"request 5 on purpose", line), line
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]


def test_the_documented_minimal_server_keeps_the_contract(tmp_path):
    """docs/reward_servers.md's minimal --reward_url server, run as written (on a free port), answers the trainer."""
    import subprocess
    import sys
    import time

    text = (ROOT / "docs" / "reward_servers.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)
    port = free_port()
    (tmp_path / "server.py").write_text(code.replace("9000", str(port)), encoding="utf-8")
    proc = subprocess.Popen([sys.executable, str(tmp_path / "server.py")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        fn = RewardFunctionServer(f"http://127.0.0.1:{port}/reward", timeout=10)
        for _ in range(100):
            try:
                fn.check()
                break
            except RewardServerError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.1)
        assert fn(["p", "p"], ["<answer>19</answer>", "no"], ["19", "19"]) == [1.0, 0.0]
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------------------- the network, as an attacker acts
def test_both_reward_servers_get_the_key_from_the_environment(demo_rm, monkeypatch):
    """Servers started with a key (every route but /health wants it): without MINIPPO_REWARD_API_KEY, one line
    naming the variable; with it, every request to the reward model (/v1/models, /tokenize, /classify) and to the
    reward function carries `Authorization: Bearer <key>`; the key is in no message."""
    from trainer.reward_server import REWARD_KEY_ENV

    _, tok = demo_rm
    rm, fn = start_rm(DEMO_RM, api_key="rk-9"), start_fn(lambda p, r, ref: 0.5, api_key="rk-9")
    try:
        monkeypatch.delenv(REWARD_KEY_ENV, raising=False)
        for check in (lambda: _remote(rm.url, tok).connect(), lambda: RewardFunctionServer(fn.url + "/reward").check()):
            with pytest.raises(RewardServerError) as e:
                check()
            assert "HTTP 401" in str(e.value) and f"set {REWARD_KEY_ENV}" in str(e.value) and "\n" not in str(e.value)
        monkeypatch.setenv(REWARD_KEY_ENV, "rk-9")
        rm.auth.clear()
        fn.auth.clear()
        assert _remote(rm.url, tok).connect().score(_conversations(2)).shape == (2,)
        assert RewardFunctionServer(fn.url + "/reward").check()(["p"], ["r"], [None]) == [0.5]
        assert len(rm.auth) >= 4 and set(rm.auth) == {"Bearer rk-9"}
        assert len(fn.auth) == 2 and set(fn.auth) == {"Bearer rk-9"}
    finally:
        rm.stop()
        fn.stop()


@pytest.mark.parametrize("mode", ["trickle_body", "trickle_head"])
def test_a_reward_server_that_trickles_bytes_fails_at_reward_timeout_not_later(mode):
    """A byte every 0.2 s keeps every socket read short: the batch still fails at --reward_timeout (1 s), in one
    line; before, it lasted as long as the server trickled."""
    import time

    from tests.hostile_http import Hostile

    server = Hostile(mode, every=0.2)
    try:
        t0 = time.monotonic()
        with pytest.raises(RewardServerError) as e:
            RewardFunctionServer(server.url + "/reward", timeout=1.0).check()
        assert time.monotonic() - t0 < 1.6
    finally:
        server.stop()
    assert str(e.value).startswith(f"--reward_url {server.url}/reward did not answer the batch within 1 s "
                                   f"(--reward_timeout)") and "\n" not in str(e.value)


def test_a_reward_server_that_floods_100_mb_is_refused_at_the_cap():
    """100 MB for an empty batch: refused at trainer/http_client.py's cap, one line naming the URL, without reading it all."""
    import time

    from tests.hostile_http import Hostile
    from trainer.http_client import MAX_BYTES

    server = Hostile("flood")
    try:
        with pytest.raises(RewardServerError) as e:
            RewardFunctionServer(server.url + "/reward", timeout=30).check()
        time.sleep(0.2)
        assert server.sent < 40_000_000, server.sent
    finally:
        server.stop()
    assert str(e.value) == (f"--reward_url: {server.url}/reward answered with 100000000 bytes, more than the {MAX_BYTES} "
                            f"bytes the trainer reads: is it the right server?")


def test_a_reward_call_rides_out_a_dropped_connection_and_a_busy_server_within_the_deadline(capsys):
    """A reward is a pure function of its request, so a batch whose connection was reset, or answered HTTP 503 (a
    proxy or a server not ready), is sent again (OpenRLHF tries a remote reward 5 times), each retry one line on
    stderr; at 5fab971 the first reset ended the run. A server that stays busy fails at the rank's deadline (1 s
    here), not --reward_timeout (300 s), in one line saying how many tries it took."""
    import time

    from tests.hostile_http import Hostile
    from trainer import dist as D

    servers = [Hostile("flaky", fails=1, failure=f, answer={"rewards": [0.5]}) for f in ("reset", 503)]
    busy = Hostile("flaky", fails=10**6, failure=503)
    try:
        for server in servers:
            assert RewardFunctionServer(server.url + "/reward", timeout=30)(["p"], ["r"], [None]) == [0.5]
            assert len(server.headers) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 2
        t0 = time.monotonic()
        with D.rank_local_deadline(1.0, "--ddp_timeout 12"), pytest.raises(RewardServerError) as e:
            RewardFunctionServer(busy.url + "/reward", timeout=300)(["p"], ["r"], [None])
        assert time.monotonic() - t0 < 1.5
    finally:
        for server in servers + [busy]:
            server.stop()
    msg = str(e.value)
    assert msg.startswith(f"--reward_url {busy.url}/reward refused the batch: HTTP 503 busy (") and " tries)" in msg
    assert "\n" not in msg
