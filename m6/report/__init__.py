"""A picture of a finished (or running) training run from the files in its run.dir: see m6.report.cli."""
