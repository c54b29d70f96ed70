"""The README as a test: every command in its ```bash blocks is exercised, and the reference it
links to resolves.

- `make demo` and `make test` must be its first two commands (tests/cluster/test_demo.py runs the demo, CI
  runs `make test`).
- The user path (pack -> ingest -> index build -> query -> serve + curl -> eval map) runs for real,
  the README's own command lines through bash in a temporary directory holding `photos/`,
  `query.jpg` and the README's `gt.json` (only the server's port is changed, to a free one).
- The cluster commands (`ray start`, `ray job submit`, `needle ingest --submit`, `s3://`) are checked
  by parsing: `needle <command> --help` (or `ray <command> --help`) lists every flag they use. So are
  the `needle` commands of the docs/ pages, in code blocks and inline.
- Every relative link of the README and docs/ resolves (anchors too); every repository path cited
  in backticks exists; the README stays within 250 lines.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 250
PACKAGES = ("core", "ingest", "embed", "index", "rerank", "query", "shards", "eval", "similarity", "service")
REPO_DIRS = (*PACKAGES, "cluster", "cli", "bench", "tests", "docs")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
# Commands that need a Ray cluster or S3: checked by parsing their flags, never run here.
CLUSTER_MARKERS = ("s3://", "HEAD_IP", "--submit")


# ---------------------------------------------------------------------------------------------------
# Reading the Markdown


def fenced_blocks(text: str, language: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(text) if m.group(1) == language]


def without_fences(text: str) -> str:
    return FENCE.sub("", text)


def block_commands(block: str) -> list[str]:
    """The command lines of a bash block: continuation lines joined, comment-only lines dropped."""
    commands, current = [], ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip() and not current.strip().startswith("#"):
            commands.append(current.strip())
        current = ""
    return commands


def readme_commands() -> list[str]:
    return [c for block in fenced_blocks(README.read_text(), "bash") for c in block_commands(block)]


def words(command: str) -> list[str]:
    """The words of one simple command: comments dropped, `VAR=value` prefixes dropped, cut at the
    first `&`, `&&`, `|` or `;`."""
    tokens = shlex.split(command, comments=True)
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):
        tokens.pop(0)
    for i, token in enumerate(tokens):
        if token in ("&", "&&", "|", "||", ";"):
            return tokens[:i]
    return tokens


def kind_of(command: str) -> str:
    """`make`, `cluster` (parsed only), `local` (run by the user-path test) or `unknown`."""
    tokens = words(command)
    if not tokens:
        return "unknown"
    if tokens[0] == "make":
        return "make"
    if tokens[0] == "ray" or any(marker in command for marker in CLUSTER_MARKERS):
        return "cluster"
    if tokens[0] in ("needle", "curl"):
        return "local"
    return "unknown"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", without_fences(path.read_text()), re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


# ---------------------------------------------------------------------------------------------------
# Flags a command accepts, from its --help


@functools.cache
def needle_parser():
    from cli.main import build_parser

    return build_parser()


def _subparsers(parser) -> dict:
    """The sub-commands an argparse parser offers, by name."""
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def needle_flags(words_after_needle: list[str]) -> tuple[tuple[str, ...], set[str], set[str]]:
    """(the subcommand path, the flags used, the flags `needle <path> --help` lists) of `needle ...`."""
    parser, path = needle_parser(), ()
    rest = list(words_after_needle)
    while rest and rest[0] in _subparsers(parser):
        parser = _subparsers(parser)[rest[0]]
        path += (rest.pop(0),)
    used = {w.split("=", 1)[0] for w in rest if w.startswith("--") and len(w) > 2}
    known = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    return path, used, known


def ray_flags(path: tuple[str, ...]) -> set[str]:
    """The flags `ray <path> --help` lists (Ray's click commands)."""
    from ray.scripts.scripts import cli

    command = cli
    for name in path:
        command = command.commands[name]
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")} | {"--help"}


def check_command_flags(command: str) -> list[str]:
    """Problems with one command's flags (empty: every flag exists)."""
    tokens = words(command)
    problems = []
    if tokens[0] == "ray":
        needle_part = []
        if "--" in tokens:  # ray job submit [...] -- needle ...
            cut = tokens.index("--")
            tokens, needle_part = tokens[:cut], tokens[cut + 1 :]
        path = tuple(t for t in tokens[1:3] if not t.startswith("-"))
        known = ray_flags(path)
        used = {t.split("=", 1)[0] for t in tokens if t.startswith("--")}
        problems += [f"ray {' '.join(path)}: no flag {f}" for f in sorted(used - known)]
        tokens = needle_part
    if tokens and tokens[0] == "needle":
        path, used, known = needle_flags(tokens[1:])
        assert path, f"no needle subcommand in {command!r}"
        problems += [f"needle {' '.join(path)}: no flag {f}" for f in sorted(used - known)]
    return problems


# ---------------------------------------------------------------------------------------------------
# Fast checks


def test_readme_is_short_and_starts_with_make_demo_and_make_test():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    commands = readme_commands()
    assert [words(c) for c in commands[:2]] == [["make", "demo"], ["make", "test"]]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    # the make block comes first, right after the opening paragraph
    assert README.read_text().index("```bash\nmake demo") < README.read_text().index("\n## ")


def test_every_readme_command_is_exercised():
    """Each command is either one of the two make targets, part of the user path that
    test_readme_user_path_runs runs, or a cluster command whose flags are checked."""
    commands = readme_commands()
    kinds = {c: kind_of(c) for c in commands}
    assert [c for c in commands if kinds[c] == "make"] == commands[:2]
    unknown = [c for c, k in kinds.items() if k == "unknown"]
    assert not unknown, f"README commands no test exercises: {unknown}"
    local = [tuple(words(c)[:3]) for c in commands if kinds[c] == "local"]
    steps = {"pack", "ingest", "index", "query", "serve", "eval"}
    assert steps <= {w[1] for w in local if w[0] == "needle"}, local
    assert any(w[0] == "curl" for w in local)
    cluster = [c for c in commands if kinds[c] == "cluster"]
    assert any(words(c)[:3] == ["ray", "job", "submit"] for c in cluster)
    assert any("--submit" in words(c) for c in cluster)


def test_readme_and_docs_commands_use_existing_flags():
    problems = []
    for path in [README, *DOCS]:
        for block in fenced_blocks(path.read_text(), "bash"):
            for command in block_commands(block):
                tokens = words(command)
                if tokens and (tokens[0] in ("needle", "ray")):
                    problems += [f"{path.name}: {p}" for p in check_command_flags(command)]
    assert not problems, "\n".join(problems)


def test_inline_needle_commands_use_existing_flags():
    """`needle <command> --flag ...` in backticks, in the README and docs/ prose and tables."""
    problems = []
    for path in [README, *DOCS]:
        for span in re.findall(r"`([^`]+)`", without_fences(path.read_text())):
            span = " ".join(span.split())
            if not span.startswith("needle "):
                continue
            head = re.match(r"needle((?: [a-z0-9][a-z0-9-]*)*)", span).group(1).split()
            path_, _, known = needle_flags(head)
            used = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", span))
            problems += [f"{path.name}: `{span}`: needle {' '.join(path_)} has no {f}" for f in sorted(used - known)]
    assert not problems, "\n".join(problems)


def test_links_resolve():
    problems = []
    for path in [README, *DOCS]:
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", without_fences(path.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{path.name}: {target}: no {dest}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{path.name}: {target}: no heading #{anchor} in {dest.name}")
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {Path(t.partition("#")[0]).name for t in re.findall(r"\]\((docs/[^)\s]+)\)", README.read_text())}
    assert {p.name for p in DOCS} <= linked


