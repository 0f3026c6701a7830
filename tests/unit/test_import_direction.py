"""The import direction of the package: floors, imports only running down, no circles.

Every .py file under the folders pyproject.toml maps into the package (`autopar/`, `passes/`,
`runtime/`, `models/` -> autopar, autopar.passes, autopar.runtime, autopar.models) is parsed
with `ast`; every `import` / `from ... import` anywhere in it is an edge (module level, inside
functions, under `if TYPE_CHECKING:` alike: a lazy import is still a dependency, and deferring
one is how circles hide). Relative imports are resolved; `from pkg import name` is an edge to
`pkg.name` when that is a module, else to `pkg` (its __init__); `import a.b` is an edge to
`a.b` only (the parents a package import runs are not counted). Imports by computed name
(`importlib.import_module(f"...")`) are not seen.

Floors, bottom to top (a module may import its own floor and those below):

  models    autopar.models: reference models (imports no other autopar module)
  runtime   autopar.runtime: the engine
  passes    autopar.passes: IR, Plan, rewrites, rules
  cost      autopar.cost: what a graph costs
  search    autopar.search: graph + mesh + hardware -> Plan; never the runtime either (it reads
            the engine's vocabulary through cost/: cost.placements, cost.schedule, cost.fused)
  build     autopar.build: Plan + captured graph -> this rank's program
  api       the door: autopar/__init__.py, api.py and the small modules it needs (API_MODULES)
  tools     everything else at the top of autopar/ (TOOL_MODULES) and autopar/tools/

A new top-level module must be put in API_MODULES or TOOL_MODULES (the test says so). Edges
that run up today, outside search/ and cost/, are listed in KNOWN_UPWARD and circles in
KNOWN_CYCLES: the test asserts each set is exactly what it finds, so a new one fails, and so
does a fixed one left in the list. search/ and cost/ have none of either, and import no name
with a leading underscore from another module.
"""
from __future__ import annotations

import ast
import os
import tomllib
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]

FLOORS = ("models", "runtime", "passes", "cost", "search", "build", "api", "tools")
PREFIX_FLOORS = {  # package prefix -> floor
    "autopar.models": "models", "autopar.runtime": "runtime", "autopar.passes": "passes", "autopar.cost": "cost",
    "autopar.search": "search", "autopar.build": "build", "autopar.tools": "tools",
}
API_MODULES = {
    "autopar",  # the package's __init__: the public names
    "autopar.api", "autopar.capture", "autopar.capture_cache", "autopar.input_checks", "autopar.checkpoint_api",
}
TOOL_MODULES = {
    "autopar.__main__", "autopar.tools.cli", "autopar.tools.demo", "autopar.tools.tune", "autopar.tools.microbench", "autopar.tools.worker",
    "autopar.tools.launcher", "autopar.tools.verify", "autopar.tools.zoo_check", "autopar.tools.model_source", "autopar.tools.planning",
    "autopar.tools.plan_dump", "autopar.tools.plan_view", "autopar.tools.html_report",
}

# Edges that run up a floor today (importer, imported): none. (The plan's text moved to
# search/plan_text.py, the explanation's floor; the schedule's picture to build/gantt.py,
# drawn where the pipeline is built.) A new one fails the test.
KNOWN_UPWARD: set[tuple[str, str]] = set()

# Import circles today (strongly connected modules): none. (capture found the package's folder
# by importing the package, and checkpoint_api imported api for an isinstance check.)
KNOWN_CYCLES: set[frozenset] = set()


