"""``accelerator.unscale_gradients()``, then a write to the model's gradients (a frozen part's zeroed, one layer's
scaled), then ``accelerator.clip_grad_norm_`` / ``clip_grad_value_``: the clip measures and clips the written
gradients, as Accelerate's own precisions and FP32 do. At O2 the clips that are not one fused pass (the model's
parameters over two optimizers, a head two optimizers share, ``norm_type=1``, a clip by value) run torch's clip on
the FP32 masters' gradients; they ignored the write (the norm of the unwritten gradients, 0.59 where FP32's is 0.91)
and then showed the clipped unwritten values over it: the weights ended 0.15 off FP32's, silently. And the other
order: a clip, ``unscale_gradients()``, a write (refused at O2 after the fused clip). Tiny MLP, CPU, bfloat16, against
``mixed_precision="no"``."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("accelerate")

from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402
from tests.accelerate_helpers import reset_accelerate_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _optimizers(model: nn.Sequential, split: str) -> list[torch.optim.Optimizer]:
    body, head = model[0], model[2]
    if split == "one":
        return [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]
    if split == "two":
        return [torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9), torch.optim.Adam(head.parameters(), lr=1e-2)]
    # "shared": the head's weight in both optimizers
    return [
        torch.optim.SGD([*body.parameters(), head.weight], lr=0.1, momentum=0.9),
        torch.optim.Adam(head.parameters(), lr=1e-2),
    ]


def _write(model: nn.Sequential) -> None:
    model[2].bias.grad.zero_()
    model[0].weight.grad.mul_(3.0)


def _unscale_write_clip(accelerator: Any, model: nn.Module, clip: Callable[[Any, nn.Module], Any]) -> Any:
    accelerator.unscale_gradients()
    _write(model)
    return clip(accelerator, model)


def _clip_unscale_write(accelerator: Any, model: nn.Module, clip: Callable[[Any, nn.Module], Any]) -> Any:
    norm = clip(accelerator, model)
    accelerator.unscale_gradients()  # after the clip: unscales nothing more (Accelerate's "bf16": nothing at all)
    _write(model)
    return norm


def _run(
    mixed_precision: str,
    split: str,
    clip: Callable[[Any, nn.Module], Any],
    habit: Callable[..., Any] = _unscale_write_clip,
) -> tuple[list[float], list[Any]]:
    reset_accelerate_state()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    kwargs = [MixedPrecisionKwargs(half_dtype="bfloat16")] if mixed_precision.startswith("O") else []
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=True, kwargs_handlers=kwargs)
    model, *optimizers = accelerator.prepare(model, *_optimizers(model, split))
    norms = []
    for i in range(4):
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)
        accelerator.backward(F.cross_entropy(model(x), y))
        norm = habit(accelerator, model, clip)
        if norm is not None:
            norms.append(float(norm))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    weights = [v.float() for v in accelerator.get_state_dict(model).values()]
    return norms, weights


CLIPS = {
    "norm": lambda acc, model: acc.clip_grad_norm_(model.parameters(), 0.2),
    "norm_type_1": lambda acc, model: acc.clip_grad_norm_(model.parameters(), 2.0, norm_type=1),
    "value": lambda acc, model: acc.clip_grad_value_(model.parameters(), 0.01),
}


@pytest.mark.parametrize(
    ("split", "clip"),
    [("one", "norm_type_1"), ("one", "value"), ("two", "norm"), ("two", "value"), ("shared", "norm")],
)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_clip_after_unscale_takes_the_models_writes(opt_level: str, split: str, clip: str) -> None:
    ref_norms, ref_weights = _run("no", split, CLIPS[clip])
    norms, weights = _run(opt_level, split, CLIPS[clip])
    # the norms of the written gradients (before: 0.59 where FP32's is 0.91, the write ignored)
    assert norms == pytest.approx(ref_norms, rel=1e-2)
    # bfloat16's rounding of four steps (2e-4 here); the write lost was 0.15 off
    for ref, got in zip(ref_weights, weights):
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=0)


@pytest.mark.parametrize("clip", ["norm", "norm_type_1", "value"])
def test_clip_then_unscale_gradients_then_write_trains_as_fp32(clip: str) -> None:
    """A clip, then ``unscale_gradients()`` (a no-op under Accelerate's ``"bf16"``), then a write to the model's
    gradients: at O2 the clip of one optimizer by norm 2 (one fused pass into the masters' gradients) left the model's
    gradients scaled, and ``unscale_gradients()`` did nothing more, so the write was refused at the step as made on
    scaled values; the model's gradients now show the unscaled, clipped values there and the write trains as FP32."""
    ref_norms, ref_weights = _run("no", "one", CLIPS[clip], _clip_unscale_write)
    norms, weights = _run("O2", "one", CLIPS[clip], _clip_unscale_write)
    assert norms == pytest.approx(ref_norms, rel=1e-2)
    for ref, got in zip(ref_weights, weights):
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=0)


def _two_models(mixed_precision: str, poisoned: int | None) -> tuple[list[Any], list[tuple[bool, bool]], list[float]]:
    """Two models, an optimizer each, one loss, one clip over both models' parameters; model ``b``'s input is
    multiplied past float16's range at iteration ``poisoned`` (FP32 reference: that iteration is not run)."""
    reset_accelerate_state()
    torch.manual_seed(0)
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(b.parameters(), lr=0.1)
    kwargs = [MixedPrecisionKwargs(half_dtype="float16", init_scale=2.0**8)] if mixed_precision != "no" else []
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=True, kwargs_handlers=kwargs)
    a, b, opt_a, opt_b = accelerator.prepare(a, b, opt_a, opt_b)
    skipped, scales = [], []
    for i in range(5):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        if i == poisoned and mixed_precision == "no":
            continue
        loss = a(x).float().pow(2).mean() + b(x * (1e6 if i == poisoned else 1.0)).float().pow(2).mean()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_([*a.parameters(), *b.parameters()], 0.5)
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        if mixed_precision != "no":
            skipped.append((opt_a.step_was_skipped, opt_b.step_was_skipped))
            scales.append(accelerator.mpx_metrics()["mpx/loss_scale"])
    weights = [v.float() for m in (a, b) for v in accelerator.get_state_dict(m).values()]
    return weights, skipped, scales


