"""Contract breaks found by running Lightning's and Accelerate's own test suites with the plugins in place of their
mixed precision (Lightning 2.6.5's ``tests_pytorch``/``tests_fabric``, Accelerate 1.15's ``tests/``), ported here.

The table of every upstream failure and its class is in docs/testing.md ("Ported framework tests").
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mpx.lightning import MixedPrecisionPlugin

LEVELS = ("O1", "O2")


def _fit(level: str, steps: int) -> BoringModel:
    """Fit with a validation sanity check first: its ``no_grad`` forward leaves the policy's backward on the path
    that recomputes (``casting.mode._may_be_recomputed``), where the break was."""
    seed_everything(0)
    model = BoringModel()
    trainer = Trainer(
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=1, num_sanity_val_steps=1, accelerator="cpu", devices=1,
        plugins=[MixedPrecisionPlugin(level, half_dtype="bfloat16")],
    )
    trainer.fit(model)
    return model


@pytest.mark.parametrize("level", LEVELS)
def test_backward_count_simple(level):
    """Lightning ``tests_pytorch/trainer/optimization/test_backward_calls.py::test_backward_count_simple``: with
    ``torch.Tensor.backward`` patched, the plugin's backward calls the patch once per step (it raised ``KeyError``
    from the cast policy's backward, which looked the replaced function up among torch's own)."""
    with mock.patch("torch.Tensor.backward") as torch_backward:
        _fit(level, 2)
    assert torch_backward.call_count == 2


@pytest.mark.parametrize("level", LEVELS)
def test_wrapped_backward_trains_as_unwrapped(level):
    """A wrapper of ``torch.Tensor.backward`` installed after import (a profiler's, a counter's) is called once per
    step (not again by the policy's mode), and the run trains the same weights as without it."""
    reference = _fit(level, 3)
    original = torch.Tensor.backward
    calls = []

    def counting_backward(self, *args, **kwargs):
        calls.append(self.dtype)
        return original(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "backward", counting_backward):
        wrapped = _fit(level, 3)
    assert len(calls) == 3
    for ours, theirs in zip(wrapped.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert not torch.equal(reference.layer.weight.float(), BoringModel().layer.weight)  # it trained


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("level", LEVELS)
def test_reinstantiated_state(level):
    """Accelerate ``tests/test_cpu.py::MultiCPUTester::test_cpu``, i.e. ``test_utils/scripts/test_script.py::
    test_reinstantiated_state``: ``prepare`` after ``AcceleratorState._reset_state()`` raises Accelerate's own hint
    (it raised a bare "'AcceleratorState' object has no attribute 'is_fsdp2'")."""
    from accelerate.state import AcceleratorState

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    AcceleratorState._reset_state()
    accelerator = Accelerator(mixed_precision=level, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])
    AcceleratorState._reset_state()
    with pytest.raises(AttributeError) as caught:
        accelerator.prepare(torch.nn.Linear(1, 1))
    assert "`AcceleratorState` object has no attribute" in str(caught.value.args[0])
    assert "This happens if `AcceleratorState._reset_state()`" in str(caught.value.args[0])


def _fabric_stages(new_plugin: bool) -> list[torch.Tensor]:
    from lightning.fabric import Fabric

    from lightning_mpx.fabric import FabricMixedPrecisionPlugin

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    batches = [torch.randn(3, 4) for _ in range(4)]
    plugin = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
    for stage in range(2):
        if stage and new_plugin:
            plugin = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        module, wrapped = fabric.setup(model, optimizer)  # the same optimizer object in both stages
        for x in batches[2 * stage: 2 * stage + 2]:
            fabric.backward(module(x).float().pow(2).sum())
            wrapped.step()
            wrapped.zero_grad()
    if new_plugin:  # stepped directly, the groups hold the half parameters with no masters: still refused
        with pytest.raises(RuntimeError, match="outside Amp.step"):
            optimizer.step()
    return [m.detach().clone() for m in plugin.master_params(wrapped)] + [optimizer.state_dict()["state"][0]["exp_avg"]]


def test_lr_scheduler_strict_second_stage_with_the_same_optimizer():
    """Lightning ``tests_pytorch/trainer/optimization/test_optimizers.py::test_lr_scheduler_strict[True]`` at O2: a
    second Trainer (a new plugin) fitting the model with the same optimizer object raised "optimizer.step() was
    called ... outside Amp.step()" from the first plugin's hook on it. Here in Fabric (the same break): the second
    stage set up with a new plugin and the same optimizer trains bit for bit as with the first plugin again."""
    same, new = _fabric_stages(new_plugin=False), _fabric_stages(new_plugin=True)
    for theirs, ours in zip(same, new, strict=True):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_second_engine_given_the_same_optimizer_takes_it_over_alone(level):
    """A second stage's engine registering the first stage's optimizer takes it from the first engine (its hooks
    off, its state keyed back): one engine's hooks stay on it, and its state dict round-trips, as in one stage."""
    from lightning_mpx import Amp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    first = Amp(level, half_dtype="bfloat16")
    model = first.prepare_model(model)
    first.prepare_optimizer(optimizer)
    hooks = len(optimizer._optimizer_step_pre_hooks)
    for amp in (first, Amp(level, half_dtype="bfloat16")):
        if amp is not first:
            amp.prepare_model(model)
            amp.prepare_optimizer(optimizer)
        with amp.forward_context():
            loss = model(amp.cast_inputs(torch.randn(3, 4))).float().pow(2).sum()
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
    assert len(optimizer._optimizer_step_pre_hooks) == hooks  # the first engine's are off
    state = optimizer.state_dict()
    assert state["state"][0]["exp_avg"].dtype == torch.float32
    optimizer.load_state_dict(state)  # through the second engine's hooks alone
    assert optimizer.state_dict()["state"][0]["step"].item() == 2
