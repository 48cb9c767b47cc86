"""fx2xla's modules import one way (docs/design.md): runtime < base < sharding < passes <
frontend, each layer importing only the layers below it and itself, with no circle among modules
(imports inside functions count; importing a.b.c runs a and a.b too). `fx2xla.runtime` and
`fx2xla.passes` are read from their folders (runtime/, passes/). No module, bench or test reads
another module's private names (`_name`; dunders are public), its own package's included: neither
imports one nor reads one off a project module it imported (torch's and jax's are theirs)."""
from __future__ import annotations

import ast
import textwrap
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


# Tests and bench scripts: no private name of a project module (fx2xla's, a bench script's, a
# test module's), imported or read. A name bound to a project module anywhere in a file counts
# everywhere in it; programs a test holds as strings (run in subprocesses) are read too.
SCRIPTS = sorted(p for folder in ("tests", "bench") for p in (ROOT / folder).rglob("*.py")
                 if p != Path(__file__).resolve())  # this file's own sample offends on purpose
READERS = {"getattr", "setattr", "hasattr", "delattr"}  # also as methods: monkeypatch.setattr, mock.patch.object


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_of(name: str) -> str | None:
    """The project module `name` is (fx2xla.x, tests.x, or a bench script or conftest imported
    by its name alone), or None."""
    if name in MODULES:
        return name
    if "." not in name and (ROOT / "bench" / f"{name}.py").is_file():
        return f"bench.{name}"
    if name == "conftest":
        return "tests.conftest"
    parts = name.split(".")
    if parts[0] == "tests" and all(p.isidentifier() for p in parts) and (
            ROOT.joinpath(*parts).with_suffix(".py").is_file() or ROOT.joinpath(*parts, "__init__.py").is_file()
            or ROOT.joinpath(*parts).is_dir()):
        return name
    return None


def _shadowed() -> set[str]:
    """Submodules whose package binds their name to something else (`fx2xla.scan` is the function)."""
    out = set()
    for name in MODULES:
        if not _is_package(name):
            continue
        for node in ast.walk(ast.parse(MODULES[name].read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                out |= {f"{name}.{a.asname or a.name}" for a in node.names} & set(MODULES)
    return out


SHADOWED = _shadowed()


def _imported(call: ast.AST) -> str | None:
    """The module `importlib.import_module("fx2xla.x")` or `__import__("fx2xla")` names, or None."""
    if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Constant):
        func = call.func
        called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if called in ("import_module", "__import__") and isinstance(call.args[0].value, str):
            name = call.args[0].value
            return _module_of(name if called == "import_module" else name.split(".")[0])
    return None


def _bound_modules(tree: ast.AST) -> dict[str, str]:
    """Local name -> project module, for every import in the file binding a module (any scope)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _imported(node.value):
            bound.update({t.id: _imported(node.value) for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    if _module_of(alias.name):
                        bound[alias.asname] = _module_of(alias.name)
                else:
                    top = alias.name.split(".")[0]
                    if _module_of(top):
                        bound[top] = _module_of(top)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                sub = _module_of(f"{node.module}.{alias.name}")
                if sub and sub not in SHADOWED:
                    bound[alias.asname or alias.name] = sub
    return bound


def _resolve(expr: ast.AST, bound: dict[str, str]) -> str | None:
    """The project module an expression (`ex`, `fx2xla.runtime.executor`) names, or None."""
    if isinstance(expr, ast.Name):
        return bound.get(expr.id)
    if isinstance(expr, ast.Attribute):
        owner = _resolve(expr.value, bound)
        sub = _module_of(f"{owner}.{expr.attr}") if owner else None
        return sub if sub not in SHADOWED else None
    return _imported(expr)


def _scripts(tree: ast.AST):
    """(line, tree) of the Python programs a file holds as strings (run in subprocesses)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "fx2xla" in node.value \
                and "import" in node.value:
            try:
                yield node.lineno, ast.parse(textwrap.dedent(node.value))
            except SyntaxError:  # prose, not a program
                continue


def private_reads(path: Path) -> list[str]:
    """Where the file at `path` (or a program it holds as a string) imports or reads a private
    name of a project module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT)
    found = []
    for start, script in _scripts(tree):
        found += [f"{f} (in a program held as a string)" for f in _reads(script, rel, start - 1)]
    return found + _reads(tree, rel)


def _reads(tree: ast.AST, rel: Path, offset: int = 0) -> list[str]:
    bound = _bound_modules(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            top = node.module.split(".")[0]
            if _module_of(node.module) or _module_of(top):
                found += [f"{rel}:{node.lineno + offset} imports {a.name} from {node.module}"
                          for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            owner = _resolve(node.value, bound)
            if owner:
                found.append(f"{rel}:{node.lineno + offset} reads {owner}.{node.attr}")
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            first, second = node.args[0], node.args[1] if len(node.args) > 1 else None
            if called in READERS or called == "object":
                owner = _resolve(first, bound)
                if owner and isinstance(second, ast.Constant) and isinstance(second.value, str) and _private(second.value):
                    found.append(f"{rel}:{node.lineno + offset} {called}s {owner}.{second.value}")
            if called in ("setattr", "delattr", "patch") and isinstance(first, ast.Constant) and isinstance(first.value, str):
                target, _, attr = first.value.rpartition(".")  # monkeypatch.setattr("fx2xla.x._y", v)
                if _module_of(target) and _private(attr):
                    found.append(f"{rel}:{node.lineno + offset} {called}s {target}.{attr}")
    return found


def test_the_private_name_check_sees_every_form():
    source = textwrap.dedent("""
        import importlib
        import torch
        import fx2xla
        import fx2xla.runtime.executor as ex
        from fx2xla import compiled_graph, scan
        from fx2xla.serving import _as_call as call, warmup
        from harness import _materialise

        scan_module = importlib.import_module("fx2xla.scan")

        def test(monkeypatch, t):
            ex._a, fx2xla.runtime.handoff._b, compiled_graph._c, scan_module._d
            monkeypatch.setattr(ex, "_e", None)
            monkeypatch.setattr("fx2xla.offload._f", None)
            getattr(fx2xla.plan, "_g")
            # not private, or not a project module's:
            fx2xla.__version__, ex.disk_cache, torch._dynamo, t._version, warmup._x, scan._y, compiled_graph.A._z
            monkeypatch.setattr(torch, "_h", None)
            monkeypatch.setattr(ex, "__doc__", None)
        """)
    found = [f.split(" ", 1)[1] for f in _reads(ast.parse(source), Path("x.py"))]
    assert sorted(found) == sorted([
        "imports _as_call from fx2xla.serving", "imports _materialise from harness",
        "reads fx2xla.runtime.executor._a", "reads fx2xla.runtime.handoff._b", "reads fx2xla.compiled_graph._c",
        "reads fx2xla.scan._d", "setattrs fx2xla.runtime.executor._e", "setattrs fx2xla.offload._f",
        "getattrs fx2xla.plan._g"])


def test_no_test_or_bench_reads_private_names():
    found = [f for path in SCRIPTS for f in private_reads(path)]
    assert not found, "\n".join(found)
