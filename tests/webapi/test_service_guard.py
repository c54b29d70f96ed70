"""webapi.guard in front of ``needle serve``'s endpoints: Host, Origin and Content-Type checks, and
the concurrency gate (its queue, /health's cached answers, a cancelled request's slot held until
its work ends). Through TestClient: fast."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import pytest

from tests.support.service import JSON, KEY, app_client, png_header

# pytest fixtures and the fixtures they request, imported by name (``x as x``: on purpose, not unused)
from tests.support.service import client as client
from tests.support.service import index as index
from tests.support.service import index_dir as index_dir


# --- browsers: Host, Origin, Content-Type ----------------------------------------------------------
@pytest.mark.parametrize(
    "headers,status",
    [
        ({"Host": "evil.example:8000"}, 421),
        ({"Host": "localhost.evil.example"}, 421),
        ({"Host": "127.0.0.1:8000"}, 200),
        ({"Host": "[::1]:8000"}, 200),
        ({"Host": "LOCALHOST."}, 200),
        ({"Content-Type": "text/plain"}, 415),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415),
        ({"Content-Type": "application/json; charset=utf-8"}, 200),
        ({"Origin": "http://evil.example"}, 403),
        ({"Origin": "null"}, 403),
        ({"Origin": "http://localhost:3000"}, 403),
        ({"Origin": "http://localhost"}, 200),
        ({"Sec-Fetch-Site": "cross-site"}, 403),
        ({"Sec-Fetch-Site": "same-origin"}, 200),
    ],
)
def test_browser_checks(client, headers, status):
    response = client.post("/search", content=json.dumps({"keys": [KEY], "k": 2}), headers={**JSON, **headers})
    assert response.status_code == status, response.text


def test_json_api_needs_a_content_type_and_images_an_image_type(client):
    response = client.post("/search", content=json.dumps({"keys": [KEY]}))
    assert response.status_code == 415 and response.json()["field"] == "Content-Type"
    png = {"Content-Type": "image/png"}
    assert client.post("/search/image?k=2", content=png_header(10, 10), headers=png).status_code == 400  # no model
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # curl --data-binary's default: a form's type
    assert client.post("/search/image?k=2", content=png_header(10, 10), headers=form).status_code == 415
    assert client.post("/search/image?k=2", content=png_header(10, 10)).status_code == 415
    assert (
        client.post("/search/image?k=2", content=png_header(10, 10), headers={"Content-Type": "text/plain"}).status_code
        == 415
    )


def test_host_names_and_health(index):
    from webapi.guard import allowed_hosts
    from webapi.limits import ServiceLimits

    assert client_status(index, "evil.example", "/health") == 421
    assert client_status(index, "needle.lan:8000", "/health", allow_hosts=("needle.lan",)) == 200
    assert client_status(index, "anything", "/health", allow_hosts=("*",)) == 200
    assert allowed_hosts(ServiceLimits(allow_hosts=("*",))) is None
    assert client_status(index, "testserver", "/health") == 421  # TestClient's default: refused like any other


def client_status(index, host: str, path: str, **limits) -> int:
    with app_client(index, **limits) as c:
        return c.get(path, headers={"Host": host}).status_code


# --- the concurrency gate --------------------------------------------------------------------------
def test_gate_hands_slots_over_and_bounds_its_queue():
    from webapi.guard import Gate

    async def scenario():
        gate = Gate(slots=1, queue=1, timeout=0.2)
        assert await gate.acquire()
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        assert not await gate.acquire()  # the queue is full
        gate.release()  # handed to the waiter, not freed
        assert await waiter and gate.busy == 1
        assert not await gate.acquire()  # waits 0.2 s, then gives up
        assert not gate.waiters
        gate.release()
        assert gate.busy == 0 and await gate.acquire()

    asyncio.run(scenario())


def test_busy_server_answers_503_and_health_is_cached_and_gated(index, monkeypatch):
    """A busy server refuses a search past its queue; /health answers from its one-second cache
    (for the generation served) and makes a fresh answer only with a slot of the same gate."""
    from webapi.query_service import QueryService

    started, finish = threading.Event(), threading.Event()

    def slow(self, body, partial=False):
        started.set()
        finish.wait(10)
        return []

    monkeypatch.setattr(QueryService, "search_json", slow)
    with app_client(index, max_inflight=1, max_queue=0) as c:
        assert c.get("/health").status_code == 200  # a fresh answer, cached for a second
        first = threading.Thread(target=lambda: c.post("/search", json={"keys": [KEY]}, headers=JSON))
        first.start()
        try:
            assert started.wait(10)
            response = c.post("/search", json={"keys": [KEY]}, headers=JSON)
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert response.json()["limit"] == "max_inflight"
            assert c.get("/health").status_code == 200  # from the cache: no slot needed
            time.sleep(1.1)
            stale = c.get("/health")  # a fresh answer needs a slot: busy, as a search
            assert stale.status_code == 503 and stale.json()["limit"] == "max_inflight"
            assert stale.headers["retry-after"] == "1"
        finally:
            finish.set()
            first.join(10)
        assert c.post("/search", json={"keys": [KEY]}, headers=JSON).status_code == 200


def test_health_answers_are_shared_for_a_second_and_never_hide_a_new_generation(index):
    """Many probes make one health answer (with shards in Ray each costs a call to every replica);
    a changed generation is reported at once (``--wait-for`` polls /health for it)."""
    import asyncio

    from webapi.guard import Gate
    from webapi.health import HealthCache

    class Changing:
        def __init__(self, inner):
            self.inner, self.generation = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        @property
        def infos(self):
            return {**self.inner.infos, "generation": self.generation}

    changing = Changing(index)
    cache = HealthCache(changing, Gate(1, 0, 1.0))

    async def probes(n):
        return [json.loads((await cache.respond()).body)["generation"] for _ in range(n)]

    assert asyncio.run(probes(50)) == [0] * 50 and cache.refreshes == 1
    changing.generation = 3
    assert asyncio.run(probes(5)) == [3] * 5 and cache.refreshes == 2


def test_health_under_serve_replicas_reports_the_generation_every_replica_serves(index):
    """Under Ray Serve (webapi.health's ``replicas``): the minimum over the replicas, null while one
    opens the index, a 503 where their generations cannot be read; an answer is reused only while
    no replica lags this one."""
    from webapi.guard import Gate
    from webapi.health import HealthCache, ReplicaStateUnavailable

    board = {"a": 0, "b": 0}

    def replicas(own):
        if board is None:
            raise ReplicaStateUnavailable("the board cannot be read")
        return {**board, "a": own}

    cache = HealthCache(index, Gate(1, 0, 1.0), replicas=replicas)

    def probe():
        response = asyncio.run(cache.respond())
        return response.status_code, json.loads(response.body)

    status, body = probe()
    assert status == 200 and (body["generation"], body["serve_replicas"]) == (0, {"a": 0, "b": 0})
    board["b"] = None  # "b" restarted: opening the index
    assert probe()[1]["generation"] == 0 and cache.refreshes == 1  # reused: no replica lagged then
    cache.at -= 2  # past its second
    assert probe()[1]["generation"] is None
    assert probe()[1]["generation"] is None and cache.refreshes == 3  # never reused while one lags
    board["b"] = 0
    assert probe()[1]["generation"] == 0
    board = None
    cache.at -= 2
    status, body = probe()
    assert status == 503 and body["generation"] is None and "board" in body["error"]


def test_a_request_cancelled_when_its_client_left_keeps_its_slot_until_its_work_ends():
    """Ray Serve cancels a request whose client disconnected; its search or decode in the thread
    pool cannot be stopped. The guard runs the endpoint shielded, so its slot of --max-inflight
    (and its body's bytes) stay counted until the work ends: the ceiling stays --max-inflight."""
    import asyncio

    from starlette.concurrency import run_in_threadpool

    from webapi.guard import Guard, Route, gate_of
    from webapi.limits import ServiceLimits

    ended = threading.Event()

    async def endpoint(scope, receive, send):
        await run_in_threadpool(lambda: (time.sleep(0.5), ended.set()))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    limits = ServiceLimits(max_inflight=1, max_queue=0)
    gate = gate_of(limits)
    guard = Guard(endpoint, limits, {("POST", "/search"): Route("json", 1 << 20, "max_json_mb")}, None, gate)
    body = [{"type": "http.request", "body": b'{"keys": ["a"]}', "more_body": False}]
    scope = {"type": "http", "method": "POST", "path": "/search", "headers": [(b"content-type", b"application/json")]}

    async def scenario():
        sent = []

        async def receive():
            return body.pop(0) if body else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        request = asyncio.ensure_future(guard(dict(scope), receive, send))
        await asyncio.sleep(0.2)
        request.cancel()  # the client went away
        with contextlib.suppress(asyncio.CancelledError):
            await request
        held_after_cancel = (gate.busy, guard.budget.used)
        await asyncio.sleep(0.6)
        return held_after_cancel, (gate.busy, guard.budget.used), ended.is_set()

    after_cancel, after_work, finished = asyncio.run(scenario())
    assert after_cancel == (1, len(b'{"keys": ["a"]}'))  # still counted: the work goes on
    assert finished and after_work == (0, 0)  # given back when it ended
