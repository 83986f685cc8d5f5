"""Small gaps left by stop 63, from the user's side (stop 64):

1. a clip limit that is not a positive number (``max_norm=-1``, ``0``, NaN; ``clip_val``/``clip_value`` too) is refused,
   before anything is unscaled, by every door that clips with torch's own clip: ``fabric.clip_gradients``,
   Accelerate's ``clip_grad_norm_`` (another norm type, a part of the parameters) and ``clip_grad_value_``, Apex's
   ``FP16_Optimizer.clip_master_grads`` (another norm type). The engine's clip refused them; torch's took them and
   flipped, zeroed or poisoned the gradients the step applied. ``math.inf`` measures without clipping. The Trainer
   keeps Lightning's ``gradient_clip_val <= 0``: no clipping, its own precisions' convention;
2. a ``loss_id`` that is no integer (``"0"``, ``1.0``, ``True``, ``None``) is a ``TypeError`` naming the type wanted
   (``"out of range"`` before);
3. ``convert_module`` takes the half dtypes only (``torch.float64`` made a "half" model in double); every other door
   that takes a half dtype refused it already;
4. ``MixedPrecisionKwargs``' signature shows ``half_dtype: str | torch.dtype | None`` (``| None`` twice before);
5. ``plugin.scaler._get_growth_tracker()``, ``GradScaler``'s private method that callbacks log, is there and answers as
   a ``GradScaler`` does;
6. parameters made FP32 after set-up (diffusers' ``cast_training_params``) are refused at the first step with the
   message of a later step: that first step trained them as plain FP32 parameters (their stale masters' storage);
7. the HF ``Trainer`` door builds the engine's checkpoint state only on the rank that writes it;
8. ``fabric.backward`` before ``fabric.setup`` is refused naming it (a loss over tensors of one's own trains once their
   optimizer is registered with the plugin).

``FIXED`` were accepted (or answered without the valid choices) before this stop; ``GOOD`` were already right and are
held so (tests/test_core_misspelt_keywords.py's table style, whose helpers are reused).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import pytest
import torch
from torch import nn

import lightning_mpx as mpx
from lightning_mpx.apex import amp as apex_amp
from lightning_mpx.apex._state import _amp_state
from tests.test_core_misspelt_keywords import _accelerator, _amp_run, _mpk, _run

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

BF16 = torch.bfloat16
SCALED = {"half_dtype": "bfloat16", "loss_scale": "dynamic", "init_scale": 2.0**10}  # unscaling matters
POSITIVE = r"must be a positive number \(math\.inf: measure without clipping\)"
Row = tuple[str, Callable[[], Any], type[Exception], str]


@pytest.fixture(autouse=True)
def _fresh_apex_state():
    _amp_state.reset()
    yield
    _amp_state.reset()


def _table(rows: list[Row]) -> Any:
    return pytest.mark.parametrize(("call", "error", "pattern"), [r[1:] for r in rows], ids=[r[0] for r in rows])


def _x(step: int = 0) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(step))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _fabric(level: str = "O2", **settings: Any) -> tuple[Any, Any, Any, Any]:
    """(fabric, plugin, model, optimizer) of a tiny run set up with the plugin."""
    from lightning.fabric import Fabric

    plugin = mpx.FabricMixedPrecisionPlugin(level, **{**SCALED, **settings})
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return fabric, plugin, model, optimizer


# -- 1. clip limits ---------------------------------------------------------------------------------------------------
def _fabric_clip(level: str, **limit: Any) -> Any:
    fabric, _, model, optimizer = _fabric(level)
    fabric.backward(model(_x()).float().pow(2).mean())
    return fabric.clip_gradients(model, optimizer, **limit)


def _accelerate_clip(how: str, limit: Any) -> Any:
    accelerator = _accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[_mpk(**SCALED)])
    net = _net()
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    accelerator.backward(model(_x()).float().pow(2).mean())
    params = list(model.parameters())
    if how == "value":
        return accelerator.clip_grad_value_(params, limit)
    if how == "part":  # not the fused clip of one optimizer's parameters: torch's
        return accelerator.clip_grad_norm_(params[:2], limit)
    return accelerator.clip_grad_norm_(params, limit, norm_type=1)


def _apex_clip(limit: Any) -> Any:
    from lightning_mpx.apex.fp16_utils import FP16_Optimizer, network_to_half

    model = network_to_half(nn.Linear(4, 2))
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0, verbose=False)
    optimizer.backward(model(_x().half()).float().pow(2).mean())
    return optimizer.clip_master_grads(limit, norm_type=1)  # norm_type 2 was the engine's clip, which refused


CLIPS_FIXED: list[Row] = [  # each flipped (-1), zeroed (0) or poisoned (NaN) the gradients the step applied
    ("fabric.clip_gradients(max_norm=-1) O2", lambda: _fabric_clip("O2", max_norm=-1.0), ValueError,
     rf"max_norm=-1\.0 {POSITIVE}"),
    ("fabric.clip_gradients(max_norm=0) O1", lambda: _fabric_clip("O1", max_norm=0.0), ValueError,
     rf"max_norm=0\.0 {POSITIVE}"),
    ("fabric.clip_gradients(max_norm=nan) O3", lambda: _fabric_clip("O3", max_norm=math.nan), ValueError,
     rf"max_norm=nan {POSITIVE}"),
    ("fabric.clip_gradients(clip_val=-1) O2", lambda: _fabric_clip("O2", clip_val=-1), ValueError,
     rf"clip_val=-1 {POSITIVE}"),
    ("accelerator.clip_grad_norm_(norm_type=1, -1)", lambda: _accelerate_clip("norm_type=1", -1.0), ValueError,
     rf"max_norm=-1\.0 {POSITIVE}"),
    ("accelerator.clip_grad_norm_(part, 0)", lambda: _accelerate_clip("part", 0.0), ValueError,
     rf"max_norm=0\.0 {POSITIVE}"),
    ("accelerator.clip_grad_value_(nan)", lambda: _accelerate_clip("value", math.nan), ValueError,
     rf"clip_value=nan {POSITIVE}"),
    ("apex clip_master_grads(-1, norm_type=1)", lambda: _apex_clip(-1.0), ValueError, rf"max_norm=-1\.0 {POSITIVE}"),
]  # fmt: skip


@_table(CLIPS_FIXED)
def test_a_clip_limit_that_would_corrupt_the_gradients_is_refused(call: Callable[[], Any], error: type, pattern: str):
    with pytest.raises(error, match=pattern):
        call()


def _fabric_steps(level: str, clips: list[dict[str, Any]]) -> list[torch.Tensor]:
    """One step, the clips tried in turn (a refused one passed over), then the weights (FP32 at O2: the masters)."""
    fabric, plugin, model, optimizer = _fabric(level)
    fabric.backward(model(_x()).float().pow(2).mean())
    for clip in clips:
        try:
            fabric.clip_gradients(model, optimizer, **clip)
        except ValueError:
            pass
    optimizer.step()
    return [p.detach().clone() for p in plugin.master_params(optimizer)]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_refused_fabric_clip_changes_nothing_and_inf_measures_without_clipping(level: str) -> None:
    """A refused limit leaves the gradients as they were (scaled, for the retry's one unscale): the retry with
    ``max_norm=1e-3`` steps as a run that clipped with it at once; ``max_norm=math.inf`` steps as no clip."""
    clipped = _fabric_steps(level, [{"max_norm": 1e-3}])
    assert all(
        map(torch.equal, _fabric_steps(level, [{"max_norm": -1.0}, {"clip_val": 0}, {"max_norm": 1e-3}]), clipped)
    )
    unclipped = _fabric_steps(level, [])
    assert all(map(torch.equal, _fabric_steps(level, [{"max_norm": math.inf}]), unclipped))
    assert not all(map(torch.equal, clipped, unclipped))  # 1e-3 clips


def _lightning_module(manual_clip: float | None = None) -> Any:
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()
            self.automatic_optimization = manual_clip is None

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self.net(batch[0]).float().pow(2).mean()
            if manual_clip is None:
                return loss
            optimizer = self.optimizers()
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=manual_clip)
            optimizer.step()
            optimizer.zero_grad()
            return None

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module()


def _fit(module: Any, **trainer: Any) -> list[torch.Tensor]:
    from tests.lightning_helpers import make_trainer

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat([_x(0), _x(1)])), batch_size=4)
    make_trainer(mpx.MixedPrecisionPlugin("O2", **SCALED), max_steps=2, **trainer).fit(module, data)
    return [p.detach().float().clone() for p in module.parameters()]


def test_trainer_gradient_clip_val_at_or_below_zero_is_no_clipping_as_lightnings_own() -> None:
    """GOOD: the Trainer keeps Lightning's convention (``Precision.clip_gradients``: nothing when ``clip_val <= 0``;
    ``"bf16-mixed"`` and ``"16-mixed"`` alike), which corrupts nothing: the run is the unclipped one, bit for bit."""
    assert all(map(torch.equal, _fit(_lightning_module(), gradient_clip_val=-1.0), _fit(_lightning_module())))


def test_trainer_manual_clip_with_a_nan_limit_is_refused() -> None:
    """GOOD: ``self.clip_gradients(opt, gradient_clip_val=nan)`` in manual optimization reaches the engine's clip,
    which refuses it (``"bf16-mixed"`` hands it to torch's clip: every gradient NaN, then stepped)."""
    with pytest.raises(ValueError, match=rf"max_norm=nan {POSITIVE}"):
        _fit(_lightning_module(manual_clip=math.nan))


# -- 2. a loss_id that is no integer ----------------------------------------------------------------------------------
def _loss_of(amp: Any, model: nn.Module) -> torch.Tensor:
    return model(_x().to(BF16)).float().sum()


def _amp_backward(loss_id: Any) -> None:
    amp, model, _ = _amp_run()
    amp.backward(_loss_of(amp, model), loss_id=loss_id)


def _fabric_backward(loss_id: Any) -> None:
    fabric, _, model, _ = _fabric("O1")
    fabric.backward(model(_x()).float().sum(), loss_id=loss_id)


def _accelerator_backward(loss_id: Any) -> None:
    accelerator = _accelerator(mixed_precision="O1", cpu=True, kwargs_handlers=[_mpk(half_dtype="bfloat16")])
    net = _net()
    model, _ = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    accelerator.backward(model(_x()).float().sum(), loss_id=loss_id)


def _apex_scale_loss(loss_id: Any) -> None:
    model, optimizer = apex_amp.initialize(*_run(), opt_level="O1", verbosity=0)
    with apex_amp.scale_loss(model(_x()).float().sum(), optimizer, loss_id=loss_id) as scaled:
        scaled.backward()


INT = r"must be an int \(a Python or numpy integer, or a 0-d integer tensor\); valid choices: 0 to 0 \(num_losses=1\)"
LOSS_IDS_FIXED: list[Row] = [  # "loss_id=... is out of range" before
    ("Amp.backward(loss_id='0')", lambda: _amp_backward("0"), TypeError, rf"loss_id='0' \(str\) {INT}"),
    ("Amp.scale_loss(loss_id=0.0)", lambda: _amp_run()[0].scale_loss(torch.ones(()), loss_id=0.0), TypeError,
     rf"loss_id=0\.0 \(float\) {INT}"),
    ("fabric.backward(loss_id=True)", lambda: _fabric_backward(True), TypeError, rf"loss_id=True \(bool\) {INT}"),
    ("Accelerator.backward(loss_id='0')", lambda: _accelerator_backward("0"), TypeError, rf"loss_id='0' \(str\) {INT}"),
    ("apex scale_loss(loss_id=None)", lambda: _apex_scale_loss(None), TypeError, rf"loss_id=None \(NoneType\) {INT}"),
]  # fmt: skip
LOSS_IDS_GOOD: list[Row] = [
    ("Amp.backward(loss_id=1)", lambda: _amp_backward(1), ValueError,
     r"loss_id=1 is out of range; valid choices: 0 to 0 \(num_losses=1\)"),
]  # fmt: skip


@_table(LOSS_IDS_FIXED + LOSS_IDS_GOOD)
def test_a_loss_id_is_refused_naming_the_valid_type_or_range(call: Callable[[], Any], error: type, pattern: str):
    with pytest.raises(error, match=pattern):
        call()


def test_numpy_and_tensor_integer_loss_ids_are_still_taken() -> None:
    np = pytest.importorskip("numpy")
    for loss_id in (np.int64(0), torch.tensor(0)):
        amp, model, optimizer = _amp_run()
        amp.backward(_loss_of(amp, model), loss_id=loss_id)
        assert amp.step(optimizer)


# -- 3. half dtypes ---------------------------------------------------------------------------------------------------
HALF = r"valid choices: .*torch\.float16, torch\.bfloat16"
HALF_FIXED: list[Row] = [  # a "half" model in float64 (its masters FP32, below it) before
    ("convert_module(float64)", lambda: mpx.convert_module(nn.Linear(4, 4), torch.float64), ValueError,
     rf"dtype=torch\.float64 is not a half-precision dtype; {HALF} \(the opt levels' half dtypes; for an FP32 model, "
     r"module\.float\(\)\)"),
    ("convert_module(float32)", lambda: mpx.convert_module(nn.Linear(4, 4), torch.float32), ValueError,
     rf"dtype=torch\.float32 is not a half-precision dtype; {HALF}"),
    ("convert_module('bfloat16')", lambda: mpx.convert_module(nn.Linear(4, 4), "bfloat16"), TypeError,
     r"dtype='bfloat16' must be a floating-point torch\.dtype; valid choices: torch\.float16, torch\.bfloat16 \("),
]  # fmt: skip
HALF_GOOD: list[Row] = [
    ("MixedPrecisionPlugin(half_dtype=float64)", lambda: mpx.MixedPrecisionPlugin("O2", half_dtype=torch.float64),
     ValueError, rf"half_dtype=torch\.float64 is not a half-precision dtype; {HALF}"),
    ("FabricMixedPrecisionPlugin(half_dtype=float64)",
     lambda: mpx.FabricMixedPrecisionPlugin("O2", half_dtype=torch.float64), ValueError,
     rf"half_dtype=torch\.float64.*{HALF}"),
    ("MixedPrecisionKwargs(half_dtype=float64)", lambda: _mpk(half_dtype=torch.float64), ValueError,
     rf"half_dtype=torch\.float64.*{HALF}"),
    ("Amp(half_dtype=float64)", lambda: mpx.Amp("O2", half_dtype=torch.float64), ValueError,
     rf"half_dtype=torch\.float64.*{HALF}"),
    # Apex's Properties took any cast_model_type (a model cast to double at O2): refused here since stop 52
    ("apex initialize(cast_model_type=float64)",
     lambda: apex_amp.initialize(nn.Linear(4, 4), opt_level="O2", cast_model_type=torch.float64, verbosity=0),
     ValueError, r"cast_model_type=torch\.float64 is not valid with half_dtype=torch\.float16; valid choices"),
]  # fmt: skip


@_table(HALF_FIXED + HALF_GOOD)
def test_a_dtype_that_is_not_half_is_refused_where_a_half_dtype_is_taken(call: Callable[[], Any], error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_a_refused_convert_module_leaves_the_model_fp32() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"dtype=torch\.float64 is not a half-precision dtype"):
        mpx.convert_module(model, torch.float64)
    assert {t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()} == {torch.float32}


# -- 4. MixedPrecisionKwargs' signature -------------------------------------------------------------------------------
def test_mixed_precision_kwargs_signature_names_none_once_for_half_dtype() -> None:
    from lightning_mpx.accelerate import MixedPrecisionKwargs

    parameter = inspect.signature(MixedPrecisionKwargs).parameters["half_dtype"]
    assert parameter.annotation.split(" | ") == ["str", "torch.dtype", "None"] and parameter.default is None


# -- 5. the scaler view's growth tracker ------------------------------------------------------------------------------
FACTORS = (1.0, 1.0, math.inf, 1.0, 1.0, 1.0, 1.0)  # the third step overflows


def _grad_scaler_reads() -> list[tuple[float, int]]:
    """torch's ``GradScaler`` (CPU) through the same overflow pattern: (scale, growth tracker) after each step."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    reads = [(scaler.get_scale(), scaler._get_growth_tracker())]
    for factor in FACTORS:
        scaler.scale((param * factor).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        reads.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return reads


def test_scaler_view_growth_tracker_answers_as_grad_scaler() -> None:
    """``fabric._precision.scaler._get_growth_tracker()`` (as ported callbacks log it): an int, 0 before the first
    backward, then the unskipped steps since the scale last changed, step by step as a ``GradScaler``'s. The Trainer
    plugin hands out the same view."""
    fabric, plugin, model, optimizer = _fabric("O1", growth_interval=3)
    reads = [(plugin.scaler.get_scale(), plugin.scaler._get_growth_tracker())]
    for step, factor in enumerate(FACTORS):
        fabric.backward(model(_x(step)).float().pow(2).mean() * factor)
        optimizer.step()
        optimizer.zero_grad()
        reads.append((plugin.scaler.get_scale(), plugin.scaler._get_growth_tracker()))
    assert reads == _grad_scaler_reads() and all(type(tracker) is int for _, tracker in reads)
    assert plugin.scaler._get_growth_tracker() == plugin.scaler.state_dict()["_growth_tracker"] == 1
    assert mpx.MixedPrecisionPlugin("O1", **SCALED).scaler._get_growth_tracker() == 0


# -- 6. parameters made FP32 after set-up, before the first step ------------------------------------------------------
def _lora_run(front: str) -> tuple[Callable[[], None], nn.Module, list[torch.Tensor]]:
    """A LoRA of a frozen tiny model at O2 (the diffusers LoRA script's set-up): (one training step, the unwrapped
    model, the LoRA parameters)."""
    from peft import LoraConfig, inject_adapter_in_model

    net = _net().requires_grad_(False)
    torch.manual_seed(1)
    net = inject_adapter_in_model(LoraConfig(r=2, target_modules=["0", "2"], init_lora_weights="gaussian"), net)
    lora = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora, lr=1e-2)
    if front == "fabric":
        fabric, _, _, _ = _fabric("O2")
        model, optimizer = fabric.setup(net, optimizer)
        backward = fabric.backward
    else:
        accelerator = _accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[_mpk(**SCALED)])
        model, optimizer = accelerator.prepare(net, optimizer)
        backward = accelerator.backward

    def step() -> None:
        backward(model(_x()).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()

    return step, net, lora


@pytest.mark.parametrize("front", ["accelerate", "fabric"])
def test_parameters_made_fp32_after_setup_are_refused_at_the_first_step_as_at_a_later_one(front: str) -> None:
    """``cast_training_params(model, torch.float32)`` after ``prepare``/``fabric.setup``: at a later step the step is
    refused (stop 63) naming it and the fix; at the first step (no clip before it) it was taken, and the LoRA
    trained as FP32 parameters through the masters' stale storage. Now the first step is refused with the same
    message, the parameters unchanged."""
    pytest.importorskip("peft")
    cast_training_params = pytest.importorskip("diffusers.training_utils").cast_training_params

    messages = []
    for steps_before in (0, 1):
        step, net, lora = _lora_run(front)
        for _ in range(steps_before):
            step()
        cast_training_params(net, dtype=torch.float32)
        before = [p.detach().clone() for p in lora]
        with pytest.raises(
            RuntimeError, match=r"made another dtype since.*cast_training_params\(model, dtype=tor"
        ) as info:
            step()
        assert all(p.dtype == torch.float32 for p in lora) and all(map(torch.equal, lora, before))
        messages.append(str(info.value))
    assert messages[0] == messages[1]


# -- 7. the HF Trainer's checkpoint state, built where written --------------------------------------------------------
def test_hf_trainer_builds_the_engine_state_only_on_the_rank_that_writes_it(tmp_path, monkeypatch) -> None:
    """Two checkpoints: the first saved as a rank other than 0 sees it (``accelerator.is_main_process`` False there),
    the second as rank 0. The engine's state (its masters cloned, the scalers read) is built for the second only,
    which writes it; before, every rank built it and rank 0 alone wrote it."""
    pytest.importorskip("transformers")
    import transformers

    from lightning_mpx.accelerate import Accelerator
    from lightning_mpx.integrations.accelerate_checkpoint import AMP_STATE_NAME
    from tests.test_hf_trainer import trainer

    main = {"process": False}
    monkeypatch.setattr(Accelerator, "is_main_process", property(lambda self: main["process"]))
    built: list[int] = []

    class Saves(transformers.TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            built.append(calls["state_dict"])
            main["process"] = True  # the next checkpoint as rank 0

    calls = {"state_dict": 0}
    state_dict = mpx.Amp._state_dict  # what Amp.state_dict() and the doors' lean entries build the state with

    def counted(amp: Any, shared: Any = ()) -> dict[str, Any]:  # the Trainer's engine (free_memory at train() makes
        calls["state_dict"] += 1  # a new one)
        return state_dict(amp, shared)

    monkeypatch.setattr(mpx.Amp, "_state_dict", counted)
    hf, _ = trainer(tmp_path, "O2", max_steps=2, save_strategy="steps", save_steps=1)
    hf.add_callback(Saves())
    hf.train()
    assert built == [0, 1]
    assert not (tmp_path / "checkpoint-1" / AMP_STATE_NAME).exists()
    assert (tmp_path / "checkpoint-2" / AMP_STATE_NAME).exists()


# -- 8. fabric.backward before fabric.setup ---------------------------------------------------------------------------
def test_fabric_backward_before_setup_is_refused_naming_it() -> None:
    """The gradients of a model Fabric never set up would keep the loss scale (an optimizer stepped by hand applies
    them 1024 times too large here; ``"16-mixed"`` scales them so too, silently), and at O2 ``fabric.setup`` drops
    them as it casts the model. Refused before the backward (Fabric refuses it under DeepSpeed); set up, the same
    model trains."""
    from lightning.fabric import Fabric

    for level in ("O1", "O2"):
        plugin = mpx.FabricMixedPrecisionPlugin(level, **SCALED)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        net = _net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        with pytest.raises(RuntimeError, match=r"fabric\.backward\(loss\) was called before fabric\.setup\(\).*Call "
                                               r"fabric\.setup\(model, optimizer\)"):  # fmt: skip
            fabric.backward(net(_x()).float().pow(2).mean())
        assert all(p.grad is None for p in net.parameters())
        model, optimizer = fabric.setup(net, optimizer)
        fabric.backward(model(_x()).float().pow(2).mean())
        optimizer.step()
        assert plugin.scaler.get_scale() == 2.0**10 and not plugin.step_was_skipped(optimizer)


def test_a_loss_over_tensors_of_ones_own_trains_once_their_optimizer_is_registered() -> None:
    """No model (an image optimized by gradient descent): refused until ``plugin.setup_optimizers(optimizer)``, then
    the scaled loss trains the tensor as FP32 does, bit for bit (a power-of-two scale, unscaled at the step)."""
    from lightning.fabric import Fabric

    plugin = mpx.FabricMixedPrecisionPlugin("O1", **SCALED)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    image, reference = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    optimizer = fabric.setup_optimizers(torch.optim.SGD([image], lr=0.1))  # Fabric hands it to no plugin
    reference_optimizer = torch.optim.SGD([reference], lr=0.1)
    target = torch.tensor([1.0, -2.0, 3.0])
    with pytest.raises(RuntimeError, match=r"register their optimizer first: plugin\.setup_optimizers\(optimizer\)"):
        fabric.backward((image - target).pow(2).sum())
    plugin.setup_optimizers(optimizer)
    for _ in range(3):
        fabric.backward((image - target).pow(2).sum())
        optimizer.step()
        optimizer.zero_grad()
        (reference - target).pow(2).sum().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert torch.equal(image, reference) and not torch.equal(image, torch.zeros(3))
