"""The shard channel's typed messages (shards/wire.py, shards/messages.py): what the coordinator and
the shards exchange comes back equal (types, dtypes, shapes, shared objects), and anything else is
refused, naming what was wrong, before any call is made."""

from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest

from core.errors import NeedleInputError, ShardReadError
from core.tokens import LocalTokens
from index.errors import IndexFileError, UnknownKeyError
from shards import messages, wire
from shards.wire import WireError


def tokens(n: int = 4, proj: bool = False) -> LocalTokens:
    rng = np.random.default_rng(n)
    return LocalTokens(
        rng.integers(0, 255, (n, 16), dtype=np.uint8),
        rng.random((n, 2), dtype=np.float32),
        np.ones(n, np.float32),
        rng.random(n, dtype=np.float32),
        None,
        rng.standard_normal((n, 128)).astype(np.float32) if proj else None,
    )


def same(a, b) -> None:
    """``a`` and ``b`` equal in type, dtype, shape and value, all the way down."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a == b
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, LocalTokens):
        for name in ("codes", "xy", "scale", "weight", "desc", "proj"):
            same(getattr(a, name), getattr(b, name))
    elif isinstance(a, BaseException):
        assert str(a) == str(b)
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b)
    else:
        assert a == b


VALUES = {
    "search answer": (
        np.random.default_rng(0).random((2, 30), dtype=np.float32),
        np.arange(60, dtype=np.int64).reshape(2, 30),
        None,
        [[f"000001/{i:05d}" for i in range(30)], [None] * 3 + [f"k{i}" for i in range(27)]],
    ),
    "scalars and JSON": [None, True, 0, -(2**62), 1.5, float("inf"), float("nan"), "", "é ✓", {"a": [1, 2.0]}],
    "numpy scalars": [np.int64(5), np.float32(0.25), np.bool_(True), np.uint8(255), np.float16(1.5)],
    "arrays": [
        np.zeros((0, 16), np.uint8),
        np.array(3.5),
        np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2],  # big-endian, not contiguous
        np.ones((2, 3), bool),
        np.arange(5, dtype=np.float16),
    ],
    "evidence by position": {"raw": np.ones(3), "evidence": {0: {"inliers": 3, "query_xy": [[1.0, 2.5]]}, 7: None}},
    "dollar keys": {"$t": 1, "plain": 2},
    "tokens": {"position": np.int64(4), "vector": np.ones(8, np.float32), "tokens": tokens(5, proj=True)},
    "thumbnail": b"\xff\xd8 jpeg \x00 bytes",
    "keys with a NUL": [f"key{i}" for i in range(20)] + ["a\x00b", None],
    "many keys and padding": [None if i % 7 == 0 else f"000003/{i:07d}" for i in range(500)],
}


@pytest.mark.parametrize("name", list(VALUES))
def test_what_the_calls_carry_comes_back_equal(name):
    value = VALUES[name]
    expected = value
    if name == "arrays":  # little-endian and contiguous on arrival, the same values
        expected = [np.require(a, a.dtype.newbyteorder("<"), ["C"]) for a in value]
    same(wire.decode(wire.encode(value)), expected)


def test_decoded_arrays_are_writable_and_aligned():
    for message in (wire.encode([np.arange(10.0), np.ones(3, np.int8)]), bytearray(wire.encode([np.arange(3.0)]))):
        arrays = wire.decode(message)
        for a in arrays:
            a += 1  # torch and FAISS want writable arrays (a bytes message is copied once)
        assert all(a.ctypes.data % 16 == 0 for a in arrays)


def test_a_request_keeps_shared_objects_shared():
    """A group batches its members' calls by the identity of what they share (the conf, each
    query's tokens: shards/shard_group.py), as one pickle kept it."""
    from rerank.rerank import RerankConfig

    conf = RerankConfig(method="sp", query_scales=(0.75, 1.0))
    query, xq = tokens(3), np.ones((1, 4), np.float32)
    shortlists = [np.arange(3)]
    calls = [(m, (conf, shortlists, [np.ones(3)], [query, None], 5, True)) for m in range(3)]
    name, got = messages.unpack_request(messages.pack_request("score_shortlists", calls), members=3)
    assert name == "score_shortlists" and [m for m, _ in got] == [0, 1, 2]
    assert got[0][1][0] == conf and repr(got[0][1][0]) == repr(conf)  # repr: the shards' reranker cache key
    assert got[0][1][0] is got[1][1][0] is got[2][1][0]
    assert got[0][1][3][0] is got[2][1][3][0] and got[0][1][3][1] is None
    _, searched = messages.unpack_request(
        messages.pack_request("search", [(0, (xq, 10, None, True)), (1, (xq, 10, 4, True))]), 2
    )
    assert searched[0][1][0] is searched[1][1][0]  # one query array, sent once