def test_cited_repository_paths_exist():
    """Paths such as `shards/coordinator.py` or `bench/results/` cited in backticks exist."""
    pattern = re.compile(rf"^(?:{'|'.join(REPO_DIRS)})/[\w./*-]*$")
    missing = []
    for path in [README, *DOCS]:
        for span in re.findall(r"`([^`]+)`", without_fences(path.read_text())):
            for token in span.split():
                token = token.strip(",;:()")
                if pattern.match(token) and not glob.glob(str(ROOT / token.rstrip("/"))):
                    missing.append(f"{path.name}: {token}")
    assert not missing, "\n".join(missing)


# ---------------------------------------------------------------------------------------------------
# The user path, for real


def _write_photos(root: Path) -> None:
    """`photos/cats/chelsea_1.jpg` and a crop of it, `chelsea_2.jpg` (the README's keys), five other
    scikit-image photos, and `query.jpg`: a mirrored crop of the cat."""
    import numpy as np
    from PIL import Image

    from ingest.demo_data import load_skimage_photo

    def save(image, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.ascontiguousarray(image)).save(path, quality=90)

    cat = load_skimage_photo("chelsea")
    h, w = cat.shape[:2]
    save(cat, root / "photos" / "cats" / "chelsea_1.jpg")
    save(cat[h // 10 :, w // 10 :], root / "photos" / "cats" / "chelsea_2.jpg")
    for name in ("astronaut", "coffee", "rocket", "camera", "coins"):
        save(load_skimage_photo(name), root / "photos" / "other" / f"{name}.jpg")
    save(cat[: h * 9 // 10, ::-1], root / "query.jpg")


def _wait_for_health(server: subprocess.Popen, port: int, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"needle serve exited {server.returncode}: {log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"needle serve did not answer /health in {timeout} s: {log.read_text()[-3000:]}")


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.kill(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


@pytest.mark.ray
@pytest.mark.slow
def test_readme_user_path_runs(tmp_path):
    assert shutil.which("curl"), "the README's serve example uses curl"
    _write_photos(tmp_path)
    (gt,) = fenced_blocks(README.read_text(), "json")  # the README's gt.json, as it is
    (tmp_path / "gt.json").write_text(gt)
    truth = json.loads(gt)["queries"][0]

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # ingest starts its own local Ray
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the venv's `needle`
    assert shutil.which("needle", path=env["PATH"]), "no needle command beside this Python"
    env.setdefault("HF_HUB_OFFLINE", "1")

    commands = [c for c in readme_commands() if kind_of(c) == "local"]
    ran: list[str] = []
    server: subprocess.Popen | None = None
    log = tmp_path / "serve.log"
    try:
        for command in commands:
            tokens = words(command)
            step = tokens[1] if tokens[0] == "needle" else tokens[0]
            if step in ("serve", "curl") or "--wait-for" in tokens:
                command = re.sub(r"\b8000\b", str(port), command)
            if step == "serve":
                with log.open("w") as out:  # exec: the server is the process whose PID we hold
                    server = subprocess.Popen(
                        ["bash", "-c", f"exec {command}"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT
                    )
                _wait_for_health(server, port, log)
                ran.append(step)
                continue
            run = subprocess.run(
                ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
            )
            assert run.returncode == 0, f"{command}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
            ran.append(step)
            if step == "pack":
                assert (tmp_path / "tars" / "000000.tar").exists()
                assert json.loads((tmp_path / "tars" / "pack_info.json").read_text())["images"] == 7
            elif step == "ingest":
                assert sorted(p.name for p in (tmp_path / "desc").glob("*.parquet")) == ["000000.parquet"]
            elif step == "index" and tokens[2] == "build":
                assert json.loads((tmp_path / "idx" / "index_infos.json").read_text())
            elif step == "index" and tokens[2] == "delete":  # visible on the server when it returns
                assert json.loads(run.stdout)["deleted"] == 1
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as answer:
                    assert json.loads(answer.read())["generation"] == json.loads(run.stdout)["generation"]
            elif step == "query":
                results = json.loads(run.stdout)["results"]
                assert results[0]["key"] in (truth["key"], *truth["positives"]), results
            elif step == "curl":
                (answer,) = json.loads(run.stdout)
                assert answer["results"][0]["key"] in (truth["key"], *truth["positives"]), answer
            elif step == "eval":
                out = tokens[tokens.index("--out") + 1]
                report = json.loads((tmp_path / out).read_text())
                assert report["n_queries"] == 1
                assert report["map_at_1000"] == pytest.approx(100.0)  # the crop is found first
    finally:
        if server is not None:
            _stop(server)
    assert server is not None and server.returncode is not None
    assert {"pack", "ingest", "index", "query", "serve", "curl", "eval"} <= set(ran), ran
