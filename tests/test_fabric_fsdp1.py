"""``FabricMixedPrecisionPlugin`` under Fabric's ``FSDPStrategy`` (FSDP1, litgpt's multi-GPU default), two CPU
processes (gloo), bfloat16.

Fabric's ``FSDPStrategy`` takes only an ``FSDPPrecision``: the plugin is one (every method replaced, as the Trainer
plugin) and gives the strategy the opt level's FSDP1 ``MixedPrecision``. Fabric converts the model (the plugin's
``convert_module``) and then wraps it; the plugin's first call after ``fabric.setup`` hands the FSDP1 wrapper to its
engine as a sharded model. O0, O1 and O3 train as the core ``Amp`` on the same FSDP1-wrapped model, and as Fabric's
own ``"32-true"``/``"bf16-mixed"``; O2 is refused with an error that says why and what to use. The runs:
``tests/fabric_fsdp1_script.py`` (one launch for every case); the first tests need no launch.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch

from tests.launch import rank_results, run_script

pytest.importorskip("lightning.fabric")

from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.precision.fsdp import FSDPPrecision  # noqa: E402
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy  # noqa: E402
from lightning.fabric.utilities.throughput import _plugin_to_compute_dtype  # noqa: E402
from torch.distributed.fsdp import MixedPrecision  # noqa: E402

from lightning_mpx import FabricMixedPrecisionPlugin  # noqa: E402
from lightning_mpx.integrations.fsdp import fsdp1_mixed_precision  # noqa: E402
from tests.fabric_fsdp1_script import USER_SETUPS, CPUFSDPStrategy  # noqa: E402

INF_AT, STEPS, RESUME_AT = 4, 7, 5
CASES = ("plugin:O1", "core:O1", "plugin:O1:root_only", "plugin:O1:empty_init", "fabric:bf16-mixed", "plugin:O0",
         "fabric:32-true", "plugin:O3", "core:O3", "refused:O2", "resume:full", "resume:sharded")  # fmt: skip
SKIPPED = [i == INF_AT for i in range(STEPS)]
SCALES = [4096.0] * INF_AT + [2048.0] * (STEPS - INF_AT)


# -- without a launch -----------------------------------------------------------------------------------------------
def test_fabrics_fsdp_strategy_accepts_the_plugin():
    """``Fabric(strategy=FSDPStrategy(...), plugins=[plugin])`` is accepted (Fabric refused it: "The FSDP strategy can
    only work with the `FSDPPrecision` plugin"), and the strategy's ``MixedPrecision`` is the opt level's FSDP1 policy
    (O1: gathered in half, reduced in FP32, as the Trainer plugin's)."""
    plugin = FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(), plugins=[plugin])
    assert fabric.strategy.precision is plugin
    config = fabric.strategy.mixed_precision_config
    assert config == fsdp1_mixed_precision(plugin)
    assert (config.param_dtype, config.reduce_dtype, config.buffer_dtype) == (torch.bfloat16, torch.float32, None)
    # O0: an empty policy, which FSDP treats as none (not FSDPPrecision's "32-true" policy, which casts buffers too).
    o0 = FabricMixedPrecisionPlugin("O0").mixed_precision_config
    assert o0 == MixedPrecision(_module_classes_to_ignore=())


def test_every_fsdp_precision_method_is_replaced():
    """None of ``FSDPPrecision``'s behaviour (autocast, its ``ShardedGradScaler``, its input casts and init dtypes)
    reaches the plugin under any strategy: each of its methods and properties is the plugin's own."""
    own = [name for name, value in vars(FSDPPrecision).items()
           if not name.startswith("__") and (callable(value) or isinstance(value, property))]  # fmt: skip
    assert "mixed_precision_config" in own and "optimizer_step" in own
    inherited = [name for name in own if getattr(FabricMixedPrecisionPlugin, name) is getattr(FSDPPrecision, name)]
    assert inherited == []
    # FSDPPrecision's attribute is a read-only view (ported code reads the scale there); none of the methods above
    # reads it, and one that called scale() on it would be refused, never scale twice.
    with pytest.raises(RuntimeError, match="read-only view"):
        FabricMixedPrecisionPlugin("O1", half_dtype="float16").scaler.scale(torch.ones(()))
    assert FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16").scaler is None  # FSDPPrecision's for "bf16-mixed"


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_other_strategies_see_what_they_saw_before(level):
    """Under single device, DDP and ModelParallelStrategy the plugin being an ``FSDPPrecision`` changes nothing
    Fabric reads: its throughput monitor's compute dtype is still FP32 (what it said for a plain ``Precision``), and
    ``fabric.init_module()`` builds in the default dtype (``FSDPPrecision``'s would switch it to the half dtype)."""
    plugin = FabricMixedPrecisionPlugin(level, half_dtype="bfloat16")
    assert _plugin_to_compute_dtype(plugin) == torch.float32
    for strategy in (SingleDeviceStrategy(device=torch.device("cpu")), DDPStrategy(),
                     ModelParallelStrategy(lambda model, mesh: model)):  # fmt: skip
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin])
        assert fabric.strategy.precision is plugin
        with fabric.init_module() if isinstance(strategy, SingleDeviceStrategy) else contextlib.nullcontext():
            assert torch.nn.Linear(2, 2).weight.dtype == torch.float32


