"""DeepSpeed's CPU Adam as the offloaded host optimizer (memory.host_optimizer): its update against
torch's AdamW, in the Trainer (offload modes, apply groups, LR schedule, clipping), bitwise resume,
state that moves between the two optimizers, the auto fallback and the exit-2 error.

Tolerance against torch's AdamW: the two compute the same AdamW formula in float32 but round
differently (DeepSpeed: fused multiply-adds, float32 betas and bias corrections; torch: lerp,
float64 scalars), so each step may differ by a few float32 ulps per element and the differences
add up over steps: parameters within rtol = 4 * 2^-23 * steps (a few ulps per step) and atol =
1e-9 * steps (the rounding of an update of size ~lr = 1e-3 near zero); moments (exponential
averages: their differences do not add up) within 8 ulps, the first moment also within 4 ulps of
its unit-scale gradients absolute, as it cancels near zero. Measured over 4 seeds and 1-30 steps:
parameters at most 0.28 of that tolerance, moments at most 6.3 ulps relative (the second) and
2 ulps absolute (the first). An optimizer that decays differently (Adam with L2) is checked to
fall outside the tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from m6.config import ConfigError, load
from m6.memory import host_optimizer
from m6.memory.host_optimizer import choose_host_optimizer, default_extensions_dir, extensions_dir, load_cpu_adam, \
    thread_note
from m6.parallel import DistEnv, build_parallel
from m6.train.loop import Trainer
from m6.train.update import ParameterUpdate

sys.path.insert(0, str(Path(__file__).parent))
from test_offload import SMALL  # noqa: E402  (the offload tests' small fp32 MoE model)

REPO = Path(__file__).resolve().parents[2]
SHAPES = [(257, 33), (1000,), (7,), (64, 64)]  # sizes off the SIMD width: the op's vector and scalar paths run
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
ULP = 2.0 ** -23
STEPS = 8
# The trainer runs resume after step 6: the first resumed step, 7, is one where the running product
# of beta2 = 0.95 in float32 differs from pow(beta2, 7), which stock DeepSpeed would use after a resume.
RESUME_AT = 6


@pytest.fixture(scope="session")
def cpu_adam():
    """DeepSpeed's op, built once per machine and version into extensions_dir() (tests/conftest.py)."""
    try:
        return load_cpu_adam(print)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"DeepSpeed's cpu_adam op does not build here: {host_optimizer.error_gist(e)}")


def _ds_adamw(params, **kw):
    from m6.memory.deepspeed_adam import DeepSpeedHostAdamW
    return DeepSpeedHostAdamW(params, lr=LR, betas=BETAS, eps=EPS, **kw)


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": params[:2], "weight_decay": WD}, {"params": params[2:], "weight_decay": 0.0}]


def _grads(g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(s, generator=g) for s in SHAPES]


def _run(make_optimizer, steps: int, seed: int = 0, state: dict | None = None, skip: int = 0):
    """Params after ``steps`` steps of ``make_optimizer(groups)`` on seeded random gradients
    (the first ``skip`` gradients drawn and unused, the optimizer's state loaded from ``state``)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    opt = make_optimizer(_groups(params))
    for _ in range(skip):
        _grads(g)
    if state is not None:
        params = [p for group in opt.param_groups for p in group["params"]]
        with torch.no_grad():
            for p, saved in zip(params, state["params"]):
                p.copy_(saved)
        opt.load_state_dict(state["optimizer"])
    for _ in range(steps):
        for p, grad in zip(params, _grads(g)):
            p.grad = grad
        opt.step()
    return params, opt


def _torch_adamw(groups):
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=True)


def _close(a, b, steps: int) -> bool:
    return torch.allclose(a, b, rtol=4 * ULP * steps, atol=1e-9 * steps)


@pytest.mark.parametrize("steps", [1, 10])
@pytest.mark.parametrize("seed", [0, 1])
def test_update_equals_torch_adamw_within_fp32_rounding(cpu_adam, steps, seed):
    ref, ref_opt = _run(_torch_adamw, steps, seed)
    ds, ds_opt = _run(_ds_adamw, steps, seed)
    start, _ = _run(_torch_adamw, 0, seed)
    for i, (a, b) in enumerate(zip(ref, ds)):
        torch.testing.assert_close(b, a, rtol=4 * ULP * steps, atol=1e-9 * steps, msg=f"param {i}")
        for key in ("exp_avg", "exp_avg_sq"):
            # The first moment cancels near zero: there the absolute ulps of the unit-scale gradients count.
            atol = 4 * ULP if key == "exp_avg" else 0.0
            torch.testing.assert_close(ds_opt.state[b][key], ref_opt.state[a][key], rtol=8 * ULP, atol=atol,
                                       msg=f"param {i} {key}")
        assert torch.equal(ds_opt.state[b]["step"], ref_opt.state[a]["step"])
        assert (a - start[i]).abs().median() > 5e-4  # every element moved by ~lr per step: not a vacuous check
    # The tolerance tells AdamW from Adam with the decay added to the gradient (L2).
    l2, _ = _run(lambda groups: torch.optim.Adam(groups, lr=LR, betas=BETAS, eps=EPS), steps, seed)
    assert not all(_close(a, b, steps) for a, b in zip(ref, l2))


def test_deepspeed_kernel_is_deepspeed_cpu_adams(cpu_adam):
    """The m6 subclass runs DeepSpeedCPUAdam's own update: bitwise equal over the first two steps
    (from the third, stock DeepSpeed multiplies beta^t up incrementally and may differ in the last bit)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    ours, _ = _run(_ds_adamw, 2)
    stock, _ = _run(lambda groups: DeepSpeedCPUAdam(groups, lr=LR, betas=BETAS, eps=EPS, adamw_mode=True), 2)
    assert all(torch.equal(a, b) for a, b in zip(ours, stock))


