"""O2 makes FP32 masters only for the parameters an optimizer holds (issue 21, item 6), as Apex did.

A distillation teacher or an EMA copy kept as a child module is half at O2 and, as ``copy.deepcopy`` leaves it,
``requires_grad=True``; no optimizer holds it. Before, it got FP32 masters (4 bytes per parameter for nothing, saved
in every checkpoint) whose every write was checked. Here: no masters for it, the teacher untouched, the EMA exactly
what the user's update computed, and the student trained exactly as in a run that keeps them outside the module.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import MixedPrecisionPlugin
from tests.lightning_helpers import classification_data, loader, make_trainer

HALF = torch.bfloat16
DECAY = 0.5


def _student() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _teacher() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _loss(logits: torch.Tensor, teacher_logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    distill = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher_logits, -1), log_target=True,
                       reduction="batchmean")
    return F.cross_entropy(logits, y) + distill


@torch.no_grad()
def _update_ema(ema: nn.Module, student: nn.Module) -> None:
    for e, p in zip(ema.parameters(), student.parameters()):
        e.lerp_(p.to(e.dtype), DECAY)


class Distillation(pl.LightningModule):
    """A student trained against a teacher, with an EMA of the student. ``children=True``: the teacher and the EMA
    are child modules (what the issue is about); ``False``: the reference, which keeps them outside the module (in a
    list, so they are not children) in half, as the plugin would have made them."""

    def __init__(self, children: bool) -> None:
        super().__init__()
        self.student = _student()
        teacher, ema = _teacher(), copy.deepcopy(self.student)  # requires_grad=True, as deepcopy leaves it
        if children:
            self.teacher, self.ema = teacher, ema
        else:
            self.outside = [teacher.to(HALF), ema.to(HALF)]

    def _others(self) -> tuple[nn.Module, nn.Module]:
        if "teacher" in self._modules:
            return self.teacher, self.ema
        return self.outside[0], self.outside[1]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        teacher = self._others()[0]
        with torch.no_grad():
            # A child gets the plugin's boundary casts (FP32 in, half in the model, FP32 out); the outside
            # teacher gets the same casts by hand.
            teacher_logits = self.teacher(x) if "teacher" in self._modules else teacher(x.to(HALF)).float()
        return _loss(self.student(x), teacher_logits, y)

    def on_train_batch_end(self, *args: Any) -> None:
        _update_ema(self._others()[1], self.student)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.student.parameters(), lr=1e-2)


def _fit(children: bool) -> tuple[Distillation, MixedPrecisionPlugin, dict[str, torch.Tensor]]:
    module = Distillation(children)
    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
    before: dict[str, torch.Tensor] = {}

    class Snapshot(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            teacher = pl_module._others()[0]
            before.update({n: p.detach().clone() for n, p in teacher.named_parameters()})

    make_trainer(plugin, max_steps=4, callbacks=[Snapshot()]).fit(module, loader(classification_data(n=64)))
    return module, plugin, before


def _assert_no_masters_for_the_teacher_and_ema(amp: Any, student: nn.Module, others: list[nn.Module],
                                               saved: dict[str, torch.Tensor], prefix: str = "") -> None:
    for param in student.parameters():
        assert amp.master_of(param) is not param and amp.master_of(param).dtype == torch.float32
    for other in others:
        for param in other.parameters():
            assert param.dtype == HALF and param.requires_grad
            assert amp.master_of(param) is param  # no FP32 copy
    # What a checkpoint holds: the student's masters only.
    assert sorted(saved) == sorted(f"{prefix}student.{n}" for n, _ in student.named_parameters())


def test_lightning_teacher_and_ema_children_get_no_masters_and_training_matches() -> None:
    module, plugin, teacher_before = _fit(children=True)
    reference, _, _ = _fit(children=False)
    saved = plugin.state_dict()["master_weights"][0]
    _assert_no_masters_for_the_teacher_and_ema(plugin.amp, module.student, [module.teacher, module.ema], saved)
    for name, param in module.teacher.named_parameters():
        assert torch.equal(param, teacher_before[name])  # untouched
    for got, want in zip(module.student.parameters(), reference.student.parameters()):
        assert torch.equal(got, want)
    for got, want in zip(module.ema.parameters(), reference.outside[1].parameters()):
        assert torch.equal(got, want)  # exactly the user's EMA: no master wrote over it


def _accelerate_run(children: bool) -> tuple[nn.Module, Any]:
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(
        mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")]
    )
    model = nn.Module()
    model.student = _student()
    teacher, ema = _teacher(), copy.deepcopy(model.student)
    if children:
        model.teacher, model.ema = teacher, ema
    else:
        model.outside = [teacher.to(HALF), ema.to(HALF)]
    model.forward = model.student.forward  # type: ignore[method-assign]
    # Two optimizers, as a GAN or a separate head would have: each one's parameters get masters, nothing else.
    first = torch.optim.AdamW(model.student[0].parameters(), lr=1e-2)
    second = torch.optim.SGD(model.student[2].parameters(), lr=0.1)
    model, first, second = accelerator.prepare(model, first, second)
    data = classification_data(n=64)
    teacher, ema = (model.teacher, model.ema) if children else model.outside
    for step in range(4):
        x, y = data[step * 16:(step + 1) * 16]
        with torch.no_grad():
            teacher_logits = teacher(x.to(HALF)).float()
        accelerator.backward(_loss(model(x), teacher_logits, y))
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
        _update_ema(ema, model.student)
    return model, accelerator


def test_accelerate_teacher_and_ema_children_get_no_masters_and_training_matches() -> None:
    model, accelerator = _accelerate_run(children=True)
    teacher_before = _teacher().to(HALF)
    reference, _ = _accelerate_run(children=False)
    saved = accelerator.amp.state_dict()["master_weights"][0]
    _assert_no_masters_for_the_teacher_and_ema(accelerator.amp, model.student, [model.teacher, model.ema], saved)
    for got, want in zip(model.teacher.parameters(), teacher_before.parameters()):
        assert torch.equal(got, want)
    for got, want in zip(model.student.parameters(), reference.student.parameters()):
        assert torch.equal(got, want)
    for got, want in zip(model.ema.parameters(), reference.outside[1].parameters()):
        assert torch.equal(got, want)


@pytest.mark.parametrize("when", ["before a step", "after a step"])
def test_a_child_added_to_an_optimizer_later_gets_masters_then(when: str) -> None:
    """Gradual unfreezing of a teacher kept as a child: its masters are made when an optimizer first holds it, and a
    checkpoint taken then already holds them."""
    from lightning_mpx import Amp

    amp = Amp("O2", half_dtype="bfloat16")
    model = nn.Module()
    model.student, model.teacher = _student(), _teacher()
    amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.student.parameters(), lr=0.1))
    assert all(amp.master_of(p) is p for p in model.teacher.parameters())
    if when == "after a step":
        amp.backward(model.student(torch.randn(2, 16, dtype=HALF)).float().sum())
        assert amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
    optimizer.add_param_group({"params": list(model.teacher.parameters())})
    saved = amp.state_dict()["master_weights"][0]
    assert {f"teacher.{n}" for n, _ in model.teacher.named_parameters()} <= set(saved)
    for name, param in model.teacher.named_parameters():
        master = amp.master_of(param)
        assert master is not param and master.dtype == torch.float32 and torch.equal(master, saved[f"teacher.{name}"])
