"""Imports go one way (docs/ARCHITECTURE.md "Layers"): no module imports a higher layer.

Every import counts -- module level, inside a function, under TYPE_CHECKING, relative -- because a lazy import is
still a dependency. A new top-level module or package must be given a layer here (the test says so)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first; a unit is `longspec.<name>` (module or subpackage) or the whole `data_prep` package.
LAYERS: list[set[str]] = [
    {"longspec.kernels"},
    {"longspec.modules"},
    {
        "longspec.target",
        "longspec.target_source",
        "longspec.drafter",
        "longspec.positions",
        "longspec.losses",
        "longspec.fingerprint",
        "longspec.config",  # the shared TargetConfig resolves targets through target_source
    },
    {"longspec.data"},
    {"longspec.train", "longspec.infer"},
    {
        "longspec.eval",
        "longspec.export",
        "longspec.convert_gguf",
        "data_prep",
    },  # data_prep reads eval.datasets
    {"longspec.pipeline"},
]
# Importable from any layer; each may itself import only up to the layer given (-1: nothing of longspec).
CROSS_CUTTING = {
    "longspec": -1,  # the package __init__
    "longspec.atomic": -1,  # temp + fsync + rename writes: data manifests, checkpoints, eval results
    "longspec.cli": -1,
    "longspec.lifetime": -1,  # run locks and dying with the launcher: trainer, data_prep, pipeline
    "longspec.ownership": 0,  # output markers: delete only what longspec wrote (imports longspec.atomic alone)
    "longspec.provenance": -1,
    "longspec.testing": 2,  # builds tiny random targets and drafters for tests and the demo
}
LEVEL = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    parts = module.split(".")
    return "data_prep" if parts[0] == "data_prep" else ".".join(parts[:2])


def imports_of(path: Path, module: str, *, with_names: bool = False) -> list[tuple[str, int]]:
    """(imported module, line) for every longspec / data_prep import in the file, relative ones resolved;
    `with_names`: each name of a `from ... import` too, as `module.name` (it may be a submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names = [".".join([*base, node.module] if node.module else base)]
            else:
                names = [node.module]
            if names[0] in ("longspec", "data_prep"):  # `from longspec import train`: the names are modules
                # (a dunder such as __version__ is the package's own attribute)
                names = [names[0] if a.name.startswith("__") else f"{names[0]}.{a.name}" for a in node.names]
            elif with_names:  # `from longspec.infer import policy`: a name may be a submodule
                names += [f"{names[0]}.{a.name}" for a in node.names if a.name != "*"]
        else:
            continue
        found += [(n, node.lineno) for n in names if n.split(".")[0] in ("longspec", "data_prep")]
    return found


def modules_under(root: Path, package: str) -> list[tuple[Path, str]]:
    out = []
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out.append((path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)))
    return out


def violations(root: Path, packages=("longspec", "data_prep")) -> list[str]:
    problems = []
    for package in packages:
        for path, module in modules_under(root, package):
            here = unit_of(module)
            if here not in LEVEL and here not in CROSS_CUTTING:
                problems.append(f"{module}: {here} has no layer in tests/test_layers.py")
                continue
            ceiling = CROSS_CUTTING.get(here, LEVEL.get(here))
            for imported, line in imports_of(path, module):
                there = unit_of(imported)
                if there == here or (there in CROSS_CUTTING and here not in CROSS_CUTTING):
                    continue
                level = CROSS_CUTTING[there] + 1 if there in CROSS_CUTTING else LEVEL.get(there)
                if level is None:
                    problems.append(
                        f"{path.relative_to(root)}:{line}: imports {imported}, which has no layer"
                    )
                elif level > ceiling:
                    problems.append(
                        f"{path.relative_to(root)}:{line}: {here} imports {imported} (a higher layer)"
                    )
    return problems


def test_no_module_imports_a_higher_layer():
    assert violations(ROOT) == []


def test_every_layer_unit_exists():
    """The table names real modules."""
    for unit in [*LEVEL, *CROSS_CUTTING]:
        if unit == "longspec":
            continue
        rel = Path(*unit.split("."))
        assert (ROOT / rel).is_dir() or (ROOT / rel).with_suffix(".py").is_file(), unit


