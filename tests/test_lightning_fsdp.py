"""MixedPrecisionPlugin under Lightning's FSDP strategies: ``ModelParallelStrategy`` (FSDP2) and ``FSDPStrategy``
(FSDP1), on two CPU processes (gloo) in one launch of ``tests/lightning_fsdp_script.py``, against the same training in
one process (the same global batches), and the plugin's own contract with Lightning's ``FSDPPrecision``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from lightning_mpx import MixedPrecisionPlugin
from tests.launch import rank_results, run_script
from tests.lightning_fsdp_script import CLIP, INF_AT, batches, reference
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

TRAIN = [f"{s}:{level}:bfloat16:train" for s in ("fsdp2", "fsdp1") for level in ("O1", "O2", "O3")]
RESUME = ["fsdp2:O2:float16:resume", "fsdp1:O2:float16:resume"]
ACCUM = ["fsdp2:O2:bfloat16:accum"]
FP16 = ["fsdp2:O1:float16:train", "fsdp1:O2:float16:train"]  # float16 through the dynamic scale (kept few: slow on CPU)
# AdamW(fused=True) under FSDP2: the default skips on the device; "fusedhost" reads the flag on the host.
FUSED = ["fsdp2:O2:bfloat16:fused", "fsdp2:O2:bfloat16:fusedhost"]
CASES = TRAIN + FP16 + ACCUM + RESUME + FUSED
# bfloat16 rounds to 2**-8 (3.9e-3) relative. The sharded run sums two half-batch gradients in FP32 where the
# reference computes one whole-batch gradient in half: measured over 20 steps, the losses differ by at most 4.0e-3
# relative (FSDP1 O3), the gradient norms by 1.1e-2 (O1), so the tolerances are two roundings and three times that
# (over 10 steps, stop 64: at most 1.6e-4 and 1.5e-3).
LOSS_TOL = 8e-3
NORM_TOL = 3e-2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lightning_fsdp")
    run_script("lightning_fsdp_script.py", out, timeout=300, MPX_CASES=",".join(CASES))
    return {case: rank_results(out, prefix=case.replace(":", "_") + "_") for case in CASES}


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, ...], dict[str, Any]]:
    """One-process runs by (level, dtype, kind), made once: FSDP2 and FSDP1 compare with the same run."""
    return {}


def _finite(values: list[Any]) -> list[float]:
    return [float(v) for v in values]


@pytest.mark.parametrize("case", TRAIN + FP16 + ACCUM)
def test_sharded_training_matches_one_process_on_the_global_batch(runs, references, case):
    """Losses follow the one-process run within half rounding; the ranks skip the step whose gradient is inf on
    rank 0 only, together, and end with the same scale and the same weights; gradient_clip_val clips by the global
    norm (the engine's norm equals the norm of the gathered gradients, and the step sees that norm clipped)."""
    strategy, level, dtype, kind = case.split(":")
    ranks = runs[case]
    if (level, dtype, kind) not in references:
        references[level, dtype, kind] = reference(level, dtype, kind)
    ref = references[level, dtype, kind]
    steps = batches(kind) // 2 if kind == "accum" else batches(kind)
    for r in ranks:
        assert r["world_size"] == 2 and r["global_step"] == steps
        assert r["skipped"] == ref["skipped"] == [1]  # the inf step, on both ranks (rank 1's gradients were finite)
        assert r["scale"] == ref["scale"]
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["grad_norms"] == ranks[1]["grad_norms"]
    losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert len(losses) == len(ref["losses"]) == batches(kind)
    assert losses == pytest.approx(ref["losses"], rel=LOSS_TOL)
    assert losses[-1] < losses[0]  # it trained

    # Clipping by the global norm: only the inf step has a non-finite norm, and it was not stepped.
    norms, engine, stepped = ranks[0]["grad_norms"], _finite(ranks[0]["engine_norms"]), ranks[0]["stepped_norms"]
    assert [math.isinf(n) for n in norms] == [i == INF_AT for i in range(steps)]
    assert [math.isinf(n) for n in engine] == [i == INF_AT for i in range(steps)]
    finite = [n for n in norms if math.isfinite(n)]
    assert [e for e in engine if math.isfinite(e)] == pytest.approx(finite, rel=1e-5)
    # The clip scales the gradients in their own dtype: FP32 shards at O1/O2, half ones at O3.
    assert stepped == pytest.approx([min(n, CLIP) for n in finite], rel=4e-3 if level == "O3" else 1e-5)
    if kind == "train":  # (accumulated gradients, averaged over two batches, stay below the clip)
        assert any(n > CLIP for n in finite) and any(n < CLIP for n in finite)  # both sides of the clip
    assert finite == pytest.approx([n for n in ref["grad_norms"] if math.isfinite(n)], rel=NORM_TOL)


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1"])
def test_fsdp_shards_are_the_masters_at_o2(runs, strategy):
    """At O2 each rank holds its half of the model in FP32 (FSDP's shards, which the optimizer steps) and no FP32
    master copy; the half weights exist only while FSDP has gathered them for a unit's forward and backward."""
    for r in runs[f"{strategy}:O2:bfloat16:train"]:
        assert r["masters"] == 0
        assert r["local_param_dtypes"] == ["torch.float32"]
        # 5508 parameters, 22032 bytes in FP32: each rank stores its shard (FSDP1 pads its flat parameters).
        assert r["full_param_bytes"] == 22032
        assert r["local_param_bytes"] <= r["full_param_bytes"] // 2 + 64
        assert "master_weights" in r["state_keys"]
    for r in runs[f"{strategy}:O3:bfloat16:train"]:
        assert r["local_param_dtypes"] == ["torch.bfloat16"]
    for r in runs[f"{strategy}:O1:bfloat16:train"]:
        assert r["local_param_dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("case", RESUME)
def test_resume_from_the_strategys_checkpoint_is_bit_exact(runs, case):
    """float16 with a dynamic scale (an overflow at step 2, growth every 4 steps): two epochs straight and the second
    epoch resumed with ``ckpt_path=`` from the first epoch's checkpoint end with the same weights, bit for bit, and
    the same scaler state; the plugin's state is in the checkpoint once (Lightning's metadata, written by rank 0),
    not in the ranks' shards."""
    from torch.distributed.checkpoint import FileSystemReader

    for r in runs[case]:
        assert r["global_step"] == 10
        assert r["params"] == r["straight"]
        assert r["resumed_state"] == r["straight_state"]
        assert r["skipped"] == r["straight_skipped"] == [1]
    assert runs[case][0]["params"] == runs[case][1]["params"]
    path = Path(runs[case][0]["checkpoint"])
    meta = torch.load(path / "meta.pt", weights_only=False)
    assert meta["MixedPrecisionPlugin"]["scalers"][0]["scale"] != 1024.0  # the state of the run, not the start
    sharded = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert not any("MixedPrecisionPlugin" in key or "scalers" in key for key in sharded)


# -- the plugin as Lightning's FSDPPrecision -------------------------------------------------------------------------
def test_no_fsdp_precision_behaviour_is_inherited():
    """FSDPStrategy takes only an FSDPPrecision, so the plugin is one; nothing of FSDPPrecision's own behaviour
    (autocast, input and output casts, init dtypes, its ShardedGradScaler) reaches a run with any strategy."""
    inherited = [
        name
        for name, value in vars(FSDPPrecision).items()
        if not name.startswith("__") and getattr(MixedPrecisionPlugin, name) is value
    ]
    assert inherited == []
    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
    assert isinstance(plugin, FSDPPrecision)
    batch = {"x": torch.ones(2), "ids": torch.arange(2)}
    assert plugin.convert_input(batch) is batch and plugin.convert_output(batch) is batch
    with plugin.tensor_init_context(), plugin.module_init_context():
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32
    FSDPStrategy().precision_plugin = plugin  # accepted (a TypeError for any other Precision)
    config = plugin.mixed_precision_config
    assert (config.param_dtype, config.reduce_dtype) == (torch.bfloat16, torch.float32)
    # Where FSDP should not cast, an empty MixedPrecision (FSDP's own default: no casts), which Lightning's
    # ThroughputMonitor can read.
    empty = MixedPrecisionPlugin("O0").mixed_precision_config
    assert (empty.param_dtype, empty.reduce_dtype, empty.buffer_dtype) == (None, None, None)


def test_single_device_training_is_unchanged_by_being_an_fsdp_precision():
    """O2 on one device with clipping: the plugin trains as before (a half model, FP32 masters, FP32 logits)."""
    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
    model = Classifier()
    make_trainer(plugin, max_steps=4, gradient_clip_val=1.0).fit(model, loader(classification_data()))
    assert model.logits_dtype == torch.float32 and model.hidden_dtypes["train"] == torch.bfloat16
    assert len(plugin.amp.master_weights) == 1


def test_deepspeed_is_refused_with_a_pointer_to_its_own_config():
    """DeepSpeed (a DDPStrategy subclass) runs its own fp16 engine: refused when its setup hands the model to the
    plugin, before DeepSpeed starts (deepspeed is not installed here: the strategy is built without it)."""
    plugin = MixedPrecisionPlugin("O2")
    trainer = make_trainer(plugin)
    trainer._accelerator_connector.strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    model = Classifier()
    model.trainer = trainer
    with pytest.raises(ValueError, match=r"DeepSpeed runs its own fp16/bf16 engine.*DeepSpeed's config"):
        plugin.convert_module(model)
    assert next(model.parameters()).dtype == torch.float32  # refused before converting anything


def test_fused_adamw_under_fsdp2_skips_on_the_device_as_the_host_read_does(runs):
    """A Trainer under ModelParallelStrategy with AdamW(fused=True) and nothing set: the step takes the device path
    (no host read of the flag in the step), and the fit is the host read's, bit for bit: the step with rank 0's inf
    skipped on both ranks, the same scale, losses, clipped norms and weights."""
    device, host = runs[FUSED[0]], runs[FUSED[1]]
    for d, h in zip(device, host):
        assert d["on_device"] == [True] and h["on_device"] == [False]
        assert d["skipped"] == h["skipped"] and sum(d["skipped"]) == 1
        for key in ("params", "losses", "scale", "scalers", "grad_norms", "engine_norms"):
            assert d[key] == h[key], key
    assert device[0]["params"] == device[1]["params"]
