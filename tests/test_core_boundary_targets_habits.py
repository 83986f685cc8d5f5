"""A hostile user's habits against the exact FP32 targets at the boundary (lightning_mpx/casting/targets.py): at O2
the loss policy gives a loss inside the forward the FP32 source of a boundary-cast target. Whatever the user does to
the target, the loss must see either the source's values or the half values the model holds, never stale or other
values; its gradient must go where the half value's would; a nested or concurrent forward must not take another's
notes; nothing may keep an FP32 batch alive. Reference: the loss of the returned prediction against the FP32 target
(what ``"bf16-mixed"`` computes), or against the half values the user wrote. Tiny models, bfloat16, CPU.
"""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_mpx import Amp

HALF = "bfloat16"


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g), 300 + 3 * torch.rand(8, 2, generator=g)


def _setup() -> tuple[Amp, nn.Module]:
    amp = Amp("O2", half_dtype=HALF)
    torch.manual_seed(0)
    return amp, amp.prepare_model(nn.Linear(4, 1))


def _pred(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().squeeze(-1)


@pytest.mark.parametrize("habit", ["data-inplace", "data-assigned", "source-written"])
def test_a_target_changed_behind_the_version_counter_is_not_its_stale_source(habit):
    """``labels.data.mul_(2)`` (``.data`` has a version counter of its own), ``labels.data = ...``, or the caller's
    FP32 batch written in place after the cast: the loss takes the half values the model holds, not the source's
    (before: 90596.5 for 362163.2, 90794.2 for 0.078, 161191.6 for 90777.7)."""
    amp, model = _setup()
    x, y = _batch()
    with amp.forward_context():
        xa, ya = amp.cast_inputs((x, y))
        if habit == "data-inplace":
            ya.data.mul_(2.0)
        elif habit == "data-assigned":
            ya.data = torch.zeros_like(ya)
        else:
            y.add_(100.0)  # a refilled buffer: the model was given the old values
        pred = _pred(model, xa)
        loss = F.mse_loss(pred, ya[:, 1])
    expected = {"data-inplace": (y[:, 1].to(torch.bfloat16) * 2).float(), "data-assigned": torch.zeros(8),
                "source-written": (y[:, 1] - 100).to(torch.bfloat16).float()}[habit]
    assert loss.item() == pytest.approx(F.mse_loss(pred.detach(), expected).item(), rel=1e-6)


def test_a_detached_target_sends_no_gradient_to_its_source():
    """``labels.detach()`` (found by its storage among the policy's notes) must not carry a gradient to an FP32
    target that requires one (before: 603.0 of gradient on it)."""
    amp, model = _setup()
    x, y = _batch()
    y.requires_grad_()
    with amp.forward_context():
        xa, ya = amp.cast_inputs((x, y))
        loss = F.mse_loss(_pred(model, xa).unsqueeze(-1).expand(8, 2), ya.detach())
    loss.backward()
    assert y.grad is None
    assert loss.item() == pytest.approx(F.mse_loss(_pred(model, x.to(torch.bfloat16)).detach().unsqueeze(-1)
                                                   .expand(8, 2), y.detach()).item(), rel=1e-6)


def test_a_target_made_a_leaf_that_requires_grad_gets_its_gradient():
    """``labels.requires_grad_()`` on the cast target (a gradient w.r.t. the targets): the loss's gradient reaches it
    (before: ``labels.grad`` was None, the loss ran on a copy of the source)."""
    amp, model = _setup()
    x, y = _batch()
    with amp.forward_context():
        xa, ya = amp.cast_inputs((x, y))
        ya.requires_grad_()
        pred = _pred(model, xa)
        loss = F.mse_loss(pred, ya[:, 1], reduction="sum")
    loss.backward()
    assert ya.grad is not None
    expected = 2 * (ya[:, 1].detach().float() - pred.detach())
    torch.testing.assert_close(ya.grad[:, 1].float(), expected.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference-mode"])
def test_a_nested_forward_leaves_the_outer_forward_its_exact_targets(inference):
    """A teacher's forward (its own ``forward_context`` and casts) inside the student's: the student's loss after it
    still takes its FP32 targets, also under inference mode, where a view is found by its storage among the
    policy's notes (before: the inner scope dropped them, the loss off by 116.5)."""
    amp, student = _setup()
    teacher = amp.prepare_model(nn.Linear(4, 1))
    x, y = _batch()
    with torch.inference_mode(inference), amp.forward_context():
        xa, ya = amp.cast_inputs((x, y))
        with amp.forward_context():
            teacher(amp.cast_inputs(x))
        pred = _pred(student, xa)
        loss = F.mse_loss(pred, ya[:, 1])
    assert loss.item() == pytest.approx(F.mse_loss(pred.detach(), y[:, 1]).item(), rel=1e-6)


@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference-mode"])
def test_two_threads_forwards_keep_their_own_exact_targets(inference):
    """Two threads run forwards of models prepared by one engine: one thread's scope leaving does not take the other
    thread's notes (before: losses off by up to 116.5, by chance)."""
    amp, _ = _setup()
    models = [amp.prepare_model(nn.Linear(4, 1)) for _ in range(2)]
    x, y = _batch()
    errors: list[float] = []
    start = threading.Barrier(2)

    def work(index: int) -> None:
        start.wait()
        target = y + 10 * index
        for _ in range(25):
            with torch.inference_mode(inference), amp.forward_context():
                xa, ya = amp.cast_inputs((x, target))
                pred = _pred(models[index], xa)
                loss = F.mse_loss(pred, ya[:, 1])
            errors.append(abs(loss.item() - F.mse_loss(pred.detach(), target[:, 1]).item()))

    threads = [threading.Thread(target=work, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 50 and max(errors) <= 1e-6 * 9e4


def test_casts_outside_a_forward_scope_keep_no_fp32_batch_alive():
    """``Amp.cast_inputs`` in an evaluation loop with no ``forward_context``: once the caller drops its half
    tensors, the FP32 batches go (before: the policy held every batch it ever cast)."""
    amp, model = _setup()
    refs = []
    for _ in range(3):
        x, y = _batch()
        refs.append(weakref.ref(y))
        with torch.no_grad():
            xa, ya = amp.cast_inputs((x, y))
            model(xa)
        del x, y, xa, ya
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert len(amp.policy._noted) <= 2  # the last cast's, held weakly


def test_after_the_forward_autograd_keeps_no_fp32_batch():
    """A half target that autograd saves for the backward pass (and the model keeps) holds its source only weakly
    once the forward ended: the dropped batch goes before the backward pass, which still runs."""
    amp, model = _setup()
    x, y = _batch()
    ref = weakref.ref(y)
    with amp.forward_context():
        xa, ya = amp.cast_inputs((x, y))
        loss = F.mse_loss(_pred(model, xa) * ya[:, 0].float(), ya[:, 1])  # ya saved by the multiplication
    del y
    gc.collect()
    assert ref() is None
    loss.backward()


def test_a_checkpointed_loss_is_differentiated_on_the_targets_its_forward_took():
    """The loss inside a (non-reentrant) activation checkpoint is recomputed in the backward pass: its gradient
    must come from the FP32 targets its value came from (before: exact value, gradient on the rounded targets:
    -4796.75 for -4799.86)."""

    def grad(use_checkpoint: bool) -> tuple[float, torch.Tensor]:
        amp, model = _setup()
        shift = torch.ones((), requires_grad=True)  # an FP32 leaf: its gradient is the loss's, unrounded
        x, y = _batch()

        def region(xa: torch.Tensor, ya: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(_pred(model, xa) + shift, ya[:, 1], reduction="sum")

        with amp.forward_context():
            xa, ya = amp.cast_inputs((x, y))
            loss = checkpoint(region, xa, ya, use_reentrant=False) if use_checkpoint else region(xa, ya)
        amp.backward(loss)
        return loss.item(), shift.grad

    (plain_loss, plain), (ckpt_loss, ckpt) = grad(False), grad(True)
    assert ckpt_loss == plain_loss
    torch.testing.assert_close(ckpt, plain, rtol=1e-6, atol=0)


class _Keeper(nn.Module):
    """Keeps the (half) target it was given, as autograd keeps an input of a half layer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.kept = target
        return F.mse_loss(self.lin(x).float().squeeze(-1), target[:, 1])


def test_a_copy_made_mid_forward_carries_no_fp32_batch():
    """A deep copy or pickle made inside the forward (an EMA copy taken in the step) of a model that keeps its half
    target, or of the cast policy: the copy carries no FP32 source (before: a copy of the batch on each kept half
    tensor, forever, and in the saved file)."""
    import io

    from lightning_mpx.casting.targets import SOURCE_ATTRIBUTE

    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(_Keeper())
    x, y = _batch()
    with amp.forward_context():
        model(*amp.cast_inputs((x, y)))
        copies = [copy.deepcopy(model)]
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copies.append(torch.load(buffer, weights_only=False))
        policy = copy.deepcopy(amp.policy)
    for other in copies:
        note = getattr(other.kept, SOURCE_ATTRIBUTE, None)
        assert note is None or not any(isinstance(item, torch.Tensor) and item.dtype == torch.float32
                                       for item in (note[0], getattr(note[0], "tensor", None)))
    assert not policy._noted
