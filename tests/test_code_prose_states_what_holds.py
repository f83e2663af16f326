"""The package's comments and docstrings say what the code does and why, not how fast it ran or
how it got there.

Numbers that a run produced, and the story of earlier versions, go stale the day the code moves;
they live in ``docs/benchmarks.md`` (numbers) and ``docs/benchmarks-log.md`` (history), where the
claims test keeps them tied to their results. A ``calibration.py`` module is exempt: its measured
constants are its subject, and each one names the run it came from.

What is read: every comment and every string that stands alone as a statement (module, class and
function docstrings, and the docstrings under a config field) in ``skyrl_megatron_kda/**/*.py``.
Inline code (``...`` or `...`) is left out: it quotes program text, such as a log message.

What is refused, each a kind in ``RULES``:

- a timing: a number with ``ms``, ``us`` or ``ns``; seconds after a verb of running (``took
  2.1 s``) or per step/call/pass;
- a speed ratio: a decimal ratio (``1.33x``), an integer one that says faster or slower
  (``9x slower``), a percentage (``87% of the step``);
- a throughput: a number with ``TFLOP/s``, ``tokens/s``, ``GB/s``, ``GiB/s`` and the like;
- a measured value: ``measured`` followed by its number, a peak given as a number (``peaked
  18.3 GiB``);
- a history word: an earlier or first layout/version/run, ``previously``, ``used to`` (not the
  passive ``is used to``), ``once was``, ``session 3``, ``no longer`` (not ``no longer than``),
  ``at the old`` speed or layout, ``before this change``, ``now the default``, ``that day``.

What passes, because the code makes it true on every run: sizes and widths (``512-wide``,
``fp32``, ``a 2 GiB buffer``), counts, tolerances (``1e-6``), timeouts given as settings
(``default 60 s``), and words about runtime order (``the earlier pool``, ``the old run``, ``the
first that does not fit``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "skyrl_megatron_kda"
EXEMPT_NAMES = {"calibration.py"}

NUMBER = r"\d(?:[\d,]*\d)?(?:\.\d+)?"
RULES: dict[str, re.Pattern[str]] = {
    "timing": re.compile(
        rf"{NUMBER}\s?(?:ms|us|µs|ns)\b"
        rf"|\b(?:took|takes|take|ran|runs in|run in|costs?|spent|spends)\b[^.;:]{{0,40}}?"
        rf"{NUMBER}\s?(?:s|sec|secs|seconds)\b"
        rf"|{NUMBER}\s?(?:s|sec|seconds) (?:a|per) (?:step|call|pass|layer|block)\b", re.I),
    "speed ratio": re.compile(
        r"(?<![\w.])\d+\.\d+\s?x\b"
        r"|(?<![\w.])\d+\s?x (?:faster|slower|longer|shorter|quicker|less time|more time)\b"
        rf"|{NUMBER}\s?%", re.I),
    "throughput": re.compile(
        rf"{NUMBER}\s?(?:TFLOP/s|TFLOPS|GFLOP/s|tokens/s|GB/s|GiB/s|TB/s|MB/s|MiB/s|Gb/s)", re.I),
    "measured value": re.compile(rf"\bmeasured\b\W{{0,3}}(?:~|about |at )?{NUMBER}"
                                 rf"|\bpeak(?:ed|s)?\s+(?:at\s+|of\s+)?{NUMBER}", re.I),
    "history": re.compile(
        r"\b(?:an?|the|our) (?:earlier|previous|older) (?:layout|version|run|call|commit|"
        r"session|implementation|design|attempt|code|kernel|measurement)s?\b"
        r"|\b(?:an?|the|our) first (?:layout|version|attempt|implementation|design)s?\b"
        r"|\bpreviously\b|\bformerly\b|\boriginally\b|\bonce (?:was|were)\b"
        r"|\bsessions? \d+"
        r"|\bno longer\b(?! than)"
        r"|\bat the old\b"
        r"|\bthe old (?:speed|layout|code|kernel|version|path|default|behaviou?r|implementation)\b"
        r"|\bbefore (?:this|the|that) (?:change|commit|fix|rewrite)\b"
        r"|\bnow the default\b|\bthat day\b", re.I),
}
USED_TO = re.compile(r"\b(\w+)\s+used to\b", re.I)
PASSIVE = {"is", "are", "be", "been", "being", "was", "were", "get", "gets", "got", "not"}
INLINE_CODE = re.compile(r"``[^`]*``|`[^`\n]*`")


def prose_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of each comment line and each line of a standalone string."""
    lines = [(tok.start[0], tok.string.lstrip("#"))
             for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            lines += [(node.lineno + i, text)
                      for i, text in enumerate(node.value.value.splitlines())]
    return sorted(lines)


def offences(source: str) -> list[tuple[int, str, str]]:
    """(line, kind, matched text) for each measurement or history phrase in ``source``'s comments
    and docstrings. A phrase broken across two lines is read with the line before it."""
    found = []
    lines = prose_lines(source)
    for index, (number, text) in enumerate(lines):
        text = INLINE_CODE.sub(" ", text)
        before = lines[index - 1] if index else None
        carried = (INLINE_CODE.sub(" ", before[1]).strip() + " "
                   if before and before[0] == number - 1 else "")
        joined = carried + text.strip()
        cut = len(joined) - len(text.strip())
        for kind, rule in RULES.items():
            found += [(number, kind, m.group(0)) for m in rule.finditer(joined) if m.end() > cut]
        found += [(number, "history", m.group(0)) for m in USED_TO.finditer(joined)
                  if m.end() > cut and m.group(1).lower() not in PASSIVE]
    return found


def package_offences() -> list[str]:
    report = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in EXEMPT_NAMES or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT).as_posix()
        report += [f"{rel}:{line}: {kind}: {text!r}"
                   for line, kind, text in offences(path.read_text())]
    return report


