"""The direct channel between a coordinator and its shard actors (shards/direct.py): messages
arrive whole and in order, each connection carries one call at a time, only a client with the key
is served (no thread before it proved it, capped, silent ones closed), TLS where Ray's is on, and
every failure is a ChannelError (the caller then goes through Ray)."""

from __future__ import annotations

import dataclasses
import datetime
import socket
import threading
import time

import numpy as np
import pytest

from shards import wire
from shards.direct import (
    ChannelError,
    DirectChannel,
    DirectServer,
    Endpoint,
    open_handshake,
    readable,
    send_message,
)
from shards.tls import TlsSetupError


def echo_handler(seen: list[int]):
    """Answers ("echo", value) to each message's value; ("sleep", s) sleeps first, "fail" raises."""

    def handler(request: memoryview) -> bytes:
        seen.append(len(request))
        value = wire.decode(request)
        if isinstance(value, tuple) and value[:1] == ("sleep",):
            time.sleep(value[1])
        if isinstance(value, str) and value == "fail":
            raise RuntimeError("handler failed")
        return wire.encode(("echo", value))

    return handler


@pytest.fixture
def echo(monkeypatch):
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    seen: list[int] = []
    server = DirectServer(echo_handler(seen))
    server.seen = seen
    yield server
    server.close()


def ask(channel: DirectChannel, value, timeout: float = 5.0):
    return wire.decode(channel.send(wire.encode(value)).receive(timeout))


def test_round_trips_keep_connections_open_and_carry_large_messages(echo):
    channel = DirectChannel(echo.endpoint)
    for value in ["", {"a": [1, None]}, np.arange(3_000_000, dtype=np.int32)]:  # 12 MB: several reads
        call = channel.send(wire.encode(value))
        assert readable([call], 5.0) == [call]
        kind, back = wire.decode(call.receive(5.0))
        assert kind == "echo"
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(back, value)
        else:
            assert back == value
    assert len(channel._idle) == 1  # one connection, reused by each call in turn
    channel.close()


def test_calls_in_flight_together_each_get_their_own_reply(echo):
    channel = DirectChannel(echo.endpoint)
    calls = [channel.send(wire.encode(("call", i))) for i in range(6)]
    assert len({call.sock.fileno() for call in calls}) == 6  # a connection per call in flight
    replies = {}
    deadline = time.monotonic() + 10
    while len(replies) < len(calls) and time.monotonic() < deadline:
        for call in readable([c for c in calls if c not in replies], 1.0):
            replies[call] = wire.decode(call.receive(1.0))
    assert [replies[c] for c in calls] == [("echo", ("call", i)) for i in range(6)]


def test_readable_waits_for_the_slow_reply_only(echo):
    channel = DirectChannel(echo.endpoint)
    slow, fast = channel.send(wire.encode(("sleep", 2.0))), channel.send(wire.encode("quick"))
    start = time.monotonic()
    assert readable([slow, fast], 5.0) == [fast]
    assert time.monotonic() - start < 1.5
    assert readable([slow], 0.01) == []  # not yet
    assert wire.decode(slow.receive(5.0)) == ("echo", ("sleep", 2.0))


def test_a_client_without_the_key_is_refused_before_any_request(echo):
    wrong = DirectChannel(dataclasses.replace(echo.endpoint, key=b"x" * 32))
    with pytest.raises(ChannelError, match="handshake"):
        wrong.send(wire.encode("hello"))
    assert echo.seen == []
    assert "key" not in repr(echo.endpoint) and repr(echo.endpoint.key) not in repr(echo.endpoint)


def test_a_server_without_the_key_is_not_trusted(monkeypatch):
    """An impostor listening where the actor was: it cannot prove the key, so nothing it would
    send is read."""
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor():
        sock, _ = listener.accept()
        with sock:
            sock.sendall(b"n" * 32)  # a challenge
            sock.recv(64)  # the client's proof and challenge
            sock.sendall(b"p" * 32)  # a proof it cannot have made

    threading.Thread(target=impostor, daemon=True).start()
    channel = DirectChannel(Endpoint("127.0.0.1", listener.getsockname()[1], b"k" * 32))
    with pytest.raises(ChannelError, match="server failed the handshake"):
        channel.send(wire.encode("hello"))
    listener.close()