# -- the launch -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One two-process launch for every case of this file (one costs seconds of start-up on two cores)."""
    out = tmp_path_factory.mktemp("fabric_fsdp1")
    cases = (*CASES, *(USER_SETUPS + case for case in FSDP_CASES))
    run_script("fabric_fsdp1_script.py", out, timeout=420, MPX_CASES=",".join(cases))
    return rank_results(out)


def _runs(ranks, *cases):
    """Each rank's results of ``cases`` (a tuple per rank), failing with the traceback of a run that raised."""
    for rank, result in enumerate(ranks):
        for case in cases:
            assert "error" not in result[case], f"{case}, rank {rank}:\n{result[case]['error']}"
    return [tuple(result[case] for case in cases) for result in ranks]


def _clean(name):
    return name.replace("_fsdp_wrapped_module.", "")


def _close(a, b, rel, tiny=0.0):
    return all((x is None and y is None) or math.isclose(x, y, rel_tol=rel, abs_tol=tiny)
               for x, y in zip(a, b, strict=True))  # fmt: skip


def test_fabric_wraps_the_model_with_the_plugins_policy(ranks):
    """The model Fabric set up is an FSDP1 wrapper with the level's ``MixedPrecision`` (O1: bfloat16 gather, FP32
    reduce; O3: the half model, its root inputs cast), and the plugin's engine took it as sharded."""
    for o1, o3 in _runs(ranks, "plugin:O1", "plugin:O3"):
        assert o1["wrapped"] == o3["wrapped"] == "FullyShardedDataParallel"
        assert "param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=None" in o1["mixed_precision"]
        assert "cast_root_forward_inputs=True" in o3["mixed_precision"]
        assert o1["sharded"] is o3["sharded"] is True


# How close the plugin's run is to the core engine's. O1: FP32 rounding (the clip's norm is FSDP1's own in the plugin,
# the engine's in the core loop). O3: FSDP1's clip returns the norm in the gradients' bfloat16 (it clips with the
# FP32 one): the clip coefficients agree, the weights to one unit in bfloat16's last place.
TOLERANCE = {"O1": (1e-6, 1e-6, 1e-7), "O3": (1e-4, 2.0**-7, 2.0**-10)}


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_the_plugin_trains_as_the_core_engine_on_the_same_fsdp1_model(ranks, level):
    """Plain steps, clipping, an overflow on rank 0 only and accumulation under ``no_backward_sync``: the plugin's run
    is the core ``Amp``'s on the same FSDP1-wrapped model (the same skips on both ranks, the same scales; losses and
    final weights to within rounding), and both ranks end with the same weights."""
    losses, rel, tiny = TOLERANCE[level]
    for plugin, core in _runs(ranks, f"plugin:{level}", f"core:{level}"):
        assert plugin["skipped"] == core["skipped"] == SKIPPED
        assert plugin["scales"] == core["scales"] == SCALES
        assert plugin["skipped_steps"] == core["skipped_steps"] == 1.0
        assert _close(plugin["losses"], core["losses"], losses)
        assert _close(plugin["weights"], core["weights"], rel, tiny)
    assert ranks[0][f"plugin:{level}"]["weights"] == ranks[1][f"plugin:{level}"]["weights"]


