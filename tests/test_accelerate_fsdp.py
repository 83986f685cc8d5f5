"""``lightning_mpx.integrations.accelerate.Accelerator`` with an opt level under Accelerate's FSDP (``fsdp_version=2``
and 1).

The two-process runs (``tests/accelerate_fsdp_script.py``, one launch) go through Accelerate's own FSDP code on CPU
with gloo; Accelerate selects FSDP only on GPU-like devices, so the script tells Accelerate's shared state that the
processes are ``MULTI_GPU`` on device ``cpu`` (the one step no user takes; see its docstring). The references: a
one-process run of the same global batch at the same level with the core ``Amp``, and the norm of the full
gradients gathered from every rank in FP64.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("torch.distributed.fsdp")

from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402

from lightning_mpx.integrations.accelerate import AMP_STATE_NAME, Accelerator, MixedPrecisionKwargs  # noqa: E402
from tests.launch import run_script  # noqa: E402

# fsdp version, level, half dtype, steps, relative tolerance against the one-process run (about the half dtype's
# rounding over a few SGD steps, as tests/test_fsdp_engine.py)
CASES = [
    (2, "O1", "bfloat16", 8, 4e-3), (2, "O2", "bfloat16", 10, 4e-3), (2, "O3", "bfloat16", 8, 4e-3),
    (2, "O2", "float16", 6, 1e-3),
    (1, "O1", "bfloat16", 6, 4e-3), (1, "O2", "bfloat16", 6, 4e-3), (1, "O3", "bfloat16", 6, 4e-3),
    (1, "O2", "float16", 6, 1e-3),
    (2, "O1", "bfloat16", 6, 1e-3, "fp32"),  # O1's Apex-exact FP32 all-gather: MixedPrecisionKwargs(fsdp_gather="fp32")
]
RESUME = (2, "O2", "float16", 8)  # the poison at step 3 backs the scale off before the save (at step 4)
ACCUMULATE = [(2, "O2", "float16", 6), (1, "O2", "float16", 6)]  # against the same cases without accumulation
POISON_AT = 3


def _spec(version, level, dtype, steps, *gather):
    return ":".join(map(str, (version, level, dtype, steps, *gather)))


def _key(case):
    return case[:4] + case[5:]  # without the tolerance


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate_fsdp")
    run_script(
        "accelerate_fsdp_script.py", out, timeout=240, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
        MPX_CASES=",".join(_spec(*_key(case)) for case in CASES), MPX_RESUME=_spec(*RESUME), MPX_STALE="1",
        MPX_BY_HAND="1",
        MPX_ACCUMULATE=",".join(_spec(*case) for case in ACCUMULATE),
    )

    def read(kind, spec):
        name = f"{kind}_{spec.replace(':', '_')}"
        return [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in (0, 1)]

    found = {_key(case): read("case", _spec(*_key(case))) for case in CASES}
    found["resume"] = read("resume", _spec(*RESUME))
    for case in ACCUMULATE:
        found[("accumulate", *case)] = read("accumulate", _spec(*case))
    found["stale"] = read("stale", "1:O2:bfloat16:0")
    found["by_hand"] = read("by_hand", "2:O2:bfloat16:6")
    found["checkpoint"] = out / f"checkpoint_{_spec(*RESUME).replace(':', '_')}"
    return found


@pytest.mark.parametrize("case", CASES, ids=lambda case: _spec(*_key(case)))
def test_sharded_training_follows_one_process_run(results, case):
    version, level, dtype, steps, rtol = case[:5]
    rank0, rank1 = results[_key(case)]
    single = rank0["single"]
    assert len(rank0["losses"]) == steps
    for mine, ref in zip(rank0["losses"], single["losses"]):
        assert mine == pytest.approx(ref, rel=rtol)
    for rank in (rank0, rank1):
        # The engine works on Accelerate's shards: no conversion after sharding, no masters (FSDP's FP32 shards are
        # the masters at O1/O2), no separate MAX all-reduce of the overflow flag.
        assert rank["sharded"] and rank["masters"] == 0 and not rank["reducer"]
        assert rank["param_types"] == (["DTensor"] if version == 2 else ["Parameter"])  # FSDP1: flat parameters
        assert rank["param_dtypes"] == (["torch.bfloat16"] if level == "O3" else ["torch.float32"])
    if version == 2:
        assert rank0["weights"] == rank1["weights"]  # the same full weights on both ranks
        # Batch norm: its own FP32 unit at O1/O2; half at O3 (its default keep_batchnorm_fp32=False).
        assert rank0["island_dtype"] == ("torch.bfloat16" if level == "O3" else "torch.float32")


@pytest.mark.parametrize("case", CASES, ids=lambda case: _spec(*_key(case)))
def test_one_rank_overflow_skips_on_every_rank_with_the_same_scale(results, case):
    version, level, dtype, steps = case[:4]
    rank0, rank1 = results[_key(case)]
    expected = [step == POISON_AT for step in range(steps)]
    assert rank0["skipped"] == rank1["skipped"] == rank0["single"]["skipped"] == expected
    assert rank0["scales"] == rank1["scales"] == rank0["single"]["scales"]
    if dtype == "float16":
        assert rank0["scales"][POISON_AT] == rank0["scales"][0] / 2  # backed off once, on both ranks
    assert rank0["state"] == rank1["state"]  # the engine's checkpoint state is the same on every rank
    assert rank0["overflow_parameters"] and rank1["overflow_parameters"] == []  # only rank 0's shard held the inf
    if version == 2:
        assert rank0["overflow_parameters"] == ["3.weight"]


@pytest.mark.parametrize("case", CASES, ids=lambda case: _spec(*_key(case)))
def test_clip_grad_norm_returns_the_global_norm(results, case):
    for rank in results[_key(case)]:
        for step, (norm, reference) in enumerate(zip(rank["norms"], rank["ref_norms"])):
            if step == POISON_AT:
                assert math.isinf(norm) and math.isinf(reference)
            else:  # accelerator.clip_grad_norm_(model.parameters(), ...): the gathered norm, not one rank's
                assert norm == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("version", [2, 1])
def test_o2_stores_only_the_fp32_shards(results, version):
    for rank in results[version, "O2", "bfloat16", 10 if version == 2 else 6]:
        # Each rank holds its half of the FP32 parameters (uneven shards and FSDP1's padding round up) and no
        # full-size masters (masters == 0 above).
        assert rank["local_param_bytes"] <= rank["full_fp32_bytes"] / 2 + 256


def test_clip_grad_value_clamps_the_unscaled_shards(results):
    for case in CASES:
        for rank in results[_key(case)]:
            # Unscaled first (clamped while scaled by up to 2**12, the largest would be 1e-4 / 2**12), then clamped;
            # at O3 the gradients are bfloat16 (the bound rounds up by less than 2**-7).
            assert 1e-4 <= rank["clipped_value_max"] * (1 + 2**-7) and rank["clipped_value_max"] <= 1e-4 * (1 + 2**-7)


def test_clip_grad_norm_refuses_what_has_no_global_norm(results):
    for rank in results[2, "O2", "bfloat16", 10]:
        assert "under FSDP the global norm" in rank["partial_clip_error"]


@pytest.mark.parametrize("case", ACCUMULATE)
def test_accumulation_matches_the_whole_batch(results, case):
    plain = results[case]
    for rank, whole in zip(results[("accumulate", *case)], plain):
        # Two micro-batches per rank (FSDP2: no reduce-scatter until the last one), one real step, one update.
        assert rank["skipped"] == whole["skipped"] and rank["scales"] == whole["scales"]
        assert rank["losses"] == pytest.approx(whole["losses"], rel=1e-3)
        assert rank["norms"][:POISON_AT] == pytest.approx(whole["norms"][:POISON_AT], rel=1e-3)
        for mine, ref in zip(rank["weights"], whole["weights"]):
            assert mine == pytest.approx(ref, rel=1e-2, abs=1e-3)


def test_a_model_sharded_by_hand_trains_as_one_sharded_by_accelerate(results):
    plain = results[2, "O2", "bfloat16", 10]
    for rank, ref in zip(results["by_hand"], plain):
        # shard_model(model, accelerator.amp, blocks=nn.Linear): the same units and policies as the adapter's.
        assert rank["sharded"] and rank["skipped"] == ref["skipped"][:6]
        assert rank["losses"] == pytest.approx(ref["losses"][:6], rel=1e-6)


def test_fsdp1_optimizer_made_before_the_wrap_is_refused(results):
    for rank in results["stale"]:  # it would train tensors that FSDP1 replaced with its flat shards
        assert "prepare the model first, then make the optimizer from it" in rank["error"]


def test_save_state_load_state_resumes_bit_exactly(results):
    for rank in results["resume"]:
        straight, resumed = rank["straight"], rank["resumed"]
        assert rank["first"]["skipped"][POISON_AT] and resumed["scales"][0] == 2.0**11  # the backed-off scale
        assert resumed["losses"] == straight["losses"] and resumed["scales"] == straight["scales"]
        assert resumed["norms"] == straight["norms"]
        assert rank["resumed_weights"] == rank["straight_weights"]
        assert rank["state_loaded"] == rank["state_saved"]
    saved = sorted(os.listdir(results["checkpoint"]))
    # Accelerate's own FSDP files (distributed checkpoints), and the engine's state once (written by rank 0).
    assert AMP_STATE_NAME in saved and "pytorch_model_fsdp_0" in saved and "optimizer_0" in saved


# -- in one process: what is refused, before anything is sharded ------------------------------------------------------
@pytest.fixture
def fsdp_state(fresh_accelerate_state, monkeypatch):
    """Accelerate's state as on a GPU machine (one process): the Accelerator then selects FSDP."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")  # Accelerate sets it to "true" when given a plugin: restored
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    PartialState._shared_state["device"] = torch.device("cpu")


