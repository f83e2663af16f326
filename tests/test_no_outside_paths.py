"""No comment, docstring or doc names a file outside the repository.

A reader of the repository has only the repository: a comment that sends them to a file on the
machine it was written on, to a folder beside the checkout, or to a file of another project is a
dead end. Say what the thing is instead. Three rules, over the comments and docstrings of every
Python file of the package, ``bench/`` and ``tests/``, and the whole text of the shell scripts in
``bench/``, the Markdown docs (``README.md``, ``docs/``, the package's and the examples' READMEs)
and the recipes:

1. no path under a machine's own folders (the roots in ``MACHINE_ROOTS``);
2. a relative path that climbs (``../``) must land on a file of the repository, seen from the
   folder of the file that cites it (as Markdown links do);
3. a cited ``.py`` or ``.md`` file must be one of the repository: its path from the root, the tail
   of one (``kda/rows.py``), or, as a bare name, the name of one.

String literals in code are not read: a test may need an absolute path as data.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MACHINE_ROOTS = ("/work", "/home", "/root", "/Users", "/mnt", "/scratch")
MACHINE_PATH = re.compile(r"(?<![\w.~-])(?:" + "|".join(map(re.escape, MACHINE_ROOTS)) + r")/[\w.-]")
CLIMBING = re.compile(r"(?<![\w./-])((?:\.\./)+[\w.-][\w./-]*)")
CITED = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-][\w.-]*\.(?:py|md))(?![\w])")


def repo_files() -> set[str]:
    skip = {".git", ".venv", "__pycache__", "runs", ".pytest_cache"}
    return {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(ROOT).parts)}


def comments_and_docstrings(source: str) -> str:
    """The text of a Python file a reader is sent somewhere by: its comments and docstrings."""
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def outside_references(text: str, cited_from: str, files: set[str]) -> list[str]:
    """Each reference in ``text`` (read from the repository file ``cited_from``) that does not name
    a file of the repository, with the rule it breaks."""
    found = [f"machine path {m.group(0)!r}..." for m in MACHINE_PATH.finditer(text)]
    folder = Path(cited_from).parent
    for m in CLIMBING.finditer(text):
        target = m.group(1).split("#")[0].rstrip(".,:;)")
        landed = (ROOT / folder / target).resolve()
        if not landed.is_relative_to(ROOT) or landed.relative_to(ROOT).as_posix() not in files:
            found.append(f"climbs to {target!r}, not a file of the repository")
    names = {f.rsplit("/", 1)[-1] for f in files}
    for m in CITED.finditer(text):
        cited = m.group(1)
        if cited.startswith("../"):
            continue  # rule 2's
        known = (cited in names) if "/" not in cited else any(
            f == cited or f.endswith("/" + cited) for f in files)
        if not known:
            found.append(f"cites {cited!r}, which the repository does not have")
    return found


def scanned_texts() -> dict[str, str]:
    texts = {}
    for pattern in ("skyrl_megatron_kda/**/*.py", "bench/*.py", "tests/**/*.py", "examples/**/*.py"):
        for path in ROOT.glob(pattern):
            texts[path.relative_to(ROOT).as_posix()] = comments_and_docstrings(path.read_text())
    for pattern in ("bench/*.sh", "README.md", "docs/*.md", "skyrl_megatron_kda/**/*.md",
                    "examples/**/*.md", "recipes/*.yaml"):
        for path in ROOT.glob(pattern):
            texts[path.relative_to(ROOT).as_posix()] = path.read_text()
    return texts


def test_nothing_names_a_file_outside_the_repository():
    files = repo_files()
    texts = scanned_texts()
    assert {"skyrl_megatron_kda/kda/kernel.py", "bench/device_run.sh", "docs/memory.md",
            "recipes/glm53_flash_1m.yaml"} <= texts.keys()
    bad = [f"{name}: {why}" for name, text in sorted(texts.items())
           for why in outside_references(text, name, files)]
    assert not bad, "describe the thing instead of citing a file outside the repository:\n" + "\n".join(bad)


def test_each_rule_catches_its_case():
    """Negative controls: each kind of outside reference is found, and the in-repository forms
    next to them are not."""
    files = repo_files()
    source = (
        '"""See ' + "glm53-flash" + '.md section 1 and kda/rows.py."""\n'
        "# constants from " + "/wor" + "k/main/notes.txt, tuning in " + ".." + "/shared/tools/a.tgz\n"
        "# like megatron's fusions/" + "fused_cross_entropy.py; our cost.py and kda/README.md\n"
        "x = '" + "/hom" + "e/me/data.json'  # a string in code is data, not a reference\n")
    bad = outside_references(comments_and_docstrings(source), "skyrl_megatron_kda/kda/x.py", files)
    assert len(bad) == 4, bad
    assert any("glm53-flash.md" in why for why in bad)
    assert any("machine path" in why for why in bad)
    assert any("climbs" in why and "shared" in why for why in bad)
    assert any("fused_cross_entropy.py" in why for why in bad)
    # A Markdown link that climbs is fine when it lands on a file of the repository.
    link = "[memory](.." + "/../docs/memory.md#the-1m-recipe) and [x](.." + "/../docs/nowhere.md)"
    bad = outside_references(link, "examples/finetune_1m/README.md", files)
    assert len(bad) == 1 and "nowhere.md" in bad[0], bad
