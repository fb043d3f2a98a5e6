"""Printing a command-line tool's report to a reader that may stop early (``| head``): the text
is written in one go, and a closed pipe ends the output quietly instead of with a BrokenPipeError
traceback (and another at interpreter exit, when Python flushes stdout again)."""

from __future__ import annotations

import os
import sys


def write_report(lines: list[str]) -> bool:
    """Write ``lines`` to stdout; False when the reader has closed the pipe (the rest is dropped)."""
    try:
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # Point stdout at /dev/null so that the flush at exit has nowhere to fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return False
    return True
