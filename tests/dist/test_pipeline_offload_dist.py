"""Pipeline parallel with m6's CPU offload on real gloo processes: pp 2 with memory.offload
(each rank's stages' fp32 masters and optimizer state on the host) trains with the
single-process run of the same offload, and each gradient leaves for the host once per step,
in its stage's last backward inside the schedule."""

from __future__ import annotations

import os

import pytest
from dist_helpers import run_distributed
from test_pipeline_parallel_dist import COMMON, NO_CHECKPOINTS, run
from test_train_world_sizes import SMALL, TINY, assert_same_curve

from m6.config import load

PP2 = "parallel.pipeline_parallel_size=2"
HOST = "memory.host_optimizer=torch"  # torch's AdamW on the host: the device run's kernels, no op build


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero_bubble"])
def test_pp2_with_optimizer_offload_trains_like_one_process(tmp_path, schedule):
    """fp32 masters and AdamW state on the host: 10 steps of pp 2 (tied head: the embedding's
    gradient summed over the two stages before it leaves) on one process's offloaded curve."""
    args = (NO_CHECKPOINTS, "memory.offload=optimizer", HOST, "data.eval_samples=0")
    reference = run(tmp_path / "w1", 1, *args)
    rows = run(tmp_path / "pp2", 2, *args, PP2, f"parallel.pipeline_schedule={schedule}")
    assert_same_curve(rows, reference)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_pp2_with_streamed_weights_trains_like_one_process(tmp_path, schedule):
    """memory.offload=optimizer+params: each rank streams its own stages' blocks from the host
    around their forwards and backwards, micro-batch by micro-batch inside the schedule; one
    process's curve."""
    args = (NO_CHECKPOINTS, "memory.offload=optimizer+params", HOST, "data.eval_samples=0")
    reference = run(tmp_path / "w1", 1, *args)
    rows = run(tmp_path / "pp2", 2, *args, PP2, f"parallel.pipeline_schedule={schedule}")
    assert_same_curve(rows, reference)


def test_pp2_with_two_data_parallel_ranks_per_stage_offloads_after_the_all_reduce(tmp_path):
    """World 4, stage 0 on ranks 0-1 and stage 1 on ranks 2-3 (EP 1: every gradient all-reduced
    over the stage's pair, in buckets launched inside the stage's last backward): each gradient
    leaves for the host once reduced, the tied embedding's after the pair sum too. aux_loss_scope=
    local as in the other world-4 pipeline tests (2 data-parallel ranks per stage)."""
    args = (NO_CHECKPOINTS, "memory.offload=optimizer", HOST, "data.eval_samples=0", "model.moe.aux_loss_scope=local",
            "parallel.expert_parallel_size=1", "parallel.bucket_size_mb=0.01")
    reference = run(tmp_path / "w1", 1, *args)
    rows = run(tmp_path / "pp2", 4, *args, PP2)
    assert "parallel world 4 = pipeline-parallel 2 (1f1b) x expert-parallel 1 x expert-data-parallel 2" in run.stdout
    assert_same_curve(rows, reference)


def assert_bf16_curve(rows: list[dict], reference: list[dict]) -> None:
    """A bf16 pipeline run against one process's bf16 run. The stages sum some gradients in
    another fp32 order than one process does (the tied embedding's: each stage's micro-batches,
    then the two stages), which moves single elements across a bf16 rounding boundary (a relative
    step of 2**-8) and the next steps' weights with them. Measured on this model over 10 steps,
    plain bf16 pp 2 against world 1 (no offload) differs by up to 1.1e-5 in the loss, 2.0e-4 in
    the weighted aux loss, 2.5e-5 in the z loss and 2.0e-4 in the gradient norm; world 1's 16-bit
    host gradients against its device ones by 1.0e-5, 1.4e-4, 2.7e-5 and 4.9e-4. The bounds are
    about 4x those: 5e-5 (loss), 1e-3 (aux, z) and 2e-3 (norm). A stage left out of the norm or a
    micro-batch's gradient lost is off by tens of percent."""
    for a, b in zip(rows, reference, strict=True):
        for key, rel in (("loss", 5e-5), ("lm_loss", 5e-5), ("aux_loss_weighted", 1e-3), ("z_loss_unweighted", 1e-3),
                         ("grad_norm", 2e-3)):
            assert a[key] == pytest.approx(b[key], rel=rel), (a["step"], key, a[key], b[key])


def test_pp2_bf16_offload_with_16bit_host_gradients_follows_one_process(tmp_path):
    """bf16 cast-on-use, memory.host_grad_dtype=compute: each gradient leaves in 16 bits once per
    step (a second stream of one parameter in a step is an error), and the clip's norm is summed
    from the 16-bit host buffers over both stages."""
    args = (NO_CHECKPOINTS, "memory.offload=optimizer", HOST, "data.eval_samples=0", "train.precision=bf16",
            "memory.host_grad_dtype=compute")
    reference = run(tmp_path / "w1", 1, *args)
    rows = run(tmp_path / "pp2", 2, *args, PP2)
    assert_bf16_curve(rows, reference)