@pytest.mark.parametrize(
    ("where", "source"),
    [
        ("longspec/modules/attention.py", "from longspec.train import trainer\n"),
        ("longspec/modules/attention.py", "def f():\n    import longspec.infer.engine\n"),
        ("longspec/modules/attention.py", "from ..eval import report\n"),
        ("longspec/modules/attention.py", "from longspec import eval\n"),
        ("longspec/modules/rope.py", "if TYPE_CHECKING:\n    from longspec.drafter import Drafter\n"),
        ("longspec/train/model.py", "from longspec.pipeline import run_pipeline\n"),
        ("longspec/cli.py", "from longspec.target import TargetModel\n"),
        ("longspec/data/loader.py", "import data_prep.stage1\n"),
        ("longspec/newthing.py", "import os\n"),
    ],
)
def test_an_upward_import_is_caught(tmp_path, where, source):
    """The checker itself: module-level, function-level and relative upward imports, a cross-cutting module
    importing a layer, and a module without a layer all fail."""
    for package in ("longspec", "data_prep"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    path = tmp_path / where
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "__init__.py").touch()
    path.write_text(source)
    assert len(violations(tmp_path)) == 1, violations(tmp_path)


def test_a_downward_import_passes(tmp_path):
    (tmp_path / "longspec" / "eval").mkdir(parents=True)
    (tmp_path / "data_prep").mkdir()
    for package in ("longspec", "longspec/eval", "data_prep"):
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "longspec" / "eval" / "report.py").write_text(
        "from longspec.cli import run_cli\nfrom ..infer import engine\n\ndef f():\n    from longspec import drafter\n"
    )
    (tmp_path / "data_prep" / "stage1.py").write_text("from longspec.eval.datasets import encode_row\n")
    assert violations(tmp_path) == []


def import_graph(root: Path, packages=("longspec", "data_prep")) -> dict[str, set[str]]:
    """module -> the modules it imports (every import, as `imports_of` finds them), each resolved to the longest
    module name it starts with (`from longspec.infer.policy import AdaptivePolicy`: longspec.infer.policy)."""
    modules = {module: path for package in packages for path, module in modules_under(root, package)}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        graph[module] = set()
        for imported, _ in imports_of(path, module, with_names=True):
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != module:
                graph[module].add(".".join(parts))
    return graph


def import_cycles(root: Path, packages=("longspec", "data_prep")) -> list[str]:
    """Each import cycle, as one line: the modules of a strongly connected component of the import graph and the
    imports between them (Tarjan's algorithm)."""
    graph = import_graph(root, packages)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(start: str) -> None:
        # iterative DFS: (node, iterator over its imports)
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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

    for module in sorted(graph):
        if module not in index:
            visit(module)
    lines = []
    for component in sorted(components):
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component]
        lines.append(f"import cycle among {', '.join(component)}: {'; '.join(edges)}")
    return lines


def test_no_import_cycle():
    """No two modules import each other, directly or through others, however lazily (function-level and
    TYPE_CHECKING imports count: a cycle hidden there is still two modules that need each other)."""
    cycles = import_cycles(ROOT)
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize(
    "sources",
    [
        {
            "longspec/infer/a.py": "from longspec.infer import b\n",
            "longspec/infer/b.py": "import longspec.infer.a\n",
        },
        {
            "longspec/infer/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from longspec.infer.c import X\n",
            "longspec/infer/b.py": "from longspec.infer.a import Y\n",
            "longspec/infer/c.py": "def f():\n    from .b import Z\n",
        },
    ],
    ids=["direct", "type-checking-and-function-level"],
)
def test_an_import_cycle_is_caught(tmp_path, sources):
    for package in ("longspec", "longspec/infer", "data_prep"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    for where, source in sources.items():
        (tmp_path / where).write_text(source)
    cycles = import_cycles(tmp_path)
    assert len(cycles) == 1 and all(m.replace("/", ".")[:-3] in cycles[0] for m in sources), cycles
    (tmp_path / "longspec/infer/b.py").write_text("")  # the cycle broken
    assert import_cycles(tmp_path) == []
