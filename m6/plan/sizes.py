"""Sizes on the planner's command line: '80GB', '80GiB', '1TB', '512M' -> GiB."""

from __future__ import annotations

import re

from m6.config_loader import ConfigError


def parse_size(text: str, flag: str) -> float:
    """'80GB', '80GiB', '1TB', '512M' -> GiB (binary units whatever the spelling)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)i?[bB]?\s*", text)
    if not m:
        raise ConfigError(f"{flag}: cannot read {text!r} as a size (e.g. 80GB, 1TB)")
    scale = {"": 1.0, "k": 2**-20, "m": 2**-10, "g": 1.0, "t": 1024.0}[m.group(2).lower()]
    return float(m.group(1)) * scale
