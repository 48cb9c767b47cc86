"""fx2xla's modules import one way (docs/design.md): runtime < base < sharding < passes <
frontend, each layer importing only the layers below it and itself, with no circle among modules
(imports inside functions count; importing a.b.c runs a and a.b too). `fx2xla.runtime` and
`fx2xla.passes` are read from their folders (runtime/, passes/). No module reads another
module's private names (`_name`), its own package's included."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"fx2xla": ROOT / "fx2xla", "fx2xla.runtime": ROOT / "runtime", "fx2xla.passes": ROOT / "passes"}
BASE = {"fx2xla.errors", "fx2xla.metrics", "fx2xla.dump", "fx2xla.version", "fx2xla.layouts", "fx2xla.lowering.dtypes"}
LAYERS = ("runtime", "base", "sharding", "passes", "frontend")  # lowest first


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "fx2xla" and parts and parts[0] in ("runtime", "passes"):
                continue
            found[name] = path
    return found


MODULES = modules()


def layer(name: str) -> str:
    if name.startswith("fx2xla.runtime"):
        return "runtime"
    if name in BASE:
        return "base"
    if name == "fx2xla.sharding" or name.startswith("fx2xla.sharding."):
        return "sharding"
    if name.startswith("fx2xla.passes"):
        return "passes"
    return "frontend"


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str):
    """(imported module, imported names, line) for each import of a project module in `name`."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fx2xla"):
                    yield alias.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("fx2xla"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:
                    yield sub, (), node.lineno
                else:
                    yield target, (alias.name,), node.lineno


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def edges() -> dict[str, set[str]]:
    """Module -> the modules importing it runs: the target and its packages, less the
    importer's own packages (already being imported when it runs)."""
    out = {}
    for name in MODULES:
        own = set(_ancestors(name))
        targets = set()
        for target, _, _ in _imports(name):
            for m in [*_ancestors(target), target]:
                if m in MODULES and m != name and m not in own:
                    targets.add(m)
        out[name] = targets
    return out


def test_the_folders_are_read():
    assert "fx2xla.runtime.executor" in MODULES and "fx2xla.passes.auto_sharding" in MODULES
    assert "fx2xla.compiled_graph" in MODULES and "fx2xla.sharding.report" in MODULES


def test_imports_follow_the_layers():
    against = []
    for name in MODULES:
        for target, _, line in _imports(name):
            if target in MODULES and LAYERS.index(layer(target)) > LAYERS.index(layer(name)):
                against.append(f"{name}:{line} ({layer(name)}) imports {target} ({layer(target)})")
    assert not against, "\n".join(against)


def test_no_circles():
    graph = edges()
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    detail = [f"{sorted(c)}: " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c)
              for c in cycles]
    assert not cycles, "\n".join(detail)


def test_no_private_names_cross_modules():
    crossing = []
    for name in MODULES:
        for target, names, line in _imports(name):
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    crossing.append(f"{name}:{line} takes {n} from {target}")
    assert not crossing, "\n".join(crossing)