def test_failures_are_channel_errors(echo):
    channel = DirectChannel(echo.endpoint)
    call = channel.send(wire.encode(("sleep", 1.0)))
    with pytest.raises(ChannelError):  # no whole reply in time: the connection is closed, never reused
        call.receive(0.05)
    assert channel._idle == []
    call = channel.send(wire.encode("fail"))  # the handler raised: the server closes the connection
    with pytest.raises(ChannelError, match="closed"):
        call.receive(5.0)
    port = echo.endpoint.port
    echo.close()
    with pytest.raises(ChannelError, match=f"cannot connect to 127.0.0.1:{port}"):
        DirectChannel(echo.endpoint).send(wire.encode("hello"))


def test_an_idle_connection_closed_by_the_server_fails_at_the_reply(monkeypatch):
    """A restarted actor: the connection kept open reaches a closed socket; the call fails as a
    ChannelError, not a hang."""
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    server = DirectServer(lambda request: bytes(request))
    channel = DirectChannel(server.endpoint)
    assert wire.decode(channel.send(wire.encode("one")).receive(5.0)) == "one"
    server.close()  # its connections closed, as a dead actor's process leaves them
    with pytest.raises(ChannelError):
        channel.send(wire.encode("two")).receive(2.0)


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "prefix",
    [
        b"\x80\x05" + b"\x00" * 14,  # a pickle
        wire.PREFIX.pack(wire.MAGIC, wire.MAX_HEADER + 1, 0),  # more header than allowed
        wire.PREFIX.pack(wire.MAGIC, 48, wire.MAX_BODY + 1),  # more body than allowed
    ],
)
def test_a_wrong_proof_or_a_message_that_is_not_one_closes_the_connection(echo, prefix):
    with socket.create_connection((echo.endpoint.host, echo.endpoint.port)) as sock:
        sock.settimeout(5)
        sock.recv(32)
        sock.sendall(b"z" * 64)  # a wrong proof: the server closes without reading further
        assert closed_by_server(sock)
    with socket.create_connection((echo.endpoint.host, echo.endpoint.port)) as sock:
        sock.settimeout(5)
        open_handshake(sock, echo.endpoint.key)
        sock.sendall(prefix)  # refused from its prefix, before anything more is read or allocated
        assert closed_by_server(sock)
    assert echo.seen == []


