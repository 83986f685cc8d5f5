"""A hostile user of stop 62's surfaces (attack63), from the user's side, each against the reference a user compares
with (an FP32 run, ``"bf16-mixed"``):

- FSDP2 at O2 on two CPU ranks (``tests/lightning_fsdp2_half_block_append_script.py``): a block loaded in bfloat16 and
  frozen, an FSDP unit of its own, unfrozen mid-run by appending its parameters to the optimizer's first group (not
  ``add_param_group``): its Adam stepped it in bfloat16 with bfloat16 moments, silently, through Lightning's
  ``ModelParallelStrategy`` and Accelerate's ``fsdp_version=2`` plugin. Now refused at the next step, before anything
  moves, as ``add_param_group`` was.
"""

from __future__ import annotations

import pytest
import torch

from tests.launch import rank_results, run_script


@pytest.fixture(scope="module")
def unfrozen_by_append(tmp_path_factory):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("attack63")
    run_script(
        "lightning_fsdp2_half_block_append_script.py", out, timeout=120, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"
    )
    return {part: rank_results(out, f"{part}_") for part in ("lightning", "accelerate")}


@pytest.mark.parametrize("front", ["lightning", "accelerate"])
def test_fsdp2_o2_half_block_appended_to_a_group_is_refused_at_the_next_step(unfrozen_by_append, front):
    """Before: both ranks stepped the half block (``moved``, bfloat16 moments); after: a ValueError naming its two
    parameters and the fix, at the step after the append, on both ranks, with the block unchanged."""
    prefix = "net." if front == "lightning" else ""
    for rank in unfrozen_by_append[front]:
        assert "unexpected" not in rank, rank["unexpected"]
        assert "error" in rank, f"stepped the half block in half: {rank}"
        assert (
            f"2 half parameter(s) of a model sharded by FSDP at O2: {prefix}first.fc.weight, {prefix}first.fc.bias"
            in rank["error"]
        )
        assert "p.requires_grad" in rank["error"]
        assert rank["steps"] == 2 and rank["moved"] is False
