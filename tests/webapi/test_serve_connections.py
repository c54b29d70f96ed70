"""Slow and many clients on a real uvicorn server (webapi.connections on both uvicorn protocols,
webapi.guard's body timeout), the issue's slowloris run against ``needle serve`` itself, and the
memory of parallel worst-case image queries."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from index.build.stage import IndexConfig
from index.search import load_index
from tests.support.ports import free_port

# pytest fixtures and the fixtures they request, imported by name (``x as x``: on purpose, not unused)
from tests.support.service import index as index
from tests.support.service import index_dir as index_dir

ROOT = Path(__file__).resolve().parents[2]
KEY = "000000/00001"


@contextlib.contextmanager
def serving(index, limits, http: str = "auto"):
    """The app of ``index`` under uvicorn, within ``limits`` (the app's and the connections'), in a
    thread; yields its port. uvicorn's own log lines reach the root logger (pytest's caplog)."""
    import uvicorn

    from webapi.connections import uvicorn_config
    from webapi.query_service import QueryService
    from webapi.webapp import create_app

    app = create_app(QueryService(index, limits=limits))
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, limits, http, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    logging.getLogger("uvicorn").propagate = True  # uvicorn's logging config stops its lines there
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def answer_of(sock: socket.socket, timeout: float) -> tuple[int | None, bool]:
    """(the status of what the server sent within ``timeout`` s, whether it closed the connection)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return (int(data.split()[1]) if data else None), True
            data += chunk
    except (TimeoutError, ConnectionResetError):
        return (int(data.split()[1]) if data else None), False


def search(port: int, body: dict) -> tuple[int, object]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/search", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError as exc:  # a connection refused at --max-connections: its 503 may come before the request
        return 0, repr(exc)  # is sent, and the client then sees a broken pipe or a reset instead


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_slow_headers_big_headers_and_too_many_connections(index, http):
    from webapi.limits import ServiceLimits

    limits = ServiceLimits(header_timeout=0.5, max_header_kb=8, max_connections=4)
    with serving(index, limits, http) as port:
        with socket.create_connection(("127.0.0.1", port)) as slow:  # trickles header lines
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
            start = time.monotonic()
            for _ in range(3):
                time.sleep(0.2)
                with contextlib.suppress(OSError):
                    slow.sendall(b"X-Slow: 1\r\n")
            assert answer_of(slow, 3) == (408, True) and time.monotonic() - start < 2.5
        with socket.create_connection(("127.0.0.1", port)) as reused:  # the next request of a connection too
            reused.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            time.sleep(0.2)
            reused.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
            status, closed = answer_of(reused, 3)
            assert status == 200 and closed  # the first answer, then the 408 and the close
        with socket.create_connection(("127.0.0.1", port)) as big:
            with contextlib.suppress(OSError):
                big.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + b"X-Big: " + b"a" * 20_000)
            assert answer_of(big, 3) in ((431, True), (400, True))  # h11 has its own 16 KiB cap: 400
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        try:
            time.sleep(0.1)
            with socket.create_connection(("127.0.0.1", port)) as extra:
                assert answer_of(extra, 3) == (503, True)  # refused before it sent anything
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.2)
        assert search(port, {"keys": [KEY], "k": 2})[0] == 200


def test_slow_search_is_not_cut_and_slow_body_is_408(index, monkeypatch):
    from webapi.limits import ServiceLimits
    from webapi.query_service import QueryService

    original = QueryService.search_json

    def slow(self, body, partial=False):
        time.sleep(1.0)  # longer than the header timeout: a request in flight is never cut
        return original(self, body, partial)

    monkeypatch.setattr(QueryService, "search_json", slow)
    with serving(index, ServiceLimits(header_timeout=0.3, body_timeout=0.5)) as port:
        assert search(port, {"keys": [KEY], "k": 2})[0] == 200
        with socket.create_connection(("127.0.0.1", port)) as sock:
            head = b"POST /search HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            sock.sendall(head + b"Content-Length: 100\r\n\r\n" + b'{"keys": ')
            assert answer_of(sock, 3)[0] == 408


