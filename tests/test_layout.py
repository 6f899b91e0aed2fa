"""The layout's rules, read from the source with `ast` (nothing is imported): no import cycle among
kvjax's modules (counting imports inside functions, which only defer a cycle), the core never
imports the models, kvjax/ never imports experiments/ or tests/, kvjax/config/ reaches nothing above
it, and no module is over 500 lines (STYLE.md: about 500; one concept per file)."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"kvjax": "kvjax", "models": "kvjax.models", "experiments": "kvjax.experiments"}
CORE = ("kvjax.core", "kvjax.attention", "kvjax.worker", "kvjax.kv_offload")


def _modules() -> dict[str, str]:
    """module name → file, with models/ and experiments/ under their installed names."""
    out = {}
    for folder, package in FOLDERS.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, folder))[:-3]
                    parts = [package] + [p for p in rel.split(os.sep) if p != "__init__"]
                    out[".".join(parts)] = os.path.join(dirpath, f)
    return out


def _imports(path: str, modules) -> set[str]:
    """The kvjax modules a file imports anywhere in it (`from pkg import name` counts pkg.name when
    that is a module, else pkg)."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = {f"{node.module}.{a.name}" for a in node.names}
            found |= names & set(modules) or {node.module}
    return {m for m in found if m in modules}


def _graph():
    modules = _modules()
    return modules, {m: _imports(p, modules) - {m} for m, p in modules.items()}


def test_no_import_cycle():
    _, graph = _graph()
    # A package's __init__ importing its own submodules is not a cycle through them.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    done, cycles = set(), []

    def visit(m, path):
        if m in path:
            cycles.append(path[path.index(m):] + [m])
            return
        if m in done:
            return
        for d in sorted(graph[m]):
            visit(d, path + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
    assert cycles == [], cycles[:5]


def test_the_core_never_imports_the_models_and_kvjax_never_imports_experiments():
    _, graph = _graph()
    for m, deps in graph.items():
        if m.startswith(CORE):
            assert not {d for d in deps if d.startswith("kvjax.models")}, (m, deps)
        if not m.startswith("kvjax.experiments"):
            assert not {d for d in deps if d.startswith("kvjax.experiments")}, (m, deps)


def test_no_module_is_over_500_lines():
    modules, _ = _graph()
    long = {m: n for m, p in modules.items() if (n := sum(1 for _ in open(p, encoding="utf-8"))) > 500}
    assert long == {}


def _room(modules, m: str) -> str:
    """The folder a module stands in (a package is its own; so is a module directly under kvjax/)."""
    if modules[m].endswith("__init__.py") or m.count(".") == 1:
        return m
    return m.rsplit(".", 1)[0]


def test_configuration_depends_on_nothing_above_it():
    # vLLM's config imports no layer that reads it. Above kvjax/config/ stands every folder with a module that imports
    # it (the accounting, the scheduler, the worker, the engine, ...) and the layers the layout puts above it without
    # importing it (the host tier, the attention kernels). Nothing kvjax/config/ imports, through any chain of
    # imports, lies in one of them: the arithmetic configuration needs is at or below its floor.
    modules, graph = _graph()
    config = "kvjax.config"
    users = {_room(modules, m) for m, deps in graph.items()
             if not m.startswith(config) and any(d.startswith(config) for d in deps)}
    above = users | {"kvjax.kv_offload", "kvjax.attention"}
    chains = {m: [m] for m in graph if m.startswith(config)}
    todo = list(chains)
    while todo:
        m = todo.pop()
        for d in sorted(graph[m]):
            if d not in chains:
                chains[d] = chains[m] + [d]
                todo.append(d)
    upward = [" -> ".join(chain) for m, chain in sorted(chains.items())
              if any(_room(modules, m) == a or _room(modules, m).startswith(a + ".") for a in above)]
    assert upward == [], upward
