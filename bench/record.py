"""One current result per benchmark, earlier runs in its history.

``bench/results/NAME.json`` is the newest run of a benchmark (the file docs and the README cite);
``bench/results/NAME.history.jsonl`` holds the runs before it, oldest first, one JSON line each:
``{"commit": ..., "date": ..., "label": ..., "record": {...}}``. Saving a new result appends the
current one to the history and then replaces the current file (a temporary file renamed into
place), so no run is lost and no file is named by a commit.

    python bench/live_index.py ... --out bench/results/live_index_1m.json     # the benches with --out
    python bench/scaling.py | python bench/record.py bench/results/scaling_realbench.json
    python bench/record.py bench/results/NAME.json --label "busy core" < run.json

From stdin, the last line that parses as a JSON object is the record (the benches print it last).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.atomic import write_atomic  # noqa: E402

HISTORY_SUFFIX = ".history.jsonl"


def history_path(current: Path) -> Path:
    """``NAME.json`` -> ``NAME.history.jsonl`` beside it."""
    return current.with_name(current.stem + HISTORY_SUFFIX)


def head_commit() -> str:
    """The checkout's short commit, or ``"unknown"`` outside git."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def history_line(record: dict[str, Any], commit: str, date: str, label: str = "") -> str:
    """One history entry: the run's commit and date (from the record where it holds them), its label."""
    entry = {"commit": record.get("commit", commit), "date": record.get("date", date), "label": label, "record": record}
    return json.dumps(entry, sort_keys=True) + "\n"


def read_history(current: Path) -> list[dict[str, Any]]:
    """The earlier runs of the benchmark whose current result is ``current``, oldest first."""
    path = history_path(current)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def save_result(record: dict[str, Any], current: Path | str, label: str = "") -> Path:
    """Make ``record`` the current result at ``current``; the one it replaces (if any) is appended
    to the history first, labelled with its file's commit and modification date."""
    current = Path(current)
    current.parent.mkdir(parents=True, exist_ok=True)
    if current.is_file():
        previous = json.loads(current.read_text())
        when = datetime.fromtimestamp(current.stat().st_mtime, UTC).date().isoformat()
        with open(history_path(current), "a") as history:
            history.write(history_line(previous, commit="unknown", date=when, label=previous.get("label", "")))
    stamped = {**record, "commit": record.get("commit", head_commit())}
    stamped.setdefault("date", datetime.now(UTC).date().isoformat())
    if label:
        stamped["label"] = label
    write_atomic(current, lambda tmp: Path(tmp).write_text(json.dumps(stamped, indent=1) + "\n"))
    return current


def last_json_object(text: str) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object (a bench's record), or ValueError."""
    for line in reversed(text.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    raise ValueError("no JSON object on any line of the input")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("current", help="the benchmark's current result file, bench/results/NAME.json")
    parser.add_argument("--label", default="", help="a few words on what this run is (kept with it in the history)")
    args = parser.parse_args()
    try:
        record = last_json_object(sys.stdin.read())
    except ValueError as exc:
        sys.exit(f"bench/record.py: {exc}")
    print(save_result(record, args.current, args.label))


if __name__ == "__main__":
    main()
