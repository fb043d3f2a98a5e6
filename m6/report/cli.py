"""The report command: ``m6-report`` and ``python -m m6.report``.

    python -m m6.report RUN_DIR [--out DIR]

Writes DIR/report.png (the picture) and DIR/report.html (a summary table with the picture
embedded); DIR defaults to RUN_DIR. Exit codes: 0 written, 2 bad input (no run dir, no
metrics.jsonl or no training row in it, an output path that cannot be written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from m6.report.run_files import RunDirError, read_run

PNG_NAME = "report.png"
HTML_NAME = "report.html"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m6-report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run.dir of m6 training (holds metrics.jsonl)")
    parser.add_argument("--out", help="folder for report.png and report.html (default: RUN_DIR)")
    args = parser.parse_args(argv)
    try:
        run = read_run(args.run_dir)
    except RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Imported after the run dir is known to be readable: matplotlib costs a second to import.
    from m6.report.figure import render_png
    from m6.report.page import build_page

    png = render_png(run)
    out = Path(args.out) if args.out is not None else Path(args.run_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / PNG_NAME).write_bytes(png)
        (out / HTML_NAME).write_text(build_page(run, png), encoding="utf-8")
    except OSError as e:
        print(f"error: cannot write the report into {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    for note in run.notes:
        print(f"note: {note}")
    print(f"wrote {out / PNG_NAME} and {out / HTML_NAME}")
    return 0


def run() -> None:
    """Console-script entry point (``m6-report``)."""
    sys.exit(main())
