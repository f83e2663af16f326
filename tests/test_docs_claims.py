"""The README's performance numbers and the claims table of docs/benchmarks.md say the same thing.

The table under "## Claims" has the columns claim | value | command | results. A README number
counts as a performance number when a unit follows it: a ratio (``1.45x``), ``GiB``, ``ms``,
``s``, ``tokens/s``, ``TFLOP/s`` or ``tokens``; code (fenced blocks and inline code) is not read.
Each one must appear, with its unit and the same value, in the claim or value cell of some row,
so that a number changed on one side and not the other fails here. (A number the README gives
without a unit is not seen: give it its unit.) Every row names its command, and its results cell
names folders or files under ``bench/results/`` that exist, or says the number is computed.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

QUANTITY = re.compile(
    r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(K|M)?\s?"
    r"(x|GiB|ms|tokens/s|TFLOP/s|tokens|s)(?![\w/])")
RESULT_PATH = re.compile(r"`(bench/results/[^`]*)`")


def prose(markdown: str) -> str:
    """The text without fenced code blocks and inline code."""
    return re.sub(r"`[^`\n]*`", " ", re.sub(r"```.*?```", " ", markdown, flags=re.S))


def quantities(text: str) -> set[tuple[str, str]]:
    """(number, unit) pairs: ``1.45x`` and ``1.450x`` are ("1.45", "x"), ``131,072 tokens`` is
    ("131072", "tokens"); a number with a K or M suffix stays as written ("32K")."""
    found = set()
    for number, suffix, unit in QUANTITY.findall(prose(text)):
        value = float(number.replace(",", ""))
        text_of = str(int(value)) if value.is_integer() else repr(value)
        found.add((text_of + suffix, unit))
    return found


def claims_table(benchmarks: str) -> list[dict[str, str]]:
    section = benchmarks.split("\n## Claims", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert header == ["claim", "value", "command", "results"], header
    return [dict(zip(header, (cell.strip() for cell in row.strip("|").split("|"))))
            for row in rows[2:]]


def claim_problems(readme: str, benchmarks: str, root: Path) -> list[str]:
    rows = claims_table(benchmarks)
    claimed = set().union(*(quantities(row["claim"] + " " + row["value"]) for row in rows))
    problems = [f"the README says {number} {unit}; no claim in docs/benchmarks.md has it"
                for number, unit in sorted(quantities(readme) - claimed)]
    for row in rows:
        name = row["claim"][:60]
        if not row["command"]:
            problems.append(f"{name!r}: no command")
        paths = RESULT_PATH.findall(row["results"])
        if not paths and not row["results"].startswith("computed"):
            problems.append(f"{name!r}: names no result folder under bench/results/")
        problems += [f"{name!r}: {path} does not exist" for path in paths if not (root / path).exists()]
    return problems


def test_readme_numbers_are_claims_and_claims_have_their_results():
    readme = (ROOT / "README.md").read_text()
    benchmarks = (ROOT / "docs/benchmarks.md").read_text()
    assert len(claims_table(benchmarks)) >= 20
    assert {("1.98", "x"), ("131072", "tokens"), ("32K", "tokens")} <= quantities(readme)
    problems = claim_problems(readme, benchmarks, ROOT)
    assert not problems, "\n".join(problems)


SYNTHETIC_TABLE = """# Benchmarks

## Claims

| claim | value | command | results |
|---|---|---|---|
| layer, CP2 faster than CP1 at 256K tokens | 1.45x | `bench/kda_layer.py` | `bench/results/h200_kda_own_gemms/` |
| slice at 131,072 tokens | 11,104 tokens/s, 131.8 GiB | `bench/model_slice.py` | `bench/results/h200_nowhere/` |
| plan | 124.55 GiB | `skyrl-kda plan` | measured once |

## After
"""


def test_a_changed_number_and_a_missing_folder_are_caught():
    """Negative controls: a README ratio that differs from the table's, a folder that does not
    exist, a row without a folder; and the README's numbers that agree are not reported."""
    readme = ("The layer is 1.47x faster than CP1 at 256K tokens (`--tokens 262144`); the slice "
              "trains at 131,072 tokens, 11,104 tokens/s, in 131.8 GiB.\n"
              "```\n99.9x inside code is not a claim\n```\n")
    problems = claim_problems(readme, SYNTHETIC_TABLE, ROOT)
    assert len(problems) == 3, problems
    assert "the README says 1.47 x" in problems[0]
    assert "h200_nowhere" in problems[1] and "does not exist" in problems[1]
    assert "names no result folder" in problems[2]
    fixed = readme.replace("1.47x", "1.45x")
    assert len(claim_problems(fixed, SYNTHETIC_TABLE, ROOT)) == 2
