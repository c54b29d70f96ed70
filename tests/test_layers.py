"""The architecture as a test: packages stand on floors, each imports only its own floor and those
below, and no two modules import each other (directly or round a longer loop).

Every import counts, also one inside a function: a lazy import still makes the importer depend on
the imported module."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The floors, lowest first: a package may import its own floor and the ones below it, never above.
FLOORS = [
    "core",
    "ingest",
    "embed",
    "index",
    "rerank",
    "query",
    "shards",
    "eval",
    "similarity",
    "webapi",
    "cluster",
    "cli",
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, package_modules: set[str]) -> set[str]:
    """The needle modules ``path`` imports (``from a.b import c`` counts as ``a.b.c`` where that is a
    module, else ``a.b``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in package_modules else node.module
                for alias in node.names
            ]
        else:
            continue
        found.update(name for name in names if name.split(".")[0] in FLOORS)
    return found


@functools.cache  # every import of the tree, parsed once for the tests that read it (none changes it)
def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for floor in FLOORS for p in (ROOT / floor).rglob("*.py")}
    return {name: _imports(path, set(files)) - {name} for name, path in files.items()}


def test_every_package_has_a_floor():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages <= set(FLOORS), f"packages without a floor in FLOORS: {sorted(packages - set(FLOORS))}"


def test_pyproject_installs_every_floor():
    text = (ROOT / "pyproject.toml").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("packages = "))
    assert ast.literal_eval(line.split("=", 1)[1].split("#")[0].strip()) == FLOORS


def test_ray_lives_only_in_cluster():
    """The other packages are plain libraries, usable and testable without a cluster."""
    users = sorted(
        f"{p.relative_to(ROOT)}"
        for floor in FLOORS
        if floor != "cluster"
        for p in (ROOT / floor).rglob("*.py")
        if any(
            isinstance(n, (ast.Import, ast.ImportFrom))
            and any((getattr(n, "module", None) or a.name).split(".")[0] == "ray" for a in n.names)
            for n in ast.walk(ast.parse(p.read_text()))
        )
    )
    assert not users, f"modules outside cluster/ importing ray: {users}"


def test_no_package_imports_one_above_it():
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in targets
        if FLOORS.index(target.split(".")[0]) > FLOORS.index(module.split(".")[0])
    )
    assert not upward, "upward imports (floors, lowest first: " + " < ".join(FLOORS) + "):\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


# The rooms inside a package and the rooms of the same package each may import besides its ground
# (the package's own top-level modules: ``index/*.py``, ``similarity/*.py``, ...; the floors below
# are open to every room as to any module of the package). The search core reads what the build
# and the living index write, so the ground itself may import the rooms.
ROOMS = {
    "index.build": {"index.gpu"},  # the offline build (trains and adds on a GPU where there is one)
    "index.live": {"index.build", "index.gpu"},  # the living index: a generation's segments are built
    "index.gpu": set(),  # the GPU engines
    "embed.locals": set(),  # the local-token extractors
    "ingest.pack": set(),  # needle pack: the stage and the record of what it packed
    "similarity.afn": set(),  # the four methods of the seed papers, each by itself
    "similarity.adaptors": set(),
    "similarity.ffa": set(),
    "similarity.twoafc": set(),
}


def _room(module: str) -> str | None:
    return next((room for room in ROOMS if module == room or module.startswith(room + ".")), None)


def test_every_room_is_declared():
    rooms = {
        _module_name(init.parent)
        for floor in FLOORS
        for init in (ROOT / floor).rglob("__init__.py")
        if init.parent.parent != ROOT
    }
    assert rooms == set(ROOMS), f"rooms on disk {sorted(rooms)}, declared in ROOMS {sorted(ROOMS)}"


def test_rooms_import_only_their_ground_and_declared_rooms():
    crossing = sorted(
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if (room := _room(module))
        for target in targets
        if (other := _room(target)) and other.split(".")[0] == room.split(".")[0]
        if other != room and other not in ROOMS[room]
    )
    assert not crossing, "imports between rooms not declared in ROOMS:\n" + "\n".join(crossing)