def test_without_tls_a_changed_or_replayed_message_is_refused_before_it_is_decoded(echo):
    """Without TLS every message after the handshake carries a tag keyed per connection from the
    handshake: a byte changed in flight, a message replayed, or one sealed for another connection
    closes the connection before the handler sees it; the untouched one is answered."""
    from shards.messages import pack_request

    message = pack_request("info", [(0, ())])

    def exchange(tamper):
        with socket.create_connection((echo.endpoint.host, echo.endpoint.port)) as sock:
            sock.settimeout(5)
            session = open_handshake(sock, echo.endpoint.key)
            assert session.key is not None
            sock.sendall(tamper(session, session.seal(message)))
            try:  # whatever was answered, then the end
                while sock.recv(65536):
                    pass
            except ConnectionResetError:
                pass
            return True  # closed by the server (a socket timeout would have raised)

    def flip(session, sealed):
        changed = bytearray(sealed)
        changed[len(message) // 2] ^= 1
        return bytes(changed)

    def replayed(session, sealed):
        return sealed + sealed  # the second copy's number is wrong

    def other_connection(session, sealed):
        from shards.direct import Session

        stranger = Session(bytes(32), b"c2s", b"s2c")  # a key of no handshake with this server
        return stranger.seal(message)

    assert exchange(flip) and exchange(other_connection)
    assert echo.seen == []  # neither reached the handler
    seen_before = len(echo.seen)
    assert exchange(replayed)
    assert len(echo.seen) == seen_before + 1  # the first copy answered, the replay refused
    with socket.create_connection((echo.endpoint.host, echo.endpoint.port)) as sock:
        sock.settimeout(5)
        session = open_handshake(sock, echo.endpoint.key)
        sock.sendall(session.seal(message))
        reply = session.receive(sock)  # the server's reply carries its own tag, checked here
        assert wire.decode(reply)[0] == "echo"


def test_send_message_writes_the_message_as_it_is():
    a, b = socket.socketpair()
    with a, b:
        message = wire.encode("xyz")
        send_message(a, message)
        assert b.recv(len(message) + 1) == message


def test_silent_connections_get_no_thread_and_are_closed_after_the_handshake_time(monkeypatch):
    """400 connections that never answer the challenge: no thread each (the handshakes run on the
    accepting thread), at most ``max_pending`` of them held, each closed after ``handshake_s``;
    a client with the key is served once they are gone."""
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    server = DirectServer(echo_handler([]), max_pending=16, handshake_s=0.5)
    threads = threading.active_count()
    silent = []
    try:
        for _ in range(400):
            sock = socket.create_connection((server.endpoint.host, server.endpoint.port), timeout=5)
            silent.append(sock)
        time.sleep(0.2)
        assert threading.active_count() <= threads + 1
        deadline = time.monotonic() + 10
        for sock in silent:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = b""
            while True:  # the challenge (32 bytes, where it got one), then the end
                try:
                    chunk = sock.recv(64)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                data += chunk
            assert len(data) in (0, 32)
        assert time.monotonic() < deadline and server.refused == 400
        assert threading.active_count() <= threads + 1
        assert ask(DirectChannel(server.endpoint), "after") == ("echo", "after")
    finally:
        for sock in silent:
            sock.close()
        server.close()


def test_a_slow_handshake_does_not_hold_up_the_others(monkeypatch):
    """Authentication runs in the accepting thread without blocking it: clients with the key are
    served at once while silent connections wait out their handshake time."""
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    server = DirectServer(echo_handler([]), handshake_s=30)
    silent = [socket.create_connection((server.endpoint.host, server.endpoint.port)) for _ in range(8)]
    try:
        start = time.monotonic()
        assert [ask(DirectChannel(server.endpoint), i) for i in range(3)] == [("echo", i) for i in range(3)]
        assert time.monotonic() - start < 3
    finally:
        for sock in silent:
            sock.close()
        server.close()


def test_authenticated_connections_are_capped(monkeypatch):
    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    server = DirectServer(echo_handler([]), max_connections=2)
    first, second = DirectChannel(server.endpoint), DirectChannel(server.endpoint)
    try:
        assert ask(first, 1) == ("echo", 1) and ask(second, 2) == ("echo", 2)  # each keeps its connection open
        with pytest.raises(ChannelError):
            ask(DirectChannel(server.endpoint), 3)
        first.close()
        deadline = time.monotonic() + 5
        while server.serving() > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ask(DirectChannel(server.endpoint), 4) == ("echo", 4)
    finally:
        server.close()


# --- TLS ---------------------------------------------------------------------------------------
def make_ca(tmp_path, name: str):
    """A CA and a certificate it signed for this machine (as Ray's TLS setup makes), as files."""
    x509 = pytest.importorskip("cryptography.x509", reason="TLS tests make their certificates with cryptography")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject: str, key, issuer: str, signer, ca: bool):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    files = {"ca": tmp_path / f"{name}-ca.pem", "cert": tmp_path / f"{name}.pem", "key": tmp_path / f"{name}.key"}
    pem = serialization.Encoding.PEM
    files["ca"].write_bytes(certificate(f"{name} CA", ca_key, f"{name} CA", ca_key, True).public_bytes(pem))
    files["cert"].write_bytes(certificate("ray-node", key, f"{name} CA", ca_key, False).public_bytes(pem))
    files["key"].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return files