def test_without_auto_wrap_the_root_unit_is_handed_to_the_engine(ranks):
    """Without ``auto_wrap_policy`` the FSDP1 wrapper Fabric puts around the model is its only unit (nothing in the
    model the plugin converted is an FSDP module): the plugin finds the wrapper, its engine trains it as sharded, as
    the core engine trains the model wrapped in units (the same skips and scales, losses and weights to FP32
    rounding)."""
    for plugin, core in _runs(ranks, "plugin:O1:root_only", "core:O1"):
        assert plugin["sharded"] is True
        assert plugin["skipped"] == SKIPPED and plugin["scales"] == SCALES
        assert _close(plugin["losses"], core["losses"], 1e-5)
        assert _close(plugin["weights"], core["weights"], 1e-5, 1e-6)
        assert plugin["overflow_parameters"] == ["0.weight"]  # the model's own name, without FSDP1's segments


def test_a_model_built_on_the_meta_device_trains(ranks):
    """litgpt builds its model in ``fabric.init_module(empty_init=True)`` (the meta device; FSDP1 materializes it when
    Fabric wraps it, after the plugin converted it): the engine takes the wrapper as sharded, and the run skips the
    overflow step on both ranks and backs off its scale as the model built on the CPU does (other initial weights)."""
    for (run,) in _runs(ranks, "plugin:O1:empty_init"):
        assert run["built_on"] == "meta"
        assert run["sharded"] is True
        assert run["skipped"] == SKIPPED and run["scales"] == SCALES
        assert all(math.isfinite(loss) for loss in run["losses"])
    assert ranks[0]["plugin:O1:empty_init"]["weights"] == ranks[1]["plugin:O1:empty_init"]["weights"]


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_overflow_record_and_telemetry_are_the_core_engines(ranks, level):
    """The overflow in rank 0's shard of a root-unit parameter is named by the parameter's name and rank; telemetry
    requested before a step's backward is measured on each rank's shards, as the core engine measures it."""
    for plugin, core in _runs(ranks, f"plugin:{level}", f"core:{level}"):
        # The plugin's names are the model's own; the core engine given the wrapper keeps FSDP1's segment in them.
        assert plugin["overflow_parameters"] == [_clean(name) for name in core["overflow_parameters"]] == ["0.weight"]
        assert plugin["overflow_ranks"] == core["overflow_ranks"] == [0]
        assert plugin["telemetry"] and list(plugin["telemetry"]) == [_clean(name) for name in core["telemetry"]]
        assert _close(list(plugin["telemetry"].values()), list(core["telemetry"].values()), 1e-6)


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_clip_gradients_clips_by_the_norm_of_the_whole_gradient(ranks, level):
    """``fabric.clip_gradients(max_norm=...)`` (FSDP1's ``clip_grad_norm_`` on the unscaled gradients) returns the
    norm of the whole gradient, every rank's shards computed here in FP64 (rounded to bfloat16 at O3, as FSDP1
    returns it for bfloat16 gradients), the same on both ranks; on the overflow step it is not finite, and the step
    is skipped on both ranks."""
    rel = 1e-6 if level == "O1" else 2.0**-8
    for (run,) in _runs(ranks, f"plugin:{level}"):
        for step, (norm, ref) in enumerate(zip(run["norms"], run["ref_norms"], strict=True)):
            if step < 2:
                assert norm is None
            elif step == INF_AT:
                assert not math.isfinite(norm)
            else:
                assert math.isclose(norm, ref, rel_tol=rel), (step, norm, ref)
    assert ranks[0][f"plugin:{level}"]["norms"] == ranks[1][f"plugin:{level}"]["norms"]


