"""The core engine on a model FSDP2 shards (two CPU processes, gloo): the scaler works on each rank's shards with one
collective per step, and training follows a single-process run of the same global batch.

The script (``tests/fsdp_engine_script.py``) shards by hand with ``fully_shard`` and the user's own policies, so this
holds the engine alone to the references: a one-process run at the same level and an FP32 run, and the norm of the
full gradients gathered in FP64.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.launch import run_script

pytest.importorskip("torch.distributed.fsdp")

# level, half dtype, steps, the relative tolerance against the one-process run at the same level (about the half
# dtype's rounding: bfloat16 2**-8, float16 2**-11, a few steps of SGD on top)
CASES = [("O1", "bfloat16", 10, 4e-3), ("O2", "bfloat16", 20, 4e-3), ("O3", "bfloat16", 10, 4e-3),
         ("O2", "float16", 6, 1e-3)]
POISON_AT = 3
# HSDP: a 2-D mesh of 2 replicas x 1 shard, every gradient replicated on both ranks (counted once in the norm).
HSDP = ("O2", "bfloat16_hsdp", 6, 4e-3)
# AdamW(fused=True) on the shards: skipped on the device by default, against skip_on_device=False (the host read).
FUSED = [("O1", "bfloat16"), ("O2", "float16")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_engine")
    cases = ",".join(f"{level}:{dtype}:{steps}" for level, dtype, steps, _ in CASES) + ",O2:bfloat16:6:hsdp"
    cases += "".join(f",{level}:{dtype}:6:fused" for level, dtype in FUSED)
    run_script("fsdp_engine_script.py", out, timeout=240, MPX_CASES=cases)
    return {
        (level, dtype): [json.loads((out / f"{level}_{dtype}_rank{r}.json").read_text()) for r in (0, 1)]
        for level, dtype, _, _ in [*CASES, HSDP, *((lv, f"{dt}_fused", 6, 0) for lv, dt in FUSED)]
    }


@pytest.mark.parametrize("level, dtype, steps, rtol", [*CASES, HSDP])
def test_sharded_training_follows_one_process_run(results, level, dtype, steps, rtol):
    rank0, rank1 = results[level, dtype]
    sharded, single, fp32 = rank0["sharded"], rank0["single"], rank0["fp32"]
    assert len(sharded["losses"]) == steps
    for mine, ref in zip(sharded["losses"], single["losses"]):
        assert mine == pytest.approx(ref, rel=rtol)
    for mine, ref in zip(sharded["losses"], fp32["losses"]):
        assert mine == pytest.approx(ref, rel=3 * rtol)
    # Stored: FSDP's sharded parameters, FP32 (the masters: no second copy) below O3, half at O3.
    assert sharded["param_types"] == ["DTensor"] and sharded["masters"] == 0
    assert sharded["param_dtypes"] == (["torch.bfloat16"] if level == "O3" else ["torch.float32"])
    if dtype.endswith("_hsdp"):  # a whole replica on each rank: the norm's weights, not the bytes, are the point
        assert sharded["local_param_bytes"] == sharded["full_fp32_bytes"]
    assert sharded["weights"] == rank1["sharded"]["weights"]


@pytest.mark.parametrize("level, dtype, steps, rtol", [*CASES, HSDP])
def test_one_rank_overflow_skips_on_every_rank(results, level, dtype, steps, rtol):
    ranks = [r["sharded"] for r in results[level, dtype]]
    expected = [step == POISON_AT for step in range(steps)]
    single = results[level, dtype][0]["single"]
    for rank in ranks:
        assert rank["skipped"] == expected == single["skipped"]
        assert rank["scales"] == single["scales"]  # the same scale, hysteresis and backoff as one process
        # The record names the parameter on every rank (merged across ranks); only rank 0's own shard held it.
        assert rank["overflow_record_parameters"] == ["3.weight"]
        assert rank["overflow_ranks"] == [0] and rank["overflow_modules"] == ["3"]  # module and rank, as on DDP
    assert ranks[0]["overflow_parameters"] == ["3.weight"] and ranks[1]["overflow_parameters"] == []
    assert ranks[0]["state"] == ranks[1]["state"]  # the engine's checkpoint state is the same on every rank
    if dtype == "float16":
        assert ranks[0]["scales"][POISON_AT] == ranks[0]["scales"][0] / 2  # backed off once, on both ranks


@pytest.mark.parametrize("level, dtype, steps, rtol", [*CASES, HSDP])
def test_clip_norm_is_the_global_norm(results, level, dtype, steps, rtol):
    for rank in (r["sharded"] for r in results[level, dtype]):
        for step, (norm, reference) in enumerate(zip(rank["norms"], rank["ref_norms"])):
            if step == POISON_AT:  # rank 0's inf, in the global norm of both ranks (HSDP: rank 1's copy is finite)
                assert math.isinf(norm)
            else:  # the FP64 norm of the gathered full gradients: not one rank's local norm
                assert norm == pytest.approx(reference, rel=1e-5)


def test_telemetry_on_shards(results):
    for rank in results["O2", "float16"]:
        telemetry = rank["sharded"]["telemetry"]
        underflow = {k: v for k, v in telemetry.items() if k.startswith("mpx/underflow/")}
        assert underflow and all(0.0 <= v <= 1.0 for v in underflow.values())


def test_o2_memory_is_the_fp32_shards(results):
    for rank in results["O2", "bfloat16"]:
        sharded = rank["sharded"]
        # Each rank holds its half of the FP32 parameters (uneven shards round up), and no full-size masters.
        assert sharded["local_param_bytes"] <= sharded["full_fp32_bytes"] / 2 + 256


@pytest.mark.parametrize("level, dtype", FUSED)
def test_fused_adamw_on_shards_skips_on_the_device_as_the_host_read_does(results, level, dtype):
    """FSDP2 with a fused AdamW: the step takes the device path by default (the flags reduced across ranks in the
    step's one collective, handed to the optimizer's step, not read on the host), and training is what the host read
    gives, bit for bit: the same skipped step (rank 0's own shard overflowed) on both ranks, the same scales, losses,
    norms and weights, and the record names the parameter on every rank."""
    expected = [step == POISON_AT for step in range(6)]
    for rank in results[level, f"{dtype}_fused"]:
        device, host = rank["sharded"], rank["host"]
        assert device["on_device"] is True and host["on_device"] is False
        assert device["skipped"] == host["skipped"] == expected
        for key in ("scales", "losses", "norms", "weights", "state"):
            assert device[key] == host[key], key
        assert device["overflow_record_parameters"] == host["overflow_record_parameters"] == ["3.weight"]
        assert device["overflow_ranks"] == [0]
