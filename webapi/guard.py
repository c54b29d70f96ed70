"""The ASGI middleware in front of ``needle serve``'s app: what every request passes before an
endpoint sees it.

Why each step (the issue's findings on a server that faces a network):

1. A request id (``x-request-id`` on every answer; in error bodies and the log's lines of the
   request): a 500 says nothing of the fault, the log says everything, the id joins them.
2. The Host header must name this server (``localhost``, ``127.0.0.1``, ``::1``, the bound
   address, ``--allow-host`` names): else 421. A page on another site that rebinds its DNS name to
   127.0.0.1 reaches the server as that name and is refused, so it cannot read answers.
3. Another site's page cannot make the server work. The search endpoints and thumbnails refuse
   (403) a request a browser marks as coming from elsewhere: an ``Origin`` other than the
   server's own (``Origin: null`` too), ``Sec-Fetch-Site`` ``cross-site`` or ``same-site``
   (another port of the same host). Browsers send those on every cross-origin POST, whatever
   the body (a form, or a no-cors ``fetch`` of a Blob whose type is ``text/plain``); curl and
   other programs send neither. Beside that, the JSON endpoints take ``application/json`` only
   (415 otherwise: a type no page can send elsewhere without a CORS preflight, which the server
   never grants), the image endpoints ``image/*`` or ``application/octet-stream`` (not the
   ``application/x-www-form-urlencoded`` that ``curl --data-binary`` sends by default: a cross-site
   HTML form may send that type; give curl ``-H 'Content-Type: image/jpeg'``).
4. Bodies of the search endpoints are read here, whole, before the endpoint runs: refused past
   their limit (413, by Content-Length before a byte is read, else while streaming), past
   ``body_timeout`` (408), or when the bodies held by all requests would pass ``max_buffered_mb``
   (503); counted as they arrive, so a client that trickles holds only what it sent.
5. Searches, image decodes and thumbnails run at most ``max_inflight`` at once; at most
   ``max_queue`` more wait, each at most ``queue_timeout`` s; past that 503 with Retry-After.
   ``/health`` answers from a one-second cache, and makes a fresh answer under the same gate
   (webapi/health.py); the page and its static files are never gated.

Slow headers and many connections are the HTTP protocol's business: webapi.connections.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from webapi.http_errors import new_request_id
from webapi.limits import ANY_HOST, LOCAL_HOSTS, LimitError, ServiceLimits, retry_after

log = logging.getLogger(__name__)
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
JSON_TYPES = ("application/json",)
IMAGE_TYPES = ("application/octet-stream", "image/*")
FOREIGN_FETCH_SITES = ("cross-site", "same-site")  # Sec-Fetch-Site values of a request from another origin


@dataclass(frozen=True)
class Route:
    """How the guard treats one (method, path): the body it reads (``kind``: "json", "image" or
    None for none), the most bytes of it, the flag that sets that, and whether it is gated."""

    kind: str | None = None
    limit: int = 0
    flag: str = "max_body_mb"
    gated: bool = True


class Refusal(Exception):
    """A request the guard answers itself: status, message, the field and limit it is about."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, **fields: Any):
        super().__init__(message)
        self.status, self.headers, self.fields = status, headers or {}, fields


def gate_of(limits: ServiceLimits) -> Gate:
    return Gate(limits.max_inflight, limits.max_queue, limits.queue_timeout)


def busy_message(gate: Gate) -> str:
    """What a request the gate had no slot for is told (a search, a thumbnail, a fresh /health)."""
    return (
        f"the server is busy ({gate.busy} requests running, {len(gate.waiters)} waiting: "
        "--max-inflight, --max-queue); retry later"
    )


