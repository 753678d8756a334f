"""JSON over HTTP for the trainer's servers (trainer/engine.py's rollout engines, trainer/reward_server.py's reward
servers): one request, bounded, whatever the server does.

- A total deadline per request: `timeout` seconds from the call to the last byte, not per socket operation (urllib's
  own timeout), so a server that trickles a byte now and then cannot outlast it. A watchdog shuts the socket down at
  the deadline (status line and headers included), and the body is read in chunks with the socket's timeout set to
  what is left before each.
- A size cap: an answer longer than `max_bytes` (its Content-Length, or the bytes read so far) is refused without
  being read further, so memory stays bounded.
- An optional bearer token (`Authorization: Bearer <token>`, sent on every route), read from an environment variable
  by `token_from_env` (never a config field: the config is written to run.json and the resume files).
- Redirects are refused, not followed: urllib would carry the Authorization header to wherever one points.
- Every failure is an HTTPFailure whose message is one line; the callers say which server and what to do.
- `Client`: one server's base URL, default deadline and token, for the trainer's clients of a server (the engines,
  the reward servers, the teacher), each of which words the failures for its own flag.
- Retries, for idempotent requests only (`attempts` > 1: the caller says which are): a connection refused or reset
  (a server restarting, a proxy dropping a connection) and HTTP 502 / 503 / 504 (a proxy or a server that says it is
  busy) are tried again, up to `attempts` tries in all, after an exponential backoff with jitter from this module's
  own random stream (never `random`'s, numpy's or torch's: the run's draws stay the same), all inside the request's
  total deadline; each retry is one line on stderr naming the rank. Nothing else is retried: another error status, a
  timeout (the deadline is spent), an answer too large or not JSON.

Only the standard library: the trainer's requirements do not grow for a server. (Not named http.py: a script run
with trainer/ first on sys.path would then import it for the standard library's http.)
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

__all__ = ["HTTPFailure", "Refused", "Unreachable", "TimedOut", "BadAnswer", "MAX_BYTES", "RETRY_ATTEMPTS",
           "request_json", "Client", "token_from_env", "server_index", "one_line"]

MAX_BYTES = 32 << 20  # an answer's default cap: far above any control route's or reward batch's answer
CHUNK = 1 << 16
ERROR_BYTES = 1 << 16  # of an error answer's body, only its message is wanted
RETRY_ATTEMPTS = 5  # tries in all of an idempotent request (OpenRLHF tries a remote reward call 5 times)
RETRY_BASE_S = 0.5  # the wait before the first retry, doubled before each next one ...
RETRY_CAP_S = 8.0  # ... up to this; each wait is drawn from [w/2, w] (jitter: ranks that failed together spread out)
RETRY_MIN_TRY_S = 0.25  # a retry starts only if this much of the deadline is left after its wait: a try with less
# would time out on any server and hide the failure that caused it
RETRY_STATUSES = frozenset({502, 503, 504})  # a gateway without its upstream, a server busy or not ready yet
_JITTER = random.Random()  # the backoff's own stream (seeded from os.urandom): no draw from the run's generators


def one_line(text: object, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]


class HTTPFailure(RuntimeError):
    """A request that got no usable answer; str() is one line (never the token)."""


class Refused(HTTPFailure):
    """The server answered with an error status: `status`, and its own message (`detail`, one line)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status} {detail}".rstrip())
        self.status, self.detail = status, detail


class Unreachable(HTTPFailure):
    """No answer: connection refused, a name that does not resolve, a connection broken before the answer ended.
    `transient`: refused or reset (worth another try for an idempotent request), not a name that does not resolve."""

    transient = False


class TimedOut(Unreachable):
    """The deadline passed before the whole answer arrived; `after` is the deadline in seconds."""

    def __init__(self, after: float) -> None:
        super().__init__(f"no complete answer within {after:.3g} s")
        self.after = after


class BadAnswer(HTTPFailure):
    """An answer that is not what a JSON server sends: over the size cap, not JSON, a redirect."""


