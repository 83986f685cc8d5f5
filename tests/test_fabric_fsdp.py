"""``FabricMixedPrecisionPlugin`` under Fabric's ``ModelParallelStrategy`` (FSDP2), two CPU processes (gloo).

Fabric converts a model (the plugin's ``convert_module``) before the strategy shards it in ``parallelize_fn``: the
plugin hands the model to its engine again as a sharded model at the first call after that, so that the step works
on each rank's shards with the engine's one collective (overflow flags), as the core ``Amp`` does with
``shard_model``. O1 and O3 train as the core engine does, step for step; O2 is refused with an error that says why
and what to use (the plugin casts the model to half before FSDP shards it, so FSDP's FP32 shards, O2's masters under
FSDP, never exist). The runs: ``tests/fabric_fsdp_script.py``.

The second half of the file runs the loop a Fabric user writes (``tests/hostile_fabric_fsdp_script.py``, in the same
launch): a body and a head optimizer set up after the model, clipping by norm and by value, an overflow on one rank
only, accumulation under ``no_backward_sync``, evaluation forwards between steps, the plugin's reads and
``fabric.log_dict`` on rank 0 only, distributed checkpoints before the first step and mid-run, two models; against the
core ``Amp`` with ``shard_model`` and Fabric's own ``"bf16-mixed"``/``"32-true"``. A hang there is a collective one
rank made alone (the strategy's 60 s timeout, then the launch's).
"""

from __future__ import annotations

import math

import pytest

from tests.launch import rank_results, run_script

pytest.importorskip("lightning.fabric")

INF_AT = 4
CASES = ("plugin:O1", "core:O1", "fabric", "plugin:O3", "core:O3", "refused:O2")

# The loop a Fabric user writes (tests/hostile_fabric_fsdp_script.py), run in the same launch.
STEPS = 8
HEAD_INF, BODY_INF, RESUME_AT = 3, 5, 4
# Per step, which optimizer (body, head) skips: the head's inf is in rank 1's shard at HEAD_INF, the body's at BODY_INF.
SKIPPED = [[i == BODY_INF, i == HEAD_INF] for i in range(STEPS)]
SCALES = [4096.0] * HEAD_INF + [2048.0] * (BODY_INF - HEAD_INF) + [1024.0] * (STEPS - BODY_INF)
CLIPPED_BY_NORM = (1, 3, 4, 7)
USER_CASES = ("plugin:O1", "core:O1", "fabric:bf16-mixed", "plugin:O0", "fabric:32-true", "plugin:O3", "core:O3",
              "resume", "mix:together", "mix:whole_first", "mix:sharded_first", "late:sharded")  # fmt: skip
USER_LOOP = "hostile/"


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """One two-process launch for every case of this file (one costs seconds of start-up on two cores)."""
    out = tmp_path_factory.mktemp("fabric_fsdp")
    cases = (*CASES, *(USER_LOOP + case for case in USER_CASES))
    run_script("fabric_fsdp_script.py", out, timeout=300, MPX_CASES=",".join(cases))
    return rank_results(out)


@pytest.fixture(scope="module")
def ranks(launch):
    """Each rank's results of the plain loop's cases."""
    return [{case: result[case] for case in CASES} for result in launch]


