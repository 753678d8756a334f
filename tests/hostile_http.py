"""A hostile HTTP server for the tests of trainer/http_client.py and its clients (engines, reward servers): it reads each
request and answers as a server that wants the client to hang or to run out of memory would.

- "trickle_body": a status line and headers at once (Content-Length 100000), then a body byte every `every` s;
- "trickle_head": the status line and a header a byte every `every` s (the answer never starts);
  both for `limit_s` seconds, then it hangs up (a client without a total deadline waits that long);
- "flood": a body of `size` bytes (100 MB by default) sent as fast as the client takes it, with its Content-Length
  or (`length=False`) none, ended by closing the connection;
- "redirect": HTTP 307 to `location`;
- "flaky": the first `fails` requests fail as `failure` says ("reset": the connection reset, RST, after the request
  is read; "close": closed without a word; a number: that HTTP status, e.g. 503), every later one is answered 200
  with `answer` as JSON. With `listen_after` > 0 nothing listens for that many seconds (connections are refused: a
  server restarting), then it answers.

`.url`, `.sent` (the bytes it sent: what the client let in), `.headers` (each request's headers, lower-case names:
one per request read), `.stop()`. Raw sockets, so nothing in it is polite.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from http import HTTPStatus
from typing import Any


class Hostile:
    def __init__(self, mode: str, every: float = 0.2, size: int = 100_000_000, length: bool = True,
                 location: str = "", limit_s: float = 5.0, fails: int = 0, failure: str | int = "reset",
                 answer: Any = None, listen_after: float = 0.0) -> None:
        self.mode, self.every, self.size, self.length, self.location = mode, every, size, length, location
        self.limit_s = limit_s
        self.fails, self.failure, self.answer, self.listen_after = fails, failure, answer, listen_after
        self.sent = 0
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))  # bound but not listening: a connection is refused (RST to the SYN)
        if not listen_after:
            self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        if self.listen_after:
            if self.done.wait(self.listen_after):
                return
            self.sock.listen(16)
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _read_request(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")[1:]
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        with self.lock:
            self.headers.append(headers)
        need = int(headers.get("content-length", "0")) - len(body)
        while need > 0:
            chunk = conn.recv(min(need, 65536))
            if not chunk:
                return
            need -= len(chunk)

    def _send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._read_request(conn)
            with self.lock:
                n = len(self.headers)  # this request's number, 1-based
            end = time.monotonic() + self.limit_s
            if self.mode == "trickle_body":
                self._send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
                while not self.done.wait(self.every) and time.monotonic() < end:
                    self._send(conn, b" ")
            elif self.mode == "trickle_head":
                for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100000:
                    if self.done.wait(self.every) or time.monotonic() > end:
                        break
                    self._send(conn, bytes([byte]))
            elif self.mode == "flood":
                length = f"Content-Length: {self.size}\r\n" if self.length else "Connection: close\r\n"
                self._send(conn, f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{length}\r\n".encode())
                chunk = b" " * (1 << 20)
                left = self.size
                while left > 0 and not self.done.is_set():
                    self._send(conn, chunk[:left])
                    left -= len(chunk)
            elif self.mode == "redirect":
                self._send(conn, f"HTTP/1.1 307 Temporary Redirect\r\nLocation: {self.location}\r\n"
                                 f"Content-Length: 0\r\n\r\n".encode())
            elif self.mode == "flaky" and n <= self.fails and self.failure == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST
            elif self.mode == "flaky" and n <= self.fails and self.failure == "close":
                pass  # closed below, before any status line
            elif self.mode == "flaky":
                status = int(self.failure) if n <= self.fails else 200
                body = json.dumps({"detail": "busy"} if status != 200 else self.answer).encode()
                self._send(conn, f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
                                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                                 f"Connection: close\r\n\r\n".encode() + body)
        except OSError:
            pass  # the client hung up: what it was meant to do
        finally:
            conn.close()

    def stop(self) -> None:
        self.done.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() under way: nothing is answered any more
        except OSError:
            pass
        self.sock.close()
