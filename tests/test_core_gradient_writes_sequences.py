"""stateful70: the sequences the O2 gradient-writes machine (tests/test_core_gradient_writes_stateful.py) found under
``HYPOTHESIS_PROFILE=explore``, written out as plain tests: two optimizers over a shared head (its FP32 master shared),
one clipped by the engine, a write to the model's gradients, the other's unscale; and a write to the masters'
gradients that the gradients a step left lost (fixed at stop 71)."""

from __future__ import annotations

import pytest
import torch

from tests.test_core_gradient_writes_stateful import REFUSED_WRITE, _both, _off_fp32


@pytest.mark.parametrize(("head", "how"), [("clip", "mul_"), ("clip", "new"), ("unscale_ and clip", "mul_")])
@pytest.mark.parametrize("whole", ["clip", "unscale_", "step"])
def test_a_write_after_one_optimizers_clip_is_refused_at_the_others_unscale(head: str, how: str, whole: str) -> None:
    """The head's engine clip (``amp.clip_grad_norm_(head_opt, 0.1)``, after ``amp.unscale_(head_opt)`` or not),
    ``p.grad.mul_(0.5)`` (or ``p.grad = p.grad * 0.5``) on the model, then the whole model's clip, ``unscale_`` or
    step. Before: the whole model's unscale took the head's written half gradients (the unclipped values the write was
    made on) into the shared master: its clip measured 2x FP32's norm (0.517 against 0.258) and its step stepped the
    head unclipped, silently; after ``unscale_`` it also showed them on the model, and the head's step no longer
    refused the write. Now refused there, as at the head's own step (docs/master_weights.md)."""
    ours, ref = _both("float16", two=True)
    if head != "clip":
        ours.amp.unscale_(ours.opts["head"])
    assert abs(ours.clip("head", 0.1) - ref.clip("head", 0.1)) <= 3e-3
    ours.write_model("model", how)  # in place, or p.grad = p.grad * 0.5 (the --hypothesis-seed=6 sequence)
    with pytest.raises(RuntimeError, match=REFUSED_WRITE):
        if whole == "clip":
            ours.clip("whole", 0.1)
        elif whole == "unscale_":
            ours.amp.unscale_(ours.opts["whole"])
        else:
            ours.amp.step(ours.opts["whole"])


def test_a_write_after_unscale_then_the_other_optimizers_clip_trains_as_fp32() -> None:
    """The whole model's ``amp.unscale_`` (the true values shown on the model), ``p.grad.mul_(0.5)`` on the model (FP32
    code's habit after ``GradScaler.unscale_``), the head's engine clip (which takes the written values into the shared
    master and clips them), both steps. Before: the whole model's step took the written head gradients again over the
    head's clip: 3.5x FP32's travel off (found after five backwards, ``--hypothesis-seed=2``). Now it steps the clipped
    master gradient, as FP32 steps the clipped gradient with both optimizers."""
    for dtype in ("float16", "bfloat16"):
        ours, ref = _both(dtype, two=True)
        ours.amp.unscale_(ours.opts["whole"])
        for run in (ours, ref):
            run.write_model("model", "mul_")
        assert abs(ours.clip("head", 0.1) - ref.clip("head", 0.1)) <= 3e-3
        for name in ("whole", "head"):
            ours.amp.step(ours.opts[name])
            ref.opts[name].step()
        ours.amp.update()
        assert _off_fp32(ours, ref) < 0.05, dtype


@pytest.mark.parametrize("max_norm", [0.1, 10.0])
def test_a_write_to_the_masters_gradients_is_kept_in_what_the_step_leaves(max_norm: float) -> None:
    """``amp.clip_grad_norm_(opt, c)``, ``m.grad.mul_(0.5)`` over ``amp.master_params(opt)`` (the documented way to
    write after the engine's clip), the step, a backward without ``zero_grad``: FP32's gradients then hold the clipped,
    halved values plus the new ones. Before: ours the clipped values without the write (the next clip's norm 1.13
    against 1.08, the weights 0.23x FP32's travel off after the next step), silently (found by
    test_core_gradient_writes_stateful.py's machine, ``--hypothesis-seed=3``). Now the step shows the written masters'
    gradients on the model before it steps (engine.masters_left)."""
    ours, ref = _both("float16")
    for run in (ours, ref):
        run.clip("whole", max_norm)
        run.write_masters("whole")
    ours.amp.step(ours.opts["whole"])
    ref.opts["whole"].step()
    ours.amp.update()
    for run in (ours, ref):
        run.backward(0)
    norm, want = ours.clip("whole", 10.0), ref.clip("whole", 10.0)
    assert abs(norm - want) <= 0.01 * want, (norm, want)
    ours.amp.step(ours.opts["whole"])
    ref.opts["whole"].step()
    assert _off_fp32(ours, ref) < 0.05