@pytest.mark.parametrize("version", [2, 1])
def test_the_plugin_gets_the_level_policy(fsdp_state, version):
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version)
    accelerator = Accelerator(
        mixed_precision="O2", fsdp_plugin=plugin, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")]
    )
    assert accelerator.distributed_type == DistributedType.FSDP
    policy = accelerator.state.fsdp_plugin.mixed_precision_policy
    # Gathered in half, reduced in FP32 (FSDP's FP32 shards are the masters); Accelerate's own mode stays "no".
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert accelerator.state.mixed_precision == "no" and accelerator.mixed_precision == "O2"


def test_fsdp_gather_picks_o1_all_gather_dtype(fsdp_state):
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    Accelerator(mixed_precision="O1", fsdp_plugin=plugin, kwargs_handlers=[MixedPrecisionKwargs(fsdp_gather="fp32")])
    assert plugin.mixed_precision_policy.param_dtype is None  # the FP32 parameters gathered as they are


def test_fsdp_gather_is_checked(fsdp_state):
    with pytest.raises(ValueError, match=r"fsdp_gather='bf16'.*valid choices"):
        MixedPrecisionKwargs(fsdp_gather="bf16")
    with pytest.raises(ValueError, match="gather='fp32' does not apply at opt_level='O2'"):
        Accelerator(
            mixed_precision="O2", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
            kwargs_handlers=[MixedPrecisionKwargs(fsdp_gather="fp32")],
        )


