"""A hostile HTTP server for the tests of trainer/http_client.py and its clients (engines, reward servers): it reads each
request and answers as a server that wants the client to hang or to run out of memory would.

- "trickle_body": a status line and headers at once (Content-Length 100000), then a body byte every `every` s;
- "trickle_head": the status line and a header a byte every `every` s (the answer never starts);
  both for `limit_s` seconds, then it hangs up (a client without a total deadline waits that long);
- "flood": a body of `size` bytes (100 MB by default) sent as fast as the client takes it, with its Content-Length
  or (`length=False`) none, ended by closing the connection;
- "redirect": HTTP 307 to `location`.

`.url`, `.sent` (the bytes it sent: what the client let in), `.headers` (each request's headers, lower-case names),
`.stop()`. Raw sockets, so nothing in it is polite.
"""

from __future__ import annotations

import socket
import threading
import time


class Hostile:
    def __init__(self, mode: str, every: float = 0.2, size: int = 100_000_000, length: bool = True,
                 location: str = "", limit_s: float = 5.0) -> None:
        self.mode, self.every, self.size, self.length, self.location = mode, every, size, length, location
        self.limit_s = limit_s
        self.sent = 0
        self.headers: list[dict[str, str]] = []
        self.done = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
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
