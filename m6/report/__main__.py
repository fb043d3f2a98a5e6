"""``python -m m6.report RUN_DIR [--out DIR]``: see m6.report.cli."""

from m6.report.cli import run

run()
