"""``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO-1) and DDP communication hooks under DDP, at O1/O2, in
the core loop, the Trainer (ZeRO from ``configure_optimizers``, a checkpoint saved and resumed) and Fabric; two CPU
ranks, one launch (tests/lightning_zero_redundancy_script.py). Each is held to the same code under torch's own bfloat16
autocast or Lightning's ``"bf16-mixed"``, and both ranks' weights to each other.

At O2 ZeRO cannot step the FP32 masters (its local optimizer steps its shard of the half parameters and broadcasts
those): it trained nothing, silently, in every door; it is now refused when the optimizer is prepared.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.launch import rank_results, run_script

pytestmark = pytest.mark.filterwarnings("ignore")

BF16_TOL = 5e-3  # bfloat16 weights (~0.5) round by ~2e-3; the runs train them by ~0.04
SAME_TOL = 1e-4  # the same bfloat16 kernels on the same FP32 weights: O1 against autocast, masters against FP32 ones
MOVED = 0.015  # each run trains the weights past this (several tolerances)


def _diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: Any) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("zero59")
    run_script("lightning_zero_redundancy_script.py", out, timeout=300)
    results = rank_results(out)
    assert results[0]["after"] == results[1]["after"] == {"sum": 2.0}  # the group still works after every case
    return results


def _trained(ranks: list[dict[str, Any]], case: str) -> dict[str, Any]:
    r0, r1 = ranks[0][case], ranks[1][case]
    assert "error" not in r0 and "error" not in r1, f"{case}: {r0.get('error') or r1.get('error')}"
    assert r0["w"] == r1["w"]  # both ranks hold the same weights after the steps
    assert _diff(r0["w"], r0["w0"]) > MOVED
    return r0


@pytest.mark.parametrize("case", ["core/O2/zero", "core/O2/zero_before", "lightning/O2/zero", "fabric/O2/zero"])
def test_zero_redundancy_at_o2_refused_at_set_up_naming_what_to_use(ranks, case):
    """A ZeroRedundancyOptimizer(AdamW) over the model's parameters at O2 (built after ``prepare_model``, before it
    over the FP32 parameters, from ``configure_optimizers``, given to ``fabric.setup``): the engine put the masters in
    the wrapper's groups, ZeRO stepped its local optimizer over the half parameters of its shard (no gradient there)
    and broadcast them: after four steps the weights had moved by their bfloat16 rounding only (0.0009 against 0.04),
    silently, on both ranks. Now refused when the optimizer is prepared, before any step, on both ranks."""
    for rank in ranks:
        error = rank[case].get("error", "")
        assert "ValueError: optimizer=ZeroRedundancyOptimizer cannot step FP32 master weights (opt_level O2)" in error
        assert "Use O1 with ZeroRedundancyOptimizer" in error and "FSDP" in error
        assert "w" not in rank[case]  # refused at set-up, nothing trained


def test_zero_redundancy_at_o1_trains_as_torch_autocast(ranks):
    """O1 bfloat16 keeps the model FP32: ZeRO shards AdamW's state and steps the weights as under torch.autocast,
    in the core loop and in Fabric (the same loop)."""
    bf16 = _trained(ranks, "core/bf16/zero")
    fp32 = _trained(ranks, "core/fp32/zero")
    for case in ("core/O1/zero", "fabric/O1/zero"):
        w = _trained(ranks, case)["w"]
        assert _diff(w, bf16["w"]) < SAME_TOL, case
        assert _diff(w, fp32["w"]) < BF16_TOL, case


def test_lightning_zero_redundancy_at_o1_checkpoint_resumes_as_bf16_mixed(ranks):
    """The Trainer with ZeRO from ``configure_optimizers`` at O1: Lightning's DDPStrategy consolidates ZeRO's state
    before saving (``optimizer_state``), the checkpoint holds AdamW's state of every parameter, and a fresh Trainer
    resumed from it trains on as ``"bf16-mixed"`` resumed the same way."""
    ref = _trained(ranks, "lightning/bf16-mixed/zero")
    o1 = _trained(ranks, "lightning/O1/zero")
    assert o1["ckpt_state"] == ref["ckpt_state"] == 4  # the 4 parameters' moments, from both ranks' shards
    assert _diff(o1["w3"], ref["w3"]) < SAME_TOL
    assert _diff(o1["w"], o1["w3"]) > MOVED  # the resumed run trained
    assert _diff(o1["w"], ref["w"]) < SAME_TOL


@pytest.mark.parametrize("front", ["core", "lightning"])
def test_bf16_compress_hook_at_o2_trains_as_the_same_hook_under_torch_bf16(ranks, front):
    """``ddp_model.register_comm_hook(None, bf16_compress_hook)`` at O2 (the half model's gradients reduced in
    bfloat16, then the FP32 masters stepped) against the same hook under torch.autocast / ``"bf16-mixed"``: the half
    weights to bfloat16's rounding, the masters to the reference's FP32 weights. (Lightning's
    ``DDPStrategy(ddp_comm_hook=...)`` registers a hook on CUDA only: here the module registers it on
    ``trainer.model`` in ``on_train_start``.)"""
    ref = _trained(ranks, "core/bf16/hook" if front == "core" else "lightning/bf16-mixed/hook")
    o2 = _trained(ranks, f"{front}/O2/hook")
    assert _diff(o2["w"], ref["w"]) < BF16_TOL
    assert _diff(o2["m"], ref["w"]) < (2e-3 if front == "core" else SAME_TOL)
    if front == "core":
        assert _diff(_trained(ranks, "core/O1/hook")["w"], ref["w"]) < SAME_TOL