class _Deadline:
    """The request's end (time.monotonic()); `arm(sock)` starts the watchdog that shuts `sock` down at the end, so
    a read blocked in http.client (the status line, a header, the body) returns at once."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.fired = False
        self._timer: threading.Timer | None = None
        self._sock: socket.socket | None = None

    def left(self) -> float:
        return self.end - time.monotonic()

    def arm(self, sock: socket.socket) -> socket.socket:
        self._sock = sock
        self._timer = threading.Timer(max(self.left(), 0.0), self._fire)
        self._timer.daemon = True
        self._timer.start()
        return sock

    def _fire(self) -> None:
        self.fired = True
        if self._sock is not None:
            try:  # the plain socket's shutdown: an SSLSocket's own would drop its state under the reading thread
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def settimeout(self) -> None:
        """Before a read: the socket waits at most what is left."""
        if self._sock is not None:
            self._sock.settimeout(max(self.left(), 0.001))

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _armed(http_class: Callable[..., http.client.HTTPConnection], deadline: _Deadline) -> Callable[..., Any]:
    """`http_class` whose connections arm `deadline` on their socket as soon as it is connected (before a TLS
    handshake or a proxy tunnel): http.client opens it through the connection's `_create_connection`."""
    def make(host: str, **kw: Any) -> http.client.HTTPConnection:
        conn = http_class(host, **kw)
        # http.client's own hook, absent from typeshed's stub of HTTPConnection
        create = conn._create_connection  # type: ignore[attr-defined]
        conn._create_connection = lambda *a, **k: deadline.arm(create(*a, **k))  # type: ignore[attr-defined]
        return conn
    return make


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def do_open(self, http_class: Any, req: Any, **kw: Any) -> Any:  # type: ignore[override]  # typeshed narrows http_class
        return super().do_open(_armed(http_class, self.deadline), req, **kw)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def do_open(self, http_class: Any, req: Any, **kw: Any) -> Any:  # type: ignore[override]  # typeshed narrows http_class
        return super().do_open(_armed(http_class, self.deadline), req, **kw)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kw: Any) -> None:
        return None  # urllib then raises the 3xx as an HTTPError


def _server_message(e: urllib.error.HTTPError, deadline: _Deadline) -> str:
    """The server's own message of an error answer, on one line (vLLM: {"error": {"message": ...}}; FastAPI:
    {"detail": ...}); the status's reason where the body says nothing readable."""
    try:
        deadline.settimeout()
        parsed = json.loads(e.read(ERROR_BYTES).decode(errors="replace"))
        msg = parsed.get("error", parsed.get("detail", parsed)) if isinstance(parsed, dict) else parsed
        if isinstance(msg, dict):
            msg = msg.get("message") or msg.get("detail") or msg
        return one_line(msg)
    except Exception:  # noqa: BLE001 - any body at all: the status line is the message then
        return one_line(e.reason if isinstance(e.reason, str) else "")


def request_json(url: str, body: Any = None, *, method: str | None = None, timeout: float,
                 token: str | None = None, max_bytes: int = MAX_BYTES, attempts: int = 1, text_ok: bool = False) -> Any:
    """`body` (None: a GET, else a POST of it as JSON) to `url`; the answer's JSON (None for an empty body).
    Everything, from connecting to the last byte, within `timeout` seconds; at most `max_bytes` of answer.
    `attempts` > 1, for an idempotent request only (one whose repeat does no harm): a connection refused or reset and
    HTTP 502 / 503 / 504 are tried again (module docstring), every try and wait inside the same `timeout`.
    `text_ok`: an answer that is not JSON is returned as its text (vLLM's LoRA routes answer success in plain text).
    Raises Refused (an error status), TimedOut, Unreachable or BadAnswer, each one line naming `url`."""
    data = None if body is None else json.dumps(body, allow_nan=False).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    verb = method or ("POST" if body is not None else "GET")
    end = time.monotonic() + timeout
    attempt = 1
    while True:
        try:
            return _request_once(url, data, verb, headers, timeout, end - time.monotonic(), max_bytes, text_ok)
        except (Refused, Unreachable) as e:
            transient = e.status in RETRY_STATUSES if isinstance(e, Refused) else e.transient
            if not transient or attempt >= attempts:
                raise _tried(e, attempt) from None
            wait = min(RETRY_CAP_S, RETRY_BASE_S * 2 ** (attempt - 1))
            wait *= 0.5 + 0.5 * _JITTER.random()
            if time.monotonic() + wait + RETRY_MIN_TRY_S >= end:  # no time left for another try: the deadline holds
                raise _tried(e, attempt) from None
            rank = os.environ.get("RANK", "0")
            print(f"warning: rank {rank}: {verb} {url}: {one_line(e, 160)}; retry {attempt} of {attempts - 1} in "
                  f"{wait:.1f} s", file=sys.stderr, flush=True)
            time.sleep(wait)
            attempt += 1


def _tried(e: HTTPFailure, tries: int) -> HTTPFailure:
    """`e` with the number of tries in its message (one try, or the deadline spent: `e` itself)."""
    if tries == 1 or isinstance(e, TimedOut):
        return e
    if isinstance(e, Refused):
        return Refused(e.status, f"{e.detail} ({tries} tries)".lstrip())
    out = Unreachable(f"{e} ({tries} tries)")
    out.transient = getattr(e, "transient", False)
    return out


