"""A script of bench/ loaded by its path, for the tests of its pure functions: bench/ never joins
sys.path, where its rerank.py would hide the rerank package from every later import."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    """bench/NAME.py as a module named ``bench_NAME``."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no bench script {BENCH / name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while the class is made
    spec.loader.exec_module(module)
    return module


def dry_run(script: str, *args: str, timeout: float = 600) -> list[dict]:
    """The JSON lines ``bench/SCRIPT --dry-run ARGS`` prints, run as a user runs it (it must exit 0)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(BENCH.parent)}
    done = subprocess.run(
        [sys.executable, f"bench/{script}", "--dry-run", *args], cwd=BENCH.parent, env=env, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()]
