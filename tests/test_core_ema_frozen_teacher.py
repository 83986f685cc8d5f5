"""A FROZEN momentum / EMA teacher kept as a child module at O2 and updated by hand (MoCo, BYOL, DINO, Mean Teacher,
timm's ``ModelEmaV2`` as a child): frozen before set-up (``requires_grad_(False)``), it is half with no FP32 master,
and at decay 0.999 most of its elements never move in bfloat16 (tests/test_lightning_ema_child.py measured it). At
set-up it cannot be told from a part frozen on purpose (a LoRA base); the writes tell them apart: the engine notes the
versions of the frozen half parameters without a master at the first backward after an engine step and compares them at
the first backward after a later one, warning once, with the recipe, where some were written in place between
(lightning_mpx/engine/frozen_writes.py). Each door, and the writes that are no hand update, are checked here.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin
from tests.lightning_helpers import classification_data, loader, make_trainer

HALF = torch.bfloat16
DECAY = 0.999
STEPS = 3  # noted at the backward after the first step, compared at the one after the second
WARNED = "were written in place between two steps"


class Pair(nn.Module):
    """A student and its frozen teacher (a deepcopy frozen before set-up, as MoCo and BYOL make it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # the teacher's targets (its batch-norm statistics move: buffers, not parameters)
            target = self.teacher(x).float().softmax(-1)
        return F.cross_entropy(self.student(x).float(), target)


def momentum_update(pair: nn.Module, sources: list[torch.Tensor] | None = None) -> None:
    """The hand-written update, as MoCo writes it."""
    sources = list(pair.student.parameters()) if sources is None else sources
    with torch.no_grad():
        for t, s in zip(pair.teacher.parameters(), sources):
            t.mul_(DECAY).add_(s.to(t.dtype), alpha=1 - DECAY)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 16, generator=g) for _ in range(STEPS)]


def _caught(run: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if WARNED in str(w.message)]


def _core(between: Callable[[Pair, Amp, torch.optim.Optimizer], None], **settings: Any) -> list[str]:
    def run() -> None:
        amp = Amp("O2", half_dtype=HALF, **settings)
        pair = amp.prepare_model(Pair())
        optimizer = amp.prepare_optimizer(torch.optim.SGD(pair.student.parameters(), lr=0.1))
        for x in _batches():
            amp.backward(pair(amp.cast_inputs(x)))
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad(set_to_none=True)
            between(pair, amp, optimizer)

    return _caught(run)


def _assert_warned(messages: list[str]) -> None:
    assert len(messages) == 1, messages
    message = messages[0]
    assert "4 frozen bfloat16 parameters of Pair ('teacher')" in message, message  # 2 Linear (batch norm: FP32)
    assert "fp32_modules=['teacher']" in message and "amp.master_of" in message, message


def test_core_loop_frozen_teacher_updated_by_hand_is_warned_about_once() -> None:
    messages = _core(lambda pair, amp, opt: momentum_update(pair))
    _assert_warned(messages)


@pytest.mark.parametrize(
    "case",
    ["never_written", "loaded_by_the_model_and_amp", "fp32_modules"],
)
def test_core_loop_no_warning_for_writes_that_are_no_hand_update(case: str) -> None:
    """A frozen teacher only run forward (its batch-norm buffers move), a load into the model and the engine between
    steps (a rollback: a stage change), and the recipe (the teacher FP32, averaging the masters): no warning."""
    if case == "never_written":
        messages = _core(lambda pair, amp, opt: None)
    elif case == "loaded_by_the_model_and_amp":

        def load(pair: Pair, amp: Amp, opt: torch.optim.Optimizer) -> None:
            pair.load_state_dict(pair.state_dict())
            amp.load_state_dict(amp.state_dict())

        messages = _core(load)
    else:

        def recipe(pair: Pair, amp: Amp, opt: torch.optim.Optimizer) -> None:
            momentum_update(pair, [amp.master_of(p) for p in pair.student.parameters()])

        messages = _core(recipe, fp32_modules=["teacher"])
    assert messages == []


def test_a_frozen_lora_base_trained_around_is_not_warned_about() -> None:
    """A frozen half base beside trained adapters (frozen before set-up, never written), and a layer frozen after
    set-up that the optimizer still holds (its master kept; the engine's steps write it): no warning."""

    class Lora(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.base = nn.Linear(16, 16).requires_grad_(False)
            self.adapter = nn.Sequential(nn.Linear(16, 2, bias=False), nn.Linear(2, 16, bias=False))
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.base(x) + self.adapter(x))

    def run() -> None:
        amp = Amp("O2", half_dtype=HALF)
        model = amp.prepare_model(Lora())
        model.head.requires_grad_(False)  # frozen after set-up, still in the optimizer
        optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for x in _batches():
            amp.backward(model(amp.cast_inputs(x)).float().square().mean())
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad(set_to_none=True)

    assert _caught(run) == []


class LitPair(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pair(batch[0])

    def on_train_batch_end(self, *args: Any) -> None:
        momentum_update(self.pair)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.pair.student.parameters(), lr=0.1)


def test_trainer_frozen_teacher_updated_on_train_batch_end_is_warned_about() -> None:
    plugin = MixedPrecisionPlugin("O2", half_dtype=HALF)
    trainer = make_trainer(plugin, max_steps=STEPS, max_epochs=-1)
    messages = _caught(lambda: trainer.fit(LitPair(), loader(classification_data(n=64))))
    assert len(messages) == 1, messages
    assert "4 frozen bfloat16 parameters of LitPair ('pair.teacher')" in messages[0]
    assert "fp32_modules=['pair.teacher']" in messages[0]  # the teacher, not the student beside it


def test_fabric_frozen_teacher_updated_after_the_step_is_warned_about() -> None:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    def run() -> None:
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")])
        pair = Pair()
        model, optimizer = fabric.setup(pair, torch.optim.SGD(pair.student.parameters(), lr=0.1))
        for x in _batches():
            fabric.backward(model(x))
            optimizer.step()
            optimizer.zero_grad()
            momentum_update(pair)

    _assert_warned(_caught(run))


def test_accelerate_frozen_teacher_updated_after_the_step_is_warned_about() -> None:
    pytest.importorskip("accelerate")
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    def run() -> None:
        accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])
        pair = Pair()
        model, optimizer = accelerator.prepare(pair, torch.optim.SGD(pair.student.parameters(), lr=0.1))
        for x in _batches():
            accelerator.backward(model(x))
            optimizer.step()
            optimizer.zero_grad()
            momentum_update(pair)

    _assert_warned(_caught(run))


def test_moco_optimizer_over_every_parameter_frozen_key_encoder_is_warned_about() -> None:
    """MoCo's own code hands ``model.parameters()`` to SGD, its frozen key encoder included (no gradient: the step
    skips it): frozen at set-up it has no FP32 master either, and its hand update is warned about the same way."""
    torch.manual_seed(0)
    model = nn.Module()
    model.q = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model.k = copy.deepcopy(model.q).requires_grad_(False)
    model.forward = lambda x: model.q(x)
    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def run() -> None:
        for _ in range(3):
            with amp.forward_context():
                loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))), y)
            amp.backward(loss)
            amp.step(optimizer)
            optimizer.zero_grad()
            with torch.no_grad():
                for k, q in zip(model.k.parameters(), model.q.parameters()):
                    k.mul_(0.999).add_(q, alpha=0.001)

    messages = [m for m in _caught(run) if WARNED in m]
    assert len(messages) == 1 and "('k')" in messages[0] and "fp32_modules=['k']" in messages[0], messages
