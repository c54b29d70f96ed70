"""A direct TCP channel between a coordinator and its shard actors, beside Ray's.

Why: a Ray actor call costs a fixed ~1.5-1.8 ms round trip on the 2-core box (a fan-out to 3
actors doing nothing; a message over a kept-open TCP connection to the same actors: 0.13 ms). A
sharded search is one fan-out, so that fixed cost is most of what separates it from the single
index (``bench/sharded_serving.py``). Ray still places, starts, restarts and health-checks the
actors, and still carries any call the channel cannot (cluster/ray_shards.py).

Protocol: each message is one typed message of shards/wire.py (its 16-byte prefix announces its
size, checked before anything more is read or allocated; no pickle); a connection carries one
call at a time (request, then reply), so replies need no ids and a connection whose reply never
came is closed, never reused.

Security:
- Authentication before anything grows: one thread accepts and runs every handshake at once
  (non-blocking, selectors), at most ``max_pending`` of them, each closed after ``handshake_s``
  seconds. Only a connection whose client proved it holds the server's 32-byte random key (HMAC-
  SHA256 challenge each way, as ``multiprocessing``'s authkey) gets a thread, at most
  ``max_connections`` of them; past either cap a connection is closed at once. The key is handed
  out only through a Ray call to the actor (``ShardGroup.endpoint``), so reaching the channel needs
  what reaching the actor through Ray needs.
- TLS where Ray's is on (``RAY_USE_TLS``), with Ray's own files (shards/tls.py); without them the
  channel refuses to run (``TlsSetupError``), never plaintext, and a client whose TLS setting
  differs from the server's is refused.
- Without TLS, every message after the handshake carries an HMAC-SHA256 tag keyed per connection
  from the handshake (``Session``): a message changed, cut, replayed or moved between connections
  or directions is refused before it is decoded.
- The server binds its node's address (the coordinator may be on another node, as Ray's own worker
  ports are reached): on a local Ray started by needle that is 127.0.0.1 (cluster/local_ray.py).
``--shard-transport ray`` turns the channel off.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import select
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shards.channel_frames import (
    ChannelError,
    Handshake,
    MessageRefused,
    Session,
    open_handshake,
    send_message,
)
from shards.tls import TlsSetupError, this_process_tls

log = logging.getLogger(__name__)

KEY_BYTES = 32
HANDSHAKE_S = 5.0  # seconds either end waits for the other's handshake
CONNECT_S = 1.0  # seconds a connection may take to open (a lost node must not hold every request)
MAX_CONNECTIONS = 128  # authenticated connections served at once (a thread each)
MAX_PENDING = 64  # connections in their handshake at once (no thread, no buffer beyond 64 bytes)
REFUSALS_LOG_S = 5.0  # refused connections are logged at most this often (a flood must not flood the log)


@dataclass(frozen=True)
class Endpoint:
    """Where a shard actor's channel listens, the key it asks for, and whether it runs TLS."""

    host: str
    port: int
    key: bytes = field(repr=False)  # the shared secret (never logged)
    tls: bool = False


