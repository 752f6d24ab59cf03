"""The package's modules import each other in layers: no import cycle, counting imports inside functions too
(a function-level import dodges a cycle at import time but keeps the modules tangled)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_nb"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set) -> set:
    """The package's modules `path` imports anywhere in it: `from . import x` and `from .x import y` alike."""
    name, found = module_name(path), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:  # `from .pkg import module` imports that module
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imported(path, set(paths)) for name, path in paths.items()}


def cycle(graph: dict) -> list | None:
    """One import cycle of `graph` as [a, b, ..., a], or None: a depth-first search for an edge back."""
    state = {}  # module -> "open" while on the search path, "done" after

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target, path + [target])):
                return found
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [module])):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert len(graph) > 40 and "grpo_nb.step" in graph["grpo_nb.trainer"]  # the graph is read at all
    found = cycle(graph)
    assert found is None, f"an import cycle: {' -> '.join(found)}"


def test_the_readme_lists_the_layers_in_import_order():
    """The README's list of layers: every module imports only from modules listed before it (a package written
    `name/` stands for its modules not listed on their own)."""
    import re

    graph = import_graph()
    readme = (PACKAGE.parent / "README.md").read_text()
    start = readme.index("1. leaves", readme.index("The modules sit in layers"))
    listed = re.findall(r"`([a-z_/]+)`", readme[start:readme.index("\n\n", start)])
    position = {}
    for i, name in enumerate(listed):
        module = "grpo_nb." + name.strip("/").replace("/", ".")
        for m in graph:
            if m == module or (name.endswith("/") and m.startswith(module + ".")):
                position.setdefault(m, i)
    assert {"grpo_nb.trainer", "grpo_nb.step", "grpo_nb.memory.accounting"} <= set(position)
    upward = [f"{m} imports {t}" for m in position for t in graph[m] if position.get(t, -1) > position[m]]
    assert not upward, f"the README's layers list these after the modules that import them: {upward}"
