"""trainer/http_client.py against a hostile server (tests/hostile_http.py): a total deadline however the bytes trickle, a size
cap that stops reading, a bearer token on the request and never carried elsewhere by a redirect, one-line errors.
The engine and reward-server clients' own tests (tests/test_engine.py, tests/test_reward_server.py) repeat the
attacks through the clients."""

from __future__ import annotations

import time

import pytest

from tests.hostile_http import Hostile
from trainer import http_client as H


@pytest.fixture
def hostile(request):
    servers: list[Hostile] = []

    def make(mode: str, **kw) -> Hostile:
        servers.append(Hostile(mode, **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


@pytest.mark.parametrize("mode", ["trickle_body", "trickle_head"])
def test_a_trickling_server_fails_at_the_deadline_not_later(mode, hostile):
    """A byte every 0.2 s keeps every socket read under any per-read timeout; the request still ends at its total
    deadline (1 s here), in the body or before the status line is whole."""
    server = hostile(mode, every=0.2)
    start = time.monotonic()
    with pytest.raises(H.TimedOut) as e:
        H.request_json(server.url + "/health", timeout=1.0)
    took = time.monotonic() - start
    assert 0.9 < took < 1.6, took
    assert str(e.value) == "no complete answer within 1 s"
    assert server.sent > 0  # it was answering, slowly


@pytest.mark.parametrize("length", [True, False], ids=["content_length", "until_close"])
def test_a_100_mb_answer_is_refused_at_the_cap_without_being_read(length, hostile):
    """100 MB sent as fast as the client takes it: refused at the cap (1 MiB here), naming the URL, in one line; the
    server could only push what the cap and the sockets' buffers let in (memory stays bounded)."""
    server = hostile("flood", length=length)
    cap = 1 << 20
    with pytest.raises(H.BadAnswer) as e:
        H.request_json(server.url + "/v1/models", timeout=30, max_bytes=cap)
    msg = str(e.value)
    assert msg.startswith(f"{server.url}/v1/models answered with ") and f"the {cap} bytes the trainer reads" in msg
    assert ("100000000 bytes" in msg) == length and "\n" not in msg
    time.sleep(0.2)  # the server's last send fails once the client has hung up
    assert server.sent < 40_000_000, server.sent  # cap + socket buffers, far from the 100 MB


def test_the_default_cap_bounds_any_answer(hostile):
    server = hostile("flood", length=False)
    with pytest.raises(H.BadAnswer, match=f"more than the {H.MAX_BYTES} bytes"):
        H.request_json(server.url, timeout=30)
    time.sleep(0.2)
    assert server.sent < H.MAX_BYTES + 40_000_000 < 100_000_000


def test_the_token_is_a_bearer_header_and_a_redirect_carries_it_nowhere(hostile):
    """The token goes as `Authorization: Bearer <token>`; a server that redirects (to collect the token elsewhere)
    is refused, and the place it points to hears nothing."""
    elsewhere = hostile("flood", size=2)
    server = hostile("redirect", location=elsewhere.url + "/steal")
    with pytest.raises(H.BadAnswer) as e:
        H.request_json(server.url + "/generate", {"input_ids": [[1]]}, timeout=5, token="s3cret")
    assert server.headers[0]["authorization"] == "Bearer s3cret"
    assert "redirect (HTTP 307 to " in str(e.value) and "s3cret" not in str(e.value)
    time.sleep(0.1)
    assert elsewhere.headers == []


def test_failures_are_one_line_of_their_kind(hostile):
    """Nobody listening: Unreachable; an error status: Refused with the server's own message."""
    server = hostile("flood")
    url = server.url
    server.stop()
    time.sleep(0.05)
    with pytest.raises(H.Unreachable) as e:
        H.request_json(url, timeout=5)
    assert "refused" in str(e.value).lower() and "\n" not in str(e.value)


def test_a_key_a_header_cannot_carry_names_the_variable_not_the_key(monkeypatch):
    monkeypatch.setenv("MINIPPO_TEST_KEY", "  abc\r\nX-Injected: 1 ")
    with pytest.raises(ValueError) as e:
        H.token_from_env("MINIPPO_TEST_KEY")
    assert str(e.value).startswith("MINIPPO_TEST_KEY holds characters an HTTP header cannot carry") and "abc" not in str(e.value)
    monkeypatch.setenv("MINIPPO_TEST_KEY", "  key-1  ")
    assert H.token_from_env("MINIPPO_TEST_KEY") == "key-1"
    monkeypatch.setenv("MINIPPO_TEST_KEY", "")
    assert H.token_from_env("MINIPPO_TEST_KEY") is None


# ------------------------------------------------------------------ retries (idempotent requests only)
@pytest.mark.parametrize("failure", ["reset", "close", 502, 503, 504])
def test_an_idempotent_request_rides_out_a_dropped_connection_or_a_busy_server(failure, hostile, capsys, monkeypatch):
    """Two tries fail (a connection reset, one closed before the status line, a gateway or server that says it is
    busy), the third is answered: with attempts the answer comes back, each retry one line on stderr naming the
    rank; without (the default: a request that is not idempotent) the first failure is the caller's, tried once."""
    monkeypatch.setenv("RANK", "3")
    server = hostile("flaky", fails=2, failure=failure, answer={"ok": 1})
    t0 = time.monotonic()
    assert H.request_json(server.url + "/v1/models", timeout=20, attempts=H.RETRY_ATTEMPTS) == {"ok": 1}
    assert time.monotonic() - t0 < 0.25 + 0.5 + 1.0  # the waits: [0.25, 0.5] then [0.5, 1] s
    assert len(server.headers) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith(f"warning: rank 3: GET {server.url}/v1/models: ") for line in lines)
    assert lines[0].endswith(f"; retry 1 of {H.RETRY_ATTEMPTS - 1} in " + lines[0].rsplit(" in ", 1)[1])
    once = hostile("flaky", fails=2, failure=failure, answer={"ok": 1})
    with pytest.raises(H.Refused if isinstance(failure, int) else H.Unreachable) as e:
        H.request_json(once.url + "/v1/completions", {"prompt": [1]}, timeout=20)
    assert len(once.headers) == 1 and "tries" not in str(e.value) and "\n" not in str(e.value)


def test_a_server_that_is_restarting_is_waited_for_within_the_deadline(hostile):
    """Nothing listens for 0.6 s (connections refused), then the server answers: the retries' backoff (0.25-0.5,
    0.5-1, 1-2 s) reaches it."""
    server = hostile("flaky", answer=[1, 2], listen_after=0.6)
    assert H.request_json(server.url + "/health", timeout=20, attempts=H.RETRY_ATTEMPTS) == [1, 2]


def test_retries_end_at_the_requests_deadline_and_say_how_many_tries(hostile, capsys):
    """A server that is always busy: the tries and waits all fit in the request's one deadline (2 s here), never
    after it; the failure says how many tries it took, on one line. An error status that is not a busy server's
    (HTTP 500) is not tried again."""
    server = hostile("flaky", fails=10**6, failure=503)
    t0 = time.monotonic()
    with pytest.raises(H.Refused) as e:
        H.request_json(server.url + "/reward", {"prompts": []}, timeout=2.0, attempts=50)
    took = time.monotonic() - t0
    assert took < 2.2, took
    tries = len(server.headers)
    assert 3 <= tries <= 4 and str(e.value) == f"HTTP 503 busy ({tries} tries)", (tries, str(e.value))
    assert len(capsys.readouterr().err.strip().splitlines()) == tries - 1
    error = hostile("flaky", fails=10**6, failure=500)
    with pytest.raises(H.Refused, match=r"^HTTP 500 busy$"):
        H.request_json(error.url + "/reward", {"prompts": []}, timeout=5, attempts=5)
    assert len(error.headers) == 1


def test_the_backoffs_jitter_draws_nothing_from_the_runs_generators(hostile):
    """The waits are drawn from the client's own stream: Python's, NumPy's and torch's global generators (the run's
    draws) are where they were."""
    import random

    import numpy as np
    import torch

    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    states = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone()
    server = hostile("flaky", fails=2, failure=503, answer={})
    assert H.request_json(server.url, timeout=20, attempts=3) == {}
    assert random.getstate() == states[0] and (np.random.get_state()[1] == states[1]).all()
    assert torch.equal(torch.get_rng_state(), states[2])


# ------------------------------------------------------------------ Client: one server's URL, deadline and key
def test_a_client_sends_its_key_retries_only_what_is_idempotent_and_says_what_to_do_about_a_401(hostile, monkeypatch):
    """The engine and reward-server clients share this: the key read from the environment variable (a bad one is one
    line naming the variable), sent as a bearer header; a GET (or a request the caller calls idempotent) rides out a
    busy server, a POST is tried once; a 401 gets a hint naming the variable."""
    monkeypatch.setenv("MINIPPO_TEST_KEY", "bad\nkey")
    with pytest.raises(ValueError, match="^MINIPPO_TEST_KEY holds characters"):
        H.Client("http://127.0.0.1:1", 5, "MINIPPO_TEST_KEY")
    monkeypatch.setenv("MINIPPO_TEST_KEY", "k-1")
    server = hostile("flaky", fails=1, failure=503, answer={"ok": 1})
    client = H.Client(f" {server.url}/ ", 20, "MINIPPO_TEST_KEY")
    assert client.url == server.url and client.timeout == 20.0
    assert client.request("/v1/models") == {"ok": 1}  # a GET: tried again
    assert len(server.headers) == 2 and server.headers[0]["authorization"] == "Bearer k-1"
    once = hostile("flaky", fails=1, failure=503, answer={"ok": 1})
    with pytest.raises(H.Refused):
        H.Client(once.url, 20, "MINIPPO_TEST_KEY").request("/v1/completions", {"prompt": [1]})  # a POST: once
    assert len(once.headers) == 1
    again = hostile("flaky", fails=1, failure=503, answer={"ok": 1})
    assert H.Client(again.url, 20, "MINIPPO_TEST_KEY").request("/classify", {"input": [1]}, idempotent=True) == {"ok": 1}
    assert client.key_hint(H.Refused(401, "Unauthorized")) == " (the key in MINIPPO_TEST_KEY is not the server's --api-key)"
    assert client.key_hint(H.Refused(403, "Forbidden")) == ""
    monkeypatch.delenv("MINIPPO_TEST_KEY")
    keyless = H.Client(server.url, 20, "MINIPPO_TEST_KEY")
    assert keyless.key_hint(H.Refused(401, "Unauthorized")) == " (it wants a key: set MINIPPO_TEST_KEY to its --api-key)"