def _request_once(url: str, data: bytes | None, method: str, headers: dict[str, str], total: float, seconds: float,
                  max_bytes: int, text_ok: bool = False) -> Any:
    """One try of request_json within `seconds` (what is left of the request's `total` deadline, which its TimedOut
    names)."""
    if seconds <= 0:
        raise TimedOut(total)
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    deadline = _Deadline(seconds)
    opener = urllib.request.build_opener(_HTTPHandler(deadline), _HTTPSHandler(deadline), _NoRedirect())
    raw = bytearray()
    try:
        try:
            with opener.open(req, timeout=max(deadline.left(), 0.001)) as resp:
                length = resp.headers.get("Content-Length", "")
                if length.strip().isdigit() and int(length) > max_bytes:
                    raise BadAnswer(f"{url} answered with {int(length)} bytes, more than the {max_bytes} bytes the "
                                    f"trainer reads: is it the right server?")
                while True:
                    if deadline.left() <= 0:
                        raise TimedOut(total)
                    deadline.settimeout()
                    chunk = resp.read1(CHUNK)
                    if not chunk:
                        break
                    raw += chunk
                    if len(raw) > max_bytes:
                        raise BadAnswer(f"{url} answered with more than the {max_bytes} bytes the trainer reads: "
                                        f"is it the right server?")
        except urllib.error.HTTPError as e:
            if 300 <= e.code < 400:
                where = one_line(e.headers.get("Location", "elsewhere"), 120)
                raise BadAnswer(f"{url} answered with a redirect (HTTP {e.code} to {where}); the trainer follows "
                                f"none: give the URL it points to") from None
            raise Refused(e.code, _server_message(e, deadline)) from None
        except HTTPFailure:
            raise
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            reason = getattr(e, "reason", e)
            if deadline.fired or deadline.left() <= 0 or isinstance(reason, TimeoutError):
                raise TimedOut(total) from None
            failure = Unreachable(one_line(reason, 120) or type(reason).__name__)
            # refused, reset, aborted, a broken pipe, closed before the status line or mid-body: the server or the
            # path to it dropped this connection; a name that does not resolve or a garbled answer is not transient
            failure.transient = isinstance(reason, (ConnectionError, http.client.IncompleteRead))
            raise failure from None
        if deadline.fired:  # shut down mid-body: what came is not the whole answer
            raise TimedOut(total)
    finally:
        deadline.disarm()
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the parser goes
        if text_ok:
            return bytes(raw).decode("utf-8", errors="replace")
        raise BadAnswer(f"{url} answered with something that is not JSON: {bytes(raw[:80])!r}") from None


class Client:
    """One JSON server: its base URL, its default deadline (`timeout` seconds) and its bearer token, read here from the
    environment variable `key_env` (the one place a server's key is read: never a config field, run.json and the resume
    files record those). Raises ValueError, one line naming the variable, for a key a header cannot carry."""

    def __init__(self, url: str, timeout: float, key_env: str) -> None:
        self.url = url.strip().rstrip("/")
        self.timeout = float(timeout)
        self.key_env = key_env
        self.token = token_from_env(key_env)

    def request(self, path: str, body: Any = None, *, method: str | None = None, timeout: float | None = None,
                max_bytes: int = MAX_BYTES, idempotent: bool | None = None, text_ok: bool = False) -> Any:
        """request_json of `body` to the server's `path`, with its token, within `timeout` seconds (default: the
        client's). An `idempotent` request (default: a GET) is tried again on a dropped connection or HTTP 502 / 503 /
        504, inside the same deadline; say so only where a repeat does no harm."""
        if idempotent is None:
            idempotent = body is None and method in (None, "GET")
        return request_json(self.url + path, body, method=method, timeout=timeout or self.timeout, token=self.token,
                            max_bytes=max_bytes, attempts=RETRY_ATTEMPTS if idempotent else 1, text_ok=text_ok)

    def key_hint(self, e: Refused) -> str:
        """What to do about a refused key (HTTP 401), to append to the failure's line; '' for any other refusal."""
        if e.status != 401:
            return ""
        return (f" (the key in {self.key_env} is not the server's --api-key)" if self.token else
                f" (it wants a key: set {self.key_env} to its --api-key)")


def token_from_env(var: str) -> str | None:
    """The bearer token in environment variable `var` (None: unset or empty). Surrounding whitespace is dropped; a
    key an HTTP header cannot carry is one line naming the variable (never the key)."""
    key = os.environ.get(var, "").strip()
    if not key:
        return None
    if not (key.isascii() and key.isprintable()):
        raise ValueError(f"{var} holds characters an HTTP header cannot carry (control or non-ASCII characters): "
                         f"set it to the server's --api-key")
    return key


def server_index(rank: int, world_size: int, n: int) -> int:
    """Which of n servers (--engine_url, --reward_model_url: comma-separated) serves `rank`: the ranks in n
    contiguous blocks, so with one server per node, listed in node order, every rank uses its own node's (torchrun
    numbers a node's ranks contiguously); with more servers than ranks, rank r uses server r."""
    return rank * n // max(world_size, 1) if n <= world_size else rank
