"""Stop 69's strict xfails made to pass (xfails70): what the fixes also cover, from the user's side, against FP32."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.test_core_gradient_writes_stateful import _both, _off_fp32


# -- 1. a write to both the masters' and the model's gradients after unscale_ (engine.master_writes) ----------------
def _masters_of(run, which: str, indices: range) -> list[torch.Tensor]:
    """``amp.master_params(opt)`` (the FP32 run: the optimizer's parameters), those at ``indices``."""
    opt = run.opts[which]
    params = [p for g in opt.param_groups for p in g["params"]] if run.amp is None else run.amp.master_params(opt)
    return [m for i, m in enumerate(params) if i in indices]


def test_masters_of_some_parameters_and_the_models_of_others_written_after_unscale_train_as_fp32() -> None:
    """The false refusal stop 69's version check made: the masters' FP32 gradients are views of one buffer (one
    version counter), so a write to the first layer's masters looked like a write to the head's too, whose model
    gradients the user wrote. Each master's gradient is told apart now: not refused, as FP32."""
    ours, ref = _both("bfloat16")
    ours.amp.unscale_(ours.opts["whole"])
    for run in (ours, ref):
        with torch.no_grad():
            for m in _masters_of(run, "whole", range(2)):  # the first layer's, through amp.master_params
                m.grad.mul_(0.5)
        run.write_model("head", "mul_")  # the head's, on the model
    ours.amp.step(ours.opts["whole"])
    ref.opts["whole"].step()
    assert _off_fp32(ours, ref) < 0.05


def test_masters_written_then_shown_then_the_models_written_trains_as_fp32() -> None:
    """The way out the refusal names: ``amp.show_unscaled_on_model(opt)`` after writing the masters' gradients, then
    the model's write (made on values with the masters' write in them): both kept, as FP32."""
    ours, ref = _both("bfloat16")
    ours.amp.unscale_(ours.opts["whole"])
    for run in (ours, ref):
        run.write_masters("whole")
    ours.amp.show_unscaled_on_model(ours.opts["whole"])
    for run in (ours, ref):
        run.write_model("model", "mul_")
    ours.amp.step(ours.opts["whole"])
    ref.opts["whole"].step()
    assert _off_fp32(ours, ref) < 0.05


def test_a_master_gradient_replaced_then_the_models_written_is_refused() -> None:
    """``m.grad = m.grad * 0.5`` over ``amp.master_params(opt)`` (a replacement, not a write in place), then a write
    to the model's gradients: refused as the write in place is (the replacement was lost the same way)."""
    ours, _ = _both("bfloat16")
    ours.amp.unscale_(ours.opts["whole"])
    for m in ours.amp.master_params(ours.opts["whole"]):
        m.grad = m.grad * 0.5
    ours.write_model("model", "mul_")
    with pytest.raises(RuntimeError, match=r"amp.master_params\(optimizer\).*and the model's gradients"):
        ours.amp.step(ours.opts["whole"])


def test_the_engines_clip_of_nothing_after_masters_handed_out_does_not_refuse_a_model_write() -> None:
    """``amp.master_params`` after ``unscale_`` (read, not written), the engine's clip that changes nothing (its
    multiply by 1 moves the masters' versions: the engine's own write, noted along), then a write to the model's
    gradients: trains as FP32, as before this fix."""
    ours, ref = _both("bfloat16")
    ours.amp.unscale_(ours.opts["whole"])
    assert all(m.grad is not None for m in ours.amp.master_params(ours.opts["whole"]))
    assert abs(ours.clip("whole", 1e6) - ref.clip("whole", 1e6)) <= 1e-2
    for run in (ours, ref):
        run.write_model("model", "mul_")
    ours.amp.step(ours.opts["whole"])
    ref.opts["whole"].step()
    assert _off_fp32(ours, ref) < 0.05


def test_masters_handed_out_after_an_unscale_not_stepped_are_let_go_at_the_next_backward() -> None:
    """``amp.unscale_``, ``amp.master_params`` (their FP32 gradients handed out), no step, a backward (the true values
    carried back into the model's gradients): the masters' FP32 gradient buffer is freed, not held by the notes
    until the next step."""
    ours, _ = _both("bfloat16")
    ours.amp.unscale_(ours.opts["whole"])
    grads = [m.grad for m in ours.amp.master_params(ours.opts["whole"])]
    buffer = weakref.ref(grads[0].untyped_storage())
    del grads
    ours.backward(1)
    gc.collect()
    assert buffer() is None


def test_apex_o2_clip_of_the_masters_then_their_halving_trains_as_fp32() -> None:
    """attack69b's Apex habit written the way the refusal names: torch's clip of ``amp.master_params(opt)``, then the
    halving made on the masters' gradients (not the model's): as FP32's clip then halving."""
    from lightning_mpx.apex import _amp_state
    from tests.test_accelerate_write_after_clip import _apex

    def run(level: str | None) -> torch.Tensor:
        return _apex(level, halve="masters", steps=3)

    try:
        assert (run("O2") - run(None)).abs().max() < 1e-3
    finally:
        _amp_state.reset()


# -- 2. a shared head stepped alone after the whole model's unscale_ (SharedGrads.settled, rescale._true_shown) -----
@pytest.mark.parametrize("dtype", ["bfloat16"])
@pytest.mark.parametrize("second", ["whole", "head"])
def test_a_shared_head_stepped_after_the_wholes_unscale_then_accumulated_trains_as_fp32(
    dtype: str, second: str
) -> None:
    """bfloat16 under a static scale of 16: the whole model's ``unscale_``, the head's step alone, ``update()``, a
    backward without ``zero_grad``, then both steps (the whole's first, or the head's first: the head's leftovers
    brought up once, not once per optimizer): as FP32."""
    ours, ref = _both(dtype, two=True)
    ours.amp.unscale_(ours.opts["whole"])
    ours.amp.step(ours.opts["head"])
    ours.amp.update()
    ref.opts["head"].step()
    for run in (ours, ref):
        run.backward(1)
    order = ("whole", "head") if second == "whole" else ("head", "whole")
    for name in order:
        ours.amp.step(ours.opts[name])
        ref.opts[name].step()
    ours.amp.update()
    assert _off_fp32(ours, ref) < 0.05
