"""The package's shape: no module imports back into one that imports it, the config modules stay
small, and imports sit at the top of each module (except optional dependencies)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "skyrl_megatron_kda"
NAME = PACKAGE.name

# Imports that may stay inside a function: dependencies that are optional on some machines
# (fla's Triton kernels and Transformer Engine need a GPU build; transformers is the test oracle
# and the tokenizer loader, heavy to import for a run without text data; vLLM is on SkyRL's
# inference machines only, imported when its weight-transfer engine is asked for).
OPTIONAL = ("fla", "transformers", "megatron.core.extensions.transformer_engine_spec_provider",
            "skyrl", "vllm")

LAZY_MODULES = ("cli.py",)
"""The command line imports each command's modules when that command runs: ``--help`` and
``recipes`` answer at once, and the warning filters are in place before megatron, fla and Ray
load."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """Package modules named by a ``from ... import ...`` (each imported name may be a module)."""
    if node.level:
        base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target] + [f"{target}.{alias.name}" for alias in node.names]


def _imports(path: Path, top_level_only: bool) -> list[tuple[str, int]]:
    """(imported name, line) of the imports in ``path``; only module-level ones if asked."""
    tree = ast.parse(path.read_text())
    module, is_package = _module_name(path), path.name == "__init__.py"
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [(name, node.lineno) for name in _resolve(module, is_package, node)]
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        deps = set()
        for name, _ in _imports(path, top_level_only=True):
            # ``from . import x`` names a module; ``from .m import f`` names m (f is not a module).
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name.startswith(NAME) and name != module:
                deps.add(name)
        graph[module] = deps
    # Importing a.b.c runs a/__init__ and a/b/__init__ first.
    for module in list(graph):
        parts = module.split(".")
        graph[module] |= {".".join(parts[:i]) for i in range(2, len(parts))} & set(files)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the modules (a package importing its own submodules excepted)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep.startswith(node + "."):  # a package's __init__ importing its own modules
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_cycle_finder_finds_a_cycle():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert _cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]
    assert _cycle({"p.a": {"p.b"}, "p.b": set()}) is None


def test_config_modules_are_small():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "config").glob("*.py")}
    assert sizes and max(sizes.values()) < 300, sizes


def test_imports_are_at_the_top_except_optional_dependencies():
    inner = []
    for path in PACKAGE.rglob("*.py"):
        if str(path.relative_to(PACKAGE)) in LAZY_MODULES:
            continue
        top = set(_imports(path, top_level_only=True))
        for name, line in _imports(path, top_level_only=False):
            if (name, line) not in top and not name.startswith(OPTIONAL):
                inner.append(f"{path.relative_to(PACKAGE)}:{line} {name}")
    assert not inner, inner
