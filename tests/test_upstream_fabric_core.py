"""Lightning Fabric's own tests of ``Fabric``'s set-up, backward, clipping, save and load, ported to a ``Fabric`` that
holds ``FabricMixedPrecisionPlugin``.

Upstream (Lightning 2.6.5, the tests of the installed 2.6.6): ``tests/tests_fabric/test_fabric.py``'s ``test_setup_*``,
``test_backward*``, ``test_autocast``, ``test_grad_clipping``, ``test_save_*``, ``test_load_*`` and
``test_fabric_load_*``, and ``tests/tests_fabric/strategies/test_single_device.py::test_clip_gradients``. Upstream
checks most of these with the strategy's methods mocked; here each runs on a real ``Fabric`` with the plugin, under
O1/O2 x float16/bfloat16, and checks what the user sees (wrappers, gradients, clipped values, files, restored state).
docs/testing.md ("Ported framework tests") lists the deliberate differences and the tests not ported.
"""

from __future__ import annotations

import copy
from re import escape
from typing import Any

import lightning.fabric
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer
from torch import nn

from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin

HALVES = ("float16", "bfloat16")
LEVELS = ("O1", "O2")
CASES = [pytest.param(level, half, id=f"{level}-{half}") for level in LEVELS for half in HALVES]
SCALE = 1024.0  # float16's first scale: 2**16 overflows the tiny models' float16 gradients at once


def _dtype(half: str) -> torch.dtype:
    return getattr(torch, half)


def _plugin(level: str, half: str, **settings: Any) -> FabricMixedPrecisionPlugin:
    return FabricMixedPrecisionPlugin(level, half_dtype=half, init_scale=SCALE, **settings)


def _fabric(level: str, half: str, **settings: Any) -> tuple[Fabric, FabricMixedPrecisionPlugin]:
    plugin = _plugin(level, half, **settings)
    return Fabric(accelerator="cpu", devices=1, plugins=[plugin]), plugin


def _scale(plugin: FabricMixedPrecisionPlugin, loss_id: int = 0) -> float:
    return plugin.amp.scalers[loss_id].get_scale()