def use_tls(monkeypatch, files) -> None:
    monkeypatch.setenv("RAY_USE_TLS", "1")
    monkeypatch.setenv("RAY_TLS_SERVER_CERT", str(files["cert"]))
    monkeypatch.setenv("RAY_TLS_SERVER_KEY", str(files["key"]))
    monkeypatch.setenv("RAY_TLS_CA_CERT", str(files["ca"]))


def test_with_rays_tls_on_the_channel_runs_tls(monkeypatch, tmp_path):
    use_tls(monkeypatch, make_ca(tmp_path, "cluster"))
    server = DirectServer(echo_handler([]))
    try:
        assert server.endpoint.tls
        channel = DirectChannel(server.endpoint)
        assert ask(channel, {"q": np.arange(5)})[1]["q"].tolist() == list(range(5))
        assert ask(channel, "again") == ("echo", "again")  # the TLS connection kept and reused
        sock, session = channel._idle[0]
        assert sock.version() in ("TLSv1.2", "TLSv1.3") and session.key is None  # TLS protects the messages
        with socket.create_connection((server.endpoint.host, server.endpoint.port)) as sock:
            sock.settimeout(5)  # plaintext: no challenge comes (the server waits for TLS), then the end
            sock.sendall(b"z" * 64)
            assert closed_by_server(sock)
    finally:
        server.close()


def test_a_certificate_of_another_ca_is_refused(monkeypatch, tmp_path):
    use_tls(monkeypatch, make_ca(tmp_path, "cluster"))
    server = DirectServer(echo_handler([]))
    try:
        use_tls(monkeypatch, make_ca(tmp_path, "rogue"))
        with pytest.raises(ChannelError, match="handshake failed"):
            ask(DirectChannel(server.endpoint), "hello")
    finally:
        server.close()


def test_with_rays_tls_on_there_is_no_plaintext(monkeypatch, tmp_path, echo):
    """TLS on without its files: no server, no client; a plaintext endpoint beside a TLS client
    (or the other way round) is refused, never used."""
    monkeypatch.setenv("RAY_USE_TLS", "1")
    monkeypatch.delenv("RAY_TLS_SERVER_KEY", raising=False)
    monkeypatch.setenv("RAY_TLS_SERVER_CERT", str(tmp_path / "missing.pem"))
    monkeypatch.setenv("RAY_TLS_CA_CERT", str(tmp_path / "missing-ca.pem"))
    with pytest.raises(TlsSetupError, match="RAY_USE_TLS is on but RAY_TLS_SERVER_KEY not set"):
        DirectServer(echo_handler([]))
    monkeypatch.setenv("RAY_TLS_SERVER_KEY", str(tmp_path / "missing.key"))
    with pytest.raises(TlsSetupError, match=r"no such file: RAY_TLS_SERVER_CERT=.*missing\.pem"):
        DirectChannel(echo.endpoint)
    use_tls(monkeypatch, make_ca(tmp_path, "cluster"))
    with pytest.raises(TlsSetupError, match=r"has TLS off, this process's Ray TLS .* is on: refused"):
        DirectChannel(echo.endpoint)  # the plaintext server of the fixture
    tls_server = DirectServer(echo_handler([]))
    monkeypatch.setenv("RAY_USE_TLS", "0")
    try:
        with pytest.raises(TlsSetupError, match=r"has TLS on, this process's Ray TLS .* is off"):
            DirectChannel(tls_server.endpoint)
    finally:
        tls_server.close()


