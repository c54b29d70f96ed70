"""The messages of the shard channel (shards/direct.py) and of a shard group's Ray calls, typed:
no pickle crosses either.

Why: a pickle runs whatever code its sender chose when it is loaded, so a channel that unpickles
is as open as the weakest thing that can reach its port. A typed message is only data: a JSON
header that names every value's type (and each array's dtype and shape), then the arrays' raw
bytes. The types are exactly those the coordinator and the shards exchange (``ShardCalls``):
JSON's own (dict, list, str, int, float, bool, None), tuples, dicts with other keys (evidence by
member position), numpy arrays and scalars of plain numeric dtypes, bytes (a JPEG thumbnail),
keys NUL-joined (``core.joined_keys.JoinedKeys``, as a shard's key files give them; decoded as a
list of str), the few dataclasses the calls carry (``LocalTokens``, ``RerankConfig`` and its parts: rebuilt by
their own constructors, which check them) and exceptions of an allow-list (the class and the
message travel, nothing else). Anything else is refused, naming where it was and what it was.

A message: ``PREFIX`` (magic, header bytes, body bytes: 16 bytes), the header (UTF-8 JSON, padded
with spaces so that the body starts 64-byte aligned), the body (each array or bytes value at a
64-byte aligned offset). A reader checks the prefix before it reads or allocates anything more
(``frame_sizes``: at most ``MAX_HEADER`` and ``MAX_BODY`` bytes). An object met twice in one
message (the query tokens and the re-ranking conf every member of a group gets, one query array
for every member's search) is sent once and decoded as one object, as a pickle would: the group
batches calls by that identity (shards/shard_group.py).

The requests and answers of a shard group in these messages: shards/messages.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import struct
from itertools import compress, repeat
from typing import Any

import numpy as np

from core.joined_keys import JoinedKeys

MAGIC = b"NDW1"  # needle wire, version 1
PREFIX = struct.Struct("!4sIQ")  # magic, header bytes, body bytes
MAX_HEADER = 64 << 20  # bytes of JSON: the keys of 1,000 queries x 1,000 candidates fit (~20 MB)
MAX_BODY = 8 << 30  # bytes of arrays (vectors of ~2M rows at d=1024)
MAX_DEPTH = 32  # nesting of the values (the calls' deepest is ~6)
ALIGN = 64
# Plain numeric dtypes (little-endian, as numpy writes them here); never objects, strings or voids.
DTYPES = frozenset(["|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8"])
ITEMSIZE = {dtype: np.dtype(dtype).itemsize for dtype in DTYPES}
INTS = frozenset([int])
# The dataclasses a call carries: name -> module (the class is only imported where one is decoded).
OBJECTS = {
    "LocalTokens": "core.tokens",
    "RerankConfig": "rerank.rerank",
    "EnsembleConfig": "rerank.ensemble",
    "MatchConfig": "rerank.matching",
    "SpatialConfig": "rerank.spatial",
    "ExpansionConfig": "rerank.expand",
    "GlueConfig": "rerank.glue",
}


# One encoder and decoder for every header (``json.dumps`` with arguments builds an encoder per call:
# a third of a small message's encoding).
HEADER_JSON = json.JSONEncoder(separators=(",", ":"))
HEADER_DECODER = json.JSONDecoder()
PLAIN = frozenset([str, int, float, bool, type(None)])  # values JSON carries as they are
KEYS = frozenset([str, type(None)])  # a list of these (keys, None for padding) travels as NUL-joined UTF-8
KEYS_MIN = 16  # a list shorter than this stays JSON


class WireError(ValueError):
    """A value that cannot be sent, or a message that is not one (each names what was wrong)."""


def path(where: Any) -> str:
    """A value's place in a message, ``value[0][1]['raw']``, from its (parent, key) chain (built
    only when an error names it)."""
    parts = []
    while isinstance(where, tuple):
        where, key = where
        parts.append(f"[{key}]" if isinstance(key, int) else key if key[:1] in (".", " ") else f"[{key!r}]")
    return str(where) + "".join(reversed(parts))


def exception_classes() -> dict[str, type[BaseException]]:
    """The exceptions an answer may carry, by name: the errors the calls raise on purpose (a
    caller tells them apart: bad input, unknown key, missing data) and the builtins beneath them.
    Another class travels as its nearest base class here, its own name in the message."""
    from core.errors import ImageDecodeError, NeedleDataError, NeedleInputError, ShardReadError
    from index.errors import IndexFileError, UnknownKeyError
    from shards.calls import ReplicaFailed

    classes: tuple[type[BaseException], ...] = (
        *(ImageDecodeError, NeedleDataError, NeedleInputError, ShardReadError, IndexFileError, UnknownKeyError),
        *(ReplicaFailed, Exception, ValueError, TypeError, KeyError, IndexError, LookupError, RuntimeError),
        *(OSError, FileNotFoundError, PermissionError, TimeoutError, MemoryError, NotImplementedError),
        *(ArithmeticError, ZeroDivisionError, AssertionError),
    )
    return {cls.__name__: cls for cls in classes}


def object_class(name: str) -> type:
    """The dataclass ``OBJECTS`` names ``name`` (imported here: re-ranking's pull in torch)."""
    if name == "LocalTokens":
        from core.tokens import LocalTokens

        return LocalTokens
    from rerank.ensemble import EnsembleConfig
    from rerank.expand import ExpansionConfig
    from rerank.glue import GlueConfig
    from rerank.matching import MatchConfig
    from rerank.rerank import RerankConfig
    from rerank.spatial import SpatialConfig

    classes = [RerankConfig, EnsembleConfig, MatchConfig, SpatialConfig, ExpansionConfig, GlueConfig]
    found = {cls.__name__: cls for cls in classes}
    if name not in found:
        raise WireError(f"object type {name!r} is not one the channel carries ({sorted(OBJECTS)})")
    return found[name]


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Encoder:
    """One message's header tree and body chunks; objects seen before are sent as references."""

    def __init__(self) -> None:
        self.chunks: list[bytes | memoryview] = []
        self.size = 0  # body bytes so far
        self.seen: dict[int, int] = {}  # id(object) -> its reference number
        self.keep: list[Any] = []  # the objects referenced (their ids stay theirs while encoding)

    def raw(self, data: bytes | memoryview) -> tuple[int, int]:
        """(offset, length) of ``data`` appended to the body, 64-byte aligned."""
        start = aligned(self.size)
        if start > self.size:
            self.chunks.append(bytes(start - self.size))
        self.chunks.append(data)
        self.size = start + len(data)
        return start, len(data)

    def reference(self, value: Any) -> int | None:
        """The reference number of ``value`` where it was sent already; else None (and it is
        numbered now)."""
        if id(value) in self.seen:
            return self.seen[id(value)]
        self.seen[id(value)] = len(self.seen)
        self.keep.append(value)
        return None

    def node(self, value: Any, where: Any, depth: int = 0) -> Any:
        kind = type(value)
        if kind in PLAIN:
            return value
        if depth > MAX_DEPTH:
            raise WireError(f"{path(where)}: nested deeper than {MAX_DEPTH}")
        if kind is tuple:  # (leaves inline: a call per leaf was most of a small message's cost)
            return {"$t": [v if type(v) in PLAIN else self.node(v, (where, i), depth + 1) for i, v in enumerate(value)]}
        if kind is list:
            return self.sequence(value, where, depth)
        if kind is np.ndarray:
            return self.array(value, where)
        if kind is dict:
            return self.mapping(value, where, depth)
        return self.other(value, where, depth)

    def other(self, value: Any, where: Any, depth: int) -> Any:
        """The types met less often (and subclasses of the common ones)."""
        if isinstance(value, (bool, str)):
            return value
        if isinstance(value, np.generic):
            return self.scalar(value, where)
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return float(value)
        if isinstance(value, (bytes, bytearray, memoryview)):
            return {"$b": list(self.raw(bytes(value)))}
        if isinstance(value, JoinedKeys):  # a shard's keys as its key files gave them: decoded as a list
            return {"$k": [*self.raw(value.data), value.count, list(value.padding)]}
        if isinstance(value, np.ndarray):
            return self.array(value, where)
        if isinstance(value, (list, tuple)):
            return self.node(list(value) if isinstance(value, list) else tuple(value), where, depth)
        if isinstance(value, dict):
            return self.mapping(value, where, depth)
        if isinstance(value, BaseException):
            return {"$e": exception_fields(value)}
        if dataclasses.is_dataclass(value) and OBJECTS.get(type(value).__qualname__) == type(value).__module__:
            return self.dataclass(value, where, depth)
        raise WireError(f"{path(where)}: a {type(value).__module__}.{type(value).__qualname__} cannot be sent")

    def sequence(self, value: list, where: Any, depth: int) -> Any:
        kinds = set(map(type, value))
        if len(value) >= KEYS_MIN and KEYS.issuperset(kinds):  # keys (None: padding): NUL-joined bytes
            nones: list[int] = []
            filled = value
            if type(None) in kinds:  # padding: rare (fewer candidates than asked for)
                nones = list(compress(range(len(value)), map(operator.is_, value, repeat(None))))
                filled = ["" if v is None else v for v in value]
            joined = "\0".join(filled).encode("utf-8", "surrogatepass")
            if joined.count(b"\0") == len(value) - 1:  # no key holds a NUL itself
                return {"$k": [*self.raw(joined), len(value), nones]}
        if PLAIN.issuperset(kinds):
            return value
        return [v if type(v) in PLAIN else self.node(v, (where, i), depth + 1) for i, v in enumerate(value)]

    def scalar(self, value: np.generic, where: Any) -> Any:
        dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
        if dtype.str not in DTYPES:
            raise WireError(f"{path(where)}: a numpy scalar of dtype {value.dtype} cannot be sent")
        return {"$s": [dtype.str, value.item()]}

    def array(self, value: np.ndarray, where: Any) -> Any:
        number = self.reference(value)
        if number is not None:
            return {"$r": number}
        dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
        if dtype.str not in DTYPES:
            raise WireError(
                f"{path(where)}: an array of dtype {value.dtype} cannot be sent (allowed: {sorted(DTYPES)})"
            )
        data = value if value.flags.c_contiguous and dtype is value.dtype else np.require(value, dtype, ["C"])
        # small arrays copied (cheaper than a view); large ones only by the message's join
        offset, size = self.raw(data.tobytes() if data.nbytes < 65536 else data.reshape(-1).view(np.uint8).data)
        return {"$a": [self.seen[id(value)], dtype.str, list(value.shape), offset, size]}

    def mapping(self, value: dict, where: Any, depth: int) -> Any:
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: v if type(v) in PLAIN else self.node(v, (where, k), depth + 1) for k, v in value.items()}
        pairs = []
        for k, v in value.items():
            if not (k is None or isinstance(k, (str, int, float))):
                raise WireError(f"{path(where)}: a dict key of type {type(k).__name__} cannot be sent")
            key = self.node(k, (where, " key"), depth + 1)
            pairs.append([key, self.node(v, (where, k), depth + 1)])
        return {"$d": pairs}

    def dataclass(self, value: Any, where: Any, depth: int) -> Any:
        number = self.reference(value)
        if number is not None:
            return {"$r": number}
        name = type(value).__qualname__
        fields = {
            f.name: self.node(getattr(value, f.name), (where, "." + f.name), depth + 1)
            for f in dataclasses.fields(value)
            if f.init
        }
        return {"$o": [self.seen[id(value)], name, fields]}


