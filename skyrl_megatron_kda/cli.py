"""``skyrl-kda``: the command line of the plugin."""

from __future__ import annotations

import argparse
import sys

from .config import parse_overrides
from .demo import byte_table, run_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="skyrl-kda", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="KDA layer on a CP mesh of Ray CPU ranks: each exchange vs CP=1, and bytes moved")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override the tiny layer recipe, e.g. --set parallel.cp=4 "
                           "--set parallel.tp=2 --set parallel.sequence_parallel=true")
    demo.add_argument("--exchanges", default=",".join(("a2a", "allgather")),
                      help="comma-separated exchanges to check (default: all)")
    sub.add_parser("bytes", help="analytic CP bytes per exchange at GLM-5.3-Flash dims")
    args = parser.parse_args(argv)

    if args.command == "bytes":
        print("\n".join(byte_table()))
        return 0
    ok = run_demo(parse_overrides(args.overrides), args.exchanges.split(","))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