def test_no_module_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize(
    "module",
    [
        "core.errors",
        "core.atomic",
        "core.hashing",
        "core.checkpoint",
        "core.tokens",
        "embed.registry",
        "embed.locals.presets",
        "embed.pca",
        "index.build.stage",
        # the configs whose fields are the commands' flags (cli/flags.py): read for every --help
        "ingest.config",
        "embed",
        "index.build.config",
        "index.live.config",
        "query.config",
        "rerank.config",
        "eval.config",
        "cluster.demo",
        "eval.kmeans",
        "similarity.cli",
        "similarity.afn.cli",
        "similarity.adaptors.cli",
        "similarity.ffa.cli",
        "similarity.twoafc.cli",
        "similarity.twoafc.registry",
        "ingest.source_images",
        "shards.coordinator",  # the coordinator of shards stays small: its RSS is a target of issue 20
        "cluster.serve",
        "shards.shard_actor",
    ],
)
def test_light_modules_do_not_import_torch(module):
    code = f"import sys, {module}; sys.exit(1 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"importing {module} imports torch" + (
        result.stderr[-2000:] if result.returncode != 1 else ""
    )


def _ray_users() -> set[str]:
    """The modules that import ray themselves (at the top or inside a function)."""
    return {
        name
        for name, path in _modules().items()
        if any(
            isinstance(n, (ast.Import, ast.ImportFrom))
            and any((getattr(n, "module", None) or a.name).split(".")[0] == "ray" for a in n.names)
            for n in ast.walk(ast.parse(path.read_text()))
        )
    }


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for floor in FLOORS for p in (ROOT / floor).rglob("*.py")}


def test_cluster_holds_the_ray_layer_and_nothing_else():
    """Every module of cluster/ uses Ray, itself or through another cluster module: what runs
    without Ray lives in the floors below (shards/, webapi/, ...)."""
    graph, users = _graph(), _ray_users()
    reach = set(users)
    changed = True
    while changed:
        changed = False
        for module, targets in graph.items():
            if module.startswith("cluster.") and module not in reach and targets & reach:
                reach.add(module)
                changed = True
    plain = sorted(m for m in graph if m.startswith("cluster.") and m != "cluster" and m not in reach)
    assert not plain, f"cluster/ modules that do not use Ray (move them down a floor): {plain}"


MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_FOLDER_ENTRIES = 15  # modules and sub-folders of one product folder: more, and it wants rooms
MAX_SHARED_PREFIX = 3  # files of one folder whose names start alike (``build_*``): more, and they are a room


def _product_folders() -> list[Path]:
    return sorted(
        folder
        for floor in FLOORS
        for folder in [ROOT / floor, *(ROOT / floor).rglob("*")]
        if folder.is_dir() and folder.name != "__pycache__"
    )


def test_every_folder_reads_as_a_map():
    """The house reads as its map: no product folder holds more than MAX_FOLDER_ENTRIES modules
    and rooms, and no name prefix (the part before the first ``_``) is shared by more than
    MAX_SHARED_PREFIX modules of one folder: systems told apart only by prefixes get a room."""
    crowded, prefixed = [], []
    for folder in _product_folders():
        entries = [p for p in folder.iterdir() if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py")]
        if len(entries) > MAX_FOLDER_ENTRIES:
            crowded.append(f"{folder.relative_to(ROOT)}: {len(entries)} entries")
        prefixes: dict[str, list[str]] = {}
        for module in folder.glob("*.py"):
            if module.stem != "__init__":
                prefixes.setdefault(module.stem.split("_")[0], []).append(module.name)
        prefixed += [
            f"{folder.relative_to(ROOT)}: {sorted(names)}"
            for names in prefixes.values()
            if len(names) > MAX_SHARED_PREFIX
        ]
    assert not crowded and not prefixed, "\n".join(crowded + prefixed)


def test_no_product_file_or_function_too_long():
    """One job per file: no product file over MAX_FILE_LINES lines, no function over
    MAX_FUNCTION_LINES (a longer one holds several steps: name them)."""
    long_files, long_functions = [], []
    for name, path in sorted(_modules().items()):
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name} (line {node.lineno}): {length} lines")
    assert not long_files and not long_functions, "\n".join(long_files + long_functions)