# --- the server ----------------------------------------------------------------------------------
class DirectServer:
    """Answers ``handler(request message) -> reply message`` on connections that pass the
    handshake, a thread per such connection, listening on ``host`` (an ephemeral port) until
    ``close``; TLS where Ray's is on (TlsSetupError where it cannot be)."""

    def __init__(
        self,
        handler: Callable[[memoryview], bytes],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_pending: int = MAX_PENDING,
        handshake_s: float = HANDSHAKE_S,
    ):
        self.handler = handler
        self.tls = this_process_tls(server=True)
        self.max_connections, self.max_pending, self.handshake_s = max_connections, max_pending, handshake_s
        self.listener = socket.create_server((host, port))
        self.listener.setblocking(False)
        key = secrets.token_bytes(KEY_BYTES)
        self.endpoint = Endpoint(host, self.listener.getsockname()[1], key, tls=self.tls is not None)
        self.closed = threading.Event()
        self._open: set[socket.socket] = set()  # connections being served (closed with the server)
        self._lock = threading.Lock()
        self.refused = 0  # connections closed unserved (failed handshakes, caps)
        self._refusals_logged = -REFUSALS_LOG_S
        self._selector = selectors.DefaultSelector()  # registered here: a close right away finds it so
        self._selector.register(self.listener, selectors.EVENT_READ)
        threading.Thread(target=self.accept_forever, name="direct-accept", daemon=True).start()

    def accept_forever(self) -> None:
        """Accept connections and run their handshakes, all on this one thread."""
        selector = self._selector
        pending: dict[socket.socket, Handshake] = {}
        try:
            while not self.closed.is_set():
                now = time.monotonic()
                wait = min((h.deadline for h in pending.values()), default=now + 0.5) - now
                for key, _ in selector.select(min(max(wait, 0.0), 0.5)):
                    if key.fileobj is self.listener:
                        if not self.admit(selector, pending):
                            return
                    else:
                        self.advance(selector, pending, key.data)
                now = time.monotonic()
                for late in [h for h in pending.values() if h.deadline <= now]:
                    self.drop(selector, pending, late, f"no handshake within {self.handshake_s:g} s")
        finally:
            for handshake in pending.values():
                handshake.sock.close()
            selector.close()

    def admit(self, selector: selectors.BaseSelector, pending: dict[socket.socket, Handshake]) -> bool:
        """Accept what is waiting; each starts its handshake, or is closed at once past a cap.
        False once the listener is closed."""
        while True:
            try:
                sock, peer = self.listener.accept()
            except BlockingIOError:
                return True
            except OSError:  # closed
                return False
            if len(pending) >= self.max_pending:
                self.refuse(sock, peer, f"{len(pending)} handshakes under way (the cap)")
                continue
            if self.serving() >= self.max_connections:
                self.refuse(sock, peer, f"{self.max_connections} connections open (the cap)")
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small messages: no Nagle delay
            if self.tls is not None:
                try:
                    sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (OSError, ValueError) as exc:
                    self.refuse(sock, peer, f"TLS: {exc}")
                    continue
            handshake = Handshake(sock, peer, self.endpoint.key, time.monotonic() + self.handshake_s)
            pending[sock] = handshake
            self.advance(selector, pending, handshake)

    def advance(
        self, selector: selectors.BaseSelector, pending: dict[socket.socket, Handshake], handshake: Handshake
    ) -> None:
        try:
            events = handshake.step()
        except (ChannelError, OSError) as exc:  # ssl.SSLError is an OSError
            self.drop(selector, pending, handshake, str(exc) or type(exc).__name__)
            return
        if not events and handshake.session is not None:  # authenticated: a thread of its own from now on
            if handshake.events:
                selector.unregister(handshake.sock)
            del pending[handshake.sock]
            self.start_serving(handshake.sock, handshake.peer, handshake.session)
        elif not handshake.events:
            selector.register(handshake.sock, events, handshake)
        elif events != handshake.events:
            selector.modify(handshake.sock, events, handshake)
        handshake.events = events

    def drop(
        self,
        selector: selectors.BaseSelector,
        pending: dict[socket.socket, Handshake],
        handshake: Handshake,
        why: str,
    ) -> None:
        if handshake.events:
            selector.unregister(handshake.sock)
        del pending[handshake.sock]
        self.refuse(handshake.sock, handshake.peer, why)

    def refuse(self, sock: socket.socket, peer: tuple, why: str) -> None:
        self.refused += 1
        sock.close()
        now = time.monotonic()
        if now - self._refusals_logged >= REFUSALS_LOG_S:
            self._refusals_logged = now
            where = f"{self.endpoint.host}:{self.endpoint.port}"
            log.warning("direct channel %s: refused %s: %s (%d refused so far)", where, peer, why, self.refused)

    def serving(self) -> int:
        with self._lock:
            return len(self._open)

    def start_serving(self, sock: socket.socket, peer: tuple, session: Session) -> None:
        with self._lock:
            full = len(self._open) >= self.max_connections
            if not full:
                self._open.add(sock)
        if full:
            self.refuse(sock, peer, f"{self.max_connections} connections open (the cap)")
            return
        sock.setblocking(True)
        threading.Thread(target=self.serve, args=(sock, peer, session), name="direct-conn", daemon=True).start()

    def serve(self, sock: socket.socket, peer: tuple, session: Session) -> None:
        try:
            self.answer(sock, peer, session)
        finally:
            with self._lock:
                self._open.discard(sock)
            sock.close()

    def answer(self, sock: socket.socket, peer: tuple, session: Session) -> None:
        """Requests on an authenticated ``sock`` answered one after another until it closes."""
        while not self.closed.is_set():
            try:
                request = session.receive(sock)
            except MessageRefused as exc:
                log.warning("direct channel: %s from %s; closing the connection", exc, peer)
                return
            except (ChannelError, OSError):  # the client closed it (or abandoned a call)
                return
            try:
                reply = self.handler(request)
            except Exception:  # the caller sees the connection close and goes through Ray
                log.exception("direct channel: handler failed; closing the connection from %s", peer)
                return
            try:
                send_message(sock, session.seal(reply))
            except OSError:
                return

    def close(self) -> None:
        """Stop listening and close every connection (their clients see the channel fail)."""
        self.closed.set()
        with contextlib.suppress(OSError):  # wakes the accepting thread (close alone leaves it listening)
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self._lock:
            open_now = list(self._open)
        for sock in open_now:
            with contextlib.suppress(OSError):  # already closed by its client
                sock.shutdown(socket.SHUT_RDWR)


