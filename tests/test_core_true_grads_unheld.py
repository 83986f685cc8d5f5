"""Small gaps found at stop 64, from the user's side:

1. ``Amp.true_grads`` of a parameter no registered optimizer holds (none, or one a door meets at its first step)
   gave its ``.grad`` still multiplied by the loss scale between the backward and the unscale; now the gradient
   divided by the scale of the backward that made it, as ``GradScaler.unscale_`` then ``.grad``; refused where that
   scale cannot be known (a tensor of no prepared model);
2. the O2 -> O3 resume refusal through the Accelerate adapter (only the engine's entry loaded by ``load_state``) named
   the core's ``model.load_state_dict(ckpt['model'])``; now Accelerate's calls;
3. Fabric at O2 refused a model sharded by ``shard_model`` before ``fabric.setup`` under its default strategy with
   words about ``ModelParallelStrategy``'s ``parallelize_fn``; now words of that path (the strategy's path keeps its
   own);
4. the Apex layer's ``amp.initialize``: a refusal while preparing left ``_amp_state`` changed (the failed engine
   installed); now a correct call after it behaves as a first one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_mpx as mpx
from lightning_mpx import Amp
from lightning_mpx.apex import amp as apex_amp
from lightning_mpx.apex._state import _amp_state
from tests.test_accelerate_fsdp2_setup_guard import _accelerate_resume

BF16 = torch.bfloat16


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def _x() -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(0))


# -- 1. Amp.true_grads of parameters no registered optimizer holds ----------------------------------------------------
def _scaler_reference(level: str) -> list[torch.Tensor]:
    """``torch.amp.GradScaler`` (CPU, scale 1024) over the whole model: ``unscale_`` then ``.grad``."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with torch.autocast("cpu", dtype=BF16, enabled=level == "O1"):
        out = model(_x()).float()
    scaler.scale(F.mse_loss(out, torch.zeros(8, 2))).backward()
    scaler.unscale_(optimizer)
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_true_grads_of_a_part_no_optimizer_holds_are_unscaled(level: str) -> None:
    """An optimizer over the first layer only: the second layer's ``true_grads`` after the backward are
    ``GradScaler``'s unscaled gradients (before: x1024)."""
    want = _scaler_reference(level)
    model = _net()
    amp = Amp(level, half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**10)
    amp.prepare_model(model)
    trunk = amp.prepare_optimizer(torch.optim.SGD(model[0].parameters(), lr=0.0))  # kept: a dropped one is gone
    out = model(_x().to(BF16) if level == "O2" else _x()).float()
    with pytest.warns(UserWarning) if level == "O2" else _nothing():  # (the unheld half head is warned about)
        amp.backward(F.mse_loss(out, torch.zeros(8, 2)))
    got = amp.true_grads(model.parameters())
    for grad, expected in zip(got, want, strict=True):
        assert grad is not None and grad.dtype == torch.float32
        torch.testing.assert_close(grad, expected, atol=2e-2, rtol=5e-2)
    assert trunk.param_groups


def test_true_grads_keep_the_scale_across_an_update_until_the_optimizer_is_met() -> None:
    """O1: a head's gradient computed at 1024, then an update that doubles nothing but moves the scale (a growth
    interval of 1): still divided by 1024, the scale it was made with."""
    want = _scaler_reference("O1")
    model = _net()
    amp = Amp("O1", half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**10, growth_interval=1)
    amp.prepare_model(model)
    trunk = torch.optim.SGD(model[0].parameters(), lr=0.0)
    amp.prepare_optimizer(trunk)
    amp.backward(F.mse_loss(model(_x()), torch.zeros(8, 2)))
    amp.step(trunk)
    amp.update()
    assert float(amp.scalers[0].scale_tensor) == 2.0**11
    got = amp.true_grads(model[2].parameters())
    for grad, expected in zip(got, want[2:], strict=True):
        torch.testing.assert_close(grad, expected, atol=2e-2, rtol=5e-2)


def test_true_grads_refuse_a_gradient_whose_scale_cannot_be_known() -> None:
    amp = Amp("O1", half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**10)
    model = amp.prepare_model(_net())
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    assert optimizer.param_groups
    own = nn.Parameter(torch.ones(2))
    assert amp.true_grads([own]) == [None]
    own.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match=r"of no model prepared by this Amp.*cannot be known"):
        amp.true_grads([own])
    unit = Amp("O1", half_dtype="bfloat16")  # every scale 1: nothing to divide by
    assert unit.true_grads([own])[0] is own.grad


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


