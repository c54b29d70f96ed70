"""The hostile clients of ``bench/serve_load.py --mixed``: bad requests (each must be a 4xx), the
slowloris, clients that pipeline searches and never read, and oversized headers pipelined behind
a search. Loaded by path (bench/ is no package)."""

from __future__ import annotations

import json
import socket
import threading

import numpy as np


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says width x height (no image data): the decompression-bomb shape."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"\x00" * 8) + chunk(b"IEND", b"")


def bad_requests(key: str, d: int) -> list[tuple[str, str, dict, bytes]]:
    """(kind, path, headers, body) of the bad requests: each must be a 4xx, never a 5xx."""
    js = {"Content-Type": "application/json"}

    def body(value: object) -> bytes:
        return json.dumps(value).encode()

    return [
        ("not_json", "/search", js, b"{not json"),
        ("nested_100k", "/search", js, b"[" * 100_000),
        ("nprobe_list", "/search", js, body({"keys": [key], "nprobe": [1]})),
        ("k_string", "/search", js, body({"keys": [key], "k": "10"})),
        ("unknown_key", "/search", js, body({"keys": ["nope/0"], "k": 10})),
        ("unknown_field", "/search", js, body({"keys": [key], "kk": 1})),
        ("keys_5000", "/search", js, body({"keys": [key] * 5000, "k": 1})),
        ("k_total", "/search", js, body({"keys": [key] * 200, "k": 100})),
        ("vectors_nan", "/search", js, body({"vectors": [[float("nan")] * d]})),
        ("text_plain", "/search", {"Content-Type": "text/plain"}, body({"keys": [key]})),
        ("foreign_host", "/search", {**js, "Host": "evil.example"}, body({"keys": [key]})),
        ("foreign_origin", "/search", {**js, "Origin": "http://evil.example"}, body({"keys": [key]})),
        ("png_20000x20000", "/search/image?k=10", {"Content-Type": "image/png"}, png_header(20_000, 20_000)),
        ("not_an_image", "/search/image?k=10", {"Content-Type": "application/octet-stream"}, b"hello"),
        ("json_700k_objects", "/search", js, b'{"keys": [' + b",".join([b"{}"] * 700_000) + b"]}"),
        ("rescored_320k", "/search", js, body({"keys": [key], "k": 5000, "refine_factor": 64})),
        ("jpeg_200_scans", "/search/image?k=10", {"Content-Type": "image/jpeg"}, many_scan_jpeg(200)),
        ("tiff", "/search/image?k=10", {"Content-Type": "image/tiff"}, tiff_bytes()),
    ]


def many_scan_jpeg(scans: int) -> bytes:
    """A small progressive JPEG whose last scan is repeated to ``scans`` scans."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(
        out, "JPEG", quality=90, progressive=True
    )
    data = out.getvalue()
    last = data[data.rindex(b"\xff\xda") : -2]
    return data[:-2] + last * (scans - data.count(b"\xff\xda")) + b"\xff\xd9"


def tiff_bytes() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 24)).save(out, "TIFF")
    return out.getvalue()


def hold(count: int, connect, alive, stop: threading.Event, tally: dict) -> None:
    """Keep ``count`` connections made by ``connect()`` open until ``stop``, checking each second
    with ``alive(sock)`` which the server closed (counted, and opened again)."""
    socks: list[socket.socket] = []
    while not stop.is_set():
        while len(socks) < count and not stop.is_set():
            try:
                socks.append(connect())
                tally["opened"] += 1
            except OSError:
                tally["refused"] += 1
                break
        stop.wait(1.0)
        kept = []
        for sock in socks:
            if alive(sock):
                kept.append(sock)
            else:
                tally["closed_by_server"] += 1
                sock.close()
        socks = kept
    for sock in socks:
        sock.close()


def trickle(port: int, count: int, stop: threading.Event, tally: dict) -> None:
    """Keep ``count`` connections sending a header line each second (reopening those the server
    closes) until ``stop``: the slowloris."""

    def connect() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        return sock

    def alive(sock: socket.socket) -> bool:
        try:
            sock.sendall(b"X-Trickle: 1\r\n")
            return True
        except OSError:
            return False

    hold(count, connect, alive, stop, tally)


def search_bytes(body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = "POST /search HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data


def gone(sock: socket.socket) -> bool:
    """Whether the server closed ``sock``, without reading what it sent: a reset leaves its error
    (ECONNRESET) on the socket; an orderly close shows as an empty peek."""
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
        return True
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def non_readers(port: int, count: int, requests: bytes, stop: threading.Event, tally: dict) -> None:
    """Keep ``count`` connections that pipelined ``requests`` and never read (a small receive
    buffer: the answers wait in the server), reopening those the server closes, until ``stop``."""

    def connect() -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(requests)
        return sock

    hold(count, connect, lambda sock: not gone(sock), stop, tally)


def pipelined_big_headers(port: int, request: bytes, stop: threading.Event, tally: dict) -> None:
    """One connection after another: a search, then a pipelined request whose headers pass
    --max-header-kb while the search is answered; the server must close each (within 10 s)."""
    header = b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + b"X-Big: " + b"a" * 100_000 + b"\r\n"
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                tally["opened"] += 1
                sock.sendall(request + header)
                while sock.recv(65536):
                    pass
            tally["closed_by_server"] += 1
        except (ConnectionResetError, BrokenPipeError):
            tally["closed_by_server"] += 1
        except OSError:  # a timeout: the server kept it open
            tally["left_open"] += 1