def exception_fields(exc: BaseException) -> list[str]:
    """[the nearest allowed class's name, the message] of ``exc`` (``exception_classes``)."""
    allowed = exception_classes()
    base = next(c for c in type(exc).__mro__ if allowed.get(c.__name__) is c or c is BaseException)
    message = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
    if base is not type(exc):
        message = f"{type(exc).__name__}: {message}"
    return [base.__name__ if base is not BaseException else "RuntimeError", message]


def encode(value: Any) -> bytes:
    """``value`` as one message (WireError naming the part that cannot be sent)."""
    encoder = _Encoder()
    tree = encoder.node(value, "value")
    header = HEADER_JSON.encode(tree).encode()
    header += b" " * (aligned(PREFIX.size + len(header)) - PREFIX.size - len(header))
    if len(header) > MAX_HEADER or encoder.size > MAX_BODY:
        raise WireError(f"message too large: {len(header)} header, {encoder.size} body bytes")
    return b"".join([PREFIX.pack(MAGIC, len(header), encoder.size), header, *encoder.chunks])


def frame_sizes(prefix: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(header bytes, body bytes) a message's first ``PREFIX.size`` bytes announce, checked."""
    magic, header, body = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise WireError(f"not a needle message: it starts {bytes(magic)!r}, not {MAGIC!r}")
    if header > MAX_HEADER:
        raise WireError(f"header of {header} bytes announced, over the {MAX_HEADER} allowed")
    if body > MAX_BODY:
        raise WireError(f"body of {body} bytes announced, over the {MAX_BODY} allowed")
    return header, body


def decode(message: bytes | bytearray | memoryview) -> Any:
    """The value of one whole message (WireError naming what is wrong with it). Arrays are views
    of ``message`` (writable where it is: a bytes message is copied once)."""
    if isinstance(message, bytes):
        message = bytearray(message)
    view = memoryview(message).cast("B")
    if len(view) < PREFIX.size:
        raise WireError(f"truncated message: {len(view)} bytes, less than its {PREFIX.size}-byte prefix")
    header, body = frame_sizes(view[: PREFIX.size])
    start = PREFIX.size + header
    if len(view) != start + body:
        what = "truncated" if len(view) < start + body else "overlong"
        raise WireError(f"{what} message: {len(view)} bytes, its prefix announces {start + body}")
    try:
        tree = HEADER_DECODER.decode(str(view[PREFIX.size : start], "utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise WireError(f"the header is not JSON: {exc}") from exc
    return _Decoder(view[start:]).node(tree, "value", 0)


class _Decoder:
    """Values from a header tree and its body; references resolved to the objects decoded."""

    def __init__(self, body: memoryview):
        self.body = body
        self.objects: dict[int, Any] = {}

    def node(self, tree: Any, where: Any, depth: int) -> Any:
        if type(tree) in PLAIN:
            return tree
        if depth > MAX_DEPTH:
            raise WireError(f"{path(where)}: nested deeper than {MAX_DEPTH}")
        if isinstance(tree, list):
            if PLAIN.issuperset(map(type, tree)):
                return tree
            return [v if type(v) in PLAIN else self.node(v, (where, i), depth + 1) for i, v in enumerate(tree)]
        if not isinstance(tree, dict):
            raise WireError(f"{path(where)}: {type(tree).__name__} is not a value")
        if len(tree) != 1 or not next(iter(tree)).startswith("$"):
            return {k: v if type(v) in PLAIN else self.node(v, (where, k), depth + 1) for k, v in tree.items()}
        [(tag, content)] = tree.items()
        if tag == "$t":
            items = self.listed(content, where)
            return tuple([v if type(v) in PLAIN else self.node(v, (where, i), depth + 1) for i, v in enumerate(items)])
        if tag == "$a":
            return self.array(content, where)
        if tag == "$k":
            return self.keys(content, where)
        if tag == "$r":
            if not isinstance(content, int) or content not in self.objects:
                raise WireError(f"{path(where)}: reference {content!r} to no object sent before it")
            return self.objects[content]
        return self.rare(tag, content, where, depth)

    def rare(self, tag: str, content: Any, where: Any, depth: int) -> Any:
        """The tags met less often."""
        if tag == "$d":
            return self.mapping(content, where, depth)
        if tag == "$s":
            return self.scalar(content, where)
        if tag == "$b":
            offset, size = self.listed(content, where, 2)
            return bytes(self.span(offset, size, where))
        if tag == "$o":
            return self.dataclass(content, where, depth)
        if tag == "$e":
            return self.exception(content, where)
        raise WireError(f"{path(where)}: unknown tag {tag!r}")

    @staticmethod
    def listed(content: Any, where: Any, length: int | None = None) -> list:
        if not isinstance(content, list) or (length is not None and len(content) != length):
            raise WireError(f"{path(where)}: malformed ({content!r:.80})")
        return content

    def span(self, offset: Any, size: Any, where: Any) -> memoryview:
        if not (isinstance(offset, int) and isinstance(size, int) and offset >= 0 and size >= 0):
            raise WireError(f"{path(where)}: malformed offset/length {offset!r}/{size!r}")
        if offset + size > len(self.body):
            raise WireError(f"{path(where)}: bytes {offset}..{offset + size} past the body's {len(self.body)}")
        return self.body[offset : offset + size]

    def keys(self, content: Any, where: Any) -> list[str | None]:
        offset, size, count, nones = self.listed(content, where, 4)
        try:
            text = bytes(self.span(offset, size, where)).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise WireError(f"{path(where)}: keys are not UTF-8: {exc}") from exc
        keys: list[str | None] = list(text.split("\0"))
        if len(keys) != count or not isinstance(nones, list):
            raise WireError(f"{path(where)}: {len(keys)} keys where {count!r} were announced")
        for i in nones:
            if not isinstance(i, int) or not 0 <= i < count:
                raise WireError(f"{path(where)}: padding at {i!r} outside {count} keys")
            keys[i] = None
        return keys

    def mapping(self, content: Any, where: Any, depth: int) -> dict:
        out = {}
        for pair in self.listed(content, where):
            key, value = self.listed(pair, where, 2)
            if not (key is None or isinstance(key, (str, int, float))):
                raise WireError(f"{path(where)}: a dict key must be a str, int, float or None, got {key!r:.80}")
            out[key] = self.node(value, (where, key), depth + 1)
        return out

    def array(self, content: Any, where: Any) -> np.ndarray:
        number, dtype, shape, offset, size = self.listed(content, where, 5)
        if dtype not in DTYPES:
            raise WireError(
                f"{path(where)}: dtype {dtype!r} is not one the channel carries (allowed: {sorted(DTYPES)})"
            )
        if not (isinstance(shape, list) and INTS.issuperset(map(type, shape)) and min(shape, default=0) >= 0):
            raise WireError(f"{path(where)}: malformed shape {shape!r:.80}")
        itemsize = ITEMSIZE[dtype]
        if math.prod(shape) * itemsize != size:
            raise WireError(
                f"{path(where)}: shape {shape} of {dtype} is {math.prod(shape) * itemsize} bytes, not {size}"
            )
        data = self.span(offset, size, where)
        if not size:
            value = np.zeros(shape, dtype)
        else:  # (a 1-D array needs no reshape: one numpy call less per array, each ~5-10 us on a loaded box)
            value = np.frombuffer(data, dtype=dtype)
            if len(shape) != 1:
                value = value.reshape(shape)
        return self.numbered(number, value, where)

    def numbered(self, number: Any, value: Any, where: Any) -> Any:
        if not isinstance(number, int) or number in self.objects:
            raise WireError(f"{path(where)}: object number {number!r} is not a new one")
        self.objects[number] = value
        return value

    def scalar(self, content: Any, where: Any) -> np.generic:
        dtype, value = self.listed(content, where, 2)
        if dtype not in DTYPES or not isinstance(value, (bool, int, float)):
            raise WireError(f"{path(where)}: malformed numpy scalar {content!r:.80}")
        return np.dtype(dtype).type(value)

    def dataclass(self, content: Any, where: Any, depth: int) -> Any:
        number, name, fields = self.listed(content, where, 3)
        if name not in OBJECTS or not isinstance(fields, dict):
            raise WireError(f"{path(where)}: object type {name!r} is not one the channel carries ({sorted(OBJECTS)})")
        values = {k: self.node(v, (where, "." + k), depth + 1) for k, v in fields.items()}
        try:
            value = object_class(name)(**values)
        except (TypeError, ValueError) as exc:  # unknown fields, or values its constructor refuses
            raise WireError(f"{path(where)}: not a valid {name}: {exc}") from exc
        return self.numbered(number, value, where)

    @staticmethod
    def exception(content: Any, where: Any) -> BaseException:
        name, message = _Decoder.listed(content, where, 2)
        if not isinstance(name, str) or not isinstance(message, str):
            raise WireError(f"{path(where)}: malformed exception {content!r:.80}")
        cls = exception_classes().get(name)
        if cls is None:
            return RuntimeError(f"{name}: {message}")
        exc = cls.__new__(cls)  # not its __init__: some take other arguments than a message
        BaseException.__init__(exc, message)
        return exc