def test_resuming_from_a_state_dict_is_bitwise(cpu_adam):
    """12 steps, or 6 steps, state saved, a new optimizer loaded and 6 more: the same bits (the bias
    corrections depend on the saved step count only, not on the C++ object's history; stock
    DeepSpeed fails this: its running product of beta2 = 0.95 differs from pow at step 7)."""
    straight, _ = _run(_ds_adamw, 12)
    first, first_opt = _run(_ds_adamw, 6)
    saved = {"params": [p.clone() for p in first], "optimizer": first_opt.state_dict()}
    resumed, _ = _run(_ds_adamw, 6, state=saved, skip=6)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_state_has_torch_adamws_layout_and_moves_both_ways(cpu_adam):
    ref, ref_opt = _run(_torch_adamw, 3)
    ds, ds_opt = _run(_ds_adamw, 3)
    for a, b in zip(ref, ds):
        sa, sb = ref_opt.state[a], ds_opt.state[b]
        assert sa.keys() == sb.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape for k in sa)
    # Each optimizer's state loads into the other as it is.
    for source, make in ((ref_opt, _ds_adamw), (ds_opt, _torch_adamw)):
        params = [p.detach().clone() for group in source.param_groups for p in group["params"]]
        target = make(_groups(params))
        target.load_state_dict(source.state_dict())
        for p, q in zip(params, (p for group in source.param_groups for p in group["params"])):
            assert all(torch.equal(target.state[p][k], source.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


# ---- in the Trainer ---------------------------------------------------------------------------------

def trainer(tmp_path, *extra: str) -> Trainer:
    return Trainer(load(None, [*SMALL, f"run.dir={tmp_path}", *extra]))


def weights_of(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def run(tr: Trainer, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = [tr.train_step()["loss"] for _ in range(steps)]
    return losses, weights_of(tr)


@pytest.fixture(scope="module")
def ds_reference(cpu_adam, tmp_path_factory):
    """auto, offloaded, one apply group: DeepSpeed's CPU Adam (the op builds here)."""
    from m6.memory.deepspeed_adam import DeepSpeedHostAdamW

    tr = trainer(tmp_path_factory.mktemp("ds"), "memory.offload=optimizer", "memory.host_optimizer=auto")
    assert tr.update.host_optimizer == "deepspeed" and isinstance(tr.update.optimizer, DeepSpeedHostAdamW)
    initial = weights_of(tr)
    return (*run(tr), initial)


@pytest.fixture(scope="module")
def torch_reference(tmp_path_factory):
    tr = trainer(tmp_path_factory.mktemp("torch"), "memory.offload=optimizer", "memory.host_optimizer=torch")
    assert type(tr.update.optimizer) is torch.optim.AdamW
    initial = weights_of(tr)
    return (*run(tr), initial)


# Weights after 8 training steps, DeepSpeed vs torch: rtol as for the optimizer alone, and an absolute
# 5e-7, 4e-4 of the 1.2e-3 that the warmup LRs (1e-3 * k / 30, k = 1..8) let a weight move. Beyond the
# optimizer's rounding the trajectories differ (from step 2 the gradients come from weights that
# differ in the last bit), and Adam turns a gradient that is zero up to rounding (the key bias,
# which softmax ignores) into a full +-lr step whose sign is noise: measured up to 9.7e-8 (at 5
# steps 3.2e-8) on such near-zero weights, so the bound is empirical, 5x the measured.
WEIGHT_RTOL, WEIGHT_ATOL = 4 * ULP * STEPS, 5e-7


def _assert_weights_close(weights: dict, reference: dict, initial: dict) -> None:
    for k, v in weights.items():
        torch.testing.assert_close(v, reference[k], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=k)
    moved = max((reference[k] - initial[k]).abs().max().item() for k in reference)
    assert moved > 100 * WEIGHT_ATOL  # the tolerance is far below what training changed


def test_offloaded_training_with_deepspeed_matches_torch(ds_reference, torch_reference):
    """8 steps (warmup LR from LambdaLR, clipping, 2 micro-batches): losses within 1e-6 relative
    (measured: 4e-8), weights as said above."""
    assert ds_reference[0] == pytest.approx(torch_reference[0], rel=1e-6, abs=0)
    assert ds_reference[0] != torch_reference[0]  # really two optimizers (they round differently)
    _assert_weights_close(ds_reference[1], torch_reference[1], torch_reference[2])


def test_params_offload_and_apply_groups_with_deepspeed_equal_one_group_bitwise(ds_reference, tmp_path):
    """Stepping a subset of parameters per group (GroupedApply) and the streamed layers' host homes
    as masters give the single-group run's bits."""
    tr = trainer(tmp_path, "memory.offload=optimizer+params", "memory.host_optimizer=deepspeed", "optim.apply_groups=3")
    assert len(tr.update.apply.groups) == 3
    losses, weights = run(tr)
    assert losses == ds_reference[0]
    for k, v in weights.items():
        assert torch.equal(v, ds_reference[1][k]), k


def test_resume_with_deepspeed_is_bitwise(ds_reference, tmp_path):
    extra = ["memory.offload=optimizer", "memory.host_optimizer=deepspeed", "optim.apply_groups=2",
             f"train.max_steps={STEPS}"]
    first = trainer(tmp_path, *extra)
    losses = [first.train_step()["loss"] for _ in range(RESUME_AT)]
    first.save_checkpoint(wait=True)
    resumed = trainer(tmp_path, *extra, "checkpoint.resume=auto")
    assert resumed.step == RESUME_AT
    more, weights = run(resumed, STEPS - RESUME_AT)
    assert losses + more == ds_reference[0]
    for k, v in weights.items():
        assert torch.equal(v, ds_reference[1][k]), k


OPTIMIZER_OF = {"deepspeed": ["memory.offload=optimizer", "memory.host_optimizer=deepspeed"],
                "torch": ["memory.offload=optimizer", "memory.host_optimizer=torch"],
                "no offload": ["memory.offload=none"]}


@pytest.mark.parametrize("saver, resumer", [("deepspeed", "torch"), ("torch", "deepspeed"), ("no offload", "deepspeed")])
def test_switching_host_optimizer_across_a_resume(ds_reference, torch_reference, tmp_path, capsys, saver, resumer):
    """Supported: the state carries over exactly, the resumed run says it is another optimizer's
    and trains on within tolerance of an uninterrupted run with the resuming optimizer."""
    first = trainer(tmp_path, *OPTIMIZER_OF[saver], f"train.max_steps={STEPS}")
    losses = [first.train_step()["loss"] for _ in range(RESUME_AT)]
    saved = {n: {k: v.clone() for k, v in s.items()} for n, s in first.state.optimizer.tensors().items()}
    first.save_checkpoint(wait=True)
    capsys.readouterr()
    resumed = trainer(tmp_path, *OPTIMIZER_OF[resumer], f"train.max_steps={STEPS}", "checkpoint.resume=auto")
    assert resumed.update.host_optimizer == resumer
    lines = [line for line in capsys.readouterr().out.splitlines() if "the checkpoint was saved by" in line]
    assert len(lines) == 1 and "not bitwise" in lines[0]
    loaded = resumed.state.optimizer.tensors()
    assert loaded.keys() == saved.keys()
    for n, s in saved.items():
        assert all(torch.equal(loaded[n][k], v) for k, v in s.items()), n
    more, weights = run(resumed, STEPS - RESUME_AT)
    reference = ds_reference if resumer == "deepspeed" else torch_reference
    assert losses + more == pytest.approx(reference[0], rel=1e-6, abs=0)
    _assert_weights_close(weights, reference[1], torch_reference[2])


def test_deepspeed_update_allocates_no_temporaries_as_the_memory_report_says(cpu_adam, tmp_path):
    from m6.memory.memory_report import estimate_memory
    from m6.memory.live_bytes import LiveBytes
    from m6.train.optim import no_decay_ids

    tr = trainer(tmp_path, "memory.offload=optimizer", "memory.host_optimizer=deepspeed")
    tr.train_step()  # the moments exist from here on
    off, params = tr.update.offload, list(tr.model.parameters())
    for p in params:
        off.master(p).grad = torch.randn_like(off.master(p))
    with LiveBytes() as counter:
        tr.update.apply.step()
    est = estimate_memory(tr.cfg, tr.model, no_decay_ids(tr.model))
    assert counter.peak == est.host["optimizer step temporaries"] == 0
    auto = estimate_memory(load(None, [*SMALL, "memory.offload=optimizer", "memory.host_optimizer=auto"]),
                           tr.model, no_decay_ids(tr.model))
    assert auto.host["optimizer step temporaries"] > 0  # auto may fall back to torch: its temporaries count


BUILD_LOG_ERROR = RuntimeError("Error building extension 'cpu_adam': [1/3] c++ -MMD -c cpu_adam.cpp -o cpu_adam.o\n"
                               "FAILED: [code=127] cpu_adam.o\n/bin/sh: 1: c++: not found\n"
                               "ninja: build stopped: subcommand failed.")


def _failing_load(log):
    raise BUILD_LOG_ERROR


def test_auto_falls_back_to_torch_with_one_line(torch_reference, tmp_path, monkeypatch, capsys):
    """m6's fallback (the loader m6 calls made to fail as a build without a compiler does): torch's
    AdamW, exactly the torch run, and one line naming the cause."""
    monkeypatch.setattr(host_optimizer, "load_cpu_adam", _failing_load)
    tr = trainer(tmp_path, "memory.offload=optimizer", "memory.host_optimizer=auto")
    out = capsys.readouterr().out.splitlines()
    assert tr.update.host_optimizer == "torch" and type(tr.update.optimizer) is torch.optim.AdamW
    said = [line for line in out if "memory.host_optimizer" in line]
    assert len(said) == 1, out
    assert "Error building extension 'cpu_adam': /bin/sh: 1: c++: not found" in said[0]
    assert "torch's AdamW" in said[0] and host_optimizer.FALLBACK_COST in said[0]
    assert [tr.train_step()["loss"] for _ in range(2)] == torch_reference[0][:2]


def test_explicit_deepspeed_that_cannot_build_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(host_optimizer, "load_cpu_adam", _failing_load)
    with pytest.raises(ConfigError, match=r"memory.host_optimizer=deepspeed: .*c\+\+: not found.*memory.host_optimizer=torch"):
        trainer(tmp_path, "memory.offload=optimizer", "memory.host_optimizer=deepspeed")


@pytest.mark.parametrize("choice", ["deepspeed", "auto"])
def test_a_real_failed_build_from_the_command_line(tmp_path, choice):
    """No usable compiler (CXX points nowhere) and an empty build cache: deepspeed -> exit 2 with
    one error line, no traceback; auto -> the run trains with torch's AdamW after one line.
    About 30 s a case on a busy 2-core machine (32 s under a load average of 14): a real `m6.train`
    process (torch and DeepSpeed imported) that really attempts the build, which is what is tested."""
    env = dict(os.environ, CXX=str(tmp_path / "no-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "m6.train", "--config", str(REPO / "configs/tiny.yaml"), *SMALL, "data.sources=[]",
           f"run.dir={tmp_path / 'run'}", "train.max_steps=1", "memory.offload=optimizer",
           f"memory.host_optimizer={choice}"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert "building DeepSpeed's cpu_adam op into" in proc.stdout
    if choice == "deepspeed":
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("config error: memory.host_optimizer=deepspeed: DeepSpeed's cpu_adam op could not be "
                               "built or loaded (RuntimeError: Error building extension 'cpu_adam': "), last
        assert "no-compiler: not found" in last
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        said = [line for line in proc.stdout.splitlines() if line.startswith("memory.host_optimizer=auto")]
        assert len(said) == 1 and "no-compiler: not found" in said[0], proc.stdout
        assert (tmp_path / "run" / "metrics.jsonl").exists()


# ---- small pieces ---------------------------------------------------------------------------------

def test_config_refuses_deepspeed_without_offload():
    with pytest.raises(ConfigError, match="memory.host_optimizer=deepspeed only applies with memory.offload"):
        load(None, ["memory.host_optimizer=deepspeed"])
    with pytest.raises(ConfigError, match="memory.host_optimizer: expected one of 'auto', 'deepspeed', 'torch'"):
        load(None, ["memory.offload=optimizer", "memory.host_optimizer=fast"])
    assert load(None, []).memory.host_optimizer == "auto"


def test_choice_is_the_same_for_every_rank_and_names_the_failing_ones():
    lines: list[str] = []
    assert choose_host_optimizer("auto", {}, lines.append) == "deepspeed" and not lines
    assert choose_host_optimizer("torch", {1: "x"}, lines.append) == "torch" and not lines
    assert choose_host_optimizer("auto", {3: "host b: OSError: gone", 1: "host a: RuntimeError: no"}, lines.append) == "torch"
    assert len(lines) == 1 and "on ranks 1, 3 (rank 1: host a: RuntimeError: no)" in lines[0]
    with pytest.raises(ConfigError, match="on rank 2 .rank 2: boom"):
        choose_host_optimizer("deepspeed", {2: "boom"}, lines.append)


def test_build_cache_defaults_to_a_per_user_versioned_directory(tmp_path, monkeypatch):
    import importlib.metadata

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expected = (tmp_path / "m6" / "torch_extensions" /
                f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}-deepspeed"
                f"{importlib.metadata.version('deepspeed')}")
    assert default_extensions_dir() == expected
    assert extensions_dir() == expected and os.environ["TORCH_EXTENSIONS_DIR"] == str(expected)  # torch reads it
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert extensions_dir() == tmp_path / "mine"


def test_a_built_op_loads_without_the_build_line(cpu_adam, capsys):
    assert load_cpu_adam(print) is cpu_adam
    assert capsys.readouterr().out == ""


def test_thread_note_when_one_thread_leaves_cores_idle():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        note = thread_note(local_world_size=1)
        if (os.cpu_count() or 1) > 1:
            assert note is not None and f"OMP_NUM_THREADS={os.cpu_count()}" in note
        assert thread_note(local_world_size=os.cpu_count() or 1) is None  # one core per process: nothing to gain
        torch.set_num_threads(2)
        assert thread_note(local_world_size=1) is None
    finally:
        torch.set_num_threads(threads)


def test_offloaded_update_with_torchs_adamw_says_it_runs_on_one_thread():
    """The host also clips (and torch's AdamW also threads): the note is for any offloaded update,
    not only DeepSpeed's Adam."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: nothing to gain from more threads")
    cfg = load("configs/tiny.yaml", ["memory.offload=optimizer", "memory.host_optimizer=torch"])
    threads = torch.get_num_threads()
    lines: list[str] = []
    try:
        torch.set_num_threads(1)
        sharded = build_parallel(cfg, torch.device("cpu"), DistEnv.single_process())
        ParameterUpdate(sharded, cfg, torch.device("cpu"), log=lines.append)
    finally:
        torch.set_num_threads(threads)
    assert any("offloaded update (host gradient clip and optimizer) runs on 1 thread" in line for line in lines), lines


def _steps_on_dtensors(rank: int, world: int) -> None:
    """One rank of a one-rank gloo group: DeepSpeed's update of DTensor parameters (FSDP2's host
    shards under parallel.shard with CPU offload) equals its update of the same plain tensors,
    bitwise, and keeps DTensor moments (torch AdamW's layout for DTensor parameters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(0)
    plain = [torch.randn(s, generator=g) for s in SHAPES]
    shards = [DTensor.from_local(p.clone(), mesh, [Shard(0)]) for p in plain]
    opt_plain, opt_shards = _ds_adamw(_groups(plain)), _ds_adamw(_groups(shards))
    for _ in range(3):
        grads = _grads(g)
        for p, q, grad in zip(plain, shards, grads):
            p.grad, q.grad = grad, DTensor.from_local(grad.clone(), mesh, [Shard(0)])
        opt_plain.step()
        opt_shards.step()
    for p, q in zip(plain, shards):
        assert torch.equal(q.to_local(), p)
        assert all(isinstance(opt_shards.state[q][k], DTensor) for k in ("exp_avg", "exp_avg_sq"))
        assert torch.equal(opt_shards.state[q]["exp_avg_sq"].to_local(), opt_plain.state[p]["exp_avg_sq"])


def test_deepspeed_steps_fsdp2_host_shards(cpu_adam):
    sys.path.insert(0, str(REPO / "tests" / "dist"))
    from dist_helpers import run_distributed
    run_distributed(_steps_on_dtensors, 1, timeout_s=120)
