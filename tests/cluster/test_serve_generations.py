"""``--wait-for`` against Ray Serve replicas (issue 55): each replica writes the generation it serves
to the generation board (cluster/generation_board.py), /health reports the minimum over the live
replicas, so a delete is visible on every replica when ``--wait-for`` returns; a replica that
stopped no longer counts."""

import threading
import time

import pytest
import ray

from tests.support.ports import free_port, urlopen_json


@ray.remote(num_cpus=0)
class Replica:
    """Stands in for a Serve replica: the board only pings it."""

    def busy(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.mark.ray
def test_the_board_drops_a_dead_replica_and_keeps_a_busy_one(ray_local):
    from cluster.generation_board import start_board

    board = start_board()
    dead, busy, opening = Replica.remote(), Replica.remote(), Replica.remote()
    ray.get([board.report.remote("dead", 3, dead), board.report.remote("busy", 2, busy)])
    ray.get(board.report.remote("opening", None, opening))
    ray.kill(dead)
    busy.busy.remote(1.5)  # a sync actor: the board's ping waits behind it, past the ping timeout
    time.sleep(0.2)
    assert ray.get(board.generations.remote(ping_timeout=0.5)) == {"busy": 2, "opening": None}
    ray.get(board.forget.remote("opening"))
    assert ray.get(board.generations.remote(ping_timeout=0.5)) == {"busy": 2}


def replica(replica_id: str):
    """The actor of the Serve replica ``replica_id`` (app and deployment "needle")."""
    return ray.get_actor(f"SERVE_REPLICA::needle#needle#{replica_id}", namespace="serve")


def hold_reload(replica_id: str, held: bool) -> None:
    """Make the replica's reload see no newer generation (``held``), or the index again: a replica
    slow to switch, which meanwhile answers every request from the generation it has."""

    def hold(actor, held):  # runs in the replica's process (nested: pickled by value)
        from query.live_index import LiveIndex

        # found from the replica actor through attributes (Serve freezes its objects out of gc's view)
        seen, todo = set(), [actor]
        while not isinstance(todo[0], LiveIndex):
            obj = todo.pop(0)
            if id(obj) not in seen and hasattr(obj, "__dict__") and not isinstance(obj, type):
                seen.add(id(obj))
                todo.extend(vars(obj).values())
        live = todo[0]
        if held:
            live.newest, seen = live._latest, live.generation
            live._latest = lambda: seen
        else:
            live._latest = live.newest

    ray.get(replica(replica_id).__ray_call__.remote(hold, held))


def waiting(url: str, generation: int, index_id: str) -> tuple[threading.Thread, dict]:
    """``--wait-for``'s wait (cli.live.wait_for) in a thread; its seconds or error land in the dict."""
    from cli.live import wait_for

    out: dict = {}

    def run():
        try:
            out["waited"] = wait_for(url, generation, 60.0, index_id)
        except Exception as exc:  # the assertion below names it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.ray
@pytest.mark.slow
def test_wait_for_returns_once_every_replica_serves_the_delete(live_flat_index, ray_local):
    """Two replicas following the index, one held back (its reload sees no newer generation): the
    other serves the delete's generation at once, yet --wait-for waits until the held one does too;
    then every replica answers without the key. A replica killed before it switches stops counting."""
    from ray import serve

    from cluster.serve import ray_app
    from index.live.delete_rows import DeleteConfig
    from index.live.delete_rows import main as delete
    from index.search import load_index
    from webapi.spec import Listen, LiveReload, ServeSpec

    index = load_index(live_flat_index)
    victim = "t1/00003"
    vector = index.vector_of(victim).tolist()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        spec = ServeSpec(index=str(live_flat_index), listen=Listen(replicas=2), reload=LiveReload(interval=0.2))
        serve.run(ray_app(spec), name="needle", route_prefix="/")
        status, health = urlopen_json(f"{url}/health")
        assert status == 200 and health["generation"] == 0 and list(health["serve_replicas"].values()) == [0, 0]
        paused, running = sorted(health["serve_replicas"])
        hold_reload(paused, True)
        assert delete(DeleteConfig(), [victim], live_flat_index)["generation"] == 1
        thread, out = waiting(url, 1, index.infos["index_id"])
        thread.join(3.0)  # 15 reload intervals: the running replica switched long ago
        assert thread.is_alive(), f"--wait-for returned while a replica served generation 0: {out}"
        status, health = urlopen_json(f"{url}/health")  # whichever replica answers
        assert health["generation"] == 0 and health["serve_replicas"] == {paused: 0, running: 1}
        hold_reload(paused, False)
        thread.join(30.0)
        assert out.get("waited", 0) >= 3.0, out
        status, health = urlopen_json(f"{url}/health")
        assert health["generation"] == 1 and health["serve_replicas"] == {paused: 1, running: 1}
        for _ in range(10):  # spread over both replicas by the proxy
            status, answer = urlopen_json(f"{url}/search", {"vectors": [vector], "k": 119})
            assert status == 200 and victim not in {r["key"] for r in answer[0]["results"]}
        # a replica that dies before it switches stops holding --wait-for back
        hold_reload(paused, True)
        assert delete(DeleteConfig(), ["t2/00004"], live_flat_index)["generation"] == 2
        thread, out = waiting(url, 2, index.infos["index_id"])
        thread.join(1.5)
        assert thread.is_alive(), out
        ray.kill(replica(paused), no_restart=True)
        thread.join(30.0)
        assert "waited" in out, out
        status, health = urlopen_json(f"{url}/health")  # Serve may have started its successor: at 2 too
        assert health["generation"] == 2 and paused not in health["serve_replicas"]
        assert set(health["serve_replicas"].values()) == {2}
    finally:
        serve.shutdown()
