"""A torch optimizer lightning_mpx never prepared, stepping parameters that NO prepared optimizer holds (a GAN's
discriminator stepped by hand beside a prepared generator optimizer; a Fabric model's optimizer stepped by hand before
the plugin met it at its first step): refused at an engine backward where harmful (O2, or a loss scale other than 1),
whichever of the usual GAN loop orders the user writes. What users legitimately do with parameters no optimizer holds
(a parameter left out whose gradient accumulates, a frozen one, an EMA teacher under ``no_grad``, an EMA swap for
validation, accumulation, a checkpoint loaded between a backward and a step, a head added after set-up) still trains as
FP32 does."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp

UNHELD = r"(?s)'d\.0\.weight'.*which no optimizer prepared by lightning_mpx holds, were written"


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def _gan() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"g": nn.Linear(4, 4), "d": nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))})


def _losses(model: nn.Module, i: int) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    x, y = _batch(i)
    dtype = model["g"].weight.dtype
    d_loss = lambda: F.mse_loss(model["d"](x.to(dtype)).float(), y)  # noqa: E731
    g_loss = lambda: F.mse_loss(model["d"](model["g"](x.to(dtype))).float(), -y)  # noqa: E731
    return d_loss, g_loss


def _gan_loop(order: str, model: nn.Module, g_opt: Any, d_opt: Any, backward: Any, g_step: Any) -> int:
    """Three iterations in the loop order ``order``; returns the number of backwards that ran."""
    count = 0
    for it in range(3):
        d_loss, g_loss = _losses(model, it)
        if order == "dcgan":  # PyTorch's DCGAN tutorial: D first, each zero_grad before its backward
            d_opt.zero_grad()
            backward(d_loss())
            count += 1
            d_opt.step()
            g_opt.zero_grad()
            backward(g_loss())
            count += 1
            g_step()
        else:  # Lightning's manual-optimization GAN: G first, each zero_grad after its step
            backward(g_loss())
            count += 1
            g_step()
            g_opt.zero_grad()
            backward(d_loss())
            count += 1
            d_opt.step()
            d_opt.zero_grad()
    return count


@pytest.mark.parametrize(
    ("opt_level", "half_dtype", "order", "refused_at"),
    [
        ("O1", "float16", "dcgan", 3),  # dynamic scale: gradients x65536; D's second backward, after its zero_grad
        ("O2", "bfloat16", "dcgan", 3),  # D's half weights stepped with no FP32 master update
        ("O2", "bfloat16", "lightning", 3),  # G's second backward, after D's step and zero_grad
        ("O1", "bfloat16", "lightning", None),  # a unit scale and no masters: a plain step, left alone
    ],
)
def test_core_gan_a_raw_discriminator_optimizer_is_refused_where_harmful(
    opt_level: str, half_dtype: str, order: str, refused_at: int | None
) -> None:
    amp = Amp(opt_level=opt_level, half_dtype=half_dtype)
    model = amp.prepare_model(_gan())
    g_opt = amp.prepare_optimizer(torch.optim.SGD(model["g"].parameters(), lr=0.1))
    d_opt = torch.optim.SGD(model["d"].parameters(), lr=0.1)  # never given to prepare_optimizer
    backwards = []

    def backward(loss: torch.Tensor) -> None:
        backwards.append(loss)
        amp.backward(loss)

    def g_step() -> None:
        amp.step(g_opt)
        amp.update()

    if refused_at is None:
        assert _gan_loop(order, model, g_opt, d_opt, backward, g_step) == 6
        assert all(torch.isfinite(p).all() for p in model.parameters())
        return
    with pytest.raises(RuntimeError, match=UNHELD + r".*amp\.prepare_optimizer\(optimizer\)"):
        _gan_loop(order, model, g_opt, d_opt, backward, g_step)
    assert len(backwards) == refused_at  # refused at that backward (counted), before it ran


def test_fabric_o1_a_raw_step_before_the_plugin_met_the_optimizer_is_refused_at_its_first_step() -> None:
    """Fabric hands the optimizer to the strategy; the plugin meets it at its first step. Stepping the inner torch
    optimizer by hand before that applied the x65536 gradients: the next ``fabric.backward`` notes it (a SAM-style
    first_step looks the same there, tests/test_fabric_sam_plain_loop.py) and the plugin refuses it where it meets the
    optimizer, a plain SGD, at ``optimizer.step()``."""
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O1", half_dtype="float16")])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    model = fabric.setup_module(net)  # the optimizer set up apart (fabric.setup(model, optimizer) meets it there)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _batch(0)
    fabric.backward(F.mse_loss(model(x), y))
    optimizer.optimizer.step()  # the inner optimizer, by hand
    optimizer.zero_grad()
    fabric.backward(F.mse_loss(model(x), y))
    with pytest.raises(RuntimeError, match=r"(?s)'0\.weight'.*no optimizer prepared.*fabric\.setup\(model, optimizer"):
        optimizer.step()


def _legit(model: nn.Module, backward: Any, step: Any, load: Any, zero: Any) -> None:
    """A parameter left out of every optimizer (``keep.weight``: its gradient accumulates, never written), a frozen
    one (``frozen``) and an EMA teacher that requires grad but runs under ``no_grad`` (``teacher``), both written by an
    EMA every micro-batch; accumulation; an EMA swap of the whole model for validation after the step, with every
    gradient cleared (``model.zero_grad()``); a skipped batch; a checkpoint loaded between a backward and a step."""
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for it in range(3):
        for micro in range(2):
            x, y = _batch(2 * it + micro)
            dtype = model.student.weight.dtype
            with torch.no_grad():
                target = model.teacher(x.to(dtype)).float()
            out = model.student(x.to(dtype)) + model.keep(x.to(dtype)) + model.frozen(x.to(dtype))
            backward(F.mse_loss(out.float(), target + y))
            with torch.no_grad():
                for t, s in zip(model.teacher.parameters(), model.student.parameters()):
                    t.lerp_(s, 0.5)
                model.frozen.weight.mul_(0.9)
        step()
        zero()
        kept = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(ema)  # the EMA weights for validation, then the trained ones back
        model.load_state_dict(kept)
        x, y = _batch(50 + it)
        backward(F.mse_loss(model.student(x.to(model.student.weight.dtype)).float(), y))  # a skipped batch
        zero()
        backward(F.mse_loss(model.student(x.to(model.student.weight.dtype)).float(), y))
        load()  # a checkpoint loaded between a backward and a step
        zero()


def _teacher_net() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.student, model.teacher, model.keep, model.frozen = (nn.Linear(4, 1) for _ in range(4))
    model.frozen.requires_grad_(False)
    return model


@pytest.mark.parametrize(("opt_level", "half_dtype"), [("O2", "bfloat16"), ("O1", "float16")])
def test_legitimate_writes_to_parameters_no_optimizer_holds_train_as_fp32(opt_level: str, half_dtype: str) -> None:
    ref = _teacher_net()
    ref_opt = torch.optim.SGD(ref.student.parameters(), lr=0.1)
    ref_saved = {k: v.clone() for k, v in ref.state_dict().items()}
    _legit(ref, lambda loss: loss.backward(), ref_opt.step, lambda: ref.load_state_dict(ref_saved), ref.zero_grad)

    amp = Amp(opt_level=opt_level, half_dtype=half_dtype)
    model = amp.prepare_model(_teacher_net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.student.parameters(), lr=0.1))
    saved = ({k: v.clone() for k, v in amp.fp32_state_dict(model).items()}, amp.state_dict())

    def step() -> None:
        amp.step(opt)
        amp.update()

    def load() -> None:
        model.load_state_dict(saved[0])
        amp.load_state_dict(saved[1])

    _legit(model, amp.backward, step, load, model.zero_grad)  # no error
    got, want = amp.fp32_state_dict(model), ref.state_dict()
    assert all(torch.allclose(got[k].float(), want[k], atol=3e-2) for k in want), {
        k: (got[k].float() - want[k]).abs().max().item() for k in want
    }


def test_o2_a_head_added_after_set_up_with_its_own_optimizer_trains_unrefused() -> None:
    """engine/surgery.py: a second stage's head added after prepare_model, its optimizer prepared later: the model is
    prepared again then, and the head's steps through the engine are no raw steps."""
    torch.manual_seed(0)
    amp = Amp(opt_level="O2", half_dtype="bfloat16")
    model = amp.prepare_model(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    body = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for i in range(2):
        amp.backward(F.mse_loss(model(_batch(i)[0].bfloat16()).float().sum(1, keepdim=True), _batch(i)[1]))
        amp.step(body)
        amp.update()
        body.zero_grad()
    model.append(nn.Linear(4, 1))  # the head, FP32, after set-up
    head = amp.prepare_optimizer(torch.optim.SGD(model[2].parameters(), lr=0.1))
    before = amp.master_of(model[2].weight).detach().clone()
    for i in range(3):
        amp.backward(F.mse_loss(model(_batch(i)[0].bfloat16()).float(), _batch(i)[1]))
        amp.step(head)
        amp.update()
        model.zero_grad()  # the body's gradients too: they are left out of this stage
    assert not torch.equal(amp.master_of(model[2].weight), before)
    assert all(torch.isfinite(p).all() for p in model.parameters())