def test_on_floor_promote_is_refused_under_fsdp(fsdp_state):
    with pytest.raises(ValueError, match="on_floor='promote' cannot work with FSDP at mixed_precision='O2'"):
        Accelerator(
            mixed_precision="O2", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
            kwargs_handlers=[MixedPrecisionKwargs(on_floor="promote")],
        )


def test_a_policy_of_ones_own_is_refused_with_an_opt_level(fsdp_state):
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    )
    with pytest.raises(ValueError, match="leave mixed_precision_policy unset"):
        Accelerator(mixed_precision="O1", fsdp_plugin=plugin)


def test_deepspeed_is_refused_with_a_pointer_to_its_own_fp16_config(fresh_accelerate_state, monkeypatch):
    with pytest.raises(ValueError, match=r"DeepSpeed.*\"fp16\": \{\"enabled\": true"):
        Accelerator(mixed_precision="O2", deepspeed_plugin=object())  # refused before DeepSpeed is imported
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # as `accelerate launch --use_deepspeed` sets it
    with pytest.raises(ValueError, match="cannot run under DeepSpeed"):
        Accelerator(mixed_precision="O1")


def test_fsdp_plugin_on_cpu_warns_that_nothing_is_sharded(fresh_accelerate_state, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    with pytest.warns(UserWarning, match="the model is not sharded"):
        accelerator = Accelerator(mixed_precision="O2", cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    assert accelerator.distributed_type != DistributedType.FSDP
