"""Training on gloo at world 1, 2 and 4: world-size invariance, scaling experts, resume across layouts
(ranks from the test fork server, with torchrun's environment), and the launchers themselves: torchrun
on one node and on two, the deepspeed launcher, a preempted rank, a dead rank."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest
from dist_helpers import REPO, free_port, train_ranks

TINY = str(REPO / "configs" / "tiny.yaml")
# Dropless, fp32, default losses (aux + z, global scope), no dropout: the math is independent of
# how the global batch of 8 is split over processes.
SMALL = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=80",
    "model.moe.every=1", "model.moe.num_experts=4", "model.moe.capacity_factor=null", "data.num_samples=256",
    "data.eval_samples=8", "train.global_batch_size=8", "train.eval_every=0", "train.eval_batches=1",
    "logging.every=1", "logging.console=false", "checkpoint.every=5", "checkpoint.keep=5",
    "data.kind=synthetic", "data.sources=[]", "data.num_workers=0", "data.seq_len=80",
]
# The embedded sample through the real loader (tar shards + text file, 2 workers per rank).
FILES = ["data.kind=files", "data.num_workers=2", "data.eval_samples=8", "model.max_text_len=128", "data.seq_len=128",
         f'data.sources=[{{path: "{REPO}/data/sample/sample-{{000000..000002}}.tar", weight: 0.9}}, '
         f'{{path: "{REPO}/data/sample/text.txt", format: text, weight: 0.1}}]']


def torchrun_nodes(run_dir, nproc: int, *overrides: str, nnodes: int, timeout: int = 240) -> None:
    """Launch train.py as ``nnodes`` torchrun agents of ``nproc`` workers each ("nodes" on this machine)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ["--config", TINY, *SMALL, f"run.dir={run_dir}", *overrides]
    with agents_on_nodes(args, nproc, nnodes, env) as procs:
        outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]


@contextlib.contextmanager
def agents_on_nodes(args: list[str], nproc: int, nnodes: int, env: dict):
    """``nnodes`` torchrun agents of ``nproc`` workers each, as separate "nodes" on this machine.

    The rendezvous store lives in its own process, started before the agents and stopped after
    them (as docs/parallelism.md advises for multi-node runs): an agent hosting it could exit while another
    agent still syncs, failing a job that trained to the end."""
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "m6.parallel.rendezvous_store", "--host", "127.0.0.1",
                              "--port", str(port)], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert "listening" in store.stdout.readline()
        yield [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                                 "--nproc_per_node", str(nproc), "--node_rank", str(i), "--rdzv_backend", "c10d",
                                 "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_conf", "is_host=false",
                                 "--rdzv_id", "m6test", str(REPO / "train.py"), *args],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
               for i in range(nnodes)]
    finally:
        store.terminate()
        store.wait(timeout=30)


def ranks(run_dir, nproc: int, *overrides: str, per_node: int | None = None) -> str:
    """train.py's main on ``nproc`` ranks (1: a plain single process), ``per_node`` ranks per
    "node" (default all on one); rank 0's stdout."""
    results = train_ranks(nproc, ["--config", TINY, *SMALL, f"run.dir={run_dir}", *overrides],
                          local_world_size=per_node)
    for rank, r in enumerate(results):
        assert r.code == 0, f"rank {rank} exited {r.code}: {r.stderr[-3000:]}"
    return results[0].stdout


def single(run_dir, *overrides: str) -> None:
    ranks(run_dir, 1, *overrides)


