"""The README's "## Layout" lists every module and package of ``skyrl_megatron_kda/``, and names
nothing that is not there.

How the listing is read (keep the README in this shape):

- the tree is the code block of the "## Layout" section, from the line ``skyrl_megatron_kda/`` to
  the next line indented as little as it;
- an entry starts at an indent at most 2 deeper than the entry above it; a line indented deeper
  continues the description of the entry above it;
- an entry's names are the text before its first run of two spaces, separated by commas, each a
  path relative to the package of the nearest shallower entry (``kernel.py``, ``workers/group.py``,
  ``kda/``, ``pools.py, pool_topk.py``);
- a ``*.py`` name in an entry's description is a module too, of that entry when it is a package
  (``train/  setup.py, data.py, ...``), else of the package the entry sits in;
- a package counts as listed when it is named or when anything inside it is.

Every module must be listed except a package's ``__init__.py``; every listed name must exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "skyrl_megatron_kda"
MODULE_IN_TEXT = re.compile(r"(?<![\w./-])((?:\w+/)*\w+\.py)\b")


def layout_block(readme: str) -> list[str]:
    section = readme.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1].splitlines()
    start = next(i for i, line in enumerate(block) if line.strip() == f"{PACKAGE}/")
    indent = len(block[start]) - len(block[start].lstrip())
    lines = []
    for line in block[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        lines.append(line)
    return lines


def listed_names(readme: str) -> set[str]:
    """Paths relative to the package: ``kda/kernel.py`` for a module, ``kda/`` for a package."""
    names: set[str] = set()
    stack: list[tuple[int, str]] = [(0, "")]  # (indent, package path) of the open entries
    entry_indent, entry_is_package, entry_dir = 0, True, ""
    for line in layout_block(readme):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent > entry_indent + 2:  # a continuation of the entry above
            description = line.strip()
        else:
            while stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1]
            head, _, description = line.strip().partition("  ")
            heads = [parent + name.strip() for name in head.split(",")]
            names.update(heads)
            entry_indent, entry_is_package = indent, heads[-1].endswith("/")
            entry_dir = heads[-1] if entry_is_package else parent
            if entry_is_package:
                stack.append((indent, heads[-1]))
        names.update(entry_dir + m.group(1) for m in MODULE_IN_TEXT.finditer(description))
    for name in list(names):  # the packages a listed path runs through
        parts = name.rstrip("/").split("/")[:-1]
        names.update("/".join(parts[:i]) + "/" for i in range(1, len(parts) + 1))
    return names


def package_tree(package_dir: Path) -> set[str]:
    tree = set()
    for path in package_dir.rglob("*.py"):
        rel = path.relative_to(package_dir)
        if "__pycache__" in rel.parts:
            continue
        if rel.name != "__init__.py":
            tree.add(rel.as_posix())
        tree.update("/".join(rel.parts[:i]) + "/" for i in range(1, len(rel.parts)))
    return tree


def layout_mismatch(readme: str, package_dir: Path) -> tuple[set[str], set[str]]:
    """(in the tree but not in the README, in the README but not in the tree)."""
    listed, tree = listed_names(readme), package_tree(package_dir)
    inits = {name for name in listed if name.endswith("__init__.py")
             and (package_dir / name).is_file()}
    return tree - listed, listed - tree - inits


def test_readme_layout_lists_every_module():
    unlisted, stale = layout_mismatch((ROOT / "README.md").read_text(), ROOT / PACKAGE)
    assert not unlisted, f"modules the README's Layout does not list: {sorted(unlisted)}"
    assert not stale, f"names the README's Layout lists that are not in {PACKAGE}/: {sorted(stale)}"


SYNTHETIC = """# x

## Layout

```
recipes/           YAML
skyrl_megatron_kda/
  kda/             the layer
    kernel.py      kernels
    exchanges/     base.py, the registry (__init__.py),
                   a2a.py, state.py
  train/           setup.py, data.py
  workers/group.py  Ray
  cli.py, tables.py  the CLI; tables
tests/             tests
```

## Next
"""


@pytest.fixture
def synthetic_package(tmp_path):
    for rel in ("__init__.py", "cli.py", "tables.py", "kda/__init__.py", "kda/kernel.py",
                "kda/exchanges/__init__.py", "kda/exchanges/base.py", "kda/exchanges/a2a.py",
                "kda/exchanges/state.py", "train/__init__.py", "train/setup.py", "train/data.py",
                "workers/__init__.py", "workers/group.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    return tmp_path


def test_the_parse_reads_each_form_of_entry(synthetic_package):
    assert listed_names(SYNTHETIC) == {
        "kda/", "kda/kernel.py", "kda/exchanges/", "kda/exchanges/base.py",
        "kda/exchanges/__init__.py", "kda/exchanges/a2a.py", "kda/exchanges/state.py", "train/",
        "train/setup.py", "train/data.py", "workers/", "workers/group.py", "cli.py", "tables.py"}
    assert layout_mismatch(SYNTHETIC, synthetic_package) == (set(), set())


def test_a_missing_and_a_stale_module_are_caught(synthetic_package):
    """Negative controls: a module added to the tree and not to the README, a package likewise,
    and a README name whose module was removed."""
    (synthetic_package / "train/stop.py").write_text("")
    (synthetic_package / "memory").mkdir()
    (synthetic_package / "memory/__init__.py").write_text("")
    (synthetic_package / "memory/census.py").write_text("")
    (synthetic_package / "kda/kernel.py").unlink()
    unlisted, stale = layout_mismatch(SYNTHETIC, synthetic_package)
    assert unlisted == {"train/stop.py", "memory/", "memory/census.py"}
    assert stale == {"kda/kernel.py"}
