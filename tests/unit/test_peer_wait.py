"""parallel.peer_wait_s: how long a survivor of a failed collective waits for the other ranks to
mark themselves alive before naming the silent ones (m6.parallel.peer_check). The default, and
that train.py's error path hands the configured value on; the real failure (a SIGKILLed rank under
torchrun) is tests/dist/test_train_world_sizes.py::test_a_dead_rank_ends_the_job_instead_of_hanging."""

from __future__ import annotations

from pathlib import Path

import pytest

from m6.config import ConfigError, load
from m6.train import cli

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def test_the_default_wait_is_ten_seconds():
    assert load(TINY).parallel.peer_wait_s == 10.0


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_wait_that_is_not_positive_is_a_config_error(value):
    with pytest.raises(ConfigError, match=rf"parallel.peer_wait_s \({float(value)}\) must be > 0"):
        load(TINY, [f"parallel.peer_wait_s={value}"])


@pytest.mark.parametrize("overrides, waited", [([], 10.0), (["parallel.peer_wait_s=2.5"], 2.5)])
def test_a_peer_failure_is_described_after_the_configured_wait(monkeypatch, capsys, overrides, waited):
    asked = []

    def peer_lost(cfg):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")

    def describe(rank, world_size, wait_s):
        asked.append((rank, world_size, wait_s))
        return "rank 1 (host h) has stopped answering"

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(cli, "train", peer_lost)
    monkeypatch.setattr(cli, "describe_peer_failure", describe)
    monkeypatch.setattr(cli, "report_once", print)  # the real one reports once per process
    assert cli.main(["--config", TINY, *overrides]) == 1
    assert asked == [(0, 2, waited)]
    assert "rank 0: error: rank 1 (host h) has stopped answering" in capsys.readouterr().out