@pytest.fixture(scope="module")
def user(launch):
    """Each rank's results of the user's loop's cases, by their names in ``USER_CASES``."""
    return [{case: result[USER_LOOP + case] for case in USER_CASES} for result in launch]


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
    shards it. ``fabric.setup`` says so (the plugin converts the model there, called by the Fabric whose strategy
    will shard it), naming the level, the strategy and the alternatives."""
    for (result,) in _runs(ranks, "refused:O2"):
        message = result.get("refusal", "")
        assert message.startswith("RuntimeError"), message
        assert result["refused_at"] == "fabric.setup_module", result["refused_at"]
        for words in ("FabricMixedPrecisionPlugin('O2')", "ModelParallelStrategy", "FP32 shards", "fully_shard", "'O1'",
                      "lightning_mpx.MixedPrecisionPlugin", "lightning_mpx.Amp", "shard_model"):  # fmt: skip
            assert words in message, (words, message)
        assert "belong to no model prepared" not in message


# -- the loop a Fabric user writes ----------------------------------------------------------------------------------
def test_o1_trains_as_the_core_engine_with_two_optimizers_and_an_overflow_on_one_rank(user):
    """The whole loop (optimizers set up after the model, clipping by norm and by value, an inf in rank 1's shard
    only, accumulation, evaluations) at O1 is the core ``Amp``'s with ``shard_model``: only the overflowing
    optimizer skips, on both ranks although rank 0 saw no inf (its weights are rank 1's), the scale backs off once
    per overflow, the losses, evaluation losses and weights match to FP32 rounding."""
    for plugin, core in _runs(user, "plugin:O1", "core:O1"):
        assert plugin["sharded"] is True
        assert _close(plugin["losses"], core["losses"], 1e-6)
        assert _close(plugin["evals"], core["evals"], 1e-6)
        assert all(_close(a, b, 1e-5, 1e-7) for a, b in zip(plugin["weights"], core["weights"], strict=True))
    assert user[0]["plugin:O1"]["weights"] == user[1]["plugin:O1"]["weights"]


def test_rank_zero_reads_skips_scales_and_logs_without_a_collective(user):
    """``step_was_skipped``, ``metrics()`` and ``fabric.log_dict`` on rank 0 only (rank 1 goes on to its next step):
    no hang, and what rank 0 reads is the core engine's (which optimizer skipped, the scale, the skip count, the
    telemetry requested at step 0); every step's metrics reach the logger."""
    plugin, core = user[0]["plugin:O1"], user[0]["core:O1"]
    assert plugin["skipped"] == core["skipped"] == SKIPPED
    assert plugin["scales"] == core["scales"] == SCALES
    assert plugin["skipped_steps"] == core["skipped_steps"] == 2.0
    assert plugin["telemetry"] and all(name.rsplit("/", 1)[0] in ("mpx/underflow", "mpx/headroom_doublings")
                                       for name in plugin["telemetry"])  # fmt: skip
    logged = plugin["logged"]
    assert len(logged) == STEPS and all("mpx/loss_scale" in row and "mpx/skipped_steps" in row for row in logged)


def test_clip_gradients_on_the_overflow_step_clips_nothing_on_both_ranks(user):
    """``fabric.clip_gradients(max_norm=...)`` returns each optimizer's norm of its whole gradient, the same on both
    ranks (the core engine's to FP32 rounding), and ``0.0`` for the head at its overflow step on both ranks, although
    only rank 1 holds the inf (its nothing-to-clip test reduces the flag: a DTensor norm on one rank would hang)."""
    for plugin, core in _runs(user, "plugin:O1", "core:O1"):
        for step in CLIPPED_BY_NORM:
            assert _close(plugin["norms"][step], core["norms"][step], 1e-5), step
        assert plugin["norms"][HEAD_INF][1] == 0.0
        assert all(norm == [None, None] for i, norm in enumerate(plugin["norms"]) if i not in CLIPPED_BY_NORM)
    assert user[0]["plugin:O1"]["norms"] == user[1]["plugin:O1"]["norms"]


def test_the_users_loop_at_o1_is_close_to_fabrics_own_bf16_mixed(user):
    """Against Fabric's ``"bf16-mixed"`` on the same units (its overflowing optimizer left out by hand): the losses,
    evaluation losses and clip norms agree to within bfloat16's rounding, step by step."""
    for plugin, fabric in _runs(user, "plugin:O1", "fabric:bf16-mixed"):
        assert _close(plugin["losses"], fabric["losses"], 2e-3)
        assert _close(plugin["evals"], fabric["evals"], 2e-3)
        for step in CLIPPED_BY_NORM:
            for ours, theirs in zip(plugin["norms"][step], fabric["norms"][step], strict=True):
                assert theirs is None or math.isclose(ours, theirs, rel_tol=2e-3), (step, ours, theirs)


