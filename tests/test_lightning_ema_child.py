"""Hand-written EMA / momentum teachers kept as a child module at O2 (BYOL, DINO, MoCo, Mean Teacher, diffusion EMA).

At O2 the whole LightningModule is half and a child no optimizer holds gets no FP32 master (as in Apex), so an EMA
updated by hand with a realistic decay moves by ``(1 - d) * (s - e)``, mostly under half a unit in the last place of
bfloat16: most elements never move, where under ``"bf16-mixed"`` (FP32 weights) the same code averages. Measured on a
tiny model, 60 steps, AdamW(lr=1e-2), distance of the EMA from the FP32 run's EMA over how far that one moved:
``"bf16-mixed"`` 0.010 for every decay and style; O2 bfloat16 0.22-0.27 at d=0.99, 1.6 at d=0.999 (78-85% of the
elements never moved), 13 at d=0.9999 (98%); O2 float16 0.03 / 0.24-0.36 / 1.85; the same for
``e.data.mul_(d).add_(s.data, alpha=1 - d)``, ``e.lerp_(s, 1 - d)`` and ``torch._foreach_lerp_`` and for a frozen
or trainable EMA. Lightning's ``EMAWeightAveraging`` is FP32 already (0.006); an ``AveragedModel`` made after set-up
copies the half weights (0.39).

What a user gets now: a warning at the first backward naming the half child that requires grad and that no optimizer
holds, beside the part an optimizer trains, with the recipe (docs/master_weights.md, "EMA and momentum teachers at
O2"): the child kept FP32 by ``fp32_modules``, averaging the student's FP32 masters (``amp.master_of``), which matches
``"bf16-mixed"``. The unchanged half EMA stays a strict xfail.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import MixedPrecisionPlugin
from tests.lightning_helpers import classification_data, loader, make_trainer

HALF = torch.bfloat16
DECAY = 0.999
STEPS = 30
STYLES = ("data", "lerp", "foreach")


def _update(style: str, ema: nn.Module, sources: list[torch.Tensor]) -> None:
    """The three hand-written updates users write, as they write them."""
    targets = list(ema.parameters())
    if style == "data":
        for e, s in zip(targets, sources):
            e.data.mul_(DECAY).add_(s.data, alpha=1 - DECAY)
        return
    with torch.no_grad():
        if style == "lerp":
            for e, s in zip(targets, sources):
                e.lerp_(s, 1 - DECAY)
        else:
            torch._foreach_lerp_(targets, sources, 1 - DECAY)


class WithEma(pl.LightningModule):
    """A student and one EMA child per update style. ``masters``: average the student's FP32 masters (the recipe)
    rather than its parameters; ``frozen``: the EMA frozen before set-up (MoCo, BYOL)."""

    def __init__(self, masters: bool = False, frozen: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.ema = nn.ModuleDict({s: copy.deepcopy(self.student).requires_grad_(not frozen) for s in STYLES})
        self.masters = masters
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self) -> None:
        self.start.update({s: _flat(e) for s, e in self.ema.items()})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.student(x), y)

    def on_train_batch_end(self, *args: Any) -> None:
        sources = list(self.student.parameters())
        if self.masters:  # the recipe: the FP32 masters the optimizer updates, as "bf16-mixed" averages its weights
            amp = self.trainer.precision_plugin.amp
            sources = [amp.master_of(p) for p in sources]
        for style, ema in self.ema.items():
            _update(style, ema, sources)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.student.parameters(), lr=1e-2)


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in module.parameters()])


def _fit(module: WithEma, **kwargs: Any) -> WithEma:
    make_trainer(max_steps=STEPS, max_epochs=-1, **kwargs).fit(module, loader(classification_data(n=64)))
    return module


def _errors(module: WithEma, reference: WithEma) -> dict[str, float]:
    """Per style: the EMA's distance from the reference's EMA over how far the reference's EMA moved."""
    out = {}
    for style in STYLES:
        want, start = _flat(reference.ema[style]), reference.start[style]
        out[style] = ((_flat(module.ema[style]) - want).norm() / (want - start).norm()).item()
    return out