def _gradients_leave_once_in_the_last_backward(rank: int, world: int, root: str) -> None:
    from m6.train import pipeline_step
    from m6.train.loop import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    backward = {"last": False}  # whether a stage's last backward of the step is running
    real = pipeline_step.FinalBackwardStage.backward_maybe_with_nosync

    def watched(self, backward_type, bwd_kwargs, last_backward=False):
        backward["last"] = last_backward
        try:
            return real(self, backward_type, bwd_kwargs, last_backward=last_backward)
        finally:
            backward["last"] = False
    pipeline_step.FinalBackwardStage.backward_maybe_with_nosync = watched
    for schedule in ("1f1b", "interleaved", "zero_bubble"):
        cfg = load(TINY, [*SMALL, *COMMON, NO_CHECKPOINTS, "memory.offload=optimizer", HOST, "data.eval_samples=0", PP2,
                          f"parallel.pipeline_schedule={schedule}", f"run.dir={root}/{schedule}"])
        tr = Trainer(cfg)
        off = tr.update.offload
        streamed: list[tuple[int, bool, bool]] = []  # (id(param), in a last backward, inside the schedule)
        in_schedule = {"now": True}
        real_grads_final, real_finish_backward = off.grads_final, off.finish_backward

        def grads_final(params):
            streamed.extend((id(p), backward["last"], in_schedule["now"]) for p in params if p.grad is not None)
            real_grads_final(params)

        def finish_backward():
            in_schedule["now"] = False
            streamed.extend((id(p), False, False) for p in off.params if p.grad is not None)
            real_finish_backward()
        off.grads_final, off.finish_backward = grads_final, finish_backward
        params = {id(p): n for n, p in tr.model.named_parameters()}
        for _ in range(2):
            in_schedule["now"] = True
            streamed.clear()
            tr.train_step()
            ids = [i for i, _, _ in streamed]
            assert sorted(ids) == sorted(params), (schedule, rank, "each gradient leaves once per step")
            tied = id(tr.model.text_embed.tokens.weight) if tr.model.text_embed is not None else None
            for i, in_last, inside in streamed:
                if schedule == "zero_bubble" or i == tied:  # after the schedule (see pipeline_step's docstring)
                    assert not inside, (schedule, rank, params[i])
                else:  # during the last of its stage's backwards in the step
                    assert inside and in_last, (schedule, rank, params[i])
        tr.fit()  # the remaining steps: the patched streams keep recording, harmlessly


def test_pp2_offload_streams_each_gradient_once_in_its_stages_last_backward(tmp_path):
    """At pp 2 with memory.offload=optimizer, in each step every parameter of the rank's stages
    leaves for the host exactly once: under 1f1b and interleaved inside the schedule, during its
    stage's last backward (the sync is off for the micro-batches before); the tied embedding's
    (summed over the first and last stages first) and all of zero_bubble's after the schedule."""
    run_distributed(_gradients_leave_once_in_the_last_backward, 2, str(tmp_path), timeout_s=120)


def test_pp2_zero_offload_follows_one_process(tmp_path):
    """memory.offload=zero (bf16 device weights, fp32 masters on the host, every block streamed in
    bf16) at pp 2 against one process's zero run."""
    args = (NO_CHECKPOINTS, "memory.offload=zero", HOST, "data.eval_samples=0", "train.precision=bf16")
    reference = run(tmp_path / "w1", 1, *args)
    rows = run(tmp_path / "pp2", 2, *args, PP2)
    assert_bf16_curve(rows, reference)


@pytest.mark.parametrize("schedule, offload", [("1f1b", "optimizer"), ("zero_bubble", "optimizer"),
                                               ("interleaved", "optimizer+params")])
def test_pp2_with_the_delayed_update_trains_like_one_process(tmp_path, schedule, offload):
    """optim.delayed_update from step 4: step t's host update runs in a background thread beside
    step t+1's pipeline schedule (whose gradients stream into the second buffer set), and its
    weights reach each rank's stages after that schedule; one process's delayed curve (the same
    one-step staleness)."""
    args = (NO_CHECKPOINTS, f"memory.offload={offload}", HOST, "data.eval_samples=0", "optim.delayed_update=true",
            "optim.delayed_update_after=3")
    reference = run(tmp_path / "w1", 1, *args)
    rows = run(tmp_path / "pp2", 2, *args, PP2, f"parallel.pipeline_schedule={schedule}")
    assert "delayed update from step 4" in run.stdout
    assert_same_curve(rows, reference)
    if schedule == "1f1b":
        # The staleness is real: the synchronous run's curve leaves it after step 4.
        synchronous = run(tmp_path / "sync", 1, *args[:-2])
        assert_same_curve(rows[:4], synchronous[:4])
        assert rows[5]["loss"] != pytest.approx(synchronous[5]["loss"], rel=1e-5)
        # A pp 2 checkpoint at step 5 (the masters after the step's update and the device weights the
        # next forward uses, per stage) resumes at pp 2 on the uninterrupted curve.
        saved = (f"memory.offload={offload}", HOST, "data.eval_samples=0", "optim.delayed_update=true",
                 "optim.delayed_update_after=3", PP2)
        run(tmp_path / "save", 2, *saved, "train.max_steps=5")
        resumed = run(tmp_path / "resume", 2, *saved, NO_CHECKPOINTS,
                      f"checkpoint.resume={tmp_path / 'save' / 'checkpoints' / 'step_00000005'}")
        assert_same_curve(resumed, reference[5:])
