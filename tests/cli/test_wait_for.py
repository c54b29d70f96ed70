"""``--wait-for URL`` (issue 55) waits for this index's generation: a server of another index (its
``/health`` reports another ``index_id``) is an error at once, naming both; an index built before
index ids is known by its generation only."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cli.live import OtherIndexError, WaitTimeout, wait_for


@pytest.fixture
def health():
    """A server whose ``/health`` answers the dict the test sets (``state``), and its URL."""
    state: dict = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(state).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_wait_for_needs_this_index_at_the_generation(health):
    state, url = health
    state.update(generation=3, index_id="aaaa")
    assert wait_for(url, 3, 5.0, "aaaa") < 5.0
    with pytest.raises(WaitTimeout, match="generation 3 after"):
        wait_for(url, 4, 0.3, "aaaa")
    with pytest.raises(OtherIndexError, match="serves index 'bbbb', not this one \\(aaaa"):
        state.update(index_id="bbbb")
        wait_for(url, 3, 5.0, "aaaa")
    state.pop("index_id")  # a server of an index without an id is not this one either
    with pytest.raises(OtherIndexError, match="serves index None"):
        wait_for(url, 3, 5.0, "aaaa")
    assert wait_for(url, 2, 5.0, None) < 5.0  # an index built before ids: its generation only
