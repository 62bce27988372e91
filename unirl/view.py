"""Compare runs in one static HTML page: curves, reward components, timing, config diff, samples.

    python -m unirl.view RUN_DIR [RUN_DIR ...] [--out report.html] [--title TEXT]

Each RUN_DIR is a run's `output_dir` (its `metrics.jsonl`, `config.yaml` and `samples/`). The page
(`unirl.tracking.report`) needs no server and no network: open it in a browser. A metrics line
that cannot be read is skipped and named (file and line) on stderr and at the top of the page.
Exit status: 0 written (with or without warnings), 2 a RUN_DIR that is not a directory.
"""

from __future__ import annotations

import argparse
import os
import sys

from unirl.tracking.report import write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m unirl.view", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's output_dir")
    parser.add_argument(
        "--out",
        default=None,
        help="the page to write (default: RUN_DIR/report.html for one run, else ./report.html)",
    )
    parser.add_argument("--title", default=None, help="the page's heading (default: the runs' names)")
    args = parser.parse_args(argv)
    missing = [d for d in args.run_dirs if not os.path.isdir(d)]
    if missing:
        print(f"error: not a run directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.run_dirs[0] if len(args.run_dirs) == 1 else ".", "report.html")
    path, warnings = write_report(args.run_dirs, out, args.title)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
