"""stop 66, fsdp1find66: Fabric's FSDP1 wrapper of a model found through the ``fabric.setup`` call that set it up, not
the garbage collector (blind to what ``gc.freeze()`` froze); ``torch.nn.DataParallel`` around a prepared model;
attack65b's limits.

The multi-rank cases: ``tests/fabric_fsdp1_frozen_heap_script.py`` (one launch)."""

from __future__ import annotations

import math
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from tests.launch import rank_results, run_script

pytest.importorskip("lightning.fabric")

from tests.fabric_fsdp1_frozen_heap_script import INF_AT, STEPS  # noqa: E402

SKIPPED = [step == INF_AT for step in range(STEPS)]


# -- FSDP1 under Fabric, the heap frozen by the user (two ranks, one launch) -----------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One two-process launch for every multi-rank case of this file."""
    out = tmp_path_factory.mktemp("fsdp1find66")
    run_script("fabric_fsdp1_frozen_heap_script.py", out, timeout=150, MPX_CASES="plain,frozen")
    return rank_results(out)


def _runs(ranks, case):
    for rank, result in enumerate(ranks):
        assert "error" not in result[case], f"{case}, rank {rank}:\n{result[case]['error']}"
    return [result[case] for result in ranks]


def test_a_heap_frozen_after_fabric_setup_leaves_the_fsdp1_model_sharded(ranks):
    """``gc.freeze()`` between ``fabric.setup_module`` (FSDPStrategy) and the first step, before the plugin's first
    call: the engine still takes Fabric's FSDP1 wrapper as the sharded model (it took the model for an unsharded one:
    the wrapper was looked for with ``gc.get_referrers``, which does not see frozen objects)."""
    for case in ("plain", "frozen"):
        for run in _runs(ranks, case):
            assert run["found_before_the_first_step"] is False  # looked for after the freeze
            assert run["sharded"] is True, case


def test_an_overflow_on_one_rank_skips_the_step_on_both_with_the_heap_frozen(ranks):
    """O1 float16, an inf in rank 0's own gradient shard only: both ranks skip that step, back off the scale, and end
    with the weights of the same run without the freeze (and the same clip norms and overflow record)."""
    plain, frozen = _runs(ranks, "plain"), _runs(ranks, "frozen")
    for mine, reference in zip(frozen, plain, strict=True):
        assert mine["skipped"] == reference["skipped"] == SKIPPED
        assert mine["scales"] == reference["scales"] == [1024.0] * INF_AT + [512.0] * (STEPS - INF_AT)
        assert mine["norms"] == reference["norms"]
        assert mine["weights"] == reference["weights"]
        assert mine["overflow"] == reference["overflow"] == [["0.weight"], [0]]
    assert frozen[0]["weights"] == frozen[1]["weights"]


@pytest.mark.parametrize("habit", ["compiled", "fabric_subclass"])
def test_the_fsdp1_wrapper_is_found_through_a_users_habits_with_the_heap_frozen(one_rank, habit):
    """In one process: ``fabric.setup_module(torch.compile(model))`` (Fabric compiles the wrapper again: its
    ``_FabricModule`` holds an ``OptimizedModule``) and a subclass of ``Fabric`` whose ``setup_module`` calls
    ``super()``, the heap frozen before the plugin's first call (``plugin.metrics()`` here): the engine takes the
    FSDP1 wrapper as the sharded model, and the ``fabric.setup_module`` call's frame is let go."""
    import gc

    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin
    from tests.fabric_fsdp1_script import CPUFSDPStrategy

    class MyFabric(Fabric):
        def setup_module(self, module, *args, **kwargs):
            return super().setup_module(module, *args, **kwargs)

    plugin = FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16")
    kind = MyFabric if habit == "fabric_subclass" else Fabric
    fabric = kind(accelerator="cpu", devices=1, strategy=CPUFSDPStrategy(), plugins=[plugin])
    fabric.launch()
    inner = nn.Sequential(nn.Linear(4, 4))
    model = fabric.setup_module(torch.compile(inner) if habit == "compiled" else inner)
    gc.collect()
    gc.freeze()  # left frozen, as tests/conftest.py's: what is alive now stays alive anyway
    plugin.metrics()
    assert plugin.amp.sharded
    wrapper = model._forward_module._orig_mod if habit == "compiled" else model._forward_module
    assert plugin._wrappers[inner]() is wrapper
    assert not plugin._setups