# -- 2. the Accelerate adapter's resume refusal names Accelerate's calls --------------------------------------------
@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_accelerate_resume_refusal_names_load_state_and_its_hook(tmp_path: Any) -> None:
    error, _, _ = _accelerate_resume("bfloat16", "bfloat16", False, tmp_path)
    assert isinstance(error, RuntimeError)
    message = str(error)
    assert "accelerator.load_state()" in message and "register_load_state_pre_hook" in message
    assert "unwrap_model" in message
    assert "ckpt['model']" not in message  # the core's advice, which no Accelerate user has


# -- 3. Fabric at O2: a model sharded before fabric.setup -----------------------------------------------------------
def test_fabric_o2_refuses_a_presharded_model_in_words_of_that_path(one_rank: None) -> None:
    from lightning.fabric import Fabric

    from lightning_mpx.integrations.fsdp import shard_model

    plugin = mpx.FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
    net = shard_model(_net(), plugin)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    with pytest.raises(RuntimeError) as caught:
        fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    message = str(caught.value)
    assert "sharded before fabric.setup" in message and "SingleDeviceStrategy" in message
    assert "parallelize_fn" not in message and "ModelParallelStrategy" not in message


def test_fabric_o2_under_model_parallel_strategy_keeps_its_own_words() -> None:
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    plugin = mpx.FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
    strategy = ModelParallelStrategy(parallelize_fn=lambda model, mesh: model)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin])
    try:
        fabric.launch()
        net = _net()
        with pytest.raises(RuntimeError, match=r"ModelParallelStrategy, fully_shard in parallelize_fn"):
            fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- 4. the Apex layer: a failed initialize leaves _amp_state as it was --------------------------------------------
@pytest.fixture
def _fresh_apex_state():
    _amp_state.reset()
    yield
    _amp_state.reset()


def _apex_losses(model: nn.Module, optimizer: Any) -> list[float]:
    losses = []
    for step in range(3):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
        loss = F.mse_loss(model(x.to(BF16)).float(), torch.zeros(4, 2))
        with apex_amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _first_run() -> list[float]:
    _amp_state.reset()
    model = _net()
    model, optimizer = apex_amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", cast_model_type=BF16,
        loss_scale="dynamic", verbosity=0,
    )  # fmt: skip
    losses = _apex_losses(model, optimizer)
    _amp_state.reset()
    return losses


FAILURES = {
    "optimizer_over_another_models_half_parameters": lambda: (
        _net(),
        torch.optim.SGD(_net().to(BF16).parameters(), lr=0.1),
        ValueError,
        "of no model given",
    ),
    "model_with_nothing_to_cast": lambda: (nn.ReLU(), None, ValueError, "no floating-point parameters"),
    "lazy_module": lambda: (nn.Sequential(nn.LazyLinear(2)), None, ValueError, "not initialized yet"),
}


@pytest.mark.usefixtures("_fresh_apex_state")
@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failed_apex_initialize_leaves_amp_state_as_it_was(failure: str) -> None:
    """After a refused call (fresh, then after an earlier call): ``_amp_state`` holds what it held, the model given
    stays FP32 and unhooked, and a correct call then trains as a first one (the same losses)."""
    want = _first_run()
    model, optimizer, error, pattern = FAILURES[failure]()
    with pytest.raises(error, match=pattern):
        apex_amp.initialize(model, optimizer, opt_level="O2", cast_model_type=BF16, verbosity=0)
    assert _amp_state.amp is None and _amp_state.enabled is None and not _amp_state.models and not _amp_state.hooks
    assert all(p.dtype == torch.float32 for p in model.parameters() if not isinstance(p, nn.UninitializedParameter))
    net = _net()
    net, opt = apex_amp.initialize(
        net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level="O2", cast_model_type=BF16, loss_scale="dynamic",
        verbosity=0,
    )  # fmt: skip
    earlier = _amp_state.amp
    scale = float(earlier.scalers[0].scale_tensor)
    model, optimizer, error, pattern = FAILURES[failure]()
    with pytest.raises(error, match=pattern):
        apex_amp.initialize(model, optimizer, opt_level="O2", cast_model_type=BF16, verbosity=0)
    assert _amp_state.amp is earlier and _amp_state.current and _amp_state.current[0] is opt
    assert float(earlier.scalers[0].scale_tensor) == scale
    assert _apex_losses(net, opt) == want
