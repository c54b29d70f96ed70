"""A direct TCP channel between a coordinator and its shard actors, beside Ray's.

Why: a Ray actor call costs a fixed ~1.5-1.8 ms round trip on the 2-core box (a fan-out to 3
actors doing nothing; a length-prefixed message over a kept-open TCP connection to the same
actors: 0.13 ms). A sharded search is one fan-out, so that fixed cost is most of what separates
it from the single index (``bench/sharded_serving.py``). Ray still places, starts, restarts and
health-checks the actors, and still carries any call the channel cannot (cluster/ray_shards.py).

Protocol: each message is an 8-byte big-endian length and that many bytes; a connection carries
one call at a time (request, then reply), so replies need no ids and a connection whose reply
never came is closed, never reused. The server is a thread per connection calling ``handler``.

Security: the server binds its node's address (the coordinator may be on another node, as Ray's
own worker ports are reached), and a connection is served only after both ends prove they hold
the server's 32-byte random key (HMAC-SHA256 challenge each way, as ``multiprocessing``'s
authkey). The key is handed out only through a Ray call to the actor (``ShardGroup.endpoint``),
so reaching the channel needs what reaching the actor through Ray needs. ``--shard-transport
ray`` turns the channel off.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_readable

log = logging.getLogger(__name__)

HEADER = struct.Struct("!Q")  # a message's length
KEY_BYTES = 32
NONCE_BYTES = 32
PROOF_BYTES = 32  # an HMAC-SHA256 digest
MAX_MESSAGE = 1 << 34  # 16 GiB: larger lengths are a corrupt stream, not a message
HANDSHAKE_S = 5.0  # seconds either end waits for the other's handshake
CONNECT_S = 1.0  # seconds a connection may take to open (a lost node must not hold every request)


class ChannelError(ConnectionError):
    """A direct channel that cannot carry a call: refused, reset, closed, timed out, or failed
    its handshake. The call can go through Ray instead."""


@dataclass(frozen=True)
class Endpoint:
    """Where a shard actor's channel listens and the key it asks for."""

    host: str
    port: int
    key: bytes = field(repr=False)  # the shared secret (never logged)


def send_message(sock: socket.socket, payload: bytes) -> None:
    """``payload`` with its length, in one write (two small writes would meet Nagle's delay)."""
    sock.sendall(HEADER.pack(len(payload)) + payload)


def receive_exact(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ChannelError(f"connection closed after {got} of {size} bytes")
        got += n
    return buffer


def receive_message(sock: socket.socket) -> bytearray:
    (size,) = HEADER.unpack(receive_exact(sock, HEADER.size))
    if size > MAX_MESSAGE:
        raise ChannelError(f"message of {size} bytes announced: not a needle channel")
    return receive_exact(sock, size)


def proof(key: bytes, role: bytes, nonce: bytes) -> bytes:
    """What ``role`` sends to show it holds ``key``; the role keeps one side's proof from being
    replayed as the other's."""
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


def accept_handshake(sock: socket.socket, key: bytes) -> None:
    """Server side: challenge the client, check its proof, answer its challenge."""
    challenge = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(challenge)
    answer = receive_exact(sock, PROOF_BYTES + NONCE_BYTES)
    if not hmac.compare_digest(bytes(answer[:PROOF_BYTES]), proof(key, b"client", challenge)):
        raise ChannelError("client failed the handshake (wrong key)")
    sock.sendall(proof(key, b"server", bytes(answer[PROOF_BYTES:])))


def open_handshake(sock: socket.socket, key: bytes) -> None:
    """Client side: answer the server's challenge, challenge it, check its proof."""
    challenge = bytes(receive_exact(sock, NONCE_BYTES))
    mine = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(proof(key, b"client", challenge) + mine)
    if not hmac.compare_digest(bytes(receive_exact(sock, PROOF_BYTES)), proof(key, b"server", mine)):
        raise ChannelError("server failed the handshake (wrong key)")


def no_delay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class DirectServer:
    """Answers ``handler(request bytes) -> reply bytes`` on connections that pass the handshake,
    a thread per connection, listening on ``host`` (an ephemeral port) until ``close``."""

    def __init__(self, handler: Callable[[bytes], bytes], host: str = "127.0.0.1", port: int = 0):
        self.handler = handler
        self.listener = socket.create_server((host, port))
        self.endpoint = Endpoint(host, self.listener.getsockname()[1], secrets.token_bytes(KEY_BYTES))
        self.closed = threading.Event()
        self._open: set[socket.socket] = set()  # connections being served (closed with the server)
        self._lock = threading.Lock()
        threading.Thread(target=self.accept_forever, name="direct-accept", daemon=True).start()

    def accept_forever(self) -> None:
        while not self.closed.is_set():
            try:
                sock, peer = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self.serve, args=(no_delay(sock), peer), name="direct-conn", daemon=True).start()

    def serve(self, sock: socket.socket, peer: tuple) -> None:
        with self._lock:
            self._open.add(sock)
        try:
            self.answer(sock, peer)
        finally:
            with self._lock:
                self._open.discard(sock)
            sock.close()

    def answer(self, sock: socket.socket, peer: tuple) -> None:
        """Requests on ``sock`` answered one after another until it closes."""
        try:
            sock.settimeout(HANDSHAKE_S)
            accept_handshake(sock, self.endpoint.key)
            sock.settimeout(None)
        except (ChannelError, OSError) as exc:
            log.warning("direct channel: refused %s: %s", peer, exc)
            return
        while not self.closed.is_set():
            try:
                request = receive_message(sock)
            except (ChannelError, OSError):  # the client closed it (or abandoned a call)
                return
            try:
                reply = self.handler(request)
            except Exception:  # the caller sees the connection close and goes through Ray
                log.exception("direct channel: handler failed; closing the connection from %s", peer)
                return
            try:
                send_message(sock, reply)
            except OSError:
                return

    def close(self) -> None:
        """Stop listening and close every connection (their clients see the channel fail)."""
        self.closed.set()
        with contextlib.suppress(OSError):  # wakes the thread blocked in accept (close alone leaves it listening)
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self._lock:
            open_now = list(self._open)
        for sock in open_now:
            with contextlib.suppress(OSError):  # already closed by its client
                sock.shutdown(socket.SHUT_RDWR)