# -- torch.nn.DataParallel (no GPU: it runs the module itself) ------------------------------------------------------
def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(4)]


OVERFLOW_AT = 2  # an inf loss: the step is skipped and the scale backs off


def _core_run(level: str, wrap: str) -> tuple[list[torch.Tensor], float, list[torch.Tensor]]:
    """The core engine as docs/core.md shows it; ``wrap``: ``""`` (none), ``"after"`` (``nn.DataParallel`` around the
    prepared model) or ``"before"`` (the wrapper prepared)."""
    amp = Amp(level, half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**8)
    model = _build()
    if wrap == "before":
        model = amp.prepare_model(nn.DataParallel(model))
    else:
        model = amp.prepare_model(model)
        if wrap == "after":
            model = nn.DataParallel(model)
    if wrap:
        assert model.device_ids == []  # no GPU: DataParallel calls the module itself
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step, (x, y) in enumerate(_batches()):
        with amp.forward_context():
            loss = F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
        amp.backward(loss * (math.inf if step == OVERFLOW_AT else 1.0))
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
    inner = model.module if wrap else model
    masters = [m.detach().clone() for m in amp.master_params(optimizer)]
    return [p.detach().clone() for p in inner.parameters()], float(amp.metrics()["mpx/loss_scale"]), masters


def _apex_run(level: str, wrap: str) -> tuple[list[torch.Tensor], float, list[torch.Tensor]]:
    """The Apex layer in Apex's documented order: ``amp.initialize`` first, then ``nn.DataParallel(model)``."""
    from lightning_mpx.apex import _amp_state
    from lightning_mpx.apex import amp as apex_amp

    _amp_state.reset()
    _amp_state.registrations.clear()
    model = _build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    half = {"cast_model_type": torch.bfloat16} if level == "O2" else {}
    model, optimizer = apex_amp.initialize(model, optimizer, opt_level=level, loss_scale="dynamic", verbosity=0, **half)
    if wrap:
        model = nn.DataParallel(model)
    for step, (x, y) in enumerate(_batches()):
        loss = F.mse_loss(model(x).float(), y) * (math.inf if step == OVERFLOW_AT else 1.0)
        with apex_amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
    inner = model.module if wrap else model
    scale = _amp_state.loss_scalers[0].loss_scale()
    masters = [m.detach().clone() for m in apex_amp.master_params(optimizer)]
    _amp_state.reset()
    _amp_state.registrations.clear()
    return [p.detach().clone() for p in inner.parameters()], float(scale), masters


@pytest.mark.parametrize(
    ("front", "level", "wrap"),
    [
        ("core", "O1", "after"),
        ("core", "O1", "before"),
        ("core", "O2", "after"),
        ("core", "O2", "before"),
        ("apex", "O1", "after"),
        ("apex", "O2", "after"),
    ],  # fmt: skip
)
def test_data_parallel_trains_as_the_model_without_it(front, level, wrap):
    """``nn.DataParallel`` around the model (the core: around the prepared model or prepared itself; Apex: after
    ``amp.initialize``, Apex's order): on a machine without a GPU it calls the model itself, and a user gets the
    weights, masters and scale of the same run without the wrapper: the steps taken, the overflow skipped."""
    run = _core_run if front == "core" else _apex_run
    weights, scale, masters = run(level, wrap)
    ref_weights, ref_scale, ref_masters = run(level, "")
    assert scale == ref_scale and scale < (2.0**8 if front == "core" else 2.0**16)  # backed off once
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(masters, ref_masters, strict=True))
    assert weights[0].dtype == (torch.float32 if level == "O1" else torch.bfloat16)
    assert masters[0].dtype == torch.float32
    assert not torch.equal(weights[0].float(), _build()[0].weight.to(weights[0].dtype).float())  # it trained


