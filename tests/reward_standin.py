"""Protocol stand-ins for the reward servers (trainer/reward_server.py's clients), for tests.

- `start_rm(DIR)`: the subset of vLLM's pooling server that --reward_model_url uses, with vLLM 0.32.0's request and
  response shapes (vllm/entrypoints/pooling/classify/protocol.py, serve/tokenize/protocol.py, the models card): GET
  /v1/models and /health, POST /tokenize, POST /classify. The model is the HF sequence-classification directory in
  fp32 (HF's forward, each row unpadded, as vLLM gets it). /classify applies vLLM's default activation unless the
  request says `use_activation: false` (sigmoid below 2 labels, softmax otherwise: pooler/activations.py), so a
  client that forgets it reads sigmoid(score). `served_root` / `tokenizer_dir` stand in for a server started on
  another model; `classify=False` for a generative model (no /classify route: 404, as vLLM registers none).
- `start_fn(fn)`: a --reward_url server: POST {"prompts", "replies", "references"} -> {"rewards": [fn(p, r, ref)...]};
  `fail_on` = the request numbers (1, 2, ...) answered with HTTP 500 instead.

Both serve from a daemon thread of this process (`.url`, `.requests`, `.auth`: each request's Authorization header,
`.stop()`); with `api_key=` every route but /health wants it as a bearer token (HTTP 401 otherwise). Ranks started
as subprocesses reach them over the loopback.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that has read its answer and gone (the trainer stopping on an HTTP 500) is not an error of the
        # server's; socketserver would print its traceback into the run's captured output.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Server:
    routes: dict[str, str] = {}

    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.api_key: str | None = None  # set: every route but /health answers 401 without `Bearer <api_key>`
        self.auth: list[str | None] = []  # every request's Authorization header, in order
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.url = ""

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> _Server:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                path = self.path.split("?", 1)[0]
                owner.auth.append(self.headers.get("Authorization"))
                if path not in owner.routes:
                    return self._send(404, {"detail": "Not Found"})
                if owner.api_key and path != "/health" and self.headers.get("Authorization") != f"Bearer {owner.api_key}":
                    return self._send(401, {"error": "Unauthorized"})
                size = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(size) or b"null")
                    with owner.lock:
                        owner.requests.append((path, body))
                        code, out = getattr(owner, owner.routes[path])(body)
                except Exception as e:  # noqa: BLE001 - a server answers every request, a bad one with 500
                    code, out = 500, _v_error(f"{type(e).__name__}: {e}", "InternalServerError", 500)
                self._send(code, out)

            def _send(self, code: int, out: Any) -> None:
                data = b"" if out is None else json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = _QuietServer((host, port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _v_error(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class RewardModelStandIn(_Server):
    """vLLM's pooling server on a sequence-classification directory (the subset --reward_model_url uses)."""

    def __init__(self, model_dir: str | Path, served_root: str | Path | None = None, tokenizer_dir: str | Path | None = None,
                 classify: bool = True, max_model_len: int = 1024) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        super().__init__()
        self.model_path = str(model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(self.model_path, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir or model_dir))
        self.root = str(served_root or model_dir)
        self.max_model_len = max_model_len
        self.routes = {"/v1/models": "models", "/health": "health", "/tokenize": "tokenize",
                       **({"/classify": "classify"} if classify else {})}

    def health(self, body: Any) -> tuple[int, Any]:
        return 200, None

    def models(self, body: Any) -> tuple[int, Any]:
        card = {"id": self.root, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": self.root,
                "parent": None, "max_model_len": self.max_model_len, "permission": []}
        return 200, {"object": "list", "data": [card]}

    def _check_model(self, body: dict) -> tuple[int, Any] | None:
        if body.get("model") not in (None, self.root):
            return 404, _v_error(f"The model `{body.get('model')}` does not exist.", "NotFoundError", 404)
        return None

    def tokenize(self, body: dict) -> tuple[int, Any]:
        if (bad := self._check_model(body)) is not None:
            return bad
        ids = self.tok(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))["input_ids"]
        return 200, {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}

    @torch.no_grad()
    def classify(self, body: dict) -> tuple[int, Any]:
        if (bad := self._check_model(body)) is not None:
            return bad
        inputs = body.get("input")
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # vLLM's prompt_to_seq: one prompt, text or token IDs
        rows = [self.tok(x, add_special_tokens=bool(body.get("add_special_tokens", True)))["input_ids"]
                if isinstance(x, str) else list(x) for x in inputs]
        too_long = next((r for r in rows if len(r) > self.max_model_len), None)
        if too_long is not None:
            return 400, _v_error(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                 f"requested {len(too_long)} tokens in the input.", "BadRequestError", 400)
        data, n_tok = [], 0
        for i, ids in enumerate(rows):
            logits = self.model(input_ids=torch.tensor([ids])).logits[0].float()
            if body.get("use_activation") is not False:
                logits = torch.sigmoid(logits) if logits.numel() < 2 else torch.softmax(logits, -1)
            probs = logits.tolist()
            label = self.model.config.id2label.get(int(torch.tensor(probs).argmax()))
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
            n_tok += len(ids)
        return 200, {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                     "model": self.root, "data": data,
                     "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok, "completion_tokens": 0,
                               "prompt_tokens_details": None}}


class RewardFnStandIn(_Server):
    """A --reward_url server around fn(prompt, reply, reference) -> float, at POST /reward."""

    def __init__(self, fn: Callable[[str, str, str | None], Any], fail_on: tuple[int, ...] = (), path: str = "/reward") -> None:
        super().__init__()
        self.fn, self.fail_on, self.path = fn, set(fail_on), path
        self.routes = {path: "reward"}

    def reward(self, body: dict) -> tuple[int, Any]:
        if len(self.requests) in self.fail_on:
            return 500, {"detail": f"the stand-in fails request {len(self.requests)} on purpose"}
        return 200, {"rewards": [self.fn(p, r, ref) for p, r, ref in
                                 zip(body["prompts"], body["replies"], body["references"])]}


def start_rm(model_dir: str | Path, api_key: str | None = None, **kw: Any) -> RewardModelStandIn:
    rm = RewardModelStandIn(model_dir, **kw)
    rm.api_key = api_key
    rm.serve()
    return rm


def start_fn(fn: Callable[[str, str, str | None], Any], api_key: str | None = None, **kw: Any) -> RewardFnStandIn:
    server = RewardFnStandIn(fn, **kw)
    server.api_key = api_key
    server.serve()
    return server


def main(argv: list[str] | None = None) -> None:
    """`python -m tests.reward_standin --model DIR --port PORT [--host H]`: the pooling stand-in as a process."""
    import argparse

    p = argparse.ArgumentParser(description="A stand-in of vLLM's pooling server on a reward model directory.")
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    s = RewardModelStandIn(a.model)
    s.serve(a.port, a.host)
    print(f"serving {a.model} (vLLM pooling) at {s.url}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
