"""A shard group's requests and answers as typed messages (shards/wire.py): what travels over the
shard channel (shards/direct.py) and in a group's Ray calls (cluster/ray_shards.py).

Why an allow-list: the method to call comes from the wire. A request names its call from
``CALLS`` (the ``ShardCalls`` methods, listed one by one: no attribute is looked up by a name that
came), and the name the group is given is the list's own string; a name not there, arguments the
call's signature does not take, or a member outside the group is refused (WireError) before
anything is called.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from shards.calls import ShardCalls, Traffic
from shards.wire import WireError, decode, encode

# The calls a request may name: ShardCalls' methods, listed one by one (no attribute looked up by a
# name that came over the wire).
CALLS: dict[str, Callable[..., Any]] = {
    call.__name__: call
    for call in (
        ShardCalls.info,
        ShardCalls.search,
        ShardCalls.keys_of,
        ShardCalls.find_keys,
        ShardCalls.tokens_of_key,
        ShardCalls.thumbnail,
        ShardCalls.vectors_of_rows,
        ShardCalls.rescore,
        ShardCalls.max_tokens,
        ShardCalls.score_shortlists,
        ShardCalls.evidence_of,
        ShardCalls.glue_matches,
    )
}


def arity(call: Callable[..., Any]) -> tuple[int, int]:
    """(fewest, most) positional arguments ``call`` takes after ``self``."""
    params = list(inspect.signature(call).parameters.values())[1:]
    return sum(p.default is inspect.Parameter.empty for p in params), len(params)


ARITY = {name: arity(call) for name, call in CALLS.items()}


Calls = list[tuple[int, tuple]]  # (member of the group, the call's arguments)
Answers = list[tuple[str, Any]]  # ("ok", value) or ("error", exception), one per call


def call_name(method: Any) -> str:
    """``method`` as the name ``CALLS`` holds (WireError where it holds no such call)."""
    for name in CALLS:
        if name == method:
            return name  # the allow-list's own string, not the one that came
    raise WireError(f"unknown call {method!r:.80}: the calls are {sorted(CALLS)}")


def pack_request(method: str, calls: Calls) -> bytes:
    """One message carrying ``method`` for each (member, arguments) of ``calls``."""
    return encode({"call": call_name(method), "members": [[m, tuple(args)] for m, args in calls]})


def unpack_request(message: bytes | bytearray | memoryview, members: int) -> tuple[str, Calls]:
    """(the call's name, [(member, arguments)]) of a request to a group of ``members`` members:
    a call of ``CALLS`` whose signature takes the arguments, members in range; else WireError."""
    request = decode(message)
    if not isinstance(request, dict) or set(request) != {"call", "members"} or not isinstance(request["members"], list):
        raise WireError("not a request: expected {call, members}")
    name = call_name(request["call"])
    calls = []
    for i, entry in enumerate(request["members"]):
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], tuple)):
            raise WireError(f"{name}: call {i} is not [member, arguments]")
        member, args = entry
        if not isinstance(member, int) or isinstance(member, bool) or not 0 <= member < members:
            raise WireError(f"{name}: call {i} names member {member!r} of a group of {members}")
        fewest, most = ARITY[name]
        if not fewest <= len(args) <= most:
            raise WireError(f"{name}: call {i} has {len(args)} arguments, the call takes {fewest} to {most}")
        calls.append((member, args))
    return name, calls


def pack_answers(answers: Answers) -> bytes:
    """One message carrying ``answers``; an answer that cannot be sent goes as an error naming
    why (the others still go)."""
    try:
        return encode(answers)
    except WireError:
        checked: Answers = []
        for answer in answers:
            try:
                encode(answer)
                checked.append(answer)
            except WireError as exc:
                checked.append(("error", RuntimeError(f"the shard's answer cannot travel: {exc}")))
        return encode(checked)


def unpack_answers(message: bytes | bytearray | memoryview) -> Answers:
    """The answers of one message: ("ok", value) or ("error", exception) each; else WireError."""
    answers = decode(message)
    if not isinstance(answers, list) or not all(
        isinstance(a, tuple) and len(a) == 2 and (a[0] == "ok" or (a[0] == "error" and isinstance(a[1], BaseException)))
        for a in answers
    ):
        raise WireError('not a list of answers: expected [("ok", value) or ("error", exception)]')
    return answers


def answer_request(
    answer: Callable[[str, Calls], Answers], message: bytes | bytearray | memoryview, members: int
) -> bytes:
    """A group's reply to ``message``: ``answer(call, calls)`` packed (a shard group's ``run``,
    over the channel or through Ray)."""
    name, calls = unpack_request(message, members)
    return pack_answers(answer(name, calls))


def count_unwired(traffic: Traffic, method: str, args: dict[int, tuple], results: dict[int, Any]) -> None:
    """Count in ``traffic`` the messages a backend without a wire (shards/local_shards.py) would
    have sent and read for one coordinator call: one request and one answer per shard."""
    sent = sum(len(pack_request(method, [(0, a)])) for a in args.values())
    received = sum(len(pack_answers([("ok", r)])) for r in results.values())
    traffic.add(sent, received, len(args))