def test_errors_travel_as_their_class_or_its_nearest_allowed_base():
    class Custom(UnknownKeyError):
        pass

    errors = [
        UnknownKeyError("key 'x' is not in the index"),
        IndexFileError("missing infos"),
        ShardReadError("s3://b/t.tar", "cut"),  # an __init__ of its own: class and message travel
        FileNotFoundError(2, "No such file"),
        KeyError("k"),
        Custom("subclass"),
        KeyboardInterrupt(),
    ]
    answers = messages.unpack_answers(messages.pack_answers([("error", e) for e in errors] + [("ok", 1)]))
    got = [value for _, value in answers[:-1]]
    assert [type(e) for e in got] == [
        UnknownKeyError,
        IndexFileError,
        ShardReadError,
        FileNotFoundError,
        KeyError,
        UnknownKeyError,
        RuntimeError,
    ]
    assert str(got[0]) == "key 'x' is not in the index" and "cannot read shard s3://b/t.tar: cut" in str(got[2])
    assert str(got[5]) == "Custom: subclass" and isinstance(got[5], NeedleInputError)
    assert answers[-1] == ("ok", 1)


def test_an_answer_that_cannot_travel_becomes_its_own_error():
    answers = messages.unpack_answers(messages.pack_answers([("ok", {"x": object()}), ("ok", [1])]))
    assert answers[1] == ("ok", [1])
    assert answers[0][0] == "error" and "value[1]['x']: a builtins.object cannot be sent" in str(answers[0][1])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (np.array(["a"], dtype=object), r"value\[0\]: an array of dtype object cannot be sent"),
        (np.array(["a"]), r"array of dtype <U1 cannot be sent"),
        ({1, 2}, r"a builtins.set cannot be sent"),
        ({(1, 2): 3}, r"a dict key of type tuple cannot be sent"),
        (np.complex64(1), r"numpy scalar of dtype complex64"),
    ],
)
def test_values_outside_the_calls_types_are_refused_by_the_sender(value, message):
    with pytest.raises(WireError, match=message):
        wire.encode([value])


def message_with(tree, body: bytes = b"") -> bytes:
    """A message whose header is ``tree`` as it comes (a crafted sender)."""
    header = json.dumps(tree).encode()
    header += b" " * (wire.aligned(wire.PREFIX.size + len(header)) - wire.PREFIX.size - len(header))
    return wire.PREFIX.pack(wire.MAGIC, len(header), len(body)) + header + body


@pytest.mark.parametrize(
    ("message", "refusal"),
    [
        (pickle.dumps(("search", [])), r"not a needle message: it starts"),
        (b"NDW", r"truncated message: 3 bytes"),
        (wire.PREFIX.pack(wire.MAGIC, wire.MAX_HEADER + 1, 0), r"header of \d+ bytes announced, over the"),
        (wire.PREFIX.pack(wire.MAGIC, 48, wire.MAX_BODY + 1), r"body of \d+ bytes announced, over the"),
        (wire.encode(np.arange(100))[:-8], r"truncated message: \d+ bytes, its prefix announces \d+"),
        (wire.encode([1]) + b"x", r"overlong message"),
        (message_with({"$a": [0, "|O", [1], 0, 8]}, bytes(8)), r"dtype '\|O' is not one the channel carries"),
        (message_with({"$a": [0, "<f4", [3], 0, 8]}, bytes(64)), r"shape \[3\] of <f4 is 12 bytes, not 8"),
        (message_with({"$a": [0, "<f4", [4], 64, 16]}, bytes(64)), r"bytes 64..80 past the body's 64"),
        (message_with({"$r": 0}), r"reference 0 to no object sent before it"),
        (message_with({"$o": [0, "Popen", {"args": "sh"}]}), r"object type 'Popen' is not one the channel carries"),
        (message_with({"$o": [0, "LocalTokens", {"codes": 1}]}), r"not a valid LocalTokens"),
        (message_with({"$x": 1}), r"unknown tag '\$x'"),
        (message_with(json.loads("[" * 40 + "]" * 40)), r"nested deeper than 32"),
        (message_with({"$k": [0, 3, 5, []]}, b"a\x00b"), r"2 keys where 5 were announced"),
    ],
)
def test_messages_that_are_not_ones_are_refused_naming_what_is_wrong(message, refusal):
    with pytest.raises(WireError, match=refusal):
        wire.decode(message)


