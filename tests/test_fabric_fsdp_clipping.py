"""Clipping and overflow under FSDP through Fabric's two FSDP strategies (one two-rank gloo launch of
tests/fabric_fsdp_clipping_script.py): ``FSDPStrategy`` (FSDP1, whose clip is FSDP's own ``clip_grad_norm_`` and
bypasses the plugin's ``main_params``) and ``ModelParallelStrategy`` (FSDP2, torch's clip over the DTensors), against
Fabric's own precisions under the same strategy and an unsharded FP32 run; the Trainer's clip by value under FSDP2 at
O2. The Trainer's clip by norm under FSDP2 at O2 and Accelerate's ``clip_grad_norm_`` under FSDP2 at O2 (an inf on one
rank) are tested in tests/test_lightning_fsdp2_llama_lora.py and tests/test_hostile_fsdp2_doors.py."""

from __future__ import annotations

import math

import pytest

from tests.fabric_fsdp_clipping_script import CLIP, INF_AT, STEPS
from tests.launch import rank_results, run_script


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_clip54")
    run_script("fabric_fsdp_clipping_script.py", out, timeout=240, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return rank_results(out)


def _case(rank, name):
    assert "error" not in rank[name], rank[name]["error"]
    return rank[name]


@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_fabric_clip_under_fsdp_takes_the_unscaled_norm_once_as_bf16_mixed_and_fp32(ranks, strategy):
    """O1 bfloat16 with a dynamic scale of 2**12: ``fabric.clip_gradients(max_norm=)`` returns the FP32 run's norm (a
    norm of the scaled gradients would be 4096 times it); a second clip in the same step returns ``max_norm`` (the
    gradients are not unscaled again); ``clip_val=`` between; the weights follow Fabric's ``bf16-mixed`` and FP32."""
    ref = _case(ranks[0], "ref")
    for rank in ranks:
        mine, theirs = _case(rank, f"clip:{strategy}:O1"), _case(rank, f"clip:{strategy}:bf16-mixed")
        assert mine["norms"][0::2] == pytest.approx(ref["norms"], rel=2e-3)
        assert mine["norms"][0::2] == pytest.approx(theirs["norms"][0::2], rel=2e-3)
        assert mine["norms"][1::2] == pytest.approx([CLIP, CLIP], rel=1e-4)  # the second clip: already clipped
        assert mine["weights"] == pytest.approx(ref["weights"], abs=1e-3)  # bfloat16 compute
        assert mine["weights"] == pytest.approx(theirs["weights"], abs=1e-3)
    assert ranks[0][f"clip:{strategy}:O1"] == ranks[1][f"clip:{strategy}:O1"]


@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_fabric_o2_under_fsdp_is_refused_naming_the_strategy_and_the_alternatives(ranks, strategy):
    for rank in ranks:
        refusal = _case(rank, f"o2:{strategy}")["refusal"]
        assert refusal.startswith("RuntimeError: FabricMixedPrecisionPlugin('O2') cannot train a model sharded by FSDP")
        assert "opt_level='O1'" in refusal and "MixedPrecisionPlugin" in refusal


@pytest.mark.parametrize("mode", ["strict", "lenient"])
@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_float16_inf_on_one_rank_skips_both_and_clips_as_16_mixed(ranks, strategy, mode):
    """An inf in rank 1's shard only: both ranks skip that step, the scale backs off once (4096 to 2048), the
    weights stay identical on both ranks and follow Fabric's ``16-mixed``. The clip's return on that step: FSDP1's
    own clip returns inf whatever ``error_if_nonfinite`` says, as under ``16-mixed``; under FSDP2 ``16-mixed`` raises
    with the default ``error_if_nonfinite=True`` where the plugin returns ``0.0`` (docs/fabric.md, "Overflow with
    clipping"), and both return inf with ``False``."""
    for rank in ranks:
        mine, theirs = _case(rank, f"inf:{strategy}:O1:{mode}"), _case(rank, f"inf:{strategy}:16-mixed:{mode}")
        assert mine["skipped"] == theirs["skipped"] == [step == INF_AT for step in range(STEPS)]
        assert mine["scales"][-1] == theirs["scales"][-1] == 2048.0
        assert max(mine["scales"]) == 4096.0
        finite = [n for step, n in enumerate(mine["norms"]) if step != INF_AT]
        assert finite == pytest.approx([n for s, n in enumerate(theirs["norms"]) if s != INF_AT], rel=2e-3)
        assert mine["weights"] == pytest.approx(theirs["weights"], abs=1e-5)
        norm, their_norm = mine["norms"][INF_AT], theirs["norms"][INF_AT]
        if strategy == "fsdp1" or mode == "lenient":
            assert math.isinf(norm) and math.isinf(their_norm)
        else:
            assert norm == 0.0 and str(their_norm).startswith("RuntimeError: The total norm of order 2.0")
    for mode_case in (f"inf:{strategy}:O1:{mode}",):
        assert ranks[0][mode_case]["weights"] == ranks[1][mode_case]["weights"]


def test_trainer_clip_by_value_under_fsdp2_at_o2_follows_bf16_mixed_and_fp32(ranks):
    """``gradient_clip_algorithm="value"`` (the plugin's ``clip_gradients`` on each rank's shards of the unscaled
    gradients) at O2 bfloat16 under ``ModelParallelStrategy``: the gathered weights are the same on both ranks and
    follow Lightning's own ``bf16-mixed`` and the unsharded FP32 run."""
    ref = _case(ranks[0], "ref_value")["weights"]
    for rank in ranks:
        mine, theirs = _case(rank, "trainer_value:O2")["weights"], _case(rank, "trainer_value:bf16-mixed")["weights"]
        assert mine == pytest.approx(ref, abs=1e-3)  # bfloat16 compute
        assert mine == pytest.approx(theirs, abs=1e-3)
    assert ranks[0]["trainer_value:O2"]["weights"] == ranks[1]["trainer_value:O2"]["weights"]
