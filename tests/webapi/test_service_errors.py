"""Whose fault an error of ``needle serve`` is (webapi.http_errors): the server's faults are 5xx
with only a request id, never described to the client; bad input is a 4xx naming no server path
and quoting user values short."""

from __future__ import annotations

import pytest

from tests.support.service import JSON, KEY

# pytest fixtures and the fixtures they request, imported by name (``x as x``: on purpose, not unused)
from tests.support.service import client as client
from tests.support.service import index as index
from tests.support.service import index_dir as index_dir


# --- whose fault: the server's faults are 5xx and say nothing of themselves ------------------------
def test_server_faults_are_5xx_with_only_a_request_id(client, index_dir, monkeypatch, caplog):
    from core.storage import StorageError
    from index.errors import IndexFileError
    from webapi.query_service import QueryService

    faults = [
        (IndexFileError(f"index shard shard_000 ({index_dir}/shard_000): keys.bin is missing"), 500),
        (StorageError("cannot read s3://bucket/idx/index_infos.json: AccessDenied"), 503),
        (TypeError("unsupported operand at /usr/lib/python3/site.py"), 500),
    ]
    for fault, status in faults:

        def fail(self, body, partial=False, fault=fault):
            raise fault

        monkeypatch.setattr(QueryService, "search_json", fail)
        response = client.post("/search", json={"keys": [KEY]}, headers=JSON)
        out = response.json()
        assert response.status_code == status and set(out) == {"error", "request_id"}, out
        assert str(index_dir) not in response.text and "s3://" not in response.text and "/usr" not in response.text
        assert out["request_id"] in caplog.text and str(fault) in caplog.text  # the log has it all, with the id
        assert (status == 503) == ("retry-after" in response.headers)


def test_bad_input_names_no_server_path(client, index_dir):
    response = client.post("/search", json={"keys": ["nope"]}, headers=JSON)
    out = response.json()
    assert response.status_code == 400 and "not in the index at <index>" in out["error"]
    assert str(index_dir) not in response.text and str(index_dir.resolve()) not in response.text


def test_scrub_keeps_keys_and_media_types():
    from webapi.http_errors import scrub

    message = "key '000000/00001' of image/png not in /srv/data/idx nor s3://b/p/x.tar (n, 32)"
    assert scrub(message, ["/srv/data/idx"]) == "key '000000/00001' of image/png not in <index> nor <path> (n, 32)"
    assert scrub("cannot read /etc/passwd: denied") == "cannot read <path>: denied"


def test_errors_name_the_route_not_a_path(client):
    """Issue 57, item 5: the scrubber took ``/search`` for a server path: "a <path> body has ..."."""
    from webapi.http_errors import scrub

    response = client.post("/search", json={"keyz": ["x"], "k": 3}, headers=JSON)
    assert response.status_code == 400 and "unknown field 'keyz': a /search body has" in response.json()["error"]
    assert "<path>" not in response.text
    assert scrub("a /page/search body, not /search/imagery nor /srv/search") == (
        "a /page/search body, not <path> nor <path>"
    )


def test_data_errors_are_the_servers_fault_but_the_cli_users_input(tmp_path):
    """IndexFileError and StorageError are NeedleDataErrors (5xx behind HTTP) and NeedleInputErrors,
    so the CLI still reports a missing index file as bad input (exit 2)."""
    from cli.main import main as needle
    from core.errors import NeedleDataError, NeedleInputError
    from core.storage import StorageError
    from index.errors import IndexFileError, UnknownKeyError
    from webapi.http_errors import describe, is_server_side

    for cls in (IndexFileError, StorageError):
        assert issubclass(cls, NeedleDataError) and issubclass(cls, NeedleInputError) and is_server_side(cls("x"))
    assert not is_server_side(UnknownKeyError("x")) and describe(UnknownKeyError("x"), "r")[0] == 400
    assert needle(["query", "--index", str(tmp_path / "missing"), "--key", "a"]) == 2


def test_server_side_names_are_input_errors_that_exist():
    """SERVER_SIDE names classes by string (no torch import to check them): each must still exist."""
    import importlib

    from core.errors import NeedleInputError
    from webapi.http_errors import SERVER_SIDE

    for name in SERVER_SIDE:
        module, _, cls = name.rpartition(".")
        assert issubclass(getattr(importlib.import_module(module), cls), NeedleInputError), name


def test_user_values_are_quoted_short_in_every_error(client, index):
    """Issue 44, item 3: a 2.5M-character unknown key came back whole as a 12.5 MB 400 body; an
    unknown field's name too. Every message quotes user values in at most 80 characters."""
    from core.quoting import SHORT_REPR_WIDTH, short_repr
    from index.errors import UnknownKeyError

    huge = "k" * 2_500_000
    response = client.post("/search", json={"keys": [huge], "k": 3}, headers=JSON)
    assert response.status_code == 400 and len(response.content) < 1_000, len(response.content)
    response = client.post("/search", json={huge: 1, "keys": ["x"]}, headers=JSON)
    assert response.status_code == 400 and len(response.content) < 1_000 and len(response.json()["field"]) <= 80
    with pytest.raises(UnknownKeyError) as caught:
        index.position_of(huge)
    assert len(str(caught.value)) < 300
    assert len(short_repr(huge)) == SHORT_REPR_WIDTH and len(short_repr("é" * 10**6)) <= SHORT_REPR_WIDTH
    assert short_repr([1] * 10**6) == "a list of 1000000" and short_repr("ok") == "'ok'"


def test_the_scrubber_reads_the_index_location_from_the_index_protocol(index, index_dir):
    """Issue 44, item 9: ``server_locations`` read ``getattr(index, "path", "")``, so an index object
    without the protocol's ``path`` had nothing scrubbed, silently; a following index (LiveIndex)
    passes its generation's path on."""
    from query.live_index import LiveIndex
    from webapi.http_errors import server_locations

    assert str(index_dir.resolve()) in server_locations(index)
    live = LiveIndex(lambda n, _: index, lambda: 0, reload_interval=0)
    assert server_locations(live) == server_locations(index)
    with pytest.raises(AttributeError):
        server_locations(object())


def test_rerank_on_an_index_without_local_tokens_names_the_field(client):
    response = client.post("/search", json={"keys": [KEY], "k": 3, "rerank": True}, headers=JSON)
    assert response.status_code == 400 and response.json()["field"] == "rerank"
    assert "no local tokens" in response.json()["error"]