def train_rows(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def step_flops(row: dict) -> float:
    """The model FLOPs of the whole job's step that the logged TFLOP/s stands for."""
    return row["tflops"] * 1e12 * row["step_time_s"]


def assert_same_curve(a: list[dict], b: list[dict], rtol: float = 1e-5) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in ("loss", "lm_loss", "aux_loss_weighted", "z_loss_unweighted", "grad_norm"):
            assert ra[key] == pytest.approx(rb[key], rel=rtol), (ra["step"], key, ra[key], rb[key])
        # Same global batch, dropless: the same work, whichever rank did it (summed over ranks;
        # with expert parallelism each rank holds a share of the experts but charges its tokens').
        assert step_flops(ra) == pytest.approx(step_flops(rb), rel=1e-9), ra["step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """World size 1, 10 steps: the curve every layout must reproduce."""
    run = tmp_path_factory.mktemp("w1")
    single(run, "train.max_steps=10")
    return run


@pytest.mark.parametrize("nproc, ep", [(2, "auto"), (4, "auto"), (4, 2)])
def test_world_size_invariance(reference, tmp_path, nproc, ep):
    # (4, 2): experts split over pairs of ranks, each pair an expert-data-parallel replica.
    ranks(tmp_path, nproc, "train.max_steps=10", f"parallel.expert_parallel_size={ep}")
    assert_same_curve(train_rows(tmp_path), train_rows(reference))


# Capacity on: cf 1.25 drops ~10% of the assignments of this model.
CAPACITY = ["model.moe.capacity_factor=1.25", "train.max_steps=3"]


@pytest.mark.parametrize("scope, micro_batch", [("global", None), ("local", 2)])
def test_capacity_and_aux_loss_scope_are_world_size_invariant(tmp_path, scope, micro_batch):
    """Same global batch at world 1, 2 and 4: the same assignments dropped (capacity per sequence)
    and the same aux loss and gradients. global: balance statistics of all ranks' micro-batch
    (one micro-batch per rank: the whole global batch); local: of each micro-batch of 2 sequences
    (world 1/2/4 accumulate 4/2/1 of them), averaged over micro-batches and ranks, not summed."""
    runs = {}
    for nproc in (1, 2, 4):
        run = tmp_path / f"w{nproc}"
        args = (*CAPACITY, f"model.moe.aux_loss_scope={scope}",
                *([f"train.micro_batch_size={micro_batch}"] if micro_batch else []))
        ranks(run, nproc, *args)
        runs[nproc] = train_rows(run)
    assert all(r["moe/block0/dropped_fraction"] > 0 for r in runs[1])  # capacity is really dropping
    for nproc in (2, 4):
        assert_same_curve(runs[nproc], runs[1])


def _worker_pid(agent_pid: int, rank: int) -> int | None:
    """The pid of the torchrun worker with RANK=rank among the agent's children (None: not this agent's)."""
    for child in (pathlib.Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()):
        environ = pathlib.Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    return None


def test_sigterm_to_one_rank_stops_every_rank_with_one_checkpoint(tmp_path):
    """Preemption reaching one worker only (a node drained, a kill by hand): the ranks agree to
    stop after the same step, save it together, and exit 0; resuming continues the curve."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ["--config", TINY, *SMALL, f"run.dir={tmp_path}", "train.max_steps=1000", "logging.console=true",
            "checkpoint.every=0", "optim.schedule=constant"]
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", str(free_port()), str(REPO / "train.py"), *args],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    for line in agent.stdout:
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= 2:
            os.kill(_worker_pid(agent.pid, 1), signal.SIGTERM)  # rank 1 is one of this agent's workers
            break
    out, err = agent.communicate(timeout=180)
    assert agent.returncode == 0, err[-3000:]
    stopped = [line for line in out.splitlines() if "stopped after step" in line]
    assert len(stopped) == 1 and stopped[0].startswith("a stop signal on another rank"), out[-2000:]
    step = int(stopped[0].split("stopped after step ")[1].split()[0])
    assert (tmp_path / "checkpoints" / f"step_{step:08d}").is_dir()
    ranks(tmp_path, 2, f"train.max_steps={step + 2}", "checkpoint.every=0", "optim.schedule=constant")
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, step + 3))


def test_two_nodes_match_single_node(reference, tmp_path):
    torchrun_nodes(tmp_path, 2, "train.max_steps=10", nnodes=2)
    assert_same_curve(train_rows(tmp_path), train_rows(reference))


def test_resume_across_world_sizes(reference, tmp_path):
    ranks(tmp_path / "w2", 2, "train.max_steps=5")  # checkpoint at step 5, saved by 2 ranks
    for nproc in (1, 4):
        run = tmp_path / f"resume{nproc}"
        run.mkdir()
        ckpt = tmp_path / "w2" / "checkpoints" / "step_00000005"
        ranks(run, nproc, "train.max_steps=10", f"checkpoint.resume={ckpt}")
        assert_same_curve(train_rows(run), train_rows(reference)[5:])