class BoringModel(nn.Module):
    """Upstream's ``BoringModel``: its forward returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer(x)
        return torch.nn.functional.mse_loss(x, torch.ones_like(x))


# -- strategies/test_single_device.py ---------------------------------------------------------------------------------
@pytest.mark.parametrize("clip_type", ["norm", "val"])
@pytest.mark.parametrize(("level", "half"), CASES)
def test_clip_gradients(level, half, clip_type):
    """Upstream ``strategies/test_single_device.py::test_clip_gradients`` (on "32-true", "bf16-mixed", and
    "16-mixed" without its norm case, "numerically unstable"): with all gradients equal, clipping to half the norm or
    half the value leaves that norm or value.

    Ours, every case: the clip is on the unscaled FP32 gradients the step uses (``mpx.main_params``: the model's own
    at O1, the FP32 masters' at O2). At O2 the model's half gradients show the clipped values at once,
    as upstream's clip leaves them (a write to them before the step is on those:
    tests/test_fabric_write_after_clip.py)."""
    fabric, plugin = _fabric(level, half)
    in_features, out_features = 32, 2
    model = torch.nn.Linear(in_features, out_features, bias=False)
    model.weight.data.fill_(0.01)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)

    batch = torch.full((1, in_features), 0.1, device=fabric.device)
    loss = model(batch).sum()
    # The example is constructed such that the gradients are all the same
    fabric.backward(loss)
    unscaled = model.weight.grad.detach().float() / _scale(plugin)

    def clipped() -> torch.Tensor:
        (grad,) = [p.grad for p in plugin.main_params(optimizer)]
        assert grad.dtype == torch.float32
        return grad

    if clip_type == "norm":
        norm = torch.linalg.vector_norm(unscaled, 2, dtype=torch.float32).item()
        new_norm = norm / 2.0
        returned = fabric.clip_gradients(model, optimizer, max_norm=new_norm)
        torch.testing.assert_close(returned, torch.tensor(norm))  # the norm before clipping, as torch's clip
        assert torch.allclose(torch.linalg.vector_norm(clipped(), 2, dtype=torch.float32), torch.tensor(new_norm))
    else:
        val = unscaled.view(-1)[0].item()
        new_val = val / 2.0
        fabric.clip_gradients(model, optimizer, clip_val=new_val)
        assert torch.allclose(clipped(), torch.full_like(clipped(), new_val))
    if level == "O2":
        assert model.weight.grad.dtype == _dtype(half)
        torch.testing.assert_close(model.weight.grad, clipped().to(_dtype(half)), rtol=0, atol=0)

    optimizer.step()
    assert not plugin.step_was_skipped(optimizer)
    optimizer.zero_grad()


# -- test_fabric.py: set-up -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup_method", ["setup", "setup_module"])
@pytest.mark.parametrize(("level", "half"), CASES)
def test_setup_module(level, half, setup_method):
    """Upstream ``test_fabric.py::test_setup_module`` (DDP mocked there; single device here): the set-up model wraps
    the original one and keeps its parameters, converted in place (half at O2), with a forward of its own."""
    fabric, plugin = _fabric(level, half)
    model = nn.Linear(1, 2)
    weight = model.weight
    fabric_model = getattr(fabric, setup_method)(model)
    assert fabric_model.module is model
    assert fabric_model.weight is model.weight is weight
    assert weight.dtype == (_dtype(half) if level == "O2" else torch.float32)
    assert fabric_model.forward != model.forward
    assert fabric_model(torch.ones(3, 1)).dtype == torch.float32


@pytest.mark.parametrize("move_to_device", [True, False])
@pytest.mark.parametrize("setup_method", ["setup", "setup_module"])
@pytest.mark.parametrize(("level", "half"), CASES)
def test_setup_module_move_to_device(level, half, setup_method, move_to_device):
    """Upstream ``test_fabric.py::test_setup_module_move_to_device`` (its CPU case; the others need a GPU or MPS):
    the parameters and the wrapper's ``device`` are where Fabric put them. The edge case of a model without
    parameters is ``test_setup_module_move_to_device_no_parameters``."""
    fabric, plugin = _fabric(level, half)
    model = nn.Linear(1, 2)
    fabric_model = getattr(fabric, setup_method)(model, move_to_device=move_to_device)
    assert all(param.device == torch.device("cpu") for param in model.parameters())
    assert all(param.device == torch.device("cpu") for param in fabric_model.parameters())
    assert fabric_model.device == fabric.device == torch.device("cpu")


@pytest.mark.parametrize("setup_method", ["setup", "setup_module"])
@pytest.mark.parametrize(("level", "half"), CASES)
def test_setup_module_move_to_device_no_parameters(level, half, setup_method):
    """Upstream ``test_fabric.py::test_setup_module_move_to_device``'s "edge case: model has no parameters":
    ``fabric.setup(nn.Sequential())`` is accepted, on the target device."""
    fabric, plugin = _fabric(level, half)
    fabric_model = getattr(fabric, setup_method)(nn.Sequential())
    assert fabric_model.device == torch.device("cpu")
    assert torch.equal(fabric_model(torch.ones(2)), torch.ones(2))


@pytest.mark.parametrize(("level", "half"), CASES)
def test_setup_module_and_optimizers(level, half):
    """Upstream ``test_fabric.py::test_setup_module_and_optimizers``: ``setup()`` takes no optimizer, one, or several,
    and returns Fabric's wrappers around the objects given (here the same model is set up three times, as upstream:
    the plugin converts it once)."""
    fabric, plugin = _fabric(level, half)
    model = nn.Linear(1, 2)
    optimizer0 = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer1 = torch.optim.Adam(model.parameters(), lr=0.1)

    # no optimizer
    fabric_model = fabric.setup(model)
    assert isinstance(fabric_model, _FabricModule)
    assert fabric_model.module is model

    # single optimizer
    fabric_model, fabric_optimizer = fabric.setup(model, optimizer0)
    assert isinstance(fabric_model, _FabricModule)
    assert isinstance(fabric_optimizer, _FabricOptimizer)
    assert fabric_model.module is model
    assert fabric_optimizer.optimizer is optimizer0

    # multiple optimizers
    fabric_model, fabric_optimizer0, fabric_optimizer1 = fabric.setup(model, optimizer0, optimizer1)
    assert isinstance(fabric_model, _FabricModule)
    assert isinstance(fabric_optimizer0, _FabricOptimizer)
    assert isinstance(fabric_optimizer1, _FabricOptimizer)
    assert fabric_model.module is model
    assert fabric_optimizer0.optimizer is optimizer0
    assert fabric_optimizer1.optimizer is optimizer1

    assert len(plugin.amp.master_weights) == (1 if level == "O2" else 0)
    assert model.weight.dtype == (_dtype(half) if level == "O2" else torch.float32)


@pytest.mark.parametrize(("level", "half"), CASES)
def test_setup_module_and_optimizers_step(level, half):
    """Upstream ``test_fabric.py::test_setup_module_and_optimizers``'s "multiple optimizers", stepped: a body and a
    head optimizer set up together each step from the FP32 weights given to the model (at O2, their masters), as the
    README promises. Reference: SGD in FP32 on the same unscaled gradients."""
    fabric, plugin = _fabric(level, half)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fp32 = [p.detach().clone() for p in model.parameters()]
    body = torch.optim.SGD(model[0].parameters(), lr=0.1)
    head = torch.optim.SGD(model[1].parameters(), lr=0.1)
    fabric_model, body, head = fabric.setup(model, body, head)

    fabric.backward(fabric_model(torch.randn(3, 4)).sum())
    grads = [p.grad.detach().float() / _scale(plugin) for p in model.parameters()]
    body.step()
    head.step()
    assert not plugin.step_was_skipped(body) and not plugin.step_was_skipped(head)
    for param, weight, grad in zip(model.parameters(), fp32, grads):
        torch.testing.assert_close(plugin.amp.master_of(param), weight - 0.1 * grad)


@pytest.mark.parametrize(("level", "half"), CASES)
def test_setup_optimizers(level, half):
    """Upstream ``test_fabric.py::test_setup_optimizers``: ``setup_optimizers()`` takes one or more optimizers and
    wraps them. Ours also steps them: a model set up with ``setup_module`` and its optimizer with
    ``setup_optimizers`` train as with ``setup(model, optimizer)``."""
    fabric, plugin = _fabric(level, half)
    model = nn.Linear(1, 2)
    optimizer0 = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer1 = torch.optim.Adam(model.parameters(), lr=0.1)

    fabric_optimizer = fabric.setup_optimizers(optimizer0)
    assert isinstance(fabric_optimizer, _FabricOptimizer)
    assert fabric_optimizer.optimizer is optimizer0

    fabric_optimizer0, fabric_optimizer1 = fabric.setup_optimizers(optimizer0, optimizer1)
    assert isinstance(fabric_optimizer0, _FabricOptimizer)
    assert isinstance(fabric_optimizer1, _FabricOptimizer)
    assert fabric_optimizer0.optimizer is optimizer0
    assert fabric_optimizer1.optimizer is optimizer1

    # The set-up sequence of setup_module + setup_optimizers, stepped.
    fabric, plugin = _fabric(level, half)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    fabric_model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(3, 4)
    fabric.backward(fabric_model(x).sum())
    optimizer.step()
    reference(x).sum().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    torch.testing.assert_close(plugin.amp.master_of(model.weight), reference.weight, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("level", "half"), CASES)
def test_setup_twice_fails(level, half):
    """Upstream ``test_fabric.py::test_setup_twice_fails``: a wrapped model or optimizer given to ``setup`` again is
    refused, with the plugin in place too."""
    fabric, plugin = _fabric(level, half)
    model = nn.Linear(1, 2)
    optimizer = torch.optim.Adam(model.parameters())

    fabric_model, fabric_optimizer = fabric.setup(model, optimizer)
    with pytest.raises(ValueError, match="A model should be passed only once to the"):
        fabric.setup(fabric_model, optimizer)

    fabric_model, fabric_optimizer = fabric.setup(model, optimizer)
    with pytest.raises(ValueError, match="An optimizer should be passed only once to the"):
        fabric.setup(model, fabric_optimizer)


@pytest.mark.parametrize(("level", "half"), CASES)
def test_setup_module_twice_fails(level, half):
    """Upstream ``test_fabric.py::test_setup_module_twice_fails``."""
    fabric, plugin = _fabric(level, half)
    fabric_model = fabric.setup_module(nn.Linear(1, 2))
    with pytest.raises(ValueError, match="A model should be passed only once to the"):
        fabric.setup_module(fabric_model)


@pytest.mark.parametrize(("level", "half"), CASES)
def test_setup_optimizers_twice_fails(level, half):
    """Upstream ``test_fabric.py::test_setup_optimizers_twice_fails``."""
    fabric, plugin = _fabric(level, half)
    optimizer = torch.optim.Adam(nn.Linear(1, 2).parameters())
    fabric_optimizer = fabric.setup_optimizers(optimizer)
    with pytest.raises(ValueError, match="An optimizer should be passed only once to"):
        fabric.setup_optimizers(fabric_optimizer)


@pytest.mark.parametrize(("level", "half"), CASES)
def test_setup_tracks_num_models(level, half):
    """Upstream ``test_fabric.py::test_setup_tracks_num_models``: Fabric counts each set-up; the plugin prepares the
    model once however often it is set up (one set of O2 masters)."""
    fabric, plugin = _fabric(level, half)
    model = nn.Linear(1, 2)
    optimizer = torch.optim.Adam(model.parameters())

    assert fabric._models_setup == 0
    fabric.setup(model, optimizer)
    assert fabric._models_setup == 1
    fabric.setup(model, optimizer)
    assert fabric._models_setup == 2
    fabric.setup_module(model)
    assert fabric._models_setup == 3
    assert len(plugin.amp.master_weights) == (1 if level == "O2" else 0)


# -- test_fabric.py: backward and autocast -----------------------------------------------------------------------------
@pytest.mark.parametrize(("level", "half"), CASES)
def test_backward(level, half):
    """Upstream ``test_fabric.py::test_backward``: ``fabric.backward(loss, *args, **kwargs)`` calls into the strategy
    and the precision plugin with the arguments. Ours, real: the gradients are the FP32 model's times the loss scale,
    and the plugin's own keyword ``loss_id`` picks the loss's scaler (``num_losses=2``)."""
    fabric, plugin = _fabric(level, half, num_losses=2, loss_scale="dynamic")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fabric_model, optimizer = fabric.setup(model, optimizer)
    plugin.setup_optimizers(optimizer)  # num_losses > 1: the plugin must know its optimizers before a backward
    plugin.amp.scalers[1].load_state_dict({**plugin.amp.scalers[1].state_dict(), "scale": 2 * SCALE})
    x = torch.randn(3, 4)
    reference(x).sum().backward()

    for loss_id, scale in ((0, SCALE), (1, 2 * SCALE)):
        fabric.backward(fabric_model(x).sum(), loss_id=loss_id)
        torch.testing.assert_close(model.weight.grad.float() / scale, reference.weight.grad, rtol=2e-2, atol=1e-2)
        optimizer.zero_grad()


@pytest.mark.parametrize("setup_method", ["setup", "setup_module"])
@pytest.mark.parametrize(("level", "half"), CASES)
def test_backward_required(level, half, setup_method):
    """Upstream ``test_fabric.py::test_backward_required``: with a precision that scales the loss ("bf16-mixed"
    there), a plain ``loss.backward()`` on a set-up model's output is refused, and ``fabric.backward(loss)`` works: one
    model, two chained, two independent, and a model returning a dict. The plugin always requires
    ``fabric.backward`` (its backward scales the loss), as "bf16-mixed" does."""
    fabric, plugin = _fabric(level, half)
    error_context = pytest.raises(RuntimeError, match=escape("requires you to call `fabric.backward(loss)`"))
    batch = torch.rand(2, 2)

    # One model
    model1 = getattr(fabric, setup_method)(nn.Linear(2, 2))
    output = model1(batch)
    assert output._backward_hooks is not None
    loss = output.sum()
    with error_context:
        loss.backward()
    loss = model1(batch).sum()
    assert not lightning.fabric.wrappers._in_fabric_backward
    fabric.backward(loss)  # no error
    assert not lightning.fabric.wrappers._in_fabric_backward

    # Two models chained
    model2 = getattr(fabric, setup_method)(torch.nn.Linear(2, 2))
    loss = model2(model1(batch)).sum()
    with error_context:
        loss.backward()
    loss = model2(model1(batch)).sum()
    fabric.backward(loss)  # no error

    # Two independent models
    loss1 = model1(batch).sum()
    loss2 = model2(batch).sum()
    with error_context:
        loss1.backward()
    with error_context:
        loss2.backward()
    fabric.backward(model1(batch).sum())  # no error
    fabric.backward(model2(batch).sum())  # no error

    # Model that returns a datastructure of tensors
    class DictReturnModel(nn.Linear):
        def forward(self, x):
            return {
                "loss": super().forward(x).sum(),
                "other": torch.rand(2, 2),  # does not require grad
            }

    model3 = getattr(fabric, setup_method)(DictReturnModel(2, 2))
    output = model3(batch)
    assert output["loss"]._backward_hooks is not None
    assert output["other"]._backward_hooks is None
    with error_context:
        (output["loss"] * 2).backward()
    fabric.backward(model3(batch)["loss"] * 2)  # no error
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model3.parameters())


@pytest.mark.parametrize(("level", "half"), CASES)
def test_autocast(level, half):
    """Upstream ``test_fabric.py::test_autocast``: ``fabric.autocast()`` enters the precision plugin's forward
    context and leaves it. Ours: at O1 a matmul inside runs in the half dtype (the cast table); at O2 a loss function
    of half tensors runs in FP32; nothing is cast after the block; a ``fabric.backward`` inside it works."""
    fabric, plugin = _fabric(level, half)
    a = torch.randn(4, 4)
    h = torch.randn(4, 4, dtype=_dtype(half))
    model = fabric.setup(nn.Linear(4, 1))
    with fabric.autocast():
        assert torch.mm(a, a).dtype == (_dtype(half) if level == "O1" else torch.float32)
        assert F.mse_loss(h, h).dtype == torch.float32
        fabric.backward(model(a).sum())
    assert torch.mm(a, a).dtype == torch.float32
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# -- test_fabric.py: clipping -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("clip_val", "max_norm"), [(1e-3, None), (None, 1)])
@pytest.mark.parametrize(("level", "half"), CASES)
def test_grad_clipping(level, half, clip_val, max_norm):
    """Upstream ``test_fabric.py::test_grad_clipping``: ``fabric.clip_gradients`` clips by value when given
    ``clip_val`` and by norm (2-norm, ``error_if_nonfinite=True``) when given ``max_norm``, on the unwrapped model and
    optimizer. Ours, on real gradients: the unscaled gradients the step uses, against torch's clip of the FP32
    model's."""
    fabric, plugin = _fabric(level, half)
    torch.manual_seed(0)
    torch_model = nn.Linear(1, 1)
    reference = copy.deepcopy(torch_model)
    torch_optimizer = torch.optim.SGD(torch_model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(torch_model, torch_optimizer)

    x = torch.rand(1, 1)
    fabric.backward(model(x).sum())
    reference(x).sum().backward()
    returned = fabric.clip_gradients(model, optimizer, max_norm=max_norm, clip_val=clip_val)
    if clip_val is not None:
        assert returned is None
        torch.nn.utils.clip_grad_value_(reference.parameters(), clip_val)
    else:
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, error_if_nonfinite=True)
        torch.testing.assert_close(returned, expected, rtol=2e-2, atol=1e-3)
    for master, ref in zip(plugin.main_params(optimizer), reference.parameters()):
        torch.testing.assert_close(master.grad, ref.grad, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("how", ["max_norm", "clip_val"])
@pytest.mark.parametrize(("level", "half"), CASES)
def test_grad_clipping_overflow(level, half, how):
    """Upstream ``test_fabric.py::test_grad_clipping`` on an overflow step (not in upstream's test): Fabric clips by
    norm with ``error_if_nonfinite=True``, so "bf16-mixed" raises on an inf gradient. Ours (a deliberate difference):
    the step is skipped and there is nothing to clip: by norm the returned norm is 0.0; by value nothing happens;
    the weights stay as they were."""
    fabric, plugin = _fabric(level, half, loss_scale="dynamic")
    torch_model = nn.Linear(2, 2)
    model, optimizer = fabric.setup(torch_model, torch.optim.SGD(torch_model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    fabric.backward(model(torch.randn(3, 2)).sum())
    model.weight.grad[0, 0] = float("inf")
    if how == "max_norm":
        assert float(fabric.clip_gradients(model, optimizer, max_norm=1.0)) == 0.0
    else:
        fabric.clip_gradients(model, optimizer, clip_val=1.0)
    optimizer.step()
    assert plugin.step_was_skipped(optimizer)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# -- test_fabric.py: save and load ------------------------------------------------------------------------------------
def _trained(level: str, half: str, *, register: bool, steps: int, seed: int = 0) -> tuple[Any, ...]:
    """Fabric, the set-up model and optimizer, the plugin, after ``steps`` steps (upstream saves right after
    ``setup``: 0 steps), and the model's FP32 state dict from before ``setup``. ``register``: the plugin is told of
    the optimizer at set-up (``mpx.setup_optimizers``)."""
    fabric, plugin = _fabric(level, half)
    torch.manual_seed(seed)
    model = BoringModel()
    fp32 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    if register:
        plugin.setup_optimizers(optimizer)
    for _ in range(steps):
        fabric.backward(model(torch.randn(4, 32)))
        optimizer.step()
        optimizer.zero_grad()
    return fabric, model, optimizer, plugin, fp32


def _fp32_weights(plugin: FabricMixedPrecisionPlugin, model: Any) -> dict[str, torch.Tensor]:
    """The FP32 values the model trains from: the O2 masters, the model's own weights at O1."""
    return plugin.amp.fp32_state_dict(model.module) if plugin.opt_level == "O2" else model.module.state_dict()


@pytest.mark.parametrize(("level", "half"), CASES)
def test_save_wrapped_objects(level, half, tmp_path):
    """Upstream ``test_fabric.py::test_save_wrapped_objects``: the model and optimizer in the state are saved
    unwrapped (Fabric's wrappers are not in the file). Ours, real file: each entry is its object's state dict (the
    model's FP32 at O2 too: its masters, not the half values it stores; the plugin's with the loss scale and the FP32
    values), other entries as they are, loadable with ``weights_only=True``."""
    fabric, model, optimizer, plugin, _ = _trained(level, half, register=False, steps=0)
    anything = {"cocofruit": 1}
    state = {"model": model, "optimizer": optimizer, "mpx": plugin, "anything": anything}
    fabric.save(tmp_path / "ckpt", state)

    saved = torch.load(tmp_path / "ckpt", weights_only=True)
    assert set(saved) == {"model", "optimizer", "mpx", "anything"}
    assert saved["anything"] == anything
    assert saved["model"].keys() == model.module.state_dict().keys()
    assert saved["model"]["layer.weight"].dtype == torch.float32
    assert saved["optimizer"].keys() == optimizer.optimizer.state_dict().keys()
    assert saved["mpx"]["opt_level"] == level
    assert state["model"] is model and state["optimizer"] is optimizer  # the state given is left as it was


@pytest.mark.parametrize(("level", "half"), CASES)
def test_save_filter(level, half, tmp_path):
    """Upstream ``test_fabric.py::test_save_filter``: per-entry filters of the state dicts saved, and bad filters
    refused. The plugin's entry is filtered like the model's and optimizer's."""
    fabric, model, optimizer, plugin, _ = _trained(level, half, register=True, steps=1)
    anything = {"cocofruit": 1}
    state = {"model": model, "optimizer": optimizer, "mpx": plugin, "anything": anything, "foo": 1}
    save_path = tmp_path / "foo.pth"

    # filter all dicts
    fabric.save(save_path, state, filter={k: lambda k, v: False for k in state})
    assert torch.load(save_path, weights_only=True) == {"foo": 1}

    # bad filters
    with pytest.raises(TypeError, match="should be a dict"):
        fabric.save(save_path, state, filter="foo")
    with pytest.raises(TypeError, match="callable, given 'foo"):
        fabric.save(save_path, state, filter={"model": "foo"})
    with pytest.raises(ValueError, match="keys {'asd'} are not present in the state keys"):
        fabric.save(save_path, state, filter={"asd": lambda k, v: True})

    # subset
    fabric.save(
        save_path,
        state,
        filter={
            "model": lambda k, v: "weight" in k,
            "anything": lambda k, v: isinstance(v, int),
            "optimizer": lambda k, v: "param_groups" in k,
            "mpx": lambda k, v: k in ("opt_level", "scalers"),
        },
    )
    saved = torch.load(save_path, weights_only=True)
    assert set(saved) == {"model", "optimizer", "mpx", "anything", "foo"}
    assert list(saved["model"]) == ["layer.weight"] and list(saved["optimizer"]) == ["param_groups"]
    assert set(saved["mpx"]) == {"opt_level", "scalers"} and saved["anything"] == anything and saved["foo"] == 1


@pytest.mark.parametrize(
    ("level", "half", "registered"),
    [
        pytest.param(level, half, registered, id=f"{level}-{half}-{'registered' if registered else 'as-upstream'}")
        for level in LEVELS for half in HALVES for registered in (False, True)
    ],
)  # fmt: skip
def test_load_wrapped_objects(level, half, registered, tmp_path):
    """Upstream ``test_fabric.py::test_load_wrapped_objects``: ``fabric.load`` restores model, optimizer and other
    entries in place and returns what the state did not ask for. Ours, real files: a checkpoint saved right after
    ``setup`` (as upstream), or after ``mpx.setup_optimizers`` too (``registered``), is loaded the documented way
    (``setup``, ``mpx.setup_optimizers``, ``load``) into another run; the model's FP32 weights come back exactly (at
    O2 as the masters) and the run steps."""
    fabric, model, optimizer, plugin, fp32 = _trained(level, half, register=registered, steps=0)
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "mpx": plugin, "int": 5, "extra": "data"})

    fabric2, model2, optimizer2, plugin2, _ = _trained(level, half, register=True, steps=0, seed=1)
    state = {"model": model2, "optimizer": optimizer2, "mpx": plugin2, "int": 0}
    remainder = fabric2.load(tmp_path / "ckpt", state)
    assert state == {"model": model2, "optimizer": optimizer2, "mpx": plugin2, "int": 5}
    assert remainder == {"extra": "data"}
    restored = _fp32_weights(plugin2, model2)
    assert all(torch.equal(restored[k], v) for k, v in fp32.items())
    fabric2.backward(model2(torch.randn(4, 32)))
    optimizer2.step()
    assert not plugin2.step_was_skipped(optimizer2)


@pytest.mark.parametrize(("level", "half"), CASES)
def test_load_raw(level, half, tmp_path):
    """Upstream ``test_fabric.py::test_load_raw``: ``fabric.load_raw`` loads a plain state dict into the unwrapped
    model or optimizer. Ours, real files: FP32 weights loaded into a set-up model are what it trains from (at O2 the
    masters take them exactly: the first step is the FP32 SGD step from them), and an optimizer's state loads into
    the optimizer the plugin knows (at O2 onto the masters, after ``mpx.setup_optimizers``)."""
    torch.manual_seed(0)
    source = nn.Linear(2, 2)
    torch.save(source.state_dict(), tmp_path / "model.pt")
    source_optimizer = torch.optim.Adam(source.parameters(), lr=0.1)
    source(torch.randn(3, 2)).sum().backward()
    source_optimizer.step()
    source_optimizer.zero_grad()
    torch.save(source_optimizer.state_dict(), tmp_path / "optimizer.pt")
    fp32 = {k: v.detach().clone() for k, v in torch.load(tmp_path / "model.pt", weights_only=True).items()}

    fabric, plugin = _fabric(level, half)
    torch.manual_seed(1)
    model = nn.Linear(2, 2)
    wrapped_model, wrapped_optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.load_raw(tmp_path / "model.pt", wrapped_model)
    fabric.backward(wrapped_model(torch.randn(3, 2)).sum())
    grad = model.weight.grad.detach().float() / _scale(plugin)
    wrapped_optimizer.step()
    torch.testing.assert_close(plugin.amp.master_of(model.weight), fp32["weight"] - 0.1 * grad)

    fabric, plugin = _fabric(level, half)
    model = nn.Linear(2, 2)
    wrapped_model, wrapped_optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))
    plugin.setup_optimizers(wrapped_optimizer)
    fabric.load_raw(tmp_path / "optimizer.pt", wrapped_optimizer)
    state = wrapped_optimizer.optimizer.state[plugin.amp.master_of(model.weight)]
    expected = source_optimizer.state[source.weight]
    assert state["exp_avg"].dtype == torch.float32
    assert torch.equal(state["exp_avg"], expected["exp_avg"])