def test_o0_is_fabrics_own_32_true_bit_for_bit(user):
    """O0 (FP32, a dynamic scale of powers of two) trains as Fabric's ``"32-true"`` bit for bit, the overflow steps
    skipped as the reference leaves them out."""
    for plugin, fabric in _runs(user, "plugin:O0", "fabric:32-true"):
        assert plugin["sharded"] is True
        assert plugin["losses"] == fabric["losses"]
        assert plugin["weights"] == fabric["weights"]
    assert user[0]["plugin:O0"]["skipped"] == SKIPPED


def test_o3_trains_as_the_core_engine(user):
    """O3 (bfloat16 model and optimizers): the same skips and scales as the core engine, losses and weights to
    within bfloat16's rounding (torch's clip computes a bfloat16 gradient's norm in bfloat16, the core engine in FP32:
    tests/test_fabric_fsdp.py)."""
    for plugin, core in _runs(user, "plugin:O3", "core:O3"):
        assert _close(plugin["losses"], core["losses"], 1e-3)
        assert all(_close(a, b, 2.0**-7, 2.0**-10) for a, b in zip(plugin["weights"], core["weights"], strict=True))
    assert user[0]["plugin:O3"]["skipped"] == user[0]["core:O3"]["skipped"] == SKIPPED
    assert user[0]["plugin:O3"]["scales"] == user[0]["core:O3"]["scales"] == SCALES
    assert user[0]["plugin:O3"]["weights"] == user[1]["plugin:O3"]["weights"]


@pytest.mark.parametrize("k", [0, RESUME_AT])
def test_resume_from_a_distributed_checkpoint_is_bit_equal(user, k):
    """``fabric.save`` before the first step or after ``RESUME_AT`` steps (past an overflow: a backed-off scale, a
    skip), ``fabric.load`` into a fresh Fabric, plugin, model and optimizers, and the plugin's state restored as
    docs/fabric.md says: the remaining steps give the uninterrupted run's losses, skips, scales, skip count and
    weights bit for bit. (The uninterrupted run saves too: torch's distributed checkpoint gives an optimizer without
    state a step with zero gradients, which moves AdamW's step count, so a run that never saves differs.)"""
    for (result,) in _runs(user, "resume"):
        straight, resumed = result["straight"], result[f"resumed{k}"]
        assert resumed["step"] == k
        assert resumed["losses"] == straight["losses"][k:]
        assert resumed["evals"] == straight["evals"][sum(1 for i in (0, 2, 6) if i < k):]
        assert resumed["weights"] == straight["weights"]
    straight, resumed = user[0]["resume"]["straight"], user[0]["resume"][f"resumed{k}"]
    assert resumed["skipped"] == straight["skipped"][k:] == SKIPPED[k:]
    assert resumed["scales"] == straight["scales"][k:] == SCALES[k:]
    assert resumed["skipped_steps"] == straight["skipped_steps"] == 2.0


@pytest.mark.parametrize("order", ["together", "whole_first", "sharded_first"])
def test_a_sharded_and_a_whole_model_are_refused_in_any_order(user, order):
    """A model ``parallelize_fn`` leaves whole (not data parallel: its gradients are never reduced) next to a sharded
    one: whichever is set up first, the first call after both are set up raises a ``ValueError`` on both ranks that
    names both kinds and says to shard every model in ``parallelize_fn``; nothing trains the mix."""
    for (result,) in _runs(user, f"mix:{order}"):
        message = result.get("refusal", "")
        assert result["where"] == "use", result
        assert message.startswith("ValueError"), message
        for words in ("FabricMixedPrecisionPlugin('O1')", "sharded by FSDP (FSDPSequential)",
                      "not sharded (Sequential)", "parallelize_fn", "fully_shard"):  # fmt: skip
            assert words in message, (words, message)


def test_a_second_sharded_model_set_up_mid_run_trains(user):
    """A second model set up after the first one stepped (a GAN set up model by model, a head added mid-run), both
    sharded: set up and trained, the same weights on both ranks (it was refused at ``fabric.setup``, as a model the
    engine took for unsharded)."""
    for (result,) in _runs(user, "late:sharded"):
        assert result["sharded"] is True and result["second_changed"] is True
    assert user[0]["late:sharded"]["second_weights"] == user[1]["late:sharded"]["second_weights"]