def test_file_data_is_world_size_invariant_and_resumable(tmp_path):
    """Real files, 2 DataLoader workers per rank: 2 ranks see the same global batches as 1, and a
    run resumed at world size 1 from the 2-rank checkpoint continues the same curve."""
    single(tmp_path / "w1", *FILES, "train.max_steps=6", "checkpoint.every=3")
    ranks(tmp_path / "w2", 2, *FILES, "train.max_steps=6", "checkpoint.every=3")
    assert_same_curve(train_rows(tmp_path / "w2"), train_rows(tmp_path / "w1"))
    ckpt = tmp_path / "w2" / "checkpoints" / "step_00000003"
    single(tmp_path / "r1", *FILES, "train.max_steps=6", f"checkpoint.resume={ckpt}")
    assert_same_curve(train_rows(tmp_path / "r1"), train_rows(tmp_path / "w1")[3:])
    assert all(r["skipped_records"] == 0 and r["data_wait_s"] >= 0 for r in train_rows(tmp_path / "w2"))


def test_scaling_experts_is_one_key(tmp_path):
    from m6.checkpoint import read_checkpoint

    ranks(tmp_path, 4, "train.max_steps=2", "model.moe.num_experts=16")
    state = read_checkpoint(tmp_path / "checkpoints" / "step_00000002")
    assert state["model"]["blocks.0.ffn.experts.w_in"].shape == (16, 32, 64)  # 4 per rank, global ids
    assert len(state["optimizer"]["state"]) > 0
    row = train_rows(tmp_path)[-1]
    # Load of all 16 global experts, summed over the 4 ranks: top-2 assignments of every token.
    tokens = row["tokens_per_s"] * row["step_time_s"]
    assert row["moe/block0/mean_tokens"] * 16 == pytest.approx(2 * tokens, rel=1e-6)


@pytest.mark.parametrize("nnodes", [1, 2])
def test_a_dead_rank_ends_the_job_instead_of_hanging(tmp_path, nnodes):
    """SIGKILL to rank 1 mid-run, under one torchrun agent or two (two "nodes"): every survivor
    ends well within the collective timeout, naming rank 1 and its host in one line. The survivor
    waits parallel.peer_wait_s for the dead rank's mark (2 s here; the 10 s default is
    tests/unit/test_peer_wait.py's): it never comes, so the wait is spent in full."""
    import time

    env = dict(os.environ, OMP_NUM_THREADS="1")
    # A checkpoint every step: the death often lands inside a save, whose error must still name it.
    args = ["--config", TINY, *SMALL, f"run.dir={tmp_path}", "train.max_steps=100000", "parallel.timeout_s=30",
            "parallel.peer_wait_s=2", "checkpoint.every=1"]
    with contextlib.ExitStack() as stack:
        if nnodes == 1:
            agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                        "--master_port", str(free_port()), str(REPO / "train.py"), *args],
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)]
        else:
            agents = stack.enter_context(agents_on_nodes(args, 1, 2, env))
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            time.sleep(0.5)
        assert metrics.exists(), "training never started"
        victim = next(pid for pid in (_worker_pid(a.pid, 1) for a in agents) if pid is not None)
        os.kill(victim, signal.SIGKILL)
        start = time.time()
        errs = [a.communicate(timeout=90)[1] for a in agents]  # well within the collective timeout + margin
    assert all(a.returncode != 0 for a in agents) and time.time() - start < 90
    # The survivor names the dead rank and its host in one line, instead of the backend's traceback.
    err = "\n".join(errs)
    named = [line for line in err.splitlines() if "has stopped answering (died or hung)" in line]
    assert len(named) == 1 and re.search(r"rank 0: error: rank 1 \(host \S+\) has stopped", named[0]), err[-3000:]
    assert "DistBackendError" not in err  # no backend traceback from the survivor


def test_deepspeed_launcher_matches_single_process(reference, tmp_path):
    """The deepspeed launcher sets the same environment as torchrun (and passes --local_rank)."""
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), str(REPO / "train.py"),
           "--config", TINY, *SMALL, f"run.dir={tmp_path}", "train.max_steps=10"]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert_same_curve(train_rows(tmp_path), train_rows(reference))
