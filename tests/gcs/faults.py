"""A fault-injecting HTTP proxy on 127.0.0.1, in front of the GCS emulator.

Point a client at :attr:`FaultProxy.endpoint` (``StorageOptions(endpoint=...)``) and queue
faults; each applies to the next ``count`` requests it matches, then the proxy forwards
faithfully again. Every request is logged, so tests can count downloads and check ranges.

Fault kinds: ``status`` (answer ``status`` without forwarding: 503, 429, ...), ``reset``
(TCP RST instead of a response), ``truncate`` (full Content-Length, half the body, then
RST), ``stall`` (sleep ``stall_s`` before answering: the client's timeout fires), and
``corrupt`` (flip one byte of the body; length unchanged).
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import urlsplit

FAULT_KINDS = ("status", "reset", "truncate", "stall", "corrupt")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


@dataclass
class Fault:
    kind: str
    count: int = 1
    match: str = "media"  # "media" (object downloads), "metadata" (JSON API GETs), "any"
    status: int = 503
    stall_s: float = 3.0

    MATCHES = ("media", "metadata", "any")

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {FAULT_KINDS} (got {self.kind!r})")
        if self.match not in self.MATCHES:
            raise ValueError(f"match must be one of {', '.join(self.MATCHES)} (got {self.match!r})")

    def error_body(self) -> tuple[bytes, str]:
        """The body and content type of an injected ``status`` answer (the store's error format)."""
        return b'{"error": {"code": %d, "message": "injected"}}' % self.status, "application/json"

    def matches(self, method: str, path: str) -> bool:
        media = method == "GET" and "alt=media" in path
        if self.match == "media":
            return media
        if self.match == "metadata":
            return method == "GET" and not media
        return True


@dataclass
class Request:
    method: str
    path: str
    range: Optional[str]
    fault: Optional[str]


@dataclass
class FaultProxy:
    upstream: str  # http://127.0.0.1:PORT of the emulator
    faults: list[Fault] = field(default_factory=list)
    log: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.handle_error = lambda request, address: None  # injected resets are expected
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fault-proxy", daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def inject(self, *faults: Fault) -> None:
        with self._lock:
            self.faults.extend(faults)

    def take(self, method: str, path: str, range_header: Optional[str]) -> Optional[Fault]:
        with self._lock:
            chosen = next((f for f in self.faults if f.count > 0 and f.matches(method, path)), None)
            if chosen is not None:
                chosen.count -= 1
            self.log.append(Request(method, path, range_header, chosen.kind if chosen else None))
            return chosen

    def pending(self) -> int:
        with self._lock:
            return sum(f.count for f in self.faults)

    def media_gets(self, name_part: str = "") -> list[Request]:
        with self._lock:
            return [r for r in self.log if r.method == "GET" and "alt=media" in r.path and name_part in r.path]

    def reset_log(self) -> None:
        with self._lock:
            self.log.clear()
            self.faults.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection, like the emulator
    owner: FaultProxy

    def log_message(self, format: str, *args) -> None:  # keep test output quiet
        pass

    def _rst(self) -> None:
        # SO_LINGER(on, 0) makes close() send RST: the client sees "connection reset by peer".
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True

    def _handle(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        fault = self.owner.take(self.command, self.path, self.headers.get("Range"))
        kind = fault.kind if fault else None
        if kind == "status":
            payload, content_type = fault.error_body()
            self.send_response(fault.status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        if kind == "reset":
            return self._rst()
        if kind == "stall":
            time.sleep(fault.stall_s)
        upstream = urlsplit(self.owner.upstream)
        conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP | {"host"}}
        conn.request(self.command, self.path, body=body or None, headers=headers)
        response = conn.getresponse()
        data = response.read()
        conn.close()
        if kind == "corrupt" and data:
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
        try:
            self.send_response(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() not in _HOP_BY_HOP:
                    self.send_header(key, value)
            # A HEAD answer has no body but says how long the object is (S3 clients read it).
            length = response.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length if length is not None else str(len(data)))
            self.end_headers()
            if kind == "truncate":
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                return self._rst()
            self.wfile.write(data)
        except OSError:
            pass  # the client gave up (stall): nothing to deliver

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _handle