def test_o1_is_close_to_fabrics_own_bf16_mixed(ranks):
    """Against Fabric's ``"bf16-mixed"`` under the same strategy (bfloat16 gather and reduce; its overflow step
    skipped by hand): the same losses, clip norms and final weights to within bfloat16's rounding."""
    for plugin, fabric in _runs(ranks, "plugin:O1", "fabric:bf16-mixed"):
        assert _close(plugin["losses"][:INF_AT], fabric["losses"][:INF_AT], 2e-3)
        assert _close(plugin["losses"][INF_AT + 1:], fabric["losses"][INF_AT + 1:], 2e-3)
        for step in (2, 3, 5, 6):
            assert math.isclose(plugin["norms"][step], fabric["norms"][step], rel_tol=2e-3)
        assert _close(plugin["weights"], fabric["weights"], 2.0**-7, 2.0**-9)


def test_o0_is_fabrics_own_32_true_bit_for_bit(ranks):
    """O0 (FP32, a dynamic scale of powers of two) trains as Fabric's ``"32-true"`` under the same strategy bit for
    bit: losses, clip norms and weights, the overflow step skipped as the reference leaves it out."""
    for plugin, fabric in _runs(ranks, "plugin:O0", "fabric:32-true"):
        assert plugin["sharded"] is True
        assert plugin["skipped"] == SKIPPED
        assert [x for i, x in enumerate(plugin["losses"]) if i != INF_AT] == [x for x in fabric["losses"] if x]
        assert [x for i, x in enumerate(plugin["norms"]) if i != INF_AT] == [
            x for i, x in enumerate(fabric["norms"]) if i != INF_AT]
        assert plugin["weights"] == fabric["weights"]


def test_o2_is_refused_with_what_to_use(ranks):
    """O2 cannot keep its FP32 values: the plugin casts the model to half when ``fabric.setup`` converts it, before
    the strategy wraps it, so FSDP1's FP32 flat parameters (O2's masters under FSDP) never exist. ``fabric.setup``
    says so on both ranks (the strategy reads the plugin's FSDP1 config to wrap the model), naming the level, the
    strategy, why, and what to use."""
    for (result,) in _runs(ranks, "refused:O2"):
        message = result.get("refusal", "")
        assert message.startswith("RuntimeError"), message
        assert result["refused_at"] == "fabric.setup_module", result["refused_at"]
        for words in ("FabricMixedPrecisionPlugin('O2')", "FSDPStrategy", "FP32 flat parameters", "bfloat16 rounding",
                      "'O1'", "lightning_mpx.MixedPrecisionPlugin('O2')", "strategy='fsdp'"):  # fmt: skip
            assert words in message, (words, message)


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_resume_is_bit_equal(ranks, kind):
    """``fabric.save`` after ``RESUME_AT`` steps (past the overflow: a backed-off scale, a skip) with the plugin in
    the state, in the strategy's ``state_dict_type``; a fresh Fabric, plugin, model and optimizer ``fabric.load`` it
    (a sharded checkpoint hands the plugin's state back as a dict, restored as docs/fabric.md says): the remaining
    steps give the uninterrupted run's losses, norms, skips, scales, skip count and weights bit for bit."""
    for (result,) in _runs(ranks, f"resume:{kind}"):
        straight, resumed = result["straight"], result["resumed"]
        assert resumed["fabric_restored_the_plugin"] is (kind == "full")
        assert resumed["scale_at_load"] == SCALES[RESUME_AT - 1]
        assert resumed["losses"] == straight["losses"][RESUME_AT:]
        assert resumed["norms"] == straight["norms"][RESUME_AT:]
        assert resumed["skipped"] == straight["skipped"][RESUME_AT:]
        assert resumed["scales"] == straight["scales"][RESUME_AT:]
        assert resumed["skipped_steps"] == straight["skipped_steps"] == 1.0
        assert resumed["weights"] == straight["weights"]


# -- the user's set-ups (tests/hostile_fabric_fsdp1_script.py) ------------------------------------------------------
FSDP_CASES = ["plain:O1", "plain:bf16-mixed", "gan:O1", "gan:bf16-mixed", "checkpointed:O1", "flat:O1",
              "user_wrapped:O1", "two_optimizers:O1", "unregistered:O1", "clip_value:O1", "clip_value:bf16-mixed",
              "reused:O1"]  # fmt: skip


