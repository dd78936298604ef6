"""The package's import graph has no cycle: every `import poslens...` (also inside functions and
under `if TYPE_CHECKING:`, since a type-only import still ties two modules together) is an arrow,
found by an AST walk over src/poslens, and no chain of arrows leads back to where it started.
Nothing but the CLI's own modules and the entry points (`__main__` modules) imports the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import poslens

ROOT = Path(poslens.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The poslens modules that the module at `path` imports (a `from pkg import name` names
    the module pkg.name when that is a module, else pkg)."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if full in modules else base)
    return {m for m in out if m in modules and m != me}


def graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports(p, modules) for p in paths}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `g` as a list of modules (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_walk_sees_imports_inside_functions_and_finds_a_planted_cycle() -> None:
    g = graph()
    assert "poslens.models.vit" in g["poslens.api"]  # a module-level import is an arrow
    planted = {k: set(v) for k, v in g.items()}
    planted["poslens.models.config"].add("poslens.api")  # api -> models.vit -> models.config
    assert find_cycle(planted) is not None


def test_only_the_cli_imports_the_cli() -> None:
    """The CLI sits on top: the library (study, report, ...) never reaches up into it."""
    up = sorted(m for m, deps in graph().items()
                if not m.startswith("poslens.cli") and not m.endswith("__main__")
                and any(d == "poslens.cli" or d.startswith("poslens.cli.") for d in deps))  # fmt: skip
    assert up == [], f"modules that import poslens.cli: {up}"
