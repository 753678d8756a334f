"""A protocol stand-in for a vLLM server of a distillation teacher (trainer/distill.py TeacherServer), for tests.

`start(model, tok)` serves the subset of vLLM's OpenAI-compatible server that --teacher_url uses, with the request and
answer shapes of vLLM's vllm/entrypoints/openai/completion/protocol.py (CompletionRequest.prompt_logprobs;
CompletionResponseChoice.prompt_logprobs: list[dict[token_id, Logprob] | None], the first entry None) and serving.py
(a choice per prompt, in order): GET /v1/models, POST /tokenize, POST /v1/completions. Each prompt's log-probs are the
local model's fp32 log-softmax of its raw logits (temperature 1, as vLLM's prompt_logprob.py computes them), one row
at a time, unpadded, as vLLM gets them.

Faults, as a broken or hostile server would answer: `mode="logits"` (values of the raw logits: a server started with
--logprobs-mode raw_logits), "short" (one entry missing), "nan" (a NaN), "other_tokenizer" (/tokenize splits
differently). `api_key`: every route wants `Authorization: Bearer <key>` (HTTP 401 otherwise).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch


class TeacherStandin:
    def __init__(self, model: torch.nn.Module, tok: Any, mode: str = "ok", api_key: str | None = None) -> None:
        self.model, self.tok, self.mode, self.api_key = model.eval(), tok, mode, api_key
        self.requests: list[dict] = []
        self.server: ThreadingHTTPServer | None = None
        self.url = ""

    @torch.no_grad()
    def _prompt_logprobs(self, ids: list[int]) -> list[dict | None]:
        logits = self.model(torch.tensor([ids])).logits[0].float()  # [T, V]
        values = logits if self.mode == "logits" else torch.log_softmax(logits, dim=-1)
        out: list[dict | None] = [None]
        for pos, tok_id in enumerate(ids[1:]):
            v = float(values[pos, tok_id])
            if self.mode == "nan" and pos == 0:
                v = float("nan")
            out.append({str(tok_id): {"logprob": v, "rank": 1, "decoded_token": self.tok.decode([tok_id])}})
        return out[:-1] if self.mode == "short" else out

    def answer(self, path: str, body: Any) -> tuple[int, Any]:
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "teacher", "object": "model", "max_model_len": 4096}]}
        if path == "/tokenize":
            ids = list(self.tok(body["prompt"], add_special_tokens=False)["input_ids"])
            return 200, {"tokens": ids[:-1] if self.mode == "other_tokenizer" else ids, "count": len(ids)}
        if path == "/v1/completions":
            prompts = body["prompt"] if body["prompt"] and isinstance(body["prompt"][0], list) else [body["prompt"]]
            choices = [{"index": i, "text": "", "finish_reason": "length", "prompt_logprobs": self._prompt_logprobs(p)}
                       for i, p in enumerate(prompts)]
            return 200, {"id": "cmpl-1", "object": "text_completion", "model": "teacher", "choices": choices}
        return 404, {"error": {"message": f"no route {path}"}}

    def start(self) -> TeacherStandin:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _reply(self, status: int, obj: Any) -> None:
                raw = json.dumps(obj).encode()  # NaN passes as the bare token NaN, as Python's json writes it
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _route(self, body: Any) -> None:
                if outer.api_key and self.headers.get("Authorization") != f"Bearer {outer.api_key}":
                    return self._reply(401, {"error": {"message": "Unauthorized"}})
                outer.requests.append({"path": self.path, "body": body})
                self._reply(*outer.answer(self.path, body))

            def do_GET(self) -> None:  # http.server's name
                self._route(None)

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                self._route(json.loads(self.rfile.read(n) or b"null"))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
