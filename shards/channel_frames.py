"""The shard channel's framing, handshake and message integrity (shards/direct.py runs them):
whole typed messages read and written (their prefix checked before anything more is read or
allocated), the HMAC challenge each way that proves both ends hold the endpoint's key, and the
per-connection ``Session`` whose tag every message carries where there is no TLS."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import selectors
import socket
import ssl

import numpy as np

from shards.wire import PREFIX, WireError, frame_sizes

NONCE_BYTES = 32
PROOF_BYTES = 32  # an HMAC-SHA256 digest


class ChannelError(ConnectionError):
    """A direct channel that cannot carry a call: refused, reset, closed, timed out, or failed
    its handshake. The call can go through Ray instead."""


class MessageRefused(ChannelError):
    """A message whose prefix is not a needle message's or announces more than shards/wire.py
    allows: a corrupt stream or a peer that is not a needle channel."""


# --- messages ------------------------------------------------------------------------------------
def send_message(sock: socket.socket, message: bytes) -> None:
    """One message (shards/wire.py: it carries its own sizes), in one write (two small writes
    would meet Nagle's delay)."""
    sock.sendall(message)


def receive_into(sock: socket.socket, view: memoryview) -> None:
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ChannelError(f"connection closed after {got} of {size} bytes")
        got += n


def receive_exact(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    receive_into(sock, memoryview(buffer))
    return buffer


def receive_message(sock: socket.socket, trailer: int = 0) -> memoryview:
    """One whole message and the ``trailer`` bytes after it (its tag, where there is one), read
    in one pass after the prefix; ChannelError where its prefix is not a needle message's or
    announces more than shards/wire.py allows (checked before the rest is read). The buffer is
    only touched as bytes arrive (an announced size alone commits no memory)."""
    prefix = receive_exact(sock, PREFIX.size)
    try:
        header, body = frame_sizes(prefix)
    except WireError as exc:
        raise MessageRefused(f"refused a message: {exc}") from exc
    view = np.empty(PREFIX.size + header + body + trailer, np.uint8).data
    view[: PREFIX.size] = prefix
    receive_into(sock, view[PREFIX.size :])
    return view


# --- integrity without TLS ------------------------------------------------------------------------
class Session:
    """One connection's message integrity after its handshake. Without TLS every message carries
    an HMAC-SHA256 tag keyed from the handshake (the endpoint's key and both nonces: a key per
    connection) over its direction, its number on the connection and its bytes, checked before
    the message is decoded: a message changed, cut, replayed or moved to another connection or
    direction is refused and the connection closed. With TLS (``key`` None) TLS protects them."""

    def __init__(self, key: bytes | None, sending: bytes, receiving: bytes):
        self.key = key
        self.sending, self.receiving = sending, receiving  # direction labels: b"c2s" / b"s2c"
        self.sent = 0
        self.received = 0
        # keyed once: each tag copies it (a fresh HMAC per message cost a fifth more, per message)
        self._keyed = hmac.new(key, digestmod=hashlib.sha256) if key is not None else None

    @staticmethod
    def after_handshake(key: bytes, server_nonce: bytes, client_nonce: bytes, tls: bool, client: bool) -> Session:
        session_key = None if tls else hmac.new(key, b"session" + server_nonce + client_nonce, hashlib.sha256).digest()
        return Session(session_key, *((b"c2s", b"s2c") if client else (b"s2c", b"c2s")))

    def tag(self, direction: bytes, number: int, message: bytes | memoryview) -> bytes:
        assert self._keyed is not None
        mac = self._keyed.copy()
        mac.update(direction + number.to_bytes(8, "big"))
        mac.update(message)
        return mac.digest()

    def seal(self, message: bytes) -> bytes:
        """``message`` as it goes on the wire: with its tag where there is no TLS."""
        if self.key is None:
            return message
        sealed = message + self.tag(self.sending, self.sent, message)
        self.sent += 1
        return sealed

    def receive(self, sock: socket.socket) -> memoryview:
        """The next message, its tag checked (ChannelError, MessageRefused where it fails)."""
        if self.key is None:
            return receive_message(sock)
        sealed = receive_message(sock, PROOF_BYTES)  # the message and its tag in one read
        message, tag = sealed[:-PROOF_BYTES], bytes(sealed[-PROOF_BYTES:])
        if not hmac.compare_digest(tag, self.tag(self.receiving, self.received, message)):
            raise MessageRefused(f"message {self.received} failed its integrity check (changed, cut or replayed)")
        self.received += 1
        return message


# --- the handshake -------------------------------------------------------------------------------
def proof(key: bytes, role: bytes, nonce: bytes) -> bytes:
    """What ``role`` sends to show it holds ``key``; the role keeps one side's proof from being
    replayed as the other's."""
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


def open_handshake(sock: socket.socket, key: bytes, tls: bool = False) -> Session:
    """Client side: answer the server's challenge, challenge it, check its proof; the connection's
    Session (its messages' integrity)."""
    challenge = bytes(receive_exact(sock, NONCE_BYTES))
    mine = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(proof(key, b"client", challenge) + mine)
    if not hmac.compare_digest(bytes(receive_exact(sock, PROOF_BYTES)), proof(key, b"server", mine)):
        raise ChannelError("server failed the handshake (wrong key)")
    return Session.after_handshake(key, challenge, mine, tls, client=True)


class Handshake:
    """Server side of one connection's handshake, non-blocking: TLS (where on), the challenge out,
    the client's proof and challenge in (64 bytes, nothing more read), the server's proof out."""

    def __init__(self, sock: socket.socket, peer: tuple, key: bytes, deadline: float):
        self.sock, self.peer, self.key, self.deadline = sock, peer, key, deadline
        self.tls = sock if isinstance(sock, ssl.SSLSocket) else None  # its TLS handshake still to do
        self.tls_on = self.tls is not None
        self.session: Session | None = None  # once the client proved it holds the key
        self.challenge = secrets.token_bytes(NONCE_BYTES)
        self.outgoing = bytearray(self.challenge)
        self.incoming = bytearray()
        self.proved = False
        self.events = 0  # what the selector watches it for (0: not registered)

    def step(self) -> int:
        """As far as the socket allows: 0 once done, else the selector events to wait for;
        ChannelError or OSError where the client failed."""
        try:
            if self.tls is not None:
                self.tls.do_handshake()
                self.tls = None
            self.flush()
            if not self.proved:
                while len(self.incoming) < PROOF_BYTES + NONCE_BYTES:
                    chunk = self.sock.recv(PROOF_BYTES + NONCE_BYTES - len(self.incoming))
                    if not chunk:
                        raise ChannelError("closed during the handshake")
                    self.incoming += chunk
                answer, theirs = bytes(self.incoming[:PROOF_BYTES]), bytes(self.incoming[PROOF_BYTES:])
                if not hmac.compare_digest(answer, proof(self.key, b"client", self.challenge)):
                    raise ChannelError("client failed the handshake (wrong key)")
                self.outgoing += proof(self.key, b"server", theirs)
                self.session = Session.after_handshake(self.key, self.challenge, theirs, self.tls_on, client=False)
                self.proved = True
                self.flush()
            return 0
        except ssl.SSLWantWriteError:
            return selectors.EVENT_WRITE
        except ssl.SSLWantReadError:
            return selectors.EVENT_READ
        except BlockingIOError:
            return selectors.EVENT_WRITE if self.outgoing else selectors.EVENT_READ

    def flush(self) -> None:
        while self.outgoing:
            sent = self.sock.send(self.outgoing)
            del self.outgoing[:sent]
