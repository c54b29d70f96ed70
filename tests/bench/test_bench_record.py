"""bench/record.py: one current result per benchmark, the runs it replaced in its history file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bench import bench_module

ROOT = Path(__file__).resolve().parents[2]


record = bench_module("record")
history_path, last_json_object, read_history, save_result = (
    record.history_path,
    record.last_json_object,
    record.read_history,
    record.save_result,
)


def test_saving_keeps_the_replaced_run_in_the_history(tmp_path):
    current = tmp_path / "results" / "live_index_1m.json"
    save_result({"add_rate": 0.5, "commit": "aaaaaaa"}, current, label="first")
    assert read_history(current) == []
    save_result({"add_rate": 0.6}, current)
    assert json.loads(current.read_text())["add_rate"] == 0.6
    (earlier,) = read_history(current)
    assert earlier["commit"] == "aaaaaaa" and earlier["label"] == "first" and earlier["record"]["add_rate"] == 0.5
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", earlier["date"])
    assert history_path(current).name == "live_index_1m.history.jsonl"
    assert sorted(p.name for p in current.parent.iterdir()) == ["live_index_1m.history.jsonl", "live_index_1m.json"]


def test_the_record_is_the_last_json_object_printed():
    assert last_json_object('log line\n{"a": 1}\n[1, 2]\nnot json\n') == {"a": 1}
    with pytest.raises(ValueError, match="no JSON object"):
        last_json_object("nothing\n[1]\n")


def test_record_command_reads_the_bench_output_from_stdin(tmp_path):
    current = tmp_path / "scaling.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "record.py"), str(current), "--label", "a run"],
        input='progress...\n{"map": 0.41}\n',
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(current.read_text())["map"] == 0.41
    refused = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "record.py"), str(current)],
        input="oops\n",
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and "no JSON object" in refused.stderr
    assert json.loads(current.read_text())["map"] == 0.41  # nothing replaced


def test_results_hold_one_current_file_per_benchmark():
    """No result file named by a commit: earlier runs live in NAME.history.jsonl, each line with its
    commit, date and record."""
    results = ROOT / "bench" / "results"
    named_by_commit = [p.name for p in results.iterdir() if re.search(r"_[0-9a-f]{7}(_|\.)", p.name)]
    assert not named_by_commit
    for history in results.glob("*.history.jsonl"):
        assert (results / history.name.replace(".history.jsonl", ".json")).is_file(), history.name
        for line in history.read_text().splitlines():
            entry = json.loads(line)
            assert {"commit", "date", "label", "record"} <= entry.keys(), (history.name, entry.keys())