# ------------------------------------------------------------------------ the walk
def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """{folder: package} as pyproject.toml maps them."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {folder: pkg for pkg, folder in mapping.items()}


def module_files(root: Path, dirs: dict[str, str]) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package __init__) for every .py file under the mapped folders
    (each folder's subfolders are its subpackages; a mapped folder inside another, such as a
    nested package that pyproject maps elsewhere, is left to its own mapping)."""
    mapped = {(root / d).resolve() for d in dirs}
    out: dict[str, tuple[Path, bool]] = {}
    for folder, pkg in dirs.items():
        base = (root / folder).resolve()
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and (Path(dirpath) / d).resolve() not in mapped)
            for fn in sorted(filenames):
                if not fn.endswith(".py"):
                    continue
                parts = list(Path(dirpath, fn).relative_to(base).with_suffix("").parts)
                is_pkg = parts[-1] == "__init__"
                if is_pkg:
                    parts = parts[:-1]
                out[".".join([pkg, *parts])] = (Path(dirpath, fn), is_pkg)
    return out


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool, known) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for one import statement, within `known`."""
    out = []
    if isinstance(node, ast.Import):
        for a in node.names:
            out.append((a.name, []))
    else:
        if node.level:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            src = ".".join(base + ([node.module] if node.module else []))
        else:
            src = node.module or ""
        plain = []
        for a in node.names:
            if f"{src}.{a.name}" in known:
                out.append((f"{src}.{a.name}", []))
            else:
                plain.append(a.name)
        if plain or not node.names:
            out.append((src, plain))
    res = []
    for name, names in out:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            res.append((name, names))
    return res


def import_edges(root: Path = ROOT) -> tuple[dict[tuple[str, str], int], list[tuple[str, str, str, int]], set[str]]:
    """(edges {(importer, imported): first line}, private names imported from another module
    [(importer, imported, name, line)], every module)."""
    files = module_files(root, package_dirs(root))
    edges: dict[tuple[str, str], int] = {}
    private: list[tuple[str, str, str, int]] = []
    for module, (path, is_pkg) in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target, names in _targets(node, module, is_pkg, files):
                if target == module:
                    continue
                edges.setdefault((module, target), node.lineno)
                private += [(module, target, n, node.lineno) for n in names if n.startswith("_") and not n.startswith("__")]
    return edges, private, set(files)


def floor_of(module: str) -> str | None:
    for prefix, floor in PREFIX_FLOORS.items():
        if module == prefix or module.startswith(prefix + "."):
            return floor
    if module in API_MODULES:
        return "api"
    if module in TOOL_MODULES:
        return "tools"
    return None


def upward(edges) -> set[tuple[str, str]]:
    rank = {f: i for i, f in enumerate(FLOORS)}
    return {(a, b) for a, b in edges if rank[floor_of(a)] < rank[floor_of(b)]}


def cycles(edges) -> set[frozenset[str]]:
    g = nx.DiGraph(list(edges))
    return {frozenset(c) for c in nx.strongly_connected_components(g) if len(c) > 1}


def search_cost_violations(edges) -> set[tuple[str, str]]:
    """Edges from search/ or cost/ to a floor above theirs, and from search/ to the runtime."""
    above = {"cost": ("search", "build", "api", "tools"), "search": ("build", "api", "tools")}
    return {(a, b) for a, b in edges if floor_of(b) in above.get(floor_of(a), ())
            or (floor_of(a) == "search" and floor_of(b) == "runtime")}


def _floor_is(module: str, *floors: str) -> bool:
    return floor_of(module) in floors


def _show(pairs, edges) -> str:
    return "\n".join(f"  {a} -> {b} (line {edges[(a, b)]})" for a, b in sorted(pairs))


@pytest.fixture(scope="module")
def walked():
    return import_edges()


# ------------------------------------------------------------------------ the house
def test_every_module_of_the_package_has_a_floor(walked):
    _edges, _private, modules = walked
    lost = sorted(m for m in modules if floor_of(m) is None)
    assert not lost, (f"modules on no floor: {lost}; put each in API_MODULES or TOOL_MODULES of "
                      f"{Path(__file__).name} (or a floor's folder)")


def test_the_walk_sees_module_level_lazy_and_relative_imports(walked):
    edges, _private, modules = walked
    assert {"autopar.api", "autopar.search.planner", "autopar.runtime.schedules", "autopar.models.gpt"} <= modules
    assert ("autopar.search.planner", "autopar.search.plan_cost") in edges  # module level
    assert ("autopar.search.planner", "autopar.search.fusion") in edges  # inside a method
    assert ("autopar.cost.graph", "autopar.cost.ops") in edges  # `from . import ops`
    assert ("autopar.models.moe", "autopar.models.gpt") in edges  # `from .gpt import ...`
    assert ("autopar.passes.plan", "autopar.runtime.placement") in edges  # a mapped folder importing another


def test_no_import_runs_up_a_floor_beyond_the_known_ones(walked):
    edges, _private, _modules = walked
    found = upward(edges)
    new, fixed = found - KNOWN_UPWARD, KNOWN_UPWARD - found
    assert not new, "imports that run up a floor:\n" + _show(new, edges)
    assert not fixed, f"KNOWN_UPWARD lists edges that are gone (fixed? remove them): {sorted(fixed)}"


def test_search_and_cost_import_nothing_above_them_and_search_not_the_runtime(walked):
    edges, _private, _modules = walked
    assert not [e for e in KNOWN_UPWARD if _floor_is(e[0], "search", "cost")]
    bad = search_cost_violations(edges)
    assert not bad, "search/ or cost/ import up (or search imports the runtime):\n" + _show(bad, edges)


def test_no_import_circle_beyond_the_known_ones_and_none_in_search_or_cost(walked):
    edges, _private, _modules = walked
    found = cycles(edges)
    assert not [c for c in found if any(_floor_is(m, "search", "cost") for m in c)], \
        "import circles through search/ or cost/: " + "; ".join(" <-> ".join(sorted(c)) for c in found)
    new, fixed = found - KNOWN_CYCLES, KNOWN_CYCLES - found
    assert not new, "new import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in new)
    assert not fixed, f"KNOWN_CYCLES lists circles that are gone (fixed? remove them): {sorted(map(sorted, fixed))}"


def test_search_and_cost_import_no_private_name_from_another_module(walked):
    _edges, private, _modules = walked
    bad = [p for p in private if _floor_is(p[0], "search", "cost")]
    assert not bad, "private names imported across files (make them public where they live):\n" + "\n".join(
        f"  {a}:{line} takes {name} from {b}" for a, b, name, line in bad)


# ------------------------------------------------------------------------ the checker itself
def test_the_checker_finds_an_upward_import_a_lazy_circle_and_a_private_name(tmp_path, monkeypatch):
    """A made-up package with one import of each kind the rules forbid: each is found."""
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "autopar" = "autopar", '
                                             '"autopar.runtime" = "runtime" }\n')
    (tmp_path / "autopar" / "search").mkdir(parents=True)
    (tmp_path / "autopar" / "cost").mkdir()
    (tmp_path / "runtime").mkdir()
    for f in ("autopar/__init__.py", "autopar/search/__init__.py", "autopar/cost/__init__.py", "runtime/__init__.py",
              "autopar/api.py"):
        (tmp_path / f).write_text("")
    (tmp_path / "autopar" / "search" / "a.py").write_text("def f():\n    from autopar import api\n"
                                                           "    from .b import thing\n")
    (tmp_path / "autopar" / "search" / "b.py").write_text("from autopar.search.a import f, _helper\n"
                                                           "from autopar.runtime import sched\n")
    (tmp_path / "runtime" / "sched.py").write_text("import os\n")
    edges, private, modules = import_edges(tmp_path)
    assert modules == {"autopar", "autopar.api", "autopar.search", "autopar.search.a", "autopar.search.b",
                       "autopar.cost", "autopar.runtime", "autopar.runtime.sched"}
    assert upward(edges) == {("autopar.search.a", "autopar.api")}
    assert cycles(edges) == {frozenset({"autopar.search.a", "autopar.search.b"})}
    assert [(a, b, n) for a, b, n, _line in private] == [("autopar.search.b", "autopar.search.a", "_helper")]
    assert search_cost_violations(edges) == {("autopar.search.a", "autopar.api"),
                                             ("autopar.search.b", "autopar.runtime.sched")}
