"""``python -m m6.train --config CONFIG [key=value ...]``: see m6.train.cli."""

from m6.train.cli import run

run()