def test_a_header_that_is_not_json_is_refused():
    header = b"{not json" + b" " * 39
    with pytest.raises(WireError, match="the header is not JSON"):
        wire.decode(wire.PREFIX.pack(wire.MAGIC, len(header), 0) + header)


def test_requests_name_an_allowed_call_with_arguments_it_takes():
    assert set(messages.CALLS) == {
        "info",
        "search",
        "keys_of",
        "find_keys",
        "tokens_of_key",
        "thumbnail",
        "vectors_of_rows",
        "rescore",
        "max_tokens",
        "score_shortlists",
        "evidence_of",
        "glue_matches",
    }
    with pytest.raises(WireError, match=r"unknown call '__reduce__': the calls are \['evidence_of'"):
        messages.pack_request("__reduce__", [(0, ())])
    crafted = wire.encode({"call": "memory", "members": [[0, ()]]})  # a group method, not a shard call
    with pytest.raises(WireError, match="unknown call 'memory'"):
        messages.unpack_request(crafted, 1)
    too_many = wire.encode({"call": "thumbnail", "members": [[0, ("key", 8, "extra")]]})
    with pytest.raises(WireError, match=r"thumbnail: call 0 has 3 arguments, the call takes 2 to 2"):
        messages.unpack_request(too_many, 1)
    with pytest.raises(WireError, match=r"names member -1 of a group of 2"):
        messages.unpack_request(messages.pack_request("info", [(-1, ())]), 2)
    with pytest.raises(WireError, match=r"names member 2 of a group of 2"):
        messages.unpack_request(messages.pack_request("info", [(2, ())]), 2)
    with pytest.raises(WireError, match="not a request"):
        messages.unpack_request(wire.encode(["info", []]), 1)
    name, calls = messages.unpack_request(messages.pack_request("find_keys", [(1, (["a"],)), (0, (["b"], True))]), 2)
    assert (name, calls) == ("find_keys", [(1, (["a"],)), (0, (["b"], True))])


def test_answers_must_be_ok_or_error_pairs():
    with pytest.raises(WireError, match="not a list of answers"):
        messages.unpack_answers(wire.encode([("error", "not an exception")]))
    with pytest.raises(WireError, match="not a list of answers"):
        messages.unpack_answers(wire.encode({"ok": 1}))


def test_the_prefix_announces_the_sizes():
    message = wire.encode({"v": np.arange(4, dtype=np.int32)})
    magic, header, body = struct.unpack("!4sIQ", message[:16])
    assert magic == wire.MAGIC and (16 + header) % wire.ALIGN == 0 and len(message) == 16 + header + body
    assert wire.frame_sizes(message[:16]) == (header, body)


def test_the_second_verification_call_and_its_settings_travel():
    from rerank.glue import GlueConfig
    from rerank.rerank import RerankConfig

    conf = RerankConfig(method="sp", glue=GlueConfig(top=7, weight=0.2, cap=10))
    rows = np.array([5, 9], np.int64)
    name, got = messages.unpack_request(messages.pack_request("glue_matches", [(1, (conf, rows, tokens(4)))]), 2)
    assert name == "glue_matches" and got[0][0] == 1
    sent_conf, sent_rows, sent_query = got[0][1]
    assert sent_conf == conf and sent_conf.glue == GlueConfig(top=7, weight=0.2, cap=10)
    np.testing.assert_array_equal(sent_rows, rows)
    assert len(sent_query) == 4


def test_joined_keys_travel_as_the_key_list_they_hold():
    """A shard's keys as its key files give them (NUL-joined bytes) arrive as the same list of
    strings (None at the padding) that a list of keys would: the coordinator cannot tell them apart."""
    from core.joined_keys import JoinedKeys

    keys = ["000001/00007", "", "猫/é", None, "z" * 300]
    data = "\0".join(k or "" for k in keys).encode()
    joined = JoinedKeys.of(data, len(keys), (3,))
    answer = [("ok", joined), ("ok", [k for k in keys if k is not None] * 5)]
    assert messages.unpack_answers(messages.pack_answers(answer)) == [("ok", keys), answer[1]]
    assert joined.split() == keys
    assert JoinedKeys.of(b"a\0b", 1) is None and JoinedKeys.of(b"", 0) is None  # a key holding a NUL; none
    assert JoinedKeys.of(b"", 1).split() == [""]