@pytest.mark.parametrize(
    ("set_to_none", "through_model"),
    [
        (False, False),
        (True, False),
        (True, True),
        (False, True),
    ],
)
def test_apex_o1_a_delay_unscale_chain_after_a_given_up_block_stays_scaled(set_to_none: bool, through_model) -> None:
    """A block without delay_unscale, the returned optimizer's zero_grad() (the block given up, no step), then a
    delay_unscale block: the chain's gradients stay scaled, as Apex's. Was unscaled at its end (the core's stage stayed
    unscaled, so an empty stash, or the given-up block's zeros, were kept as an earlier block's): a clip of
    model.parameters() between the blocks saw 1/64 of Apex's norm (test_apex_stateful.py's machine, seed 2); after
    ``model.zero_grad(set_to_none=False)`` (no code of ours runs) until stop 72. Now the zeros stay in place."""
    from tests.test_apex_stateful import ApexAgainstReference

    machine = ApexAgainstReference()
    try:
        machine.setup(level="O1", optimizer="sgd")
        machine.block(seed=11, loss_id=0, delay=False, poison=None)
        machine.zero_grad(set_to_none=set_to_none, through_model=through_model)
        machine.block(seed=0, loss_id=0, delay=True, poison=None)
        for param, want in zip(machine.ours.model.parameters(), machine.ref.holders(), strict=True):
            torch.testing.assert_close(param.grad.float(), want.grad.float(), rtol=0.01, atol=1e-3)  # scaled, as Apex
        machine.block(seed=5, loss_id=0, delay=False, poison=None)
        machine.step()  # the chain's end and the step: the reference's update (FP32 steps the zeros, momentum too)
    finally:
        machine.teardown()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_one_optimizer_stepped_after_the_others_clip_then_accumulated(dtype: str) -> None:
    """A shared head: the whole model's engine clip (no step), the head's step alone, then a backward. Before: the
    whole optimizer's next clip measured 1.88 where FP32's measures 1.13 (the head's half gradients kept the values
    without the whole model's clip, which its step had stepped with), silently; found by
    test_core_gradient_writes_stateful.py's machine in CI. Now the head's step leaves the values it stepped with
    (engine.shared_clips.keep_clipped)."""
    ours, ref = _both(dtype, two=True)
    for run in (ours, ref):
        run.clip("whole", 0.1)
    ours.amp.step(ours.opts["head"])
    ref.opts["head"].step()
    ours.amp.update()
    for run in (ours, ref):
        run.backward(0)
    norm, want = ours.clip("whole", 0.1), ref.clip("whole", 0.1)
    assert abs(norm - want) <= 0.03 * want, (norm, want)


def test_a_write_after_unscale_then_the_same_optimizers_clip_is_kept_at_the_others_unscale() -> None:
    """A shared head: the head's ``unscale_``, a write to the model's gradients, the head's engine clip (which takes the
    write into the shared master and clips it), both steps. Before: the whole model's unscale took the written half
    gradients again over the head's clip (3.5x FP32's travel off), silently (``--hypothesis-seed=3`` at stop 70). Now
    the clip notes the master's clipped gradient for the written half ones (engine.shared_clips.took_written)."""
    ours, ref = _both("float16", two=True)
    ours.amp.unscale_(ours.opts["head"])
    for run in (ours, ref):
        run.write_model("model", "mul_")
    assert abs(ours.clip("head", 0.1) - ref.clip("head", 0.1)) <= 3e-3
    for name in ("whole", "head"):
        ours.amp.step(ours.opts[name])
        ref.opts[name].step()
    ours.amp.update()
    assert _off_fp32(ours, ref) < 0.05