class DirectCall:
    """One call in flight on its own connection; ``receive`` reads the reply once."""

    def __init__(self, channel: DirectChannel, sock: socket.socket):
        self.channel = channel
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        """Give up on the reply: the connection is closed, never reused."""
        self.sock.close()

    def receive(self, timeout: float | None) -> bytearray:
        """The reply, within ``timeout`` seconds (None: no limit); ChannelError (and the connection
        closed) when it does not come whole. The connection goes back to its channel for the next
        call."""
        try:
            self.sock.settimeout(None if timeout is None else max(timeout, 1e-3))
            reply = receive_message(self.sock)
            self.sock.settimeout(None)
        except (OSError, ChannelError) as exc:
            self.sock.close()
            raise ChannelError(f"{self.channel.endpoint.host}:{self.channel.endpoint.port}: {exc}") from exc
        self.channel.give_back(self.sock)
        return reply


class DirectChannel:
    """Connections to one endpoint, opened as calls need them (one call per connection at a
    time) and kept open for the next."""

    def __init__(self, endpoint: Endpoint, connect_timeout: float = CONNECT_S):
        self.endpoint = endpoint
        self.connect_timeout = connect_timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def connect(self) -> socket.socket:
        where = (self.endpoint.host, self.endpoint.port)
        try:
            sock = no_delay(socket.create_connection(where, timeout=self.connect_timeout))
        except OSError as exc:
            raise ChannelError(f"cannot connect to {where[0]}:{where[1]}: {exc}") from exc
        try:
            sock.settimeout(HANDSHAKE_S)
            open_handshake(sock, self.endpoint.key)
            sock.settimeout(None)
        except (OSError, ChannelError) as exc:
            sock.close()
            raise ChannelError(f"{where[0]}:{where[1]}: handshake failed: {exc}") from exc
        return sock

    def send(self, payload: bytes) -> DirectCall:
        """``payload`` sent on an idle connection (or a new one): the call to receive from."""
        with self._lock:
            sock = self._idle.pop() if self._idle else None
        if sock is None:
            sock = self.connect()
        try:
            send_message(sock, payload)
        except OSError as exc:
            sock.close()
            raise ChannelError(f"{self.endpoint.host}:{self.endpoint.port}: send failed: {exc}") from exc
        return DirectCall(self, sock)

    def give_back(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append(sock)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


def readable(calls: list[DirectCall], timeout: float) -> list[DirectCall]:
    """Those of ``calls`` whose reply has begun to arrive (or whose connection closed), waiting up
    to ``timeout`` seconds for the first (poll: no limit on descriptor numbers)."""
    if not calls:
        return []
    by_socket = {call.sock: call for call in calls}
    try:
        return [by_socket[sock] for sock in wait_readable(list(by_socket), max(timeout, 0.0))]
    except (OSError, ValueError):  # one was closed meanwhile (by another thread's failed receive)
        return calls  # each receives now: the closed one fails at once, the others wait for their reply