def test_one_optimizer_overflowing_under_a_joint_clip_skips_both() -> None:
    """O2 float16, one clip over two optimizers' parameters, model ``b``'s gradients overflowing on one iteration: the
    joint norm is NaN, and torch's clip made model ``a``'s gradients NaN, which its optimizer (its own check clean)
    stepped on: ``a``'s weights NaN from then on, silently (as under Accelerate's own ``"fp16"``). Now both skip that
    iteration (the norm of gradients that overflowed cannot clip anything) and train on as FP32 without it."""
    ref, _, _ = _two_models("no", poisoned=2)
    weights, skipped, scales = _two_models("O2", poisoned=2)
    assert skipped[2] == (True, True)
    assert scales[2] == scales[1] / 2  # backed off once
    for r, w in zip(ref, weights):
        assert torch.isfinite(w).all()
        torch.testing.assert_close(w, r, atol=2e-3, rtol=0)


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Host reads while ``on``: ``.item()``/``bool()``/``float()`` of a tensor (``aten._local_scalar_dense``) and
    ``Tensor.tolist`` (no aten op on CPU, seen by :class:`_ToList`): each one a host sync on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.on, self.reads = False, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.reads += self.on and func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


class _ToList(torch.overrides.TorchFunctionMode):
    def __init__(self, counter: _HostReads) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counter.reads += self.counter.on and func is torch.Tensor.tolist
        return func(*args, **(kwargs or {}))


def _reads_of_joint_clip(front: str) -> list[int]:
    """Host reads of each iteration's clip and steps: two models, an optimizer each, one loss, one clip over both
    models' parameters, float16 with a dynamic scale; ``front``: the adapter at O2, or ``torch.amp.GradScaler`` (the
    reference: Accelerate's own ``"fp16"`` unscales and steps each optimizer through it)."""
    reset_accelerate_state()
    torch.manual_seed(0)
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = None
    if front == "GradScaler":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    else:
        accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[
            MixedPrecisionKwargs(half_dtype="float16", init_scale=2.0**8)])
        a, b, opt_a, opt_b = accelerator.prepare(a, b, opt_a, opt_b)
    counter = _HostReads()
    reads = []
    with counter, _ToList(counter):
        for i in range(3):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
            loss = a(x).float().pow(2).mean() + b(x).float().pow(2).mean()
            params = [*a.parameters(), *b.parameters()]
            if scaler is None:
                accelerator.backward(loss)
                counter.on, counter.reads = True, 0
                accelerator.clip_grad_norm_(params, 0.5)
                opt_a.step()
                opt_b.step()
            else:
                scaler.scale(loss).backward()
                counter.on, counter.reads = True, 0
                scaler.unscale_(opt_a)
                scaler.unscale_(opt_b)
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                scaler.step(opt_a)
                scaler.step(opt_b)
                scaler.update()
            counter.on = False
            reads.append(counter.reads)
            opt_a.zero_grad()
            opt_b.zero_grad()
    return reads


def test_a_joint_clip_over_two_optimizers_reads_their_flags_once() -> None:
    """O2 float16, one clip over two optimizers' parameters, no overflow: the clip looks at both optimizers' overflow
    flags before clipping (an overflow in one skips both), and read them one host read each (2 per iteration, as
    ``GradScaler``'s one per optimizer's step); now one read for both, which their steps take without reading
    again."""
    reference = _reads_of_joint_clip("GradScaler")
    reads = _reads_of_joint_clip("O2")
    assert reference[1:] == [2, 2]
    assert reads[1:] == [1, 1]  # (the first step's set-up reads its own)
