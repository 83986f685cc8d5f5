"""What an O2 step leaves in the model's half gradients when the loop does not zero them (accumulation across a step,
FP32's habit: the next backward adds to what the step used), after writes and clips the step's values carry that the
half gradients do not: a write to the FP32 masters' gradients (a list of the masters kept from before ``unscale_``,
clipped with torch's ``clip_grad_norm_``), another optimizer's engine clip of a shared head. Each against an FP32 run of
the same calls (tests/test_core_gradient_writes_stateful.py's runs: Linear-Tanh-Linear, a second optimizer over the
head)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from tests.test_core_gradient_writes_stateful import _both, _off_fp32, _params


def _next_clip_and_steps(ours, ref, names: tuple[str, ...]) -> tuple[float, float]:  # noqa: ANN001
    """``update()``, a backward without ``zero_grad`` in both runs, the whole model's clip (its norm, ours and FP32's),
    then a step of each of ``names``."""
    ours.amp.update()
    for run in (ours, ref):
        run.backward(1)
    norms = ours.clip("whole", 10.0), ref.clip("whole", 10.0)
    for name in names:
        ours.amp.step(ours.opts[name])
        ref.opts[name].step()
    return norms


def test_a_master_list_kept_from_before_unscale_clipped_then_accumulated_trains_as_fp32() -> None:
    """``masters = list(amp.master_params(opt))`` at set-up, ``amp.unscale_(opt)``, torch's ``clip_grad_norm_(masters,
    0.1)``, the step, a backward without ``zero_grad``. Before: the model's half gradients kept the unclipped values
    ``unscale_`` showed, so the next backward added to those (the next clip's norm 1.35 against FP32's 0.89). Now the
    step shows the masters' written gradients on the model first (engine.masters_left)."""
    ours, ref = _both("bfloat16")
    kept = list(ours.amp.master_params(ours.opts["whole"]))
    ours.amp.unscale_(ours.opts["whole"])
    torch.nn.utils.clip_grad_norm_(kept, 0.1)
    torch.nn.utils.clip_grad_norm_(_params(ref.opts["whole"]), 0.1)
    ours.amp.step(ours.opts["whole"])
    ref.opts["whole"].step()
    norm, want = _next_clip_and_steps(ours, ref, ("whole",))
    assert abs(norm - want) <= 0.01 * want, (norm, want)
    assert _off_fp32(ours, ref) < 0.05


def test_masters_written_after_the_engines_clip_then_zero_grad_leaves_nothing_to_show() -> None:
    """The usual loop after a write to the masters' gradients (the engine's clip, ``m.grad.mul_(0.5)`` over
    ``amp.master_params``, the step, ``zero_grad``): trains as FP32, and the gradients the step leaves are cleared
    as in any loop (the masters' FP32 gradients freed, the model's zeroed)."""
    ours, ref = _both("bfloat16")
    for run in (ours, ref):
        run.clip("whole", 0.1)
        run.write_masters("whole")
    ours.amp.step(ours.opts["whole"])
    ref.opts["whole"].step()
    for run in (ours, ref):
        run.opts["whole"].zero_grad()
    assert all(ours.amp.master_of(p).grad is None and p.grad is None for p in ours.model.parameters())
    norm, want = _next_clip_and_steps(ours, ref, ("whole",))
    assert abs(norm - want) <= 0.01 * want, (norm, want)
    assert _off_fp32(ours, ref) < 0.05


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_the_whole_models_clip_then_the_heads_step_alone_then_accumulated(clip: str) -> None:
    """A shared head: the whole model's engine clip (by norm, or ``amp.clip_grad_value_``), the head's step alone,
    ``update()``, a backward without ``zero_grad``. Before: the head's half gradients kept the values without the whole
    model's clip (the next clip's norm 1.25 against FP32's 0.89; by value 1.26 against 0.92), silently. Now its step
    leaves the values it stepped with (engine.shared_clips)."""
    ours, ref = _both("bfloat16", two=True)
    for run in (ours, ref):
        if clip == "norm":
            run.clip("whole", 0.1)
        elif run.amp is None:
            torch.nn.utils.clip_grad_value_(_params(run.opts["whole"]), 0.01)
        else:
            run.amp.clip_grad_value_(run.opts["whole"], 0.01)
    ours.amp.step(ours.opts["head"])
    ref.opts["head"].step()
    norm, want = _next_clip_and_steps(ours, ref, ("whole", "head"))
    assert abs(norm - want) <= 0.02 * want, (norm, want)
    assert _off_fp32(ours, ref) < 0.05


@pytest.mark.parametrize("then", [(), ("head",)])
def test_the_heads_clip_then_the_whole_models_step_then_accumulated(then: tuple[str, ...]) -> None:
    """The mirror: the head's engine clip, the whole model's step (it takes the head's clipped values for the head),
    the head's own step or none, a backward without ``zero_grad``. Before (without the head's step): the next clip
    measured 1.35 against FP32's 1.04. Now as FP32."""
    ours, ref = _both("bfloat16", two=True)
    for run in (ours, ref):
        run.clip("head", 0.1)
    for name in ("whole", *then):
        ours.amp.step(ours.opts[name])
        ref.opts[name].step()
    norm, want = _next_clip_and_steps(ours, ref, ("whole", "head"))
    assert abs(norm - want) <= 0.02 * want, (norm, want)
    assert _off_fp32(ours, ref) < 0.05


