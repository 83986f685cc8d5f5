"""``FabricMixedPrecisionPlugin`` under Fabric's ``ModelParallelStrategy`` (FSDP2), two CPU processes (gloo).

Fabric converts a model (the plugin's ``convert_module``) before the strategy shards it in ``parallelize_fn``: the
plugin hands the model to its engine again as a sharded model at the first call after that, so that the step works
on each rank's shards with the engine's one collective (overflow flags), as the core ``Amp`` does with
``shard_model``. O1 and O3 train as the core engine does, step for step; O2 is refused with an error that says why
and what to use (the plugin casts the model to half before FSDP shards it, so FSDP's FP32 shards, O2's masters under
FSDP, never exist). The runs: ``tests/fabric_fsdp_script.py``.
"""

from __future__ import annotations

import math

import pytest

from tests.launch import rank_results, run_script

pytest.importorskip("lightning.fabric")

INF_AT = 4
CASES = ("plugin:O1", "core:O1", "fabric", "plugin:O3", "core:O3", "refused:O2")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric_fsdp")
    run_script("fabric_fsdp_script.py", out, timeout=240, MPX_CASES=",".join(CASES))
    return rank_results(out)


def _runs(ranks, *cases):
    """Each rank's results of ``cases`` (a tuple per rank), failing with the traceback of a run that raised."""
    for rank, result in enumerate(ranks):
        for case in cases:
            assert "error" not in result[case], f"{case}, rank {rank}:\n{result[case]['error']}"
    return [tuple(result[case] for case in cases) for result in ranks]


def _close(a, b, rel, tiny=0.0):
    return all((x is None and y is None) or math.isclose(x, y, rel_tol=rel, abs_tol=tiny)
               for x, y in zip(a, b, strict=True))  # fmt: skip


# How close the plugin's run is to the core engine's. O1: FP32 rounding (the clip's norm is torch's over the DTensors
# in the plugin, the engine's own in the core loop). O3: torch's clip computes the norm of bfloat16 gradients in
# bfloat16 (as for an O3 model Fabric does not shard), the core engine in FP32: the clip coefficients differ by
# bfloat16's rounding, and so do the bfloat16 weights by up to one unit in the last place.
# Per level: the losses (relative), the weights (relative, absolute).
TOLERANCE = {"O1": (1e-5, 1e-5, 1e-6), "O3": (1e-3, 2.0**-7, 2.0**-10)}


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_the_plugin_trains_as_the_core_engine_with_shard_model(ranks, level):
    """Plain steps, clipping, a skipped overflow step and accumulation: the plugin's run is the core ``Amp``'s with
    ``shard_model`` (the same skips and scales; losses and final weights to within rounding), on both ranks, and the
    engine knows the model is sharded."""
    losses, rel, tiny = TOLERANCE[level]
    for plugin, core in _runs(ranks, f"plugin:{level}", f"core:{level}"):
        assert plugin["sharded"] is True
        assert plugin["skipped"] == core["skipped"] == [i == INF_AT for i in range(7)]
        assert plugin["scales"] == core["scales"] == [4096.0] * INF_AT + [2048.0] * 3
        assert _close(plugin["losses"], core["losses"], losses)
        assert all(_close(a, b, rel, tiny) for a, b in zip(plugin["weights"], core["weights"], strict=True))
    assert ranks[0][f"plugin:{level}"]["weights"] == ranks[1][f"plugin:{level}"]["weights"]


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_clip_gradients_clips_by_the_norm_of_the_whole_gradient(ranks, level):
    """``fabric.clip_gradients(max_norm=...)`` returns the norm of the full gradient (every rank's shards, computed
    here in FP64 from ``full_tensor()``; in bfloat16 at O3, as torch's clip computes it), the same on both ranks;
    ``0.0`` on the overflow step (nothing to clip)."""
    rel = 1e-5 if level == "O1" else 2.0**-7
    for (run,) in _runs(ranks, f"plugin:{level}"):
        for step, (norm, ref) in enumerate(zip(run["norms"], run["ref_norms"], strict=True)):
            if step < 2:
                assert norm is None
            elif step == INF_AT:
                assert norm == 0.0
            else:
                assert math.isclose(norm, ref, rel_tol=rel), (step, norm, ref)
    assert ranks[0][f"plugin:{level}"]["norms"] == ranks[1][f"plugin:{level}"]["norms"]


def test_o1_is_close_to_fabrics_own_bf16_mixed(ranks):
    """Against Fabric's ``"bf16-mixed"`` (autocast, FP32 gather) on the same ``fully_shard`` units: the same losses
    and clip norms to within bfloat16's rounding, step by step (its overflow step skipped by hand)."""
    for plugin, fabric in _runs(ranks, "plugin:O1", "fabric"):
        assert _close(plugin["losses"][:INF_AT], fabric["losses"][:INF_AT], 2e-3)
        assert _close(plugin["losses"][INF_AT + 1:], fabric["losses"][INF_AT + 1:], 2e-3)
        for step in (2, 3, 5, 6):
            assert math.isclose(plugin["norms"][step], fabric["norms"][step], rel_tol=2e-3)


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_overflow_record_and_telemetry_are_the_core_engines(ranks, level):
    """The overflow in rank 0's shard is named by the parameter's name (not ``param<i>``) and rank; telemetry
    requested before a step's backward is measured on each rank's shards, as the core engine measures it."""
    for plugin, core in _runs(ranks, f"plugin:{level}", f"core:{level}"):
        assert plugin["overflow_parameters"] == core["overflow_parameters"] == ["3.weight"]
        assert plugin["overflow_ranks"] == core["overflow_ranks"] == [0]
        assert plugin["telemetry"] and plugin["telemetry"].keys() == core["telemetry"].keys()
        assert _close(list(plugin["telemetry"].values()), list(core["telemetry"].values()), 1e-6)


def test_o2_is_refused_with_what_to_use(ranks):
    """O2 cannot work: the plugin casts the model to half when ``fabric.setup`` converts it, before the strategy
    shards it. The first call after the set-up says so, naming the level, the strategy and the alternatives."""
    for (result,) in _runs(ranks, "refused:O2"):
        message = result.get("refusal", "")
        assert message.startswith("RuntimeError"), message
        for words in ("FabricMixedPrecisionPlugin('O2')", "ModelParallelStrategy", "FP32 shards", "'O1'",
                      "MixedPrecisionPlugin", "lightning_mpx.Amp", "shard_model"):  # fmt: skip
            assert words in message, (words, message)
        assert "belong to no model prepared" not in message