@pytest.fixture(scope="module")
def bf16_mixed() -> WithEma:
    return _fit(WithEma(), precision="bf16-mixed")


def test_ema_child_in_fp32_averaging_the_masters_matches_bf16_mixed(bf16_mixed: WithEma) -> None:
    """The recipe: ``fp32_modules=["ema"]`` keeps the child FP32 (the plugin's inputs and outputs cast for it) and
    the update averages the student's FP32 masters: every style follows "bf16-mixed", no warning."""
    plugin = MixedPrecisionPlugin("O2", half_dtype=HALF, fp32_modules=["ema"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = _fit(WithEma(masters=True), plugins=[plugin])
    assert not [w for w in caught if "no optimizer holds" in str(w.message)]
    assert all(p.dtype == torch.float32 for p in module.ema.parameters())
    assert all(p.dtype == HALF for p in module.student.parameters())
    errors = _errors(module, bf16_mixed)
    assert max(errors.values()) < 0.05, errors


@pytest.fixture(scope="module")
def plain_o2() -> tuple[WithEma, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = _fit(WithEma(), plugins=[MixedPrecisionPlugin("O2", half_dtype=HALF)])
    return module, [w for w in caught if "no optimizer holds" in str(w.message)]


def test_a_half_ema_child_no_optimizer_holds_is_warned_about_with_the_recipe(
    plain_o2: tuple[WithEma, list[warnings.WarningMessage]],
) -> None:
    """The common code unchanged at O2: one warning naming the child, its dtype and the fix."""
    module, caught = plain_o2
    assert all(p.dtype == HALF for p in module.ema.parameters())
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "12 bfloat16 parameters of WithEma ('ema')" in message  # 3 copies of 2 Linear layers
    assert "fp32_modules=['ema']" in message and "amp.master_of" in message and "requires_grad_(False)" in message


@pytest.mark.xfail(
    strict=True,
    reason="test_lightning_ema_child.py: at O2 the EMA child is bfloat16 with no FP32 master (no optimizer holds it, "
    "as in Apex); each update (1 - 0.999) * (s - e) is mostly under half an ulp, so ~80% of its elements never move: "
    "0.86-0.87 of the reference EMA's movement away from bf16-mixed's at 30 steps (1.6 at 60), where the recipe "
    "(fp32_modules + amp.master_of) gives 0.0. Only warned about; the half child is kept as the user's own state.",
)
def test_a_half_ema_child_updated_by_hand_averages_as_bf16_mixed(
    plain_o2: tuple[WithEma, list[warnings.WarningMessage]], bf16_mixed: WithEma,
) -> None:
    errors = _errors(plain_o2[0], bf16_mixed)
    assert max(errors.values()) < 0.05, errors


def test_the_warning_names_a_nested_ema_as_fp32_modules_needs_it() -> None:
    """An EMA nested in the model (``self.net.ema`` beside ``self.net.student``): the warning's ``fp32_modules``
    advice names ``'net.ema'``; the top-level child (``'net'``) would make the student FP32 too."""
    from lightning_mpx import Amp

    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model = nn.Module()
    model.net = nn.ModuleDict({"student": student, "ema": copy.deepcopy(student)})
    model.forward = lambda x: model.net["student"](x)
    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.net["student"].parameters(), lr=1e-2))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with amp.forward_context():
                loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))), y)
            amp.backward(loss)
            amp.step(optimizer)
            optimizer.zero_grad()
    messages = [str(w.message) for w in caught if "no optimizer holds" in str(w.message)]
    assert len(messages) == 1, messages
    assert "('net.ema')" in messages[0] and "fp32_modules=['net.ema']" in messages[0], messages[0]
