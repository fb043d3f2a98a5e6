"""Simulated CUDA for the tests in this folder: the preload library is built once (or found in its
cache), and every scenario group a collected test needs starts at once, each in its own process, so
the groups run side by side; a test waits only for its own group's report.

Where the library cannot be built (no C++ compiler, no torch headers, a CUDA build of torch), every
test here is skipped with that reason.
"""

from __future__ import annotations

from typing import Callable

import pytest

from preload import ScenarioRun, SimulationUnavailable, build_preload


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "simcuda_group(name): the scenario group (tests/simcuda/scenarios.py) "
                                       "whose report the test reads")


@pytest.fixture(scope="session")
def simcuda(request: pytest.FixtureRequest) -> Callable[[str], dict]:
    """``simcuda(group)``: the JSON report of a scenario group run under simulated CUDA."""
    try:
        library = build_preload()
    except SimulationUnavailable as e:
        pytest.skip(f"simulated CUDA cannot run on this machine: {e}")
    groups = []
    for item in request.session.items:
        for mark in item.iter_markers("simcuda_group"):
            if mark.args[0] not in groups:
                groups.append(mark.args[0])
    runs = {group: ScenarioRun(group, library) for group in groups}

    def report(group: str) -> dict:
        if group not in runs:
            runs[group] = ScenarioRun(group, library)
        return runs[group].report()
    return report

