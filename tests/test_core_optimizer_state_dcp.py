"""A hostile user of ``optimizer.state[p]`` at O2 (stop 61's ``StateByMasters``) and of checkpoint tools that read an
optimizer's state from outside: torch.distributed.checkpoint's ``get_state_dict``/``set_state_dict`` (one process),
a user's own state key, state touched before the first step, whole-object copies and saves, and an O2 <-> O1 switch
of ``optimizer.state_dict()``, each against the O1 run (FP32 parameters, torch's own state) or the uninterrupted one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lightning_mpx import Amp
from tests.test_core_state_by_param import _core_steps, _net


def _run(level: str) -> tuple[Amp, torch.nn.Module, torch.optim.Optimizer]:
    amp = Amp(level, half_dtype=torch.bfloat16)
    model = amp.prepare_model(_net())
    return amp, model, amp.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))


def _weights(amp: Amp, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    held = amp.master_params(optimizer) if amp.properties.master_weights else list(model.parameters())
    return [p.detach().float().clone() for p in held]


@pytest.mark.parametrize("level", ["O2", "O1"])
def test_dcp_state_dict_before_the_first_step_and_a_resume(level):
    """DCP's ``get_state_dict``/``set_state_dict`` of an optimizer without state run torch's ``_init_optim_state``: a
    direct ``optimizer.step()`` with zero gradients and ``lr`` 0. At O2 that step was refused as a raw step (the
    error told the user to call ``amp.step``, which they never skipped), so neither a checkpoint before training nor a
    DCP resume into a fresh run worked. Now it does nothing at O2 (no half state made); the resume (DCP's model and
    optimizer entries with ``amp.state_dict()``) trains on as the uninterrupted run, bit for bit."""
    amp, model, optimizer = _run(level)
    _, before = get_state_dict(model, optimizer)  # a checkpoint at step 0
    assert all(v.dtype == torch.float32 for s in before["state"].values() for v in s.values())
    _core_steps(amp, model, optimizer, 2)
    saved = copy.deepcopy((*get_state_dict(model, optimizer), amp.state_dict()))
    assert sorted(saved[1]["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]  # each once, by its name
    assert {v.dtype for s in saved[1]["state"].values() for v in s.values()} == {torch.float32}
    _core_steps(amp, model, optimizer, 2)

    amp2, model2, optimizer2 = _run(level)
    set_state_dict(model2, optimizer2, model_state_dict=saved[0], optim_state_dict=saved[1])
    amp2.load_state_dict(saved[2])
    _core_steps(amp2, model2, optimizer2, 2)
    for ours, theirs in zip(_weights(amp2, model2, optimizer2), _weights(amp, model, optimizer)):
        assert torch.equal(ours, theirs)
    assert optimizer2.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]


@pytest.mark.parametrize("loss_scale", [None, "dynamic"])
def test_trainer_scaler_is_none_for_a_static_scale_as_bf16_mixed(loss_scale):
    """``trainer.scaler`` (Lightning reads ``precision_plugin.scaler``) was the view for bfloat16's static unit scale
    while Fabric's was ``None``: code guarded by ``if trainer.scaler is not None`` (written for "16-mixed" and
    "bf16-mixed") took the view and called its refused ``unscale_()``. Now ``None`` as under "bf16-mixed"; a dynamic
    scale at bfloat16 still gives the view."""
    import lightning as L

    from lightning_mpx import MixedPrecisionPlugin

    settings = {} if loss_scale is None else {"loss_scale": loss_scale}
    plugin = MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16, **settings)
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    reference = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", logger=False)
    if loss_scale is None:
        assert trainer.scaler is None and reference.scaler is None
    else:
        assert trainer.scaler.is_enabled() and trainer.scaler.get_scale() == 65536.0