# --- the client ----------------------------------------------------------------------------------
class DirectCall:
    """One call in flight on its own connection; ``receive`` reads the reply once."""

    def __init__(self, channel: DirectChannel, sock: socket.socket, session: Session):
        self.channel = channel
        self.sock = sock
        self.session = session

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        """Give up on the reply: the connection is closed, never reused."""
        self.sock.close()

    def receive(self, timeout: float | None) -> memoryview:
        """The reply, within ``timeout`` seconds (None: no limit); ChannelError (and the connection
        closed) when it does not come whole. The connection goes back to its channel for the next
        call."""
        try:
            self.sock.settimeout(None if timeout is None else max(timeout, 1e-3))
            reply = self.session.receive(self.sock)
            self.sock.settimeout(None)
        except (OSError, ChannelError) as exc:
            self.sock.close()
            raise ChannelError(f"{self.channel.endpoint.host}:{self.channel.endpoint.port}: {exc}") from exc
        self.channel.give_back(self.sock, self.session)
        return reply


class DirectChannel:
    """Connections to one endpoint, opened as calls need them (one call per connection at a
    time) and kept open for the next; TLS where this process's Ray runs it (TlsSetupError where
    the endpoint's setting differs: never plaintext beside a TLS cluster)."""

    def __init__(self, endpoint: Endpoint, connect_timeout: float = CONNECT_S):
        self.endpoint = endpoint
        self.connect_timeout = connect_timeout
        self.tls = this_process_tls(server=False)
        if endpoint.tls != (self.tls is not None):
            mine, theirs = ("on" if self.tls else "off"), ("on" if endpoint.tls else "off")
            raise TlsSetupError(
                f"{endpoint.host}:{endpoint.port}: the shard's channel has TLS {theirs}, this process's Ray TLS "
                f"(RAY_USE_TLS) is {mine}: refused"
            )
        self._idle: list[tuple[socket.socket, Session]] = []
        self._lock = threading.Lock()

    def connect(self) -> tuple[socket.socket, Session]:
        where = (self.endpoint.host, self.endpoint.port)
        try:
            sock = socket.create_connection(where, timeout=self.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise ChannelError(f"cannot connect to {where[0]}:{where[1]}: {exc}") from exc
        try:
            sock.settimeout(HANDSHAKE_S)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock)
            session = open_handshake(sock, self.endpoint.key, self.tls is not None)
            sock.settimeout(None)
        except (OSError, ChannelError) as exc:
            sock.close()
            raise ChannelError(f"{where[0]}:{where[1]}: handshake failed: {exc}") from exc
        return sock, session

    def send(self, message: bytes) -> DirectCall:
        """``message`` sent on an idle connection (or a new one): the call to receive from."""
        with self._lock:
            idle = self._idle.pop() if self._idle else None
        sock, session = idle if idle is not None else self.connect()
        try:
            send_message(sock, session.seal(message))
        except OSError as exc:
            sock.close()
            raise ChannelError(f"{self.endpoint.host}:{self.endpoint.port}: send failed: {exc}") from exc
        return DirectCall(self, sock, session)

    def give_back(self, sock: socket.socket, session: Session) -> None:
        with self._lock:
            self._idle.append((sock, session))

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()


def readable(calls: list[DirectCall], timeout: float) -> list[DirectCall]:
    """Those of ``calls`` whose reply has begun to arrive (or whose connection closed), waiting up
    to ``timeout`` seconds for the first (poll: no limit on descriptor numbers). TLS may hold
    decrypted bytes the descriptor no longer shows: those calls are readable at once."""
    if not calls:
        return []
    buffered = [c for c in calls if isinstance(c.sock, ssl.SSLSocket) and c.sock.fileno() >= 0 and c.sock.pending()]
    if buffered:
        return buffered
    # one poll object of their descriptors (multiprocessing's ``wait`` builds and fills a selector
    # per call: ~3x the cost, and a lookup polls ~3 times)
    by_fd: dict[int, DirectCall] = {}
    poller = select.poll()
    try:
        for call in calls:
            fd = call.sock.fileno()
            by_fd[fd] = call
            poller.register(fd, select.POLLIN)
        events = poller.poll(math.ceil(max(timeout, 0.0) * 1000))
    except (OSError, ValueError):  # one was closed meanwhile (by another thread's failed receive)
        return calls  # each receives now: the closed one fails at once, the others wait for their reply
    return [by_fd[fd] for fd, _ in events if fd in by_fd]