@pytest.mark.parametrize("weights_only", [None, False, True])
@pytest.mark.parametrize(("level", "half"), CASES)
def test_fabric_load_forwards_weights_only_to_strategy(level, half, weights_only, tmp_path):
    """Upstream ``test_fabric.py::test_fabric_load_forwards_weights_only_to_strategy`` and
    ``test_fabric_load_accepts_weights_only_false``: ``fabric.load(..., weights_only=...)`` reaches ``torch.load``.
    Ours, real file: a checkpoint with the plugin's state loads under each (its state is tensors and plain Python
    values, which ``weights_only=True`` accepts), and the loss scale comes back."""
    fabric, model, optimizer, plugin, _ = _trained(level, half, register=True, steps=1)
    plugin.amp.scalers[0].load_state_dict({**plugin.amp.scalers[0].state_dict(), "scale": 4.0 * SCALE})
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "mpx": plugin, "foo": 123})

    fabric2, model2, optimizer2, plugin2, _ = _trained(level, half, register=True, steps=0, seed=1)
    remainder = fabric2.load(
        tmp_path / "ckpt", {"model": model2, "optimizer": optimizer2, "mpx": plugin2}, weights_only=weights_only
    )
    assert remainder == {"foo": 123}
    assert _scale(plugin2) == 4.0 * SCALE
