"""Hostile use of the Accelerate adapter and the Trainer plugin under FSDP2 (two CPU processes, gloo, one launch of
tests/hostile_fsdp2_doors_script.py): a tiny GPT with tied ``wte``/``lm_head`` and a sharded unit holding frozen and
trainable parameters, an inf on rank 1 only, against Accelerate's own ``mixed_precision="bf16"`` and the gathered FP64
gradient norm; the Trainer's distributed checkpoints saved before the first step and after the skipped one."""

from __future__ import annotations

import math

import pytest

from tests.launch import rank_results, run_script

pytest.importorskip("accelerate")

from tests.hostile_fsdp2_doors_script import CLIP, INF_AT, STEPS  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_doors")
    run_script("hostile_fsdp2_doors_script.py", out, timeout=240, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return rank_results(out)


def test_accelerate_clips_the_trainable_parameters_of_an_optimizer_that_holds_frozen_ones(ranks):
    """``clip_grad_norm_([p for p in model.parameters() if p.requires_grad])`` with the optimizer made from
    ``model.parameters()``: Accelerate's own bf16 run clips them; the adapter refused them under FSDP as "a part of
    the optimizer's parameters". It returns the global norm (the tied weight counted once), inf on the step whose
    gradient rank 1 alone made inf, which both ranks skip."""
    for name in ("acc_O2", "acc_bf16"):
        for rank in ranks:
            assert "error" not in rank[name], rank[name].get("error")
            norms, refs = rank[name]["norms"], rank[name]["ref_norms"]
            assert len(norms) == STEPS
            for step, (norm, ref) in enumerate(zip(norms, refs)):
                if name == "acc_O2" and step == INF_AT:
                    assert math.isinf(norm) and math.isinf(ref)
                else:
                    assert norm == pytest.approx(ref, rel=1e-5)
    for rank in ranks:
        assert rank["acc_O2"]["skipped"] == [step == INF_AT for step in range(STEPS)]
        assert rank["acc_bf16"]["losses"][0] == pytest.approx(rank["acc_O2"]["losses"][0], rel=1e-3)
        assert rank["acc_O2"]["frozen_unchanged"] and rank["acc_bf16"]["frozen_unchanged"]


def test_accelerate_o2_exports_and_restores_the_fp32_shards(ranks):
    """``get_state_dict`` gives the FP32 values trained (FSDP's FP32 shards are the masters), as Accelerate's own bf16
    run gives FP32, the tied weight once; ``save_state``/``load_state`` into a fresh accelerator restores the weights
    and the engine's state (the skipped step)."""
    for name in ("acc_O2", "acc_bf16"):
        zero = ranks[0][name]
        assert zero["state_dtypes"] == ["torch.float32"] and zero["state_is_shards"] and zero["tied_in_state"]
        for rank in ranks:
            assert rank[name]["unwrapped_dtypes"] == ["torch.float32"]
    for rank in ranks:
        o2 = rank["acc_O2"]
        assert o2["state_restored"] and o2["weights_restored"] and o2["skipped_steps"] == [INF_AT]


def test_trainer_resumes_sharded_checkpoints_before_the_first_step_and_after_a_skipped_one(ranks):
    """ModelParallelStrategy, O2 float16: checkpoints saved with ``trainer.save_checkpoint`` (distributed) before the
    first step (the initial scale) and after the step rank 1's inf skipped (the halved scale, one skipped step)
    resume to the straight run's losses, norms, scale and weights, bit for bit; ``gradient_clip_val`` clips by the
    gathered norm; the frozen parameters of the shared unit stay as they were."""
    straight = [rank["straight"] for rank in ranks]
    for rank in straight:
        assert "error" not in rank, rank.get("error")
        assert rank["saved"]["0"].startswith("[{'scale': 1024.0") and "'overflows': 0" in rank["saved"]["0"]
        assert rank["saved"]["2"].startswith("[{'scale': 512.0") and "'overflows': 1" in rank["saved"]["2"]
        assert rank["skipped"] == [1] and rank["frozen_unchanged"]
        finite = [(n, e) for n, e in zip(rank["norms"], rank["engine_norms"]) if math.isfinite(n)]
        assert len(finite) == STEPS - 1 and all(n > CLIP for n, _ in finite)
        assert [e for _, e in finite] == pytest.approx([n for n, _ in finite], rel=1e-5)
    assert straight[0]["params"] == straight[1]["params"] and straight[0]["scalers"] == straight[1]["scalers"]
    for rank, whole in zip(ranks, straight):
        for name, start in (("from0", 0), ("from2", 2)):
            resumed = rank[name]
            assert "error" not in resumed, resumed.get("error")
            assert resumed["global_step"] == STEPS
            assert resumed["losses"] == whole["losses"][start:] and resumed["norms"] == whole["norms"][start:]
            assert resumed["params"] == whole["params"] and resumed["scalers"] == whole["scalers"]
            assert resumed["skipped"] == whole["skipped"]