def test_package_comments_and_docstrings_state_no_measurement_or_history():
    report = package_offences()
    assert not report, (
        "comments and docstrings say what holds: put the number in docs/benchmarks.md and the "
        "story in docs/benchmarks-log.md (or the module's calibration.py), then say here what the "
        "code does and why:\n" + "\n".join(report))


OFFENDER = '''"""Index scores in Triton.

An earlier layout took 5.6 ms on the same block; this one is 1.33x faster at the
old speed's shapes, 12% of the step.
"""

# Runs at 465 TFLOP/s on an H200 (session 3); the fused path no longer copies.
# It used to read whole rows, and at the old speed the selection was a third of the step.


def f(x):
    """The layer's forward took 2.1 s per step; measured ~6e-6 against fp64; peaked 18.3 GiB."""
    y = x  # 9x slower before this change
    return y


class Config:
    width: int = 512
    """Now the default: the backward 291 us; the core 1.22 s a step."""
'''

CLEAN = '''"""Index scores in Triton over a 512-wide latent, fp32 accumulators.

Each program covers 4 queries x 128 pools (a 2 GiB buffer at 1M tokens); ties keep the earlier
pool, and equal scores within 1e-6 are one score. ``took over the lock (no longer running)``
quotes a log line.
"""

# Ray kills workers that miss the wait (default 60 s); the old run is moved aside first.
# The tensor is used to pick the rows, and no longer than T tokens is read.


def f(x):
    """Pick the first that does not fit; 2x the rows when doubled."""
    return x
'''


def test_the_rule_catches_a_synthetic_offender_and_passes_clean_code():
    """Negative control: every kind of phrase in ``OFFENDER`` is found, on its line; the code
    facts of ``CLEAN`` (sizes, tolerances, a setting in seconds, runtime order, a quoted log line,
    the passive 'is used to') are not."""
    found = offences(OFFENDER)
    texts = {text.lower() for _, _, text in found}
    for phrase in ("an earlier layout", "5.6 ms", "1.33x", "at the old", "12%", "465 tflop/s",
                   "session 3", "no longer", "it used to", "took 2.1 s", "1.22 s a step",
                   "measured ~6", "peaked 18.3", "9x slower", "before this change",
                   "now the default", "291 us"):
        assert any(phrase in text for text in texts), (phrase, found)
    assert {kind for _, kind, _ in found} == set(RULES)
    assert (4, "history", "at the old") in found  # read across the line break
    assert offences(CLEAN) == []