def test_the_handed_out_masters_clipped_after_unscale_then_accumulated_trains_as_fp32() -> None:
    """``amp.unscale_(opt)``, torch's ``clip_grad_norm_(amp.master_params(opt), 0.1)`` (the documented habit), the step,
    a backward without ``zero_grad``. Before: the model's half gradients kept the unclipped values ``unscale_`` showed
    (the next clip's norm 1.35 against FP32's 0.89). Now the step shows the handed-out masters' written gradients on
    the model first (engine.master_writes.any_written)."""
    ours, ref = _both("bfloat16")
    ours.amp.unscale_(ours.opts["whole"])
    torch.nn.utils.clip_grad_norm_(ours.amp.master_params(ours.opts["whole"]), 0.1)
    torch.nn.utils.clip_grad_norm_(_params(ref.opts["whole"]), 0.1)
    ours.amp.step(ours.opts["whole"])
    ref.opts["whole"].step()
    norm, want = _next_clip_and_steps(ours, ref, ("whole",))
    assert abs(norm - want) <= 0.01 * want, (norm, want)


@pytest.mark.parametrize("clear", [True, False, None])
def test_the_heads_step_skipped_for_an_overflow_after_the_whole_models_clip(clear: bool | None) -> None:
    """A shared head's gradient overflows: the whole model's engine clip (it clips nothing: an overflow), the head's
    step, skipped (its step leaves the masters' values, inf and all, in the half gradients: engine.shared_clips.
    keep_clipped), ``update()``. The loop's ``zero_grad`` (``clear``: ``set_to_none``) then trains as FP32, whose
    optimizers holding the inf skipped; without it the inf stays in what the next steps use, which skip again (as
    FP32's would), the weights finite."""
    ours, ref = _both("float16", two=True)
    ours.model[2].weight.grad[0, 0] = float("inf")
    ours.clip("whole", 0.1)
    assert not ours.amp.step(ours.opts["head"])
    ours.amp.update()
    for run in (ours, ref):
        for optimizer in run.opts.values() if clear is not None else ():
            optimizer.zero_grad(set_to_none=clear)
        if clear is None and run is ref:
            continue
        run.backward(1)
    before = ours.trained()
    ours.clip("whole", 0.1)
    stepped = [bool(ours.amp.step(ours.opts[name])) for name in ("whole", "head")]
    ours.amp.update()
    assert all(torch.isfinite(w).all() for w in ours.trained())
    if clear is None:
        assert stepped == [False, False]
        for got, want in zip(ours.trained(), before, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        return
    ref.clip("whole", 0.1)
    for name in ("whole", "head"):
        ref.opts[name].step()
    assert stepped == [True, True]
    assert _off_fp32(ours, ref) < 0.05


def _handed_out_clip_run(level: str | None, clear: bool | None) -> tuple[list[torch.Tensor], float]:
    """Four iterations of ``unscale_``, torch's ``clip_grad_norm_`` of ``amp.master_params(opt)`` (``level=None``: FP32
    with ``torch.amp.GradScaler`` and the model's parameters), the step, the update, ``zero_grad`` (``clear``:
    ``set_to_none``; ``None``: none), an inf in a gradient at the second: returns the weights and the scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    amp = scaler = None
    if level is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    else:
        amp = Amp(level, half_dtype="float16", init_scale=256.0)
        model = amp.prepare_model(model)
        opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        if amp is None:
            scaler.scale(F.cross_entropy(model(x), y)).backward()
        else:
            with amp.forward_context():
                out = amp.cast_outputs(model(amp.cast_inputs(x)))
            amp.backward(F.cross_entropy(out.float(), y))
        if i == 1:
            model[0].weight.grad[0, 0] = float("inf")
        (scaler or amp).unscale_(opt)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) if amp is None else amp.master_params(opt), 0.5)
        (scaler or amp).step(opt)
        (scaler or amp).update()
        if clear is not None:
            opt.zero_grad(set_to_none=clear)
    weights = [p if amp is None else amp.master_of(p) for p in model.parameters()]
    return [w.detach().float().clone() for w in weights], (scaler or amp.scalers[0]).get_scale()


@pytest.mark.parametrize("clear", [True, False, None])
def test_handed_out_masters_clipped_over_an_overflow_then_the_next_steps_train_as_grad_scaler(clear) -> None:
    """The Apex habit in the core loop: torch's clip of ``amp.master_params(opt)`` over an overflow (NaN in them, the
    step skipped: engine.master_writes.any_written shows them on the model), then the next iterations: as
    ``GradScaler``'s loop of the same calls, with the loop's ``zero_grad`` either way (trained on) or without (the NaN
    kept, every later step skipped, the scale halved each time), the weights finite."""
    ours, scale = _handed_out_clip_run("O2", clear)
    ref, ref_scale = _handed_out_clip_run(None, clear)
    assert scale == ref_scale
    for got, want in zip(ours, ref, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # float16's forward; a step moves ~1e-2
