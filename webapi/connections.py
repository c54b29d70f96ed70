"""Slow and many clients under uvicorn: a header timeout, a header size cap and a cap on open
connections, which uvicorn (0.54 here) does not have.

Why: uvicorn's ``timeout_keep_alive`` runs only between requests, and any byte received cancels
it; its ``limit_concurrency`` answers 503 only once a request's headers are complete. A client that
opens a connection and trickles header lines is never closed: in the issue, 1,000 such connections
took the server from 22 to 1,223 open files. With httptools (uvicorn's default where it is
installed) nothing bounds the size of the headers either.

``guarded_protocol(limits)`` subclasses the protocol uvicorn would pick (httptools, else h11):

- every request's line and headers must arrive within ``header_timeout`` s of the connection
  opening or of the previous answer: else a 408 and the connection is closed;
- they may take at most ``max_header_kb`` KiB: else a 431 and close (h11 has its own 16 KiB cap);
- past ``max_connections`` open connections a new one is answered 503 (Retry-After) and closed
  at once, before it sends anything, so the open files stay bounded.

Bodies are bounded by webapi.guard (``body_timeout``, the sizes). The subclass touches only what
both uvicorn protocols share: ``connections``, ``cycle`` (its ``response_complete``),
``transport``, ``loop``, ``connection_made``/``data_received``/``connection_lost`` and
``on_response_complete``; tests/test_service_limits.py runs it on both.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from webapi.limits import ServiceLimits, retry_after

REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def base_protocol(http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's protocol class for ``http`` ("auto": httptools where installed, else h11)."""
    if http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol


def raw_response(status: int, message: str, extra: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response with a JSON ``{"error"}`` body that closes the connection."""
    body = json.dumps({"error": message}).encode()
    head = [f"HTTP/1.1 {status} {REASONS.get(status, '')}", "content-type: application/json"]
    head += [f"content-length: {len(body)}", "connection: close"]
    head += [f"{name}: {value}" for name, value in (extra or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def guarded_protocol(limits: ServiceLimits, http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's protocol class with the limits of the module doc (pass it as ``uvicorn.Config(http=...)``)."""
    base: Any = base_protocol(http)

    class GuardedProtocol(base):  # type: ignore[misc, valid-type]
        """One connection: refused when too many are open, closed when its headers are too slow or too big."""

        max_connections = limits.max_connections
        header_timeout = limits.header_timeout
        max_header_bytes = limits.max_header_kb << 10

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            full = len(self.connections) >= self.max_connections  # before this one joins them
            self._header_timer: asyncio.TimerHandle | None = None
            self._header_bytes = 0
            super().connection_made(transport)
            if full:
                message = f"too many open connections (--max-connections {self.max_connections}); retry later"
                self.refuse(503, message, {"retry-after": retry_after(1)})
                return
            self.await_headers()

        def await_headers(self) -> None:
            """(Re)start the wait for the next request's headers."""
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(self.header_timeout, self.headers_too_slow)

        def awaiting_headers(self) -> bool:
            """No request in flight: the bytes arriving are (part of) the next request's headers."""
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing() or not self.awaiting_headers():
                return
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                kib = self.max_header_bytes >> 10
                self.refuse(431, f"request line and headers over {kib} KiB (--max-header-kb)")

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self.await_headers()  # the next request of this connection gets its own header_timeout

        def headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and self.awaiting_headers():
                self.refuse(408, f"request headers did not arrive within {self.header_timeout:g} s (--header-timeout)")

        def refuse(self, status: int, message: str, extra: dict[str, str] | None = None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            self.transport.write(raw_response(status, message, extra))
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if getattr(self, "_header_timer", None) is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

    GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedProtocol


def uvicorn_config(app: Any, host: str, port: int, limits: ServiceLimits, http: str = "auto", **kwargs: Any) -> Any:
    """A ``uvicorn.Config`` serving ``app`` with ``limits``'s connection bounds (the protocol above;
    uvicorn's own keep-alive timeout stays, 5 s)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, http=guarded_protocol(limits, http), **kwargs)