class Slot:
    """One request's hold on a Gate slot (None: an ungated route), given back once: when its answer
    starts, or when its endpoint ends without one."""

    def __init__(self, gate: Gate | None):
        self.gate = gate

    def release(self) -> None:
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.release()

    def sending(self, send: Send) -> Send:
        async def send_and_release(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.release()
            await send(message)

        return send_and_release


class Gate:
    """At most ``slots`` holders at once; at most ``queue`` waiters, each for at most ``timeout``
    s. Used from one event loop: no lock, the futures are that loop's."""

    def __init__(self, slots: int, queue: int, timeout: float):
        self.slots, self.queue, self.timeout = slots, queue, timeout
        self.busy = 0
        self.waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> bool:
        """True once a slot is held (release it), False where the queue is full or time ran out."""
        if self.busy < self.slots and not self.waiters:
            self.busy += 1
            return True
        if len(self.waiters) >= self.queue:
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:  # a slot handed over as time runs out is still returned by wait_for: never lost
            await asyncio.wait_for(waiter, self.timeout)
            return True
        except TimeoutError:
            return False
        finally:
            if not waiter.done() or waiter.cancelled():
                waiter.cancel()
                if waiter in self.waiters:
                    self.waiters.remove(waiter)

    def release(self) -> None:
        """Hand the slot to the first live waiter, else free it."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.busy -= 1


class Budget:
    """Bytes of request bodies held in memory by all requests at once, at most ``limit``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


def allowed_hosts(limits: ServiceLimits, bound: str | None = None) -> frozenset[str] | None:
    """The Host names answered (None: any, with ``--allow-host '*'``): this machine's, the bound
    address where it names one interface, and ``limits.allow_hosts``."""
    names = {normal_host(h) for h in (*LOCAL_HOSTS, *limits.allow_hosts)}
    if ANY_HOST in names:
        return None
    if bound and bound not in ("0.0.0.0", "::", ""):
        names.add(normal_host(bound))
    return frozenset(names)


def normal_host(value: str) -> str:
    """A Host header's name: lowercase, without port, brackets or a trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:  # name:port (an IPv6 address without brackets has several colons)
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def media_type_ok(value: str | None, accepted: tuple[str, ...]) -> bool:
    kind = (value or "").split(";", 1)[0].strip().lower()
    return any(kind == a or (a.endswith("/*") and kind.startswith(a[:-1]) and len(kind) > len(a) - 1) for a in accepted)


class Guard:
    """The middleware (see the module doc): ``routes`` maps (method, path) to its Route; ``hosts``
    the Host names answered (None: any)."""

    def __init__(
        self,
        app: Any,
        limits: ServiceLimits,
        routes: dict[tuple[str, str], Route],
        hosts: Any,
        gate: Gate | None = None,
    ):
        self.app, self.limits, self.routes, self.hosts = app, limits, routes, hosts
        # shared with endpoints that gate part of their work themselves (webapi/health.py)
        self.gate = gate or gate_of(limits)
        self.budget = Budget(limits.max_buffered_mb << 20)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = rid

        gone = False  # the client's connection closed: the rest of the answer goes nowhere

        async def send_with_id(message: Message) -> None:
            nonlocal gone
            if gone:
                return
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            try:
                await send(message)
            except RuntimeError as exc:  # uvloop's transport, closed before uvicorn heard of it
                if not connection_closed(exc):
                    raise
                gone = True
                log.info("request %s: the client's connection closed; its answer is dropped", rid)

        try:
            await self.guarded(scope, receive, send_with_id)
        except Refusal as refusal:
            await send_refusal(send_with_id, refusal, rid)

    async def guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The checks in order; the endpoint runs with the body read and a slot held."""
        self.check_host(scope)
        route = self.routes.get((scope["method"], scope["path"]))
        if route is None:
            await self.app(scope, receive, send)
            return
        check_same_origin(scope)
        held = [0]  # body bytes this request holds in the budget
        working = False  # the endpoint runs: it gives back the slot and the body when it ends
        try:
            if route.kind is not None:
                check_media_type(scope, route)
                body = await self.read_body(scope, receive, route, held)
                receive = replay(body, receive)
            if route.gated and not await self.gate.acquire():
                raise Refusal(503, busy_message(self.gate), {"Retry-After": retry_after(1)}, limit="max_inflight")
            # The endpoint in a task of its own, shielded: where the server cancels a request whose
            # client went away (Ray Serve does; uvicorn lets it run), its work in the thread pool
            # cannot be stopped, so the task runs on and holds the slot and the body until it ends.
            # The slot bounds work, not sending: it is given back once the answer starts (a client
            # slow to read holds its connection and its unsent bytes: webapi.connections).
            slot = Slot(self.gate if route.gated else None)
            work = asyncio.ensure_future(self.app(scope, receive, slot.sending(send)))
            work.add_done_callback(lambda task: self.work_ended(task, slot, held[0]))
            working = True
            await asyncio.shield(work)
        finally:
            if not working:
                self.budget.give(held[0])

    def work_ended(self, task: asyncio.Future[None], slot: Slot, body_bytes: int) -> None:
        """An endpoint's task ended (answered, failed, or finished after its client went away)."""
        slot.release()
        self.budget.give(body_bytes)
        if not task.cancelled() and task.exception() is not None:
            log.debug("endpoint ended with %r", task.exception())  # raised to the request too, where it waits

    def check_host(self, scope: Scope) -> None:
        """421 unless the Host header names this server (DNS rebinding: see the module doc)."""
        if self.hosts is None:
            return
        host = header(scope, b"host")
        if host is None or normal_host(host) not in self.hosts:
            shown = "none" if host is None else repr(host[:100])
            raise Refusal(
                421,
                f"Host {shown} is not a name this server answers to (--allow-host adds one)",
                field="Host",
            )

    async def read_body(self, scope: Scope, receive: Receive, route: Route, held: list[int]) -> bytes:
        """The whole body: 413 past ``route.limit``, 408 past ``body_timeout``, 503 past the budget."""
        declared = header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > route.limit:
            raise too_large(route, int(declared))
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise Refusal(400, "the client went away before sending the whole body")
                    chunk = message.get("body", b"")
                    if held[0] + len(chunk) > route.limit:
                        raise too_large(route, held[0] + len(chunk))
                    if not self.budget.take(len(chunk)):
                        raise Refusal(
                            503,
                            "the server holds too many request bodies at once (--max-buffered-mb); retry later",
                            {"Retry-After": retry_after(1)},
                            limit="max_buffered_mb",
                        )
                    held[0] += len(chunk)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            flag = "--body-timeout"
            raise Refusal(
                408,
                f"the request body did not arrive within {self.limits.body_timeout:g} s ({flag})",
                {"Connection": "close"},
                limit="body_timeout",
            ) from None


def connection_closed(exc: RuntimeError) -> bool:
    """Whether a send failed because the connection was closed (by the client, or hard by
    webapi.connections): uvloop raises this until uvicorn's connection_lost marks the request
    disconnected, after which uvicorn drops sends itself."""
    return "handler is closed" in str(exc) or "closed=True" in str(exc)


def check_same_origin(scope: Scope) -> None:
    """403 for a request a browser sent from another origin (see the module doc)."""
    site = header(scope, b"sec-fetch-site")
    origin = header(scope, b"origin")
    if site is not None and site.strip().lower() in FOREIGN_FETCH_SITES:
        raise Refusal(403, f"a {site.strip().lower()} request from a browser page: refused", field="Sec-Fetch-Site")
    if origin is None:
        return
    netloc = origin.strip().lower().split("://", 1)[-1].rstrip("/")
    host = (header(scope, b"host") or "").strip().lower()
    if origin.strip().lower() == "null" or netloc != host:
        raise Refusal(403, f"a request from the page of another origin ({origin[:100]!r}): refused", field="Origin")


def check_media_type(scope: Scope, route: Route) -> None:
    accepted = JSON_TYPES if route.kind == "json" else IMAGE_TYPES
    given = header(scope, b"content-type")
    if not media_type_ok(given, accepted):
        shown = "none" if given is None else repr(given[:100])
        raise Refusal(415, f"Content-Type {shown}: {scope['path']} takes {' or '.join(accepted)}", field="Content-Type")


def too_large(route: Route, size: int) -> Refusal:
    error = LimitError("body", route.flag, route.limit, size, "request body bytes")
    return Refusal(413, str(error), field="body", limit=route.flag, max=route.limit, got=size)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the endpoint the body read already, then whatever the client sends next."""
    sent = [False]

    async def receive_again() -> Message:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


async def send_refusal(send: Send, refusal: Refusal, rid: str) -> None:
    payload = {"error": str(refusal), **refusal.fields, "request_id": rid}
    log.info("request %s refused %d: %s", rid, refusal.status, refusal)
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in refusal.headers.items()]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_limited(request: Any, limit: int, flag: str) -> bytes:
    """A request's body, at most ``limit`` bytes (a LimitError naming ``flag`` past it). Behind the
    Guard the body was read and checked already (this reads it again from memory); on an app
    without it (a page registered on a bare FastAPI app) this is the only bound."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise LimitError("body", flag, limit, int(declared), "request body bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise LimitError("body", flag, limit, size, "request body bytes")
        chunks.append(chunk)
    return b"".join(chunks)
