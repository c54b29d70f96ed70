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

Answers the client does not take (issue 44: 20 clients that never read a 15 MB answer held every
slot of ``--max-connections 20`` for good; uvicorn's timers close a connection gracefully, which
waits for its write buffer to drain):

- a connection's unsent answer bytes must all leave within ``send_timeout`` s of the first of
  them waiting (the transport's buffer past its high-water mark, or any left when an answer
  completes): else the connection is closed hard (``abort`` with a zero linger: the kernel's copy
  is dropped too), which frees its slot and its buffer;
- the unsent bytes of all connections together stay under ``max_unsent_mb``: the connection whose
  answer passes it is closed hard at once.

Pipelined requests (httptools parses every request in the bytes it reads, also while an earlier
one is answered) keep the header cap and the header timeout: each request's line and headers are
counted from its first byte (``on_message_begin``), and one that is too big or too slow while an
earlier answer is on its way closes the connection hard (a 431 or 408 cannot be sent into the
middle of the other answer). h11 parses nothing while a request is answered (it pauses reading),
so there the connection-level checks above already hold; tests/webapi/test_serve_connections.py runs
both.

Bodies are bounded by webapi.guard (``body_timeout``, the sizes). The subclass touches only what
both uvicorn protocols share: ``connections``, ``cycle`` (its ``response_complete``),
``transport``, ``loop``, ``connection_made``/``data_received``/``connection_lost`` and
``on_response_complete``; tests/webapi/test_serve_connections.py runs it on both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
from typing import Any

from webapi.limits import ServiceLimits, retry_after

log = logging.getLogger(__name__)
WRITE_HIGH_WATER = 64 << 10  # asyncio's default: an answer larger than this waits in the buffer
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


class GuardedConnection:
    """The limits of the module doc on one connection, mixed into uvicorn's protocol class by
    ``guarded_protocol`` (which sets the class attributes below from the ServiceLimits): refused
    when too many are open, closed when its headers are too slow or too big, closed hard when its
    answer is not taken."""

    max_connections: int
    header_timeout: float
    max_header_bytes: int
    send_timeout: float
    max_unsent_bytes: int
    # uvicorn's protocol's own (both protocols have them)
    connections: Any
    cycle: Any
    transport: Any
    loop: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        full = len(self.connections) >= self.max_connections  # before this one joins them
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._send_timer: asyncio.TimerHandle | None = None
        self._pipelined_timer: asyncio.TimerHandle | None = None
        self._pipelined_bytes = 0
        self._cycles: list[Any] = []  # the requests parsed and not yet answered (httptools)
        super().connection_made(transport)
        # resume_writing only once every byte is sent: it ends the send timer
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=0)  # type: ignore[attr-defined]
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
        if self.transport.get_write_buffer_size() > 0:
            self.await_sending()

    # --- answers the client does not take ---------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        self.await_sending()
        unsent = sum(unsent_bytes(c) for c in self.connections)
        if unsent > self.max_unsent_bytes and not self.transport.is_closing():
            mib = self.max_unsent_bytes >> 20
            self.drop(f"answers waiting for their clients hold {unsent} bytes, over {mib} MiB (--max-unsent-mb)")

    def resume_writing(self) -> None:
        super().resume_writing()  # every byte sent (low-water mark 0)
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def await_sending(self) -> None:
        """Start the wait for this connection's unsent bytes to leave (once per wait)."""
        if self._send_timer is None and not self.transport.is_closing():
            self._send_timer = self.loop.call_later(self.send_timeout, self.sending_too_slow)

    def sending_too_slow(self) -> None:
        self._send_timer = None
        left = self.transport.get_write_buffer_size()
        if left > 0:
            self.drop(f"{left} answer bytes not taken within {self.send_timeout:g} s (--send-timeout)")

    def drop(self, why: str) -> None:
        """Close hard: no answer, nothing more sent (the buffer and the kernel's copy dropped)."""
        peer = self.transport.get_extra_info("peername")
        log.warning("closing the connection of %s: %s", peer, why)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # a zero linger: RST, the kernel's copy dropped too
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    # --- pipelined requests (httptools parser callbacks) ------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self.awaiting_headers():  # parsed while an earlier request is answered
            self._pipelined_bytes = 0
            self.cancel_pipelined_timer()
            self._pipelined_timer = self.loop.call_later(self.header_timeout, self.pipelined_too_slow)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self.count_pipelined(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self.count_pipelined(len(name) + len(value) + 4)

    def on_headers_complete(self) -> None:
        self.cancel_pipelined_timer()
        super().on_headers_complete()
        # every request's cycle, pipelined ones too: uvicorn marks only its newest one
        # disconnected when the connection is lost (see connection_lost)
        self._cycles = [c for c in self._cycles if not c.response_complete] + [self.cycle]

    def count_pipelined(self, n: int) -> None:
        if self._pipelined_timer is None:
            return  # not a pipelined request: data_received counts its bytes
        self._pipelined_bytes += n
        if self._pipelined_bytes > self.max_header_bytes and not self.transport.is_closing():
            kib = self.max_header_bytes >> 10
            self.drop(f"a pipelined request's line and headers are over {kib} KiB (--max-header-kb)")

    def pipelined_too_slow(self) -> None:
        self._pipelined_timer = None
        if not self.transport.is_closing():
            self.drop(f"a pipelined request's headers did not arrive within {self.header_timeout:g} s")

    def cancel_pipelined_timer(self) -> None:
        if self._pipelined_timer is not None:
            self._pipelined_timer.cancel()
            self._pipelined_timer = None

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
        for name in ("_header_timer", "_send_timer", "_pipelined_timer"):
            timer = getattr(self, name, None)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)
        # uvicorn marks only the newest request disconnected; an earlier one still being
        # answered (pipelined behind it) would write to the closed transport and be logged as
        # an ASGI error: mark every unanswered one, so their answers are dropped quietly
        for cycle in getattr(self, "_cycles", []):
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)


def guarded_protocol(limits: ServiceLimits, http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's protocol class with the limits of the module doc (pass it as ``uvicorn.Config(http=...)``)."""
    base: Any = base_protocol(http)
    attributes = {
        "max_connections": limits.max_connections,
        "header_timeout": limits.header_timeout,
        "max_header_bytes": limits.max_header_kb << 10,
        "send_timeout": limits.send_timeout,
        "max_unsent_bytes": limits.max_unsent_mb << 20,
        "__qualname__": f"Guarded{base.__name__}",
    }
    return type(f"Guarded{base.__name__}", (GuardedConnection, base), attributes)


def unsent_bytes(protocol: Any) -> int:
    """Bytes in a connection's write buffer (0 before it has a transport)."""
    transport = getattr(protocol, "transport", None)
    return transport.get_write_buffer_size() if transport is not None else 0


def uvicorn_config(app: Any, host: str, port: int, limits: ServiceLimits, http: str = "auto", **kwargs: Any) -> Any:
    """A ``uvicorn.Config`` serving ``app`` with ``limits``'s connection bounds (the protocol above;
    uvicorn's own keep-alive timeout stays, 5 s)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, http=guarded_protocol(limits, http), **kwargs)