@pytest.fixture(scope="module")
def fsdp1(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's results of the user's set-ups (run in this file's launch), by their names in ``FSDP_CASES``."""
    ranks = [{case: result[USER_SETUPS + case] for case in FSDP_CASES} for result in ranks]
    for case in FSDP_CASES:
        assert "error" not in ranks[0][case], f"{case}: {ranks[0][case]['error']}"
    for case in FSDP_CASES:  # the gathered weights, and the ranks' answers, agree
        assert ranks[0][case].get("weights") == ranks[1][case].get("weights"), case
        assert ranks[0][case].get("refusal") == ranks[1][case].get("refusal"), case
    return ranks[0]


def _near(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def test_fsdp1_plain_o1_is_close_to_fabrics_bf16_mixed(fsdp1):
    plugin, own = fsdp1["plain:O1"], fsdp1["plain:bf16-mixed"]
    assert _near(plugin["norms"], own["norms"], 1e-3) and _near(plugin["weights"], own["weights"], 2e-3)
    assert min(plugin["norms"]) > 0.05  # every step clips


@pytest.mark.parametrize("kind", ["checkpointed", "flat", "user_wrapped", "reused"])
def test_fsdp1_setups_train_as_the_plain_setup(fsdp1, kind):
    # activation checkpointing (recomputed under the cast policy), use_orig_params=False (the optimizer over the flat
    # parameters), a model the user wrapped in FSDP1 before fabric.setup, and the plugin of a finished run given to a
    # second Fabric: the plain run's numbers
    run, plain = fsdp1[f"{kind}:O1"], fsdp1["plain:O1"]
    # (flat parameters: a reduction order of their own, an FP32 ulp or two)
    assert _near(run["norms"], plain["norms"], 1e-6) and _near(run["losses"], plain["losses"], 1e-6)
    assert _near(run["weights"], plain["weights"], 1e-6)
    if kind == "checkpointed":
        assert run["checkpoint_wrappers"] == 2 and plain["checkpoint_wrappers"] == 0  # it is checkpointed


def test_fsdp1_gan_set_up_model_by_model_matches_fabrics_bf16_mixed(fsdp1):
    # the generator set up, run once, then the discriminator set up: both sharded, both trained
    plugin, own = fsdp1["gan:O1"], fsdp1["gan:bf16-mixed"]
    assert _near(plugin["norms"], own["norms"], 2e-3)
    assert _near(plugin["weights"], own["weights"], 2e-3)


def test_fsdp1_two_optimizers_over_one_model_clip_the_unscaled_norm(fsdp1):
    # Fabric unscales the optimizer it is given, then clips the whole FSDP1 model: the other optimizer's gradients
    # must be unscaled too (they counted scaled: a norm of ~2000, every step clipped to almost nothing)
    two, plain, own = fsdp1["two_optimizers:O1"], fsdp1["plain:O1"], fsdp1["plain:bf16-mixed"]
    assert _near(two["norms"][0::2], own["norms"], 1e-3)
    assert _near(two["norms"][1::2], [0.05] * 4, 1e-3)  # the second clip sees the first's result
    assert _near(two["weights"], plain["weights"], 1e-4)


def test_fsdp1_two_optimizers_the_plugin_does_not_know_are_refused(fsdp1):
    refusal = fsdp1["unregistered:O1"]["refusal"]
    assert "plugin.setup_optimizers(" in refusal and "clips the whole FSDP1 model" in refusal


def test_fsdp1_clip_by_value_is_close_to_fabrics_bf16_mixed(fsdp1):
    plugin, own = fsdp1["clip_value:O1"], fsdp1["clip_value:bf16-mixed"]
    assert "refusal" not in plugin and "refusal" not in own
    assert _near(plugin["losses"], own["losses"], 2e-3) and _near(plugin["weights"], own["weights"], 2e-3)
    assert not _near(plugin["weights"], fsdp1["plain:O1"]["weights"], 1e-3)  # the clip by value changed the run
