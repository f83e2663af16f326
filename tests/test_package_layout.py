"""The package's shape: each module imports only from its own floor or below (the table in the
README's "## Layout"), no module imports back into one that imports it, ``config`` loads neither
torch nor megatron-core, the config modules stay small, no module runs past MAX_MODULE_LINES
lines nor any function past MAX_FUNCTION_LINES, and imports sit at the top of each module
(except optional dependencies)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "skyrl_megatron_kda"
NAME = PACKAGE.name

# Imports that may stay inside a function: dependencies that are optional on some machines
# (fla's Triton kernels and Transformer Engine need a GPU build; transformers is the test oracle
# and the tokenizer loader, heavy to import for a run without text data; vLLM is on SkyRL's
# inference machines only, imported when its weight-transfer engine is asked for).
OPTIONAL = ("fla", "transformers", "megatron.core.extensions.transformer_engine_spec_provider",
            "skyrl", "vllm", "tilelang")

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


def _graph(top_level_only: bool = True) -> dict[str, set[str]]:
    """Each package module -> the package modules it imports (at module level only, if asked)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        deps = set()
        for name, _ in _imports(path, top_level_only):
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


MAX_MODULE_LINES = 500
"""A module longer than this holds more than one concern: split it by concern or phase (as
``dsa/ops/latent/`` splits our sparse-MLA programs by phase)."""
MAX_FUNCTION_LINES = 120
"""A function (nested ones counted on their own too) longer than this does several jobs: give
each its own function or macro."""


def _oversized(sources: dict[str, str]) -> list[str]:
    """``name: N lines`` for each module over MAX_MODULE_LINES and ``name:line function: N
    lines`` for each function over MAX_FUNCTION_LINES (decorators not counted)."""
    found = []
    for name, text in sorted(sources.items()):
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            found.append(f"{name}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}: {n} lines")
    return found


def test_no_module_or_function_is_oversized():
    sources = {str(p.relative_to(PACKAGE)): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert not _oversized(sources)


def test_size_check_finds_a_long_module_and_a_long_function():
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    long_function = f"def outer():\n    def inner():\n{body}\n    return inner\n"
    long_module = "x = 0\n" * (MAX_MODULE_LINES + 1)
    assert _oversized({"f.py": long_function}) == [
        f"f.py:1 outer: {MAX_FUNCTION_LINES + 3} lines",
        f"f.py:2 inner: {MAX_FUNCTION_LINES + 1} lines"]
    assert _oversized({"m.py": long_module}) == [f"m.py: {MAX_MODULE_LINES + 1} lines"]
    assert _oversized({"ok.py": "def f():\n    return 1\n"}) == []


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


# --- floors ------------------------------------------------------------------------------------


def _readme_floors() -> dict[str, int]:
    """Top-level module or package -> its floor, from the table in the README's "## Layout"."""
    text = (PACKAGE.parent / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    floors = {}
    for floor, names in re.findall(r"^\| (\d+) \| (.+?) \|$", section, re.MULTILINE):
        for name in re.findall(r"`([\w.]+)`", names):
            assert name not in floors, f"{name} is on two floors of the README's table"
            floors[name] = int(floor)
    return floors


def _top(module: str) -> str:
    """``skyrl_megatron_kda.kda.layer`` -> ``kda`` (the package itself -> "")."""
    return module.split(".")[1] if "." in module else ""


def _upward_imports(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    """``a -> b`` for each import from a module to one on a higher floor."""
    return sorted(f"{module} -> {dep}" for module, deps in graph.items() for dep in deps
                  if _top(module) and _top(dep) and floors[_top(dep)] > floors[_top(module)])


def test_every_module_has_a_floor():
    tops = {_top(m) for m in _graph()} - {""}
    floors = _readme_floors()
    assert tops == set(floors), {"without a floor": tops - set(floors),
                                 "not in the package": set(floors) - tops}


def test_no_module_imports_from_a_higher_floor():
    # Every import counts, also those inside functions (the command line imports its commands'
    # modules when they run).
    assert not _upward_imports(_graph(top_level_only=False), _readme_floors())


def test_floor_check_finds_an_upward_import():
    floors = {"config": 0, "kda": 1, "model": 2}
    graph = {"p.config.a": set(), "p.kda.b": {"p.config.a"}, "p.model.c": {"p.kda.b"}}
    assert _upward_imports(graph, floors) == []
    graph["p.config.a"] = {"p.kda.b"}
    assert _upward_imports(graph, floors) == ["p.config.a -> p.kda.b"]


def test_config_loads_neither_torch_nor_the_rest_of_the_package():
    """Reading a recipe (``skyrl-kda recipes``, SkyRL's driver-side config parse) needs only the
    config: a fresh interpreter that imports it has no torch, megatron-core or other module of
    the package loaded."""
    code = (f"import sys, {NAME}.config; print('\\n'.join(sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.split()
    loaded = [m for m in out if m.split(".")[0] in ("torch", "megatron")
              or (m.startswith(f"{NAME}.") and not m.startswith(f"{NAME}.config"))]
    assert not loaded, loaded