# -- attack65b's limits: the evaluation-first masters warning -------------------------------------------------------
def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _prepared_after_evaluation(case: str) -> tuple[list[str], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Accelerate adapter, O2 bfloat16: the model prepared for evaluation only and evaluated (``case="trained"``: for
    training, with its optimizer, and stepped once), then ``free_memory()`` and ``prepare(model, optimizer)``
    (``"two_optimizers"``: no ``free_memory()``; one optimizer per layer). The lightning_mpx warnings, the model's
    FP32 weights at the start and its masters after the second ``prepare``."""
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    accelerator = Accelerator(
        mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")]
    )
    net = _net()
    fp32 = {k: v.clone() for k, v in net.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case == "trained":
            model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.0))
            accelerator.backward(model(torch.ones(2, 8)).float().sum())
            optimizer.step()
        else:
            model = accelerator.prepare_model(net, evaluation_mode=True)
            with torch.no_grad():
                model(torch.ones(2, 8))
        if case == "two_optimizers":
            first, second = (torch.optim.SGD(net[i].parameters(), lr=0.1) for i in (0, 2))
            model, _, _ = accelerator.prepare(net, first, second)
        else:
            accelerator.free_memory()
            model, _ = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        masters = {k: v.float().clone() for k, v in accelerator.get_state_dict(model).items()}
    reset_accelerate_state()
    return [str(w.message) for w in caught if "lightning_mpx" in str(w.message)], fp32, masters


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_masters_from_the_rounding_after_free_memory_are_warned_about():
    """A model prepared for evaluation only, then ``accelerator.free_memory()`` (a retried training function) and
    ``prepare(model, optimizer)``: the new engine's masters start from the bfloat16 rounding, as at the first
    preparation, which warns; after ``free_memory()`` it was silent. A model trained before ``free_memory()`` hands its
    exact masters over, and nothing is said."""
    warned, fp32, masters = _prepared_after_evaluation("free_memory")
    assert len(warned) == 1 and "4 parameter(s) (0.weight, 0.bias, 2.weight and 1 more)" in warned[0], warned
    assert "prepared for evaluation only" in warned[0]
    assert all(not torch.equal(masters[k], fp32[k]) for k in fp32)  # what the warning says: the rounding
    warned, fp32, masters = _prepared_after_evaluation("trained")
    assert warned == []
    assert all(torch.equal(masters[k], fp32[k]) for k in fp32)  # lr=0: the FP32 weights, exactly


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_evaluation_first_warning_names_every_optimizers_parameters():
    """Two optimizers over a model prepared for evaluation first (one per layer): the warning, made with the first
    optimizer's masters, named only its parameters (2 of 4), and the second's masters came from the rounding
    silently. Now it names all four."""
    warned, _, _ = _prepared_after_evaluation("two_optimizers")
    assert len(warned) == 1 and "4 parameter(s) (0.weight, 0.bias, 2.weight and 1 more)" in warned[0], warned


# -- attack65b's limits: a required argument misspelt or left out --------------------------------------------------
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("mixed_precision", ["O2", "no"])
def test_a_misspelt_required_argument_of_the_accelerate_adapter_is_named(mixed_precision):
    """``clip_grad_norm_(params, max_nrom=1.0)`` got Python's "GradientClipping.clip_grad_norm_() missing 1 required
    positional argument: 'max_norm'" (an internal class, and not the keyword given): the per-step methods take no
    wrapper. Now the keyword given is named with the one meant; an argument left out is named with the call (an opt
    level or Accelerate's own precision). A refused clip unscales nothing."""
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    ours = [MixedPrecisionKwargs(half_dtype="bfloat16")] if mixed_precision == "O2" else None
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=True, kwargs_handlers=ours)
    net = nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    accelerator.backward(model(torch.ones(2, 4)).float().sum())
    a, params, loss = accelerator, model.parameters, lambda: model(torch.ones(2, 4)).float().sum()
    misspelt = [
        ("clip_grad_norm_", lambda: a.clip_grad_norm_(params(), max_nrom=1.0), "max_nrom", "max_norm"),
        ("clip_grad_norm_", lambda: a.clip_grad_norm_(params=params(), max_norm=1.0), "params", "parameters"),
        ("clip_grad_value_", lambda: a.clip_grad_value_(params(), clip_val=1.0), "clip_val", "clip_value"),
    ]
    if mixed_precision == "O2":  # (Accelerate's own backward divides the loss first: "missing", below)
        misspelt.append(("backward", lambda: a.backward(los=loss()), "los", "loss"))
    for method, call, given, meant in misspelt:
        with pytest.raises(TypeError) as error:
            call()
        assert str(error.value).startswith(f"accelerator.{method}() got an unexpected keyword argument {given!r}")
        assert f"Did you mean {meant}=?" in str(error.value)
    left_out = [
        ("clip_grad_norm_", lambda: a.clip_grad_norm_(params()), "max_norm"),
        ("clip_grad_norm_", lambda: a.clip_grad_norm_(max_norm=1.0), "parameters"),
        ("clip_grad_value_", lambda: a.clip_grad_value_(params()), "clip_value"),
        ("backward", lambda: a.backward(), "loss"),
    ]
    for method, call, name in left_out:
        with pytest.raises(TypeError, match=rf"^accelerator\.{method}\(\) missing 1 required argument: '{name}'$"):
            call()
    if mixed_precision == "O2":
        assert not accelerator.amp.is_unscaled(optimizer.optimizer)


def test_a_misspelt_logs_of_mpx_trainer_is_named():
    """``trainer.log(logz={...})`` on an ``mpx_trainer`` class got Python's "MpxTrainerMixin.log() missing 1 required
    positional argument: 'logs'"; now the keyword given, the Trainer's valid ones and the one meant."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from lightning_mpx.accelerate import mpx_trainer

    trainer = mpx_trainer(Trainer)(model=nn.Linear(2, 2), args=TrainingArguments("unused", report_to=[], use_cpu=True))
    with pytest.raises(TypeError, match=r"^trainer\.log\(\) got an unexpected keyword argument 'logz'; .*logs=\?"):
        trainer.log(logz={"loss": 1.0})
    with pytest.raises(TypeError, match=r"^trainer\.log\(\) missing 1 required argument: 'logs'$"):
        trainer.log()


def _as_a_replica(forward):
    """``forward()`` run as ``nn.DataParallel`` runs each replica's forward over two or more GPUs
    (``torch.nn.parallel.parallel_apply``'s worker): in a thread of its own, carrying grad mode and autocast's on/off
    only (on the CPU here: without a GPU DataParallel calls the module itself)."""
    result = {}
    grad, autocast = torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")

    def worker():
        with torch.set_grad_enabled(grad), torch.amp.autocast("cpu", enabled=autocast):
            result["output"] = forward()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    return result["output"]


def test_o1_casts_apply_in_a_data_parallel_replicas_thread():
    amp = Amp("O1", half_dtype="bfloat16")
    model = amp.prepare_model(nn.Linear(4, 4))
    x = torch.ones(2, 4)
    with amp.forward_context():
        assert model(x).dtype == torch.bfloat16  # on the calling thread
        replica = model._replicate_for_data_parallel()  # torch.nn.parallel.replicate's call, on this thread
        replica.__dict__.update(model._parameters)  # (replicate sets the parameters' copies on it so)
        assert _as_a_replica(lambda: replica(x)).dtype == torch.bfloat16  # (dp66: the scope goes with it)
