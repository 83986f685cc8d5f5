"""An EMA child INSIDE the optimizer at O2 (``copy.deepcopy(student)`` kept as a child, ``SGD(model.parameters())``):
its half parameters are held, so they get FP32 masters, but never a gradient; the user's ``lerp_`` under
``no_grad`` writes the half values and the masters take each write as its rounding, so the EMA barely moves
(tests/test_accelerate_o2_saves_and_generate.py measured it against ``"bf16-mixed"``). The engine warns once, at a step
that took writes into the masters (lightning_mpx/engine/frozen_writes.py ``HeldWrites``), about the held half parameters
written since the last step whose masters have no gradient and no optimizer state, naming the child, in every door,
pointing at the user's line; writes that are no hand update of an untrained child are not warned about.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp

HALF = torch.bfloat16
STEPS = 4
WARNED = "that the optimizer holds got no gradient"


class Student(nn.Module):
    """A network, an expert no step uses (a branch not taken: no gradient, never written) and its EMA child."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.spare = nn.Linear(16, 4)
        self.ema = copy.deepcopy(self.net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def ema_update(model: nn.Module, sources: list[torch.Tensor] | None = None) -> None:
    sources = list(model.net.parameters()) if sources is None else sources
    with torch.no_grad():
        for e, s in zip(model.ema.parameters(), sources):
            e.lerp_(s.to(e.dtype), 0.001)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(STEPS)]


def _caught(run: Callable[[], Any]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [w for w in caught if "lightning_mpx:" in str(w.message) and "EMA" in str(w.message)]


def _assert_warned(caught: list[warnings.WarningMessage], recipe: str = "fp32_modules=['ema']") -> None:
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert WARNED in message and "4 bfloat16 parameters of Student ('ema')" in message, message  # not 'spare'
    assert recipe in message, message
    assert caught[0].filename == __file__, caught[0].filename  # the user's line


def _core(between: Callable[[Student, Amp, Any], None], **settings: Any) -> list[warnings.WarningMessage]:
    def run() -> None:
        amp = Amp("O2", half_dtype=HALF, **settings)
        model = amp.prepare_model(Student())
        optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        for x, y in _batches():
            with amp.forward_context():
                loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            between(model, amp, optimizer)

    return _caught(run)


def test_core_loop_ema_child_in_the_optimizer_is_warned_about_once() -> None:
    _assert_warned(_core(lambda model, amp, opt: ema_update(model)))


def _clamp(model: Student, amp: Amp, opt: Any) -> None:
    with torch.no_grad():  # in place (a version bump), on parameters that have gradients
        for p in model.net.parameters():
            p.clamp_(-0.05, 0.05)


def _load(model: Student, amp: Amp, opt: Any) -> None:
    torch.manual_seed(3)  # a held layer with no gradient written by a load (a rollback, a swap of experts)
    model.spare.load_state_dict(nn.Linear(16, 4).state_dict())


def _groups(model: Student, amp: Amp, opt: Any) -> None:
    for group in opt.param_groups:
        group["lr"] *= 0.9


def _recipe(model: Student, amp: Amp, opt: Any) -> None:
    ema_update(model, [amp.master_of(p) for p in model.net.parameters()])


@pytest.mark.parametrize(
    ("between", "settings"),
    [(_clamp, {}), (_load, {}), (_groups, {}), (_recipe, {"fp32_modules": ["ema"]})],
    ids=["clamp", "load_state_dict", "param_groups", "recipe_fp32_ema"],
)
def test_core_loop_no_warning_for_writes_that_are_no_ema_update(between: Callable[..., None], settings: Any) -> None:
    """A clamp of trained parameters, a load into a held layer with no gradient, a scheduler and a param_groups
    change (all with the expert not taken each step), and the recipe (the EMA FP32, averaging the masters)."""
    assert _core(between, **settings) == []


def test_tied_weights_are_not_warned_about() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x))

    def run() -> None:
        amp = Amp("O2", half_dtype=HALF)
        model = amp.prepare_model(Tied())
        optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(STEPS):
            with amp.forward_context():
                loss = F.cross_entropy(amp.cast_outputs(model(torch.arange(10))).float(), torch.arange(10))
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()

    assert _caught(run) == []


def test_fabric_ema_child_in_the_optimizer_is_warned_about_once() -> None:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    def run() -> None:
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")])
        student = Student()
        model, optimizer = fabric.setup(student, torch.optim.SGD(student.parameters(), lr=0.1))
        for x, y in _batches():
            fabric.backward(F.cross_entropy(model(x).float(), y))
            optimizer.step()
            optimizer.zero_grad()
            ema_update(student)

    _assert_warned(_caught(run))


def test_accelerate_ema_child_in_the_optimizer_is_warned_about_once() -> None:
    pytest.importorskip("accelerate")
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    def run() -> None:
        accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])
        student = Student()
        model, optimizer = accelerator.prepare(student, torch.optim.SGD(student.parameters(), lr=0.1))
        for x, y in _batches():
            accelerator.backward(F.cross_entropy(model(x).float(), y))
            optimizer.step()
            optimizer.zero_grad()
            ema_update(student)

    _assert_warned(_caught(run))


def test_apex_ema_child_in_the_optimizer_is_warned_about_once_with_its_recipe() -> None:
    from lightning_mpx.apex import amp

    def run() -> None:
        student = Student()
        optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
        model, optimizer = amp.initialize(student, optimizer, opt_level="O2", cast_model_type=HALF, verbosity=0)
        for x, y in _batches():
            loss = F.cross_entropy(model(x.to(HALF)).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
            ema_update(model)

    _assert_warned(_caught(run), recipe="amp.master_params(optimizer)")