def search_request(body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST /search HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    return head.encode() + b"\r\n\r\n" + data


def non_reader(port: int, requests: bytes) -> socket.socket:
    """A client that sends ``requests`` and never reads (a small receive buffer: the answers wait in the server)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(requests)
    return sock


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


BIG = {"keys": [KEY] * 60, "k": 300}  # an answer of ~1 MB


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_clients_that_never_read_are_closed_hard_and_free_their_slots(index, http, caplog):
    """The issue's run: every slot of --max-connections held by clients that pipelined searches and
    read nothing (75 s later /health got 503). Now their unsent answers must leave within
    --send-timeout, else the connection is closed hard and its slot freed; the answers sent to
    those closed connections are dropped quietly (no failed request in the log)."""
    from webapi.limits import ServiceLimits

    limits = ServiceLimits(max_connections=4, send_timeout=1.0, max_k_total=10**6, max_queries=100)
    with serving(index, limits, http) as port:
        size = len(json.dumps(search(port, BIG)[1]))
        clients = [non_reader(port, search_request(BIG) * 8) for _ in range(4)]
        try:
            time.sleep(0.3)
            assert health(port) in (0, 503)  # every slot held
            start = time.monotonic()
            while health(port) != 200:
                assert time.monotonic() - start < 10, "the non-reading clients still hold every slot"
                time.sleep(0.2)
            while len([r for r in caplog.records if "(--send-timeout)" in r.getMessage()]) < 4:
                assert time.monotonic() - start < 10, "not every non-reading client was closed"
                time.sleep(0.2)
        finally:
            for sock in clients:
                sock.close()
    assert size > 500_000
    dropped = [r for r in caplog.records if "not taken within 1 s (--send-timeout)" in r.getMessage()]
    assert len(dropped) >= 4
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_a_client_slow_to_read_holds_no_search_slot(index):
    """--max-inflight bounds work, not sending: a request's slot is given back when its answer
    starts, so one client that never reads (its answers stalled in the server) leaves the only
    slot free for the next search."""
    from webapi.limits import ServiceLimits

    limits = ServiceLimits(max_inflight=1, queue_timeout=2.0, max_k_total=10**6, max_queries=100)
    with serving(index, limits) as port:
        stalled = non_reader(port, search_request(BIG) * 8)
        try:
            time.sleep(1.0)
            assert search(port, {"keys": [KEY], "k": 2})[0] == 200
        finally:
            stalled.close()


def test_unsent_answers_of_all_connections_are_capped(index, caplog):
    """--max-unsent-mb: past it the connection whose answer passes the cap is closed at once
    (long before --send-timeout), and the server answers others."""
    from webapi.limits import ServiceLimits

    limits = ServiceLimits(max_unsent_mb=1, send_timeout=60, max_k_total=10**6, max_queries=100)
    with serving(index, limits) as port:
        clients = [non_reader(port, search_request(BIG) * 10) for _ in range(6)]
        try:
            start = time.monotonic()
            while not [r for r in caplog.records if "--max-unsent-mb" in r.getMessage()]:
                assert time.monotonic() - start < 10, "no connection closed at the unsent cap"
                time.sleep(0.1)
            assert health(port) == 200 and time.monotonic() - start < 10
        finally:
            for sock in clients:
                sock.close()


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_pipelined_headers_keep_the_cap_while_a_request_is_answered(index, http, monkeypatch, caplog):
    """A request's headers sent behind a slow search: httptools parses them at once, so they are
    counted there from their first byte (over --max-header-kb: closed hard, before the search's
    answer, which cannot be cut by a 431); h11 reads nothing until the answer is sent, then its
    own 16 KiB cap refuses them."""
    from webapi.limits import ServiceLimits
    from webapi.query_service import QueryService

    original = QueryService.search_json

    def slow(self, body, partial=False):
        time.sleep(2.0)
        return original(self, body, partial)

    monkeypatch.setattr(QueryService, "search_json", slow)
    with (
        serving(index, ServiceLimits(max_header_kb=8), http) as port,
        socket.create_connection(("127.0.0.1", port)) as sock,
    ):
        sock.sendall(search_request({"keys": [KEY], "k": 2}))
        start = time.monotonic()
        with contextlib.suppress(OSError):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
            for _ in range(20):
                sock.sendall(b"X-Big: " + b"a" * 10_000 + b"\r\n")
        sock.settimeout(5)
        if http == "httptools":
            with pytest.raises((ConnectionResetError, BrokenPipeError)):  # closed hard: RST, no answer
                assert sock.recv(65536) == b""  # (or an orderly close without a byte)
                raise ConnectionResetError
            assert time.monotonic() - start < 1.5  # before the search's answer (2 s)
        else:  # the search's answer, then h11's own 400 and a close (or a reset: unread bytes)
            assert answer_of(sock, 5)[0] == 200
        time.sleep(2.5)  # the search ends on the closed connection: its answer dropped quietly
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


# --- the slowloris, against `needle serve` ------------------------------------------------
def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def needle_serve(index_dir: Path, *flags: str):
    """``needle serve`` in a subprocess; yields (pid, port)."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "cli.main", "serve", "--index", str(index_dir), "--port", str(port), *flags]
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "needle serve did not start"
            with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                break
            time.sleep(0.3)
        yield server.pid, port
    finally:
        server.terminate()
        server.wait(30)


def trickle(port: int, count: int, seconds: float) -> int:
    """``count`` connections that send a header line each second for ``seconds`` s (never a whole
    request); returns how many the server had not closed by then."""
    socks = []
    for _ in range(count):
        with contextlib.suppress(OSError):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
            socks.append(sock)
    end = time.monotonic() + seconds
    while time.monotonic() < end and socks:
        time.sleep(1.0)
        alive = []
        for sock in socks:
            try:
                sock.sendall(b"X-Trickle: 1\r\n")
                alive.append(sock)
            except OSError:  # closed by the server (a send after its close fails)
                sock.close()
        socks = alive
    for sock in socks:
        sock.close()
    return len(socks)


@pytest.mark.slow
def test_slowloris_keeps_open_files_bounded_and_queries_answered(index_dir):
    """300 connections trickling headers (under --max-connections): every query still answers, and
    the server closes them all after --header-timeout; 600 (over it): the open files stay at the
    cap, queries answer or get 503 while the cap is full, and answer once the timeout freed it."""
    with needle_serve(index_dir, "--header-timeout", "2", "--max-connections", "400") as (pid, port):
        expected = search(port, {"keys": [KEY], "k": 5})
        base = open_files(pid)
        for attackers in (300, 600):
            with ThreadPoolExecutor(1) as pool:
                attack = pool.submit(trickle, port, attackers, 6.0)
                peak, answers = base, []
                while not attack.done():
                    answers.append(search(port, {"keys": [KEY], "k": 5}))
                    peak = max(peak, open_files(pid))
                    time.sleep(0.2)
                left_open = attack.result()
            refused = sum(a[0] in (0, 503) for a in answers)
            print(
                f"slowloris {attackers} (cap 400): open files {base} -> at most {peak}; "
                f"{len(answers)} queries, {refused} of them refused"
            )
            assert left_open == 0 and peak <= base + 400 + 10, (attackers, base, peak, left_open)
            if attackers < 400:
                assert answers and all(a == expected for a in answers), answers[:3]
            else:
                assert all(a == expected or a[0] in (0, 503) for a in answers), answers[:3]
            time.sleep(2.5)
            assert open_files(pid) <= base + 5 and search(port, {"keys": [KEY], "k": 5}) == expected


# --- memory under parallel worst-case image queries -----------------------------------------------
def peak_rss_mb() -> float:
    """This process's peak resident memory since the last reset_peak_rss (VmHWM), in MB."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from the current RSS


def post_image(port: int, data: bytes) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/search/image?k=3", data, {"Content-Type": "image/png"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.slow
def test_parallel_worst_case_images_stay_within_the_memory_bound(tmp_path, tiny_shards, extractor):
    """8 PNGs at --max-image-pixels (5000², 84 KB each: the issue's decompression-bomb shape) at once
    with --max-inflight 2: the peak memory is that of 2 decodes (about 9 bytes per pixel each), not 8."""
    import io

    from PIL import Image

    from index.build.stage import main as build
    from ingest.pipeline import process_shard
    from webapi.limits import ServiceLimits

    desc = tmp_path / "desc"
    for i, shard in enumerate(tiny_shards):
        assert process_shard(str(shard), i, desc, [extractor]).status == "ok"
    (desc / "ingest_info.json").write_text(json.dumps({"extractors": [extractor.info()]}))
    index = load_index(build(IndexConfig(kind="flat"), desc, tmp_path / "idx"))
    buffer = io.BytesIO()
    Image.new("RGB", (5000, 5000), (120, 80, 40)).save(buffer, "PNG")
    worst = buffer.getvalue()
    small = io.BytesIO()
    Image.new("RGB", (64, 64), (120, 80, 40)).save(small, "PNG")
    limits = ServiceLimits(max_inflight=2, queue_timeout=300, max_image_pixels=25_000_000)
    with serving(index, limits) as port:
        assert post_image(port, small.getvalue()) == 200  # the model loaded before the measurement
        reset_peak_rss()
        before = peak_rss_mb()
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda _: post_image(port, worst), range(8)))
        growth = peak_rss_mb() - before
    assert statuses == [200] * 8
    bound = limits.max_inflight * 9 * limits.max_image_pixels / 1e6 + 150  # two decodes, the model's activations
    print(f"peak RSS growth with 8 parallel 25 MP PNGs, --max-inflight 2: {growth:.0f} MB (bound {bound:.0f} MB)")
    assert growth < bound, growth