# --- through Ray -------------------------------------------------------------------------------
def fake_group_class():
    """A stand-in for ShardGroup with the same ``endpoint``/``run`` protocol and typed messages: it
    echoes each call's method and arguments, hangs 2 s on ``max_tokens``, and can close its channel
    (defined in a function: pickled by value for the Ray workers)."""
    import time

    from shards.direct import DirectServer
    from shards.messages import answer_request

    class FakeGroup:
        def __init__(self):
            self.server = None

        def endpoint(self):
            if self.server is None:  # a restarted actor listens elsewhere
                self.server = DirectServer(self.run)
            return self.server.endpoint

        def close_channel(self) -> None:
            self.server.close()
            self.server = None

        def answer(self, method: str, calls: list) -> list:
            if method == "max_tokens":
                time.sleep(2.0)
            return [("ok", (method, args)) for _, args in calls]

        def run(self, packed) -> bytes:
            return answer_request(self.answer, packed, 1)

    return FakeGroup


@pytest.mark.ray
def test_ray_shards_go_direct_and_fall_back_to_ray(ray_local):
    """Calls go over the actors' channels; a channel that breaks sends its call again through Ray
    (the same answer); a call that hangs past the request's timeout is abandoned, its channel
    dropped (Ray carries the actor's calls) and opened again later."""
    import ray

    from cluster.ray_shards import CHANNEL_RETRY_S, RayShards
    from shards.coordinator import ShardedIndex, ShardsUnavailable

    actors = [[ray.remote(fake_group_class()).options(max_concurrency=4).remote()] for _ in range(2)]
    backend = RayShards(actors)
    assert backend.open_channels(30) == 2
    infos = {"shards": [{"name": "s0", "rows": 1}, {"name": "s1", "rows": 1}], "dim": 4, "ntotal": 2}
    index = ShardedIndex(infos, "fake", backend, timeout=0.5)

    def keys(*pairs):
        return {s: ("keys_of", (k,)) for s, k in pairs}

    assert index.call("keys_of", {0: ("a",), 1: ("b",)}) == keys((0, "a"), (1, "b"))
    assert (backend.calls, backend.ray_calls) == (2, 0)
    with pytest.raises(Exception, match="unknown call 'echo'"):  # the allow-list holds on the sending side too
        index.call("echo", {0: (1,)})

    ray.get(actors[1][0].close_channel.remote())  # the connection kept open now meets a closed peer
    assert index.call("keys_of", {1: ("c",)}) == keys((1, "c"))
    assert backend.ray_calls == 1 and backend.channels_open() == 1

    with pytest.raises(ShardsUnavailable, match="s0"):
        index.call("max_tokens", {0: ()})
    assert backend.channels_open() == 0  # the hung actor's channel dropped
    assert index.call("keys_of", {0: ("d",)}) == keys((0, "d"))  # through Ray meanwhile
    assert backend.ray_calls == 2

    time.sleep(CHANNEL_RETRY_S)
    deadline = time.monotonic() + 20
    while backend.channels_open() < 2 and time.monotonic() < deadline:
        assert index.call("keys_of", {0: ("e",), 1: ("f",)}) == keys((0, "e"), (1, "f"))
        time.sleep(0.05)
    assert backend.channels_open() == 2
    ray_calls = backend.ray_calls
    assert index.call("keys_of", {0: ("g",), 1: ("h",)}) == keys((0, "g"), (1, "h"))
    assert backend.ray_calls == ray_calls  # direct again
    for replicas in actors:
        ray.kill(replicas[0])


def test_a_stale_channel_failing_leaves_the_new_channel_open(echo):
    """A call of an actor's old channel that fails after the restarted actor's new channel opened
    must not drop the new one (only the channel that failed is forgotten)."""
    from cluster.ray_shards import RayShards

    backend = RayShards([[object()]], direct=False)  # no Ray: the channel table alone
    old, new = DirectChannel(echo.endpoint), DirectChannel(echo.endpoint)
    backend._channels[0, 0] = new
    backend.channel_failed(0, 0, old, ChannelError("reset"))
    assert backend._channels[0, 0] is new and (0, 0) not in backend._failed
    backend.channel_failed(0, 0, new, ChannelError("reset"))
    assert backend.channels_open() == 0 and (0, 0) in backend._failed
