"""The MoE layer and the model on simulated cuda:0: no device mix, no CUDA-only constraint broken,
and no host sync but the MoE layer's one (its split sizes), which a dropless layer running
grouped_mm on one GPU does not make either."""

from __future__ import annotations

import pytest

from preload import scenario_result

pytestmark = pytest.mark.simcuda_group("layers")


def _syncs(findings: dict) -> list[tuple[str, str, int]]:
    return [(s["site"], s["phase"], s["count"]) for s in findings["syncs"]]


ONE_SYNC = [("m6/moe/dispatch.py:host_ints", "moe_forward", 1)]


@pytest.mark.parametrize("case, kernel, syncs", [("capacity-fp32-loop", "loop", ONE_SYNC),
                                                 ("dropless-fp32-loop", "loop", ONE_SYNC),
                                                 ("capacity-bf16-autocast-auto", "grouped_mm", ONE_SYNC),
                                                 ("dropless-bf16-cast_on_use-grouped_mm", "grouped_mm", [])])
def test_moe_layer_stays_on_the_device_with_at_most_one_host_sync(simcuda, case, kernel, syncs):
    """The loop reads the rows per expert back, and so does a capacity limit (the kept count is
    data-dependent); a dropless layer on grouped_mm (padding dispatched with weight 0, so T*K rows)
    reads nothing back, forward and backward."""
    result = scenario_result(simcuda("layers"), "moe_layer")[case]
    facts, findings = result["facts"], result["findings"]
    assert findings["problems"] == [] and findings["unchecked_ops"] == {}, findings
    assert _syncs(findings) == syncs, findings["syncs"]
    assert facts["kernel"] == kernel
    assert facts["output_on_device"] and facts["grads_on_device"], facts


# (compute capability, model.moe.expert_kernel, dtype) -> the kernel run, or the refusal's words.
KERNELS = {
    "sm80-auto-bf16": "loop", "sm90-auto-bf16": "grouped_mm", "sm100-auto-bf16": "grouped_mm",
    "sm120-auto-bf16": "loop",
    "sm90-grouped_mm-bf16": "grouped_mm", "sm100-grouped_mm-bf16": "grouped_mm",
    "sm80-grouped_mm-bf16": "this GPU is 8.0", "sm120-grouped_mm-bf16": "this GPU is 12.0",
    "sm80-grouped_mm-fp32": "needs bf16", "sm90-grouped_mm-fp32": "needs bf16",
    "sm100-grouped_mm-fp32": "needs bf16", "sm120-grouped_mm-fp32": "needs bf16",
}


@pytest.mark.parametrize("case", sorted(KERNELS))
def test_expert_kernel_on_cuda_is_fused_or_refused(simcuda, case):
    """torch fuses the CUDA grouped GEMM only for bf16 on compute capability 9.x and 10.x; anywhere
    else it loops over the experts with a host sync per GEMM. auto must not choose it there, and an
    explicit grouped_mm must be refused naming the key (never a silent slow path)."""
    result = scenario_result(simcuda("layers"), "expert_kernel_choice")[case]
    expected = KERNELS[case]
    if expected in ("loop", "grouped_mm"):
        assert result["error"] is None, result["error"]
        assert result["facts"]["kernel"] == expected
        assert result["findings"]["problems"] == [], result["findings"]["problems"]
        # Dropless: only the loop reads the rows per expert back.
        assert _syncs(result["findings"]) == (ONE_SYNC if expected == "loop" else [])
    else:
        assert result["error"] is not None and result["error"].startswith("ConfigError: "), result
        assert "model.moe.expert_kernel=grouped_mm" in result["error"] and expected in result["error"], result


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_model_forward_and_loss_sync_only_in_moe_layers(simcuda, precision):
    """The loss picks its target positions without reading the device (the batch knows how many
    there are), so a micro-batch's only host syncs are its MoE layers'."""
    result = scenario_result(simcuda("layers"), "model_forward_backward")[precision]
    findings = result["findings"]
    assert findings["problems"] == [] and findings["unchecked_ops"] == {}, findings
    assert result["facts"]["moe_layers"] == 2 and result["facts"]["loss_on_device"]
    assert _syncs(findings) == [("m6/moe/dispatch.py:host_ints", "moe_forward", 2)], findings["syncs"]


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_model_built_under_cuda_context_runs_on_the_device(simcuda, precision):
    """``with torch.device("cuda"): MoELayer(...)`` and the model with the Hugging Face block
    options build, and run on the device (rotary tables, q/k norms, shared experts included) with
    no host sync outside the MoE layers. (Simulated CUDA does not model torch's check that a
    generator is on the draw's device: tests/unit/test_model_options.py holds the expert init to
    the host under a device context.)"""
    result = scenario_result(simcuda("layers"), "built_under_cuda_context")
    assert result["error"] is None, result["error"]
    assert result["on_device"]
    run = result[precision]
    findings = run["findings"]
    assert findings["problems"] == [] and findings["unchecked_ops"] == {}, findings
    assert run["facts"]["moe_layers"] == 3 and run["facts"]["loss_on_device"]
    assert _syncs(findings) == [("m6/moe/dispatch.py:host_ints", "moe_forward", 3)], findings["syncs"]
