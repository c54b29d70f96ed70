"""The direct channel between a coordinator and its shard actors (shards/direct.py): messages
arrive whole and in order, each connection carries one call at a time, only a client with the key
is served, and every failure is a ChannelError (the caller then goes through Ray)."""

from __future__ import annotations

import dataclasses
import pickle
import socket
import threading
import time

import numpy as np
import pytest

from shards.direct import (
    HEADER,
    MAX_MESSAGE,
    ChannelError,
    DirectChannel,
    DirectServer,
    Endpoint,
    open_handshake,
    readable,
    send_message,
)


@pytest.fixture
def echo():
    """A server answering each request reversed (slowly where it asks: b"sleep:<seconds>")."""
    seen: list[int] = []

    def handler(request: bytes) -> bytes:
        seen.append(len(request))
        if bytes(request[:6]) == b"sleep:":
            time.sleep(float(bytes(request[6:])))
        if bytes(request) == b"fail":
            raise RuntimeError("handler failed")
        return bytes(request)[::-1]

    server = DirectServer(handler)
    server.seen = seen
    yield server
    server.close()


def test_round_trips_keep_connections_open_and_carry_large_messages(echo):
    channel = DirectChannel(echo.endpoint)
    for payload in [b"", b"abc", np.arange(3_000_000, dtype=np.int32).tobytes()]:  # 12 MB: several reads
        call = channel.send(payload)
        assert readable([call], 5.0) == [call]
        assert bytes(call.receive(5.0)) == payload[::-1]
    assert len(channel._idle) == 1  # one connection, reused by each call in turn
    channel.close()


def test_calls_in_flight_together_each_get_their_own_reply(echo):
    channel = DirectChannel(echo.endpoint)
    calls = [channel.send(pickle.dumps(("call", i))) for i in range(6)]
    assert len({call.sock.fileno() for call in calls}) == 6  # a connection per call in flight
    replies = {}
    deadline = time.monotonic() + 10
    while len(replies) < len(calls) and time.monotonic() < deadline:
        for call in readable([c for c in calls if c not in replies], 1.0):
            replies[call] = pickle.loads(bytes(call.receive(1.0))[::-1])
    assert [replies[c] for c in calls] == [("call", i) for i in range(6)]


def test_readable_waits_for_the_slow_reply_only(echo):
    channel = DirectChannel(echo.endpoint)
    slow, fast = channel.send(b"sleep:2"), channel.send(b"quick")
    start = time.monotonic()
    assert readable([slow, fast], 5.0) == [fast]
    assert time.monotonic() - start < 1.5
    assert readable([slow], 0.01) == []  # not yet
    assert bytes(slow.receive(5.0)) == b"2:peels"


def test_a_client_without_the_key_is_refused_before_any_request(echo):
    wrong = DirectChannel(dataclasses.replace(echo.endpoint, key=b"x" * 32))
    with pytest.raises(ChannelError, match="handshake"):
        wrong.send(b"hello")
    assert echo.seen == []
    assert "key" not in repr(echo.endpoint) and repr(echo.endpoint.key) not in repr(echo.endpoint)


def test_a_server_without_the_key_is_not_trusted():
    """An impostor listening where the actor was: it cannot prove the key, so nothing it would
    send is unpickled."""
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
        channel.send(b"hello")
    listener.close()


def test_failures_are_channel_errors(echo):
    channel = DirectChannel(echo.endpoint)
    call = channel.send(b"sleep:1")
    with pytest.raises(ChannelError):  # no whole reply in time: the connection is closed, never reused
        call.receive(0.05)
    assert channel._idle == []
    call = channel.send(b"fail")  # the handler raised: the server closes the connection
    with pytest.raises(ChannelError, match="closed"):
        call.receive(5.0)
    port = echo.endpoint.port
    echo.close()
    with pytest.raises(ChannelError, match=f"cannot connect to 127.0.0.1:{port}"):
        DirectChannel(echo.endpoint).send(b"hello")


def test_an_idle_connection_closed_by_the_server_fails_at_the_reply():
    """A restarted actor: the connection kept open reaches a closed socket; the call fails as a
    ChannelError, not a hang."""
    server = DirectServer(lambda request: bytes(request))
    channel = DirectChannel(server.endpoint)
    call = channel.send(b"one")
    assert bytes(call.receive(5.0)) == b"one"
    server.close()  # its connections closed, as a dead actor's process leaves them
    with pytest.raises(ChannelError):
        channel.send(b"two").receive(2.0)


def test_a_wrong_proof_or_a_corrupt_length_closes_the_connection(echo):
    with socket.create_connection((echo.endpoint.host, echo.endpoint.port)) as sock:
        sock.settimeout(5)
        sock.recv(32)
        sock.sendall(b"z" * 64)  # a wrong proof: the server closes without reading further
        assert sock.recv(1) == b""
    with socket.create_connection((echo.endpoint.host, echo.endpoint.port)) as sock:
        sock.settimeout(5)
        open_handshake(sock, echo.endpoint.key)
        sock.sendall(HEADER.pack(MAX_MESSAGE + 1))  # no message is that long: a corrupt stream
        assert sock.recv(1) == b""
    assert echo.seen == []


def test_send_message_writes_length_then_payload():
    a, b = socket.socketpair()
    with a, b:
        send_message(a, b"xyz")
        assert b.recv(16) == b"\x00" * 7 + b"\x03xyz"


def fake_group_class():
    """A stand-in for ShardGroup with the same ``endpoint``/``run`` protocol: it echoes each
    call's method and arguments, hangs 2 s on "hang", and can close its channel (defined in a
    function: pickled by value for the Ray workers)."""
    import pickle
    import time

    from shards.direct import DirectServer

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

        def run(self, packed: bytes) -> bytes:
            method, calls = pickle.loads(packed)
            if method == "hang":
                time.sleep(2.0)
            return pickle.dumps([("ok", (method, args)) for _, args in calls])

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
    assert index.call("echo", {0: (1,), 1: (2,)}) == {0: ("echo", (1,)), 1: ("echo", (2,))}
    assert (backend.calls, backend.ray_calls) == (2, 0)

    ray.get(actors[1][0].close_channel.remote())  # the connection kept open now meets a closed peer
    assert index.call("echo", {1: (3,)}) == {1: ("echo", (3,))}
    assert backend.ray_calls == 1 and backend.channels_open() == 1

    with pytest.raises(ShardsUnavailable, match="s0"):
        index.call("hang", {0: ()})
    assert backend.channels_open() == 0  # the hung actor's channel dropped
    assert index.call("echo", {0: (4,)}) == {0: ("echo", (4,))}  # through Ray meanwhile
    assert backend.ray_calls == 2

    time.sleep(CHANNEL_RETRY_S)
    deadline = time.monotonic() + 20
    while backend.channels_open() < 2 and time.monotonic() < deadline:
        assert index.call("echo", {0: (5,), 1: (6,)}) == {0: ("echo", (5,)), 1: ("echo", (6,))}
        time.sleep(0.05)
    assert backend.channels_open() == 2
    ray_calls = backend.ray_calls
    assert index.call("echo", {0: (7,), 1: (8,)}) == {0: ("echo", (7,)), 1: ("echo", (8,))}
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
