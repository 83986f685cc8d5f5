"""Amp's per-optimizer state machine (issue 10, design 2): update() resets every optimizer's stage, a backward
after unscale_()/clip_grad_*() and before step() is handled, overflows are charged to the losses that produced
them, pending gradients keep their scale across update(), a static scale from a checkpoint is applied both ways,
numpy loss ids, the Adam-eps hint of the floor error; and a model-based test that drives Amp through random
sequences of what users do against an FP32 reference."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.scaling.scaler import LossScaleFloorError

# Parameters after a few steps against FP32: the half forward/backward's rounding (the largest differences seen in
# these tiny models were 5e-5 in float16 and 9e-4 in bfloat16), tight enough that a missed or wrongly scaled step of
# size lr * gradient cannot hide in it.
TOLERANCE = {
    torch.float16: dict(rtol=1e-3, atol=5e-4),
    torch.bfloat16: dict(rtol=4e-3, atol=4e-3),
}


def _batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def _pair(level: str, *, half: str = "float16", lr: float = 0.1, **settings):
    """An Amp-prepared model and SGD, and the FP32 twin that starts from the same (half-rounded at O2) weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    amp = Amp(level, half_dtype=half, **settings)
    model = amp.prepare_model(model)
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5))
    ref = copy.deepcopy(model).float()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.5)
    return amp, model, opt, ref, ref_opt


def _backward(amp: Amp, model: nn.Module, seed: int, loss_id: int = 0) -> None:
    x, y = _batch(seed)
    with amp.forward_context():
        out = amp.cast_outputs(model(amp.cast_inputs(x)))
    # out.float(): at O1 the output is half, and torch before 2.13 fails the backward of mse_loss(half, float) on CPU
    amp.backward(F.mse_loss(out.float(), y), loss_id=loss_id)


def _ref_backward(ref: nn.Module, seed: int) -> None:
    x, y = _batch(seed)
    F.mse_loss(ref(x), y).backward()


def _trained(opt: torch.optim.Optimizer, amp: Amp | None = None) -> list[torch.Tensor]:
    """What the optimizer updates: the model's parameters, or the FP32 masters at O2 (``amp`` given)."""
    if amp is not None:
        return amp.master_params(opt)
    return [p for group in opt.param_groups for p in group["params"]]


def _assert_close_to_reference(amp: Amp, opt: torch.optim.Optimizer, ref_opt: torch.optim.Optimizer) -> None:
    for got, want in zip(_trained(opt, amp), _trained(ref_opt)):
        torch.testing.assert_close(got.float(), want, **TOLERANCE[amp.half_dtype])


# -- update() resets the stage: a skipped batch's unscale or clip does not leak ---------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("calls_update", [True, False], ids=["update", "no-update"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_clip_without_a_step_does_not_leak_into_the_next_iteration(level, calls_update, set_to_none):
    # A bad batch: clipped, then skipped (no step), gradients zeroed. The next iteration must step as FP32 does.
    # Before the fix, its step used the still-scaled gradients (clipped to max_norm: O1 moved ~10x too far) or, at
    # O2, nothing at all. The Lightning plugin and the Accelerate adapter do not call update() on such a batch,
    # hence "no-update".
    amp, model, opt, ref, ref_opt = _pair(level)
    _backward(amp, model, seed=1)
    amp.clip_grad_norm_(opt, 10.0)  # above the true norm: the FP32 run does not clip at all
    if calls_update:
        amp.update()
    opt.zero_grad(set_to_none=set_to_none)
    for seed in (2, 3):
        _backward(amp, model, seed)
        amp.clip_grad_norm_(opt, 10.0)
        assert amp.step(opt)
        amp.update()
        opt.zero_grad(set_to_none=set_to_none)
        _ref_backward(ref, seed)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 10.0)
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_close_to_reference(amp, opt, ref_opt)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("calls_update", [True, False], ids=["update", "no-update"])
def test_gradients_left_by_a_skipped_clip_accumulate_as_in_fp32(level, calls_update):
    # Not zeroed: the clipped, unscaled gradients left behind add to the next backward's, as FP32's would.
    amp, model, opt, ref, ref_opt = _pair(level)
    _backward(amp, model, seed=1)
    amp.clip_grad_norm_(opt, 0.05)  # below the true norm: this clip changes the gradients
    if calls_update:
        amp.update()
    _backward(amp, model, seed=2)
    assert amp.step(opt)
    _ref_backward(ref, seed=1)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    _ref_backward(ref, seed=2)
    ref_opt.step()
    _assert_close_to_reference(amp, opt, ref_opt)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_step_after_update_without_a_backward_steps_the_gradients_left_behind(level):
    # Clipped, the iteration closed without a step, then stepped with no new backward: the gradients are already
    # unscaled, so they are checked but not divided again.
    amp, model, opt, ref, ref_opt = _pair(level)
    _backward(amp, model, seed=1)
    amp.clip_grad_norm_(opt, 0.5)
    amp.update()
    assert amp.step(opt)
    _ref_backward(ref, seed=1)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    ref_opt.step()
    _assert_close_to_reference(amp, opt, ref_opt)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("first", ["unscale_", "clip_grad_norm_", "clip_grad_value_"])
def test_backward_after_unscale_and_before_step_is_added_at_the_right_scale(level, first):
    # Before the fix the second backward's gradients were stepped 65,536x too large.
    amp, model, opt, ref, ref_opt = _pair(level)
    _backward(amp, model, seed=1)
    _ref_backward(ref, seed=1)
    if first == "unscale_":
        amp.unscale_(opt)
    elif first == "clip_grad_norm_":
        amp.clip_grad_norm_(opt, 0.05)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    else:
        amp.clip_grad_value_(opt, 0.01)
        torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
    _backward(amp, model, seed=2)
    _ref_backward(ref, seed=2)
    amp.unscale_(opt)  # allowed again: the backward started a new round of gradients
    assert amp.step(opt)
    ref_opt.step()
    _assert_close_to_reference(amp, opt, ref_opt)


def test_unscale_twice_still_names_the_calls():
    amp, model, opt, _, _ = _pair("O1")
    _backward(amp, model, seed=1)
    amp.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called .*clip_grad_norm_\(\).*step\(\)"):
        amp.unscale_(opt)
    amp.update()
    amp.unscale_(opt)  # a new iteration: the gradients left behind are checked, not divided again
    assert amp.is_unscaled(opt)


@pytest.mark.parametrize("calls_update", [True, False], ids=["update", "no-update"])
def test_an_overflow_seen_by_a_skipped_unscale_counts_toward_the_next_update(calls_update):
    # As torch's GradScaler.update() counts every unscale_(): a batch skipped because its gradients overflowed backs
    # the scale off, or training that skips such batches would never leave the overflowing scale. Without an
    # update() after the skipped batch (the adapters' case) it counts toward the next one.
    amp, model, opt, _, _ = _pair("O1", init_scale=2.0**10)
    _backward(amp, model, seed=1)
    model[0].weight.grad[0, 0] = float("inf")
    norm = amp.clip_grad_norm_(opt, 1.0)
    assert not torch.isfinite(norm)  # the user skips the batch
    if calls_update:
        amp.update()
        assert amp.scalers[0].get_scale() == 2.0**9
    opt.zero_grad()
    _backward(amp, model, seed=2)
    assert amp.step(opt)  # the next batch is clean: its step is not skipped for the old overflow
    amp.update()
    assert amp.scalers[0].get_scale() == 2.0**9  # backed off once, whichever update saw the overflow
    assert amp.skipped_steps == [0]


def test_clip_grad_value_without_gradients_does_nothing():
    # A batch without gradients (a Lightning training_step that returned None) with clipping by value: torch's
    # clip_grad_value_ refuses an empty list.
    amp, _, opt, _, _ = _pair("O1")
    amp.clip_grad_value_(opt, 1.0)
    assert amp.is_unscaled(opt)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gradients_pending_across_an_update_keep_their_scale(level):
    # One loss through two models with an optimizer each; the second steps every other iteration (accumulating),
    # and update() grows the scale in between (growth_interval=1). Its pending gradients carry the old scale.
    torch.manual_seed(0)
    first, second = nn.Linear(6, 8), nn.Linear(8, 3)
    amp = Amp(level, growth_interval=1, init_scale=2.0**8, half_dtype="float16")
    amp.prepare_model(first), amp.prepare_model(second)
    opt_first = amp.prepare_optimizer(torch.optim.SGD(first.parameters(), lr=0.1))
    opt_second = amp.prepare_optimizer(torch.optim.SGD(second.parameters(), lr=0.1))
    ref = copy.deepcopy(second).float()
    ref_first = copy.deepcopy(first).float()
    ref_opt_first = torch.optim.SGD(ref_first.parameters(), lr=0.1)
    for seed in (1, 2):
        x, y = _batch(seed)
        with amp.forward_context():
            out = amp.cast_outputs(second(amp.cast_inputs(amp.cast_outputs(first(amp.cast_inputs(x))))))
        amp.backward(F.mse_loss(out.float(), y))  # out.float(): see _backward
        F.mse_loss(ref(ref_first(x)), y).backward()
        assert amp.step(opt_first)
        amp.update()
        opt_first.zero_grad()
        ref_opt_first.step()
        ref_opt_first.zero_grad()
    assert amp.scalers[0].get_scale() == 2.0**10
    amp.unscale_(opt_second)
    for got, want in zip(_trained(opt_second, amp), ref.parameters()):
        torch.testing.assert_close(got.grad.float(), want.grad, **TOLERANCE[amp.half_dtype])


# -- per-loss attribution ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_discriminator_overflow_does_not_back_off_the_generator_scale(level, set_to_none):
    # The generator's loss (1) also back-propagates into the discriminator, whose gradients are then zeroed. With
    # zero_grad(set_to_none=False) the zeroed tensors remain: before the fix, they made loss 1 count as a contributor
    # to the discriminator's next step, and its overflow backed off both scales ([128, 128]).
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 1))
    amp = Amp(level, num_losses=2, init_scale=256.0, half_dtype="float16")
    amp.prepare_model(gen), amp.prepare_model(disc)
    opt_g = amp.prepare_optimizer(torch.optim.Adam(gen.parameters(), lr=1e-3))
    opt_d = amp.prepare_optimizer(torch.optim.Adam(disc.parameters(), lr=1e-3))

    def zero(*pairs):
        for opt, model in pairs:
            opt.zero_grad(set_to_none=set_to_none)
            model.zero_grad(set_to_none=set_to_none)  # at O2 the half model's own gradients too

    stepped = []
    for it in range(3):
        z, real = torch.randn(16, 4), torch.randn(16, 8)
        with amp.forward_context():
            fake = amp.cast_outputs(gen(amp.cast_inputs(z))).detach()
            logits = amp.cast_outputs(disc(amp.cast_inputs(torch.cat([real, fake]))))
            d_loss = F.binary_cross_entropy_with_logits(logits, torch.cat([torch.ones(16, 1), torch.zeros(16, 1)]))
        amp.backward(d_loss, loss_id=0)
        if it == 1:
            disc[0].weight.grad[0, 0] = float("nan")
        d_stepped = amp.step(opt_d)
        zero((opt_d, disc))
        with amp.forward_context():
            logits = amp.cast_outputs(disc(amp.cast_inputs(amp.cast_outputs(gen(amp.cast_inputs(z))))))
            g_loss = F.binary_cross_entropy_with_logits(logits, torch.ones(16, 1))
        amp.backward(g_loss, loss_id=1)
        stepped.append((d_stepped, amp.step(opt_g)))
        zero((opt_g, gen), (opt_d, disc))
        amp.update()
    assert stepped == [(True, True), (False, True), (True, True)]
    assert [scaler.get_scale() for scaler in amp.scalers] == [128.0, 256.0]
    assert amp.skipped_steps == [1, 0]


def test_an_overflow_is_charged_to_the_loss_whose_gradients_held_it():
    # Two losses into one optimizer: loss 1's gradients overflow, loss 0's come after them and are finite. The
    # non-finite values persist in the sum, but they are loss 1's: only its scale backs off.
    amp = Amp("O1", num_losses=2, init_scale=2.0**10, half_dtype="float16")
    model = amp.prepare_model(nn.Linear(3, 1))
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.ones(2, 3)
    amp.backward(model(x).sum(), loss_id=1)
    model.weight.grad[0, 0] = float("inf")
    amp.backward(model(x).sum(), loss_id=0)
    assert amp.step(opt) is False
    amp.update()
    assert [s.get_scale() for s in amp.scalers] == [2.0**10, 2.0**9]
    assert amp.skipped_steps == [0, 1]


def test_attribution_needs_no_host_sync_before_the_step():
    # The per-loss flags are device tensors: scale_loss() and the rescale between losses read nothing back.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    amp = Amp("O1", num_losses=2, half_dtype="float16")
    model = amp.prepare_model(nn.Linear(3, 1))
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    amp.backward(model(torch.ones(2, 3)).sum(), loss_id=0)
    amp.clip_grad_norm_(opt, 1.0)
    loss = model(torch.ones(2, 3)).sum()
    with Record() as recorded:
        amp.scale_loss(loss, loss_id=1)  # rescales the clipped gradients back up, charges the check to loss 0
        amp.update()
    assert recorded.ops and not any("_local_scalar_dense" in op for op in recorded.ops), recorded.ops


# -- static scale from a checkpoint ------------------------------------------------------------------------------------
def test_a_static_scale_loaded_from_a_checkpoint_is_applied_both_ways():
    # Before the fix a static 128 loaded into a static 1.0 scaler divided the gradients by 128 but never multiplied
    # the loss: the gradients came out 128x too small.
    amp, model, opt, ref, _ = _pair("O1", loss_scale=1.0)
    saved = Amp("O1", loss_scale=128.0, half_dtype="float16").state_dict()
    amp.load_state_dict(saved)
    loss = torch.tensor(3.0)
    assert amp.scale_loss(loss).item() == 384.0
    _backward(amp, model, seed=1)
    amp.unscale_(opt)
    _ref_backward(ref, seed=1)
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, **TOLERANCE[torch.float16])


# -- loss_id -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_id", [np.int64(1), np.int32(1), np.uint8(1), torch.tensor(1)], ids=repr)
def test_integer_like_loss_ids_are_accepted(loss_id):
    amp = Amp("O1", num_losses=2, half_dtype="bfloat16")
    amp.scalers[1].load_state_dict({"scale": 8.0, "growth_tracker": 0, "hysteresis_tracker": 1, "overflows": 0})
    model = amp.prepare_model(nn.Linear(3, 1, bias=False))
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    assert amp.scale_loss(torch.tensor(2.0), loss_id=loss_id).item() == 16.0
    amp.backward(model(torch.ones(1, 3)).sum(), loss_id=loss_id)
    assert amp.step(opt)
    amp.update()
    assert amp._machine.iteration_found == {} and amp.skipped_steps == [0, 0]


@pytest.mark.parametrize("loss_id", [True, np.bool_(True), 1.0, "1", torch.tensor(True), None, 2, -1], ids=repr)
def test_other_loss_ids_are_refused_with_the_choices(loss_id):
    amp = Amp("O1", num_losses=2, half_dtype="bfloat16")
    error = ValueError if type(loss_id) is int else TypeError  # not an integer: a type error (stop 64)
    with pytest.raises(error, match=r"loss_id=.* valid choices: 0 to 1 \(num_losses=2\)"):
        amp.scale_loss(torch.tensor(1.0), loss_id=loss_id)


# -- the floor error's hint for Adam's eps in half ---------------------------------------------------------------------
def _o3_adamw(eps=1e-8, level="O3", half="float16", **settings):
    torch.manual_seed(0)
    amp = Amp(level, half_dtype=half, on_floor="raise", **settings)
    model = amp.prepare_model(nn.Linear(8, 4))
    opt = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps))
    return amp, model, opt


def _train_until_floor(amp, model, opt, steps=5):
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    for _ in range(steps):
        amp.backward(F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))), y) * 1e-3)
        amp.step(opt)
        amp.update()
        opt.zero_grad()


def test_o3_float16_adamw_floor_error_names_the_eps():
    # Small gradients: AdamW's v underflows in float16 and eps=1e-8 is 0 there, so the first update divides by zero.
    amp, model, opt = _o3_adamw()
    with pytest.raises(LossScaleFloorError) as info:
        _train_until_floor(amp, model, opt)
    message = str(info.value)
    assert "eps=1e-08" in message and "is 0 in torch.float16" in message
    assert "opt_level='O2'" in message and "half_dtype='bfloat16'" in message and "1e-4" in message
    assert "Check the loss and inputs" not in message


@pytest.mark.parametrize(
    "eps, level, half", [(1e-4, "O3", "float16"), (1e-8, "O2", "float16"), (1e-8, "O3", "bfloat16")]
)
def test_the_floor_error_keeps_its_general_advice_otherwise(eps, level, half):
    amp, model, opt = _o3_adamw(eps, level, half, loss_scale=1.0)  # static: any overflow is at the floor
    amp.backward(model(amp.cast_inputs(torch.ones(2, 8))).float().sum())
    next(model.parameters()).grad.view(-1)[0] = float("nan")
    with pytest.raises(LossScaleFloorError, match="Check the loss and inputs") as info:
        amp.step(opt)
    assert "eps" not in str(info.value)


# -- consecutive_hysteresis through Amp --------------------------------------------------------------------------------
def test_consecutive_hysteresis_reaches_the_scalers_and_is_validated():
    amp = Amp("O1", num_losses=2, hysteresis=2, consecutive_hysteresis=True, half_dtype="float16")
    assert all(s.consecutive_hysteresis and s.hysteresis == 2 for s in amp.scalers)
    with pytest.raises(TypeError, match=r"consecutive_hysteresis='yes' must be True or False"):
        Amp("O1", consecutive_hysteresis="yes", half_dtype="bfloat16")


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_a_step_that_raises_leaves_the_gradients_as_an_unscale_does(half):
    # The step unscales for itself and notes the half gradients it read only if it does not finish: an optimizer
    # that raises inside it (a step pre-hook here), then another backward and a step, must add the first batch's
    # gradients (unscaled into the masters, scaled back up) to the second's, as after unscale_().
    amp, model, opt, ref, ref_opt = _pair("O2", half=half)
    _backward(amp, model, seed=1)
    _ref_backward(ref, seed=1)

    def refuse(*args):
        raise RuntimeError("refused by a hook")

    handle = opt.register_step_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="refused by a hook"):
        amp.step(opt)
    handle.remove()
    _backward(amp, model, seed=2)
    _ref_backward(ref, seed=2)
    assert amp.step(opt)
    ref_opt.step()
    _assert_close_to_reference(amp, opt, ref_opt)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_o2_with_fp32_batch_norm_steps_skips_and_recovers_as_fp32(device):
    """O2 with batch norm kept FP32 (its parameters their own masters, beside half layers with masters of their own),
    on the CPU (foreach) and on CUDA (the fused kernels; gpu_suite.py's tests part runs it): steps as the FP32 twin,
    an overflow skips without changing anything, and a step an optimizer hook refuses leaves the gradients so that
    the next batch adds to them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).to(device)
    ref = copy.deepcopy(model)
    amp = Amp("O2", half_dtype="float16")
    model = amp.prepare_model(model)
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.float16
    with torch.no_grad():  # the twin starts from the half-rounded weights
        for p, q in zip(ref.parameters(), model.parameters()):
            p.copy_(q.float())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)

    def backward(seed: int) -> None:
        x, y = (t.to(device) for t in _batch(seed))
        with amp.forward_context():
            out = amp.cast_outputs(model(amp.cast_inputs(x)))
        amp.backward(F.mse_loss(out.float(), y))  # out.float(): see _backward
        F.mse_loss(ref(x), y).backward()

    def close() -> None:
        for got, want in zip(amp.master_params(opt), ref.parameters()):
            torch.testing.assert_close(got.float(), want, **TOLERANCE[torch.float16])

    for seed in range(3):
        backward(seed)
        assert amp.step(opt)
        ref_opt.step()
        amp.update()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        close()
    backward(3)
    model[0].weight.grad[0, 0] = float("inf")
    before = [t.detach().clone() for t in [*amp.master_params(opt), *model.parameters()]]
    assert not amp.step(opt)
    assert all(torch.equal(a, b) for a, b in zip([*amp.master_params(opt), *model.parameters()], before))
    amp.update()
    opt.zero_grad(set_to_none=True)
    ref_opt.zero_grad(set_to_none=True)
    backward(4)
    handle = opt.register_step_pre_hook(lambda *args: (_ for _ in ()).throw(RuntimeError("refused")))
    with pytest.raises(RuntimeError, match="refused"):
        amp.step(opt)
    handle.remove()
    backward(5)
    assert amp.step(opt)
    ref_opt.step()
    close()


# -- the flags the step reads on the host update the scalers as the device count would -------------------------------
@settings(max_examples=60, deadline=None)
@given(
    iterations=st.lists(
        st.lists(st.tuples(st.integers(0, 1), st.booleans(), st.booleans()), max_size=4), max_size=12
    ),
    dynamic=st.booleans(),
)
def test_flags_read_on_the_host_update_the_scalers_as_the_device_count(iterations, dynamic):
    """Several flags per loss in one iteration (two optimizers, a clip then a step, an unscale without a step),
    some read on the host and some not: the scalers told what the reads said end where the ones that count every
    flag on the device end (scale, trackers, overflow count)."""
    from lightning_mpx.engine.optimizers import StepMachine
    from lightning_mpx.health.telemetry import GradTelemetry
    from lightning_mpx.scaling.scaler import LossScaler

    def machine():
        scalers = [LossScaler("dynamic" if dynamic else 4.0, init_scale=2.0**4, growth_interval=2) for _ in range(2)]
        return StepMachine(scalers, None, backend="foreach", telemetry=GradTelemetry(torch.float16), names={})

    told, counted = machine(), machine()
    for records in iterations:
        for loss_id, overflow, read in records:
            flag = torch.tensor(1.0 if overflow else 0.0)
            told.record_found({loss_id: flag}, read={loss_id: overflow} if read else None)
            counted.record_found({loss_id: flag})
        told.update()
        counted.update()
        for a, b in zip(told.scalers, counted.scalers):
            assert a.state_dict() == b.state_dict()


# -- model-based: random sequences of what users do, against an FP32 reference -----------------------------------------
class AmpAgainstFP32(RuleBasedStateMachine):
    """Two models (``first`` and ``second``), an optimizer each, two losses: loss 0 reaches ``first`` only, loss 1
    both. Every rule does to the Amp run and to a plain FP32 twin the same logical thing (the twin clips the true
    gradients; a skipped step leaves it as it was). After each step the trained parameters match the twin within
    half-precision tolerance, or, on a skipped step, are bit-identical to before.

    What the design refuses (``unscale_`` twice in one iteration) must raise ``RuntimeError`` and change nothing.
    A check of an optimizer's gradients decides its next step whatever comes between: the one ``unscale_`` (or a clip)
    makes, and the one a backward makes of gradients still pending from another loss, from before an ``update()``
    or left unscaled (they are brought to the new scale, and what they hold is charged to the loss they came from):
    zeroing the gradients after it does not undo a non-finite value it found. The model keeps Amp's record of these
    checks as a user could follow it: which losses were checked since the step (``checked``), whether one found a
    non-finite value (``charged``), which loss each optimizer's pending gradients carry (``loss_of``), and whether an
    ``update()`` since changed their scale (``rescaled``).
    Out of scope, as with ``torch.amp.GradScaler``: a backward or a second step after a step without zeroing that
    optimizer's gradients first (the backward rule zeroes them, as a training loop does).
    """

    NAMES = ("first", "second")

    @initialize(
        level=st.sampled_from(["O1", "O2"]),
        half=st.sampled_from(["float16", "bfloat16"]),
        dynamic=st.booleans(),
        hysteresis=st.integers(1, 2),
        backend=st.sampled_from(["auto", "reference"]),
        seed=st.integers(0, 3),
    )
    def setup(self, level, half, dynamic, hysteresis, backend, seed):
        torch.manual_seed(seed)
        self.settings = dict(
            half_dtype=half,
            unscale_backend=backend,
            num_losses=2,
            init_scale=2.0**8,
            growth_interval=2,
            max_loss_scale=2.0**10,  # no real overflow in these small models: only the injected ones
            hysteresis=hysteresis,
            on_floor="continue",
        )
        if dynamic:
            self.settings["loss_scale"] = "dynamic"  # bfloat16's default is a static 1.0
        self.level = level
        self.amp = Amp(level, **self.settings)
        self.models = {"first": nn.Linear(4, 3), "second": nn.Linear(3, 2)}
        # Gradual unfreezing: the second model's bias is frozen when the model is prepared (no master for it at O2)
        # until the add_param_group rule trains it.
        self.unfrozen = False
        self.models["second"].bias.requires_grad_(False)
        for model in self.models.values():
            self.amp.prepare_model(model)
        self.opts = {name: self._optimizer(name, self.models[name]) for name in self.NAMES}
        for name, opt in self.opts.items():
            self.amp.prepare_optimizer(opt)
        self.ref_models = {name: copy.deepcopy(model).float() for name, model in self.models.items()}
        self.ref_opts = {name: self._optimizer(name, self.ref_models[name]) for name in self.NAMES}
        self.stage = dict.fromkeys(self.NAMES, "ready")  # what Amp's stage must be
        self.poisoned = dict.fromkeys(self.NAMES, False)  # non-finite gradients since the last zero_grad
        self._forget_checks()
        self.poisoned_by_inf = dict.fromkeys(self.NAMES, False)  # clip_grad_value_ would clamp them to finite
        self.stepped = dict.fromkeys(self.NAMES, False)  # stepped since the last zero_grad
        self.has_grad = dict.fromkeys(self.NAMES, False)

    def _forget_checks(self):
        """A fresh Amp: no optimizer has pending gradients or checks."""
        self.loss_of = dict.fromkeys(self.NAMES)  # the loss whose scale the pending gradients carry (None: none yet)
        self.rescaled = dict.fromkeys(self.NAMES, False)  # an update() since gave them a scale to leave
        self.checked = {name: set() for name in self.NAMES}  # the losses checked since the last step
        self.charged = dict.fromkeys(self.NAMES, False)  # one of those checks found a non-finite gradient
        self.iteration = set()  # the losses whose checks the next update() counts

    def _check(self, name, loss_id, clear=False):
        """One check of ``name``'s gradients, charged to ``loss_id``: it finds what they hold now."""
        if clear:
            self.checked[name], self.charged[name] = set(), False
        self.checked[name].add(loss_id)
        self.charged[name] = self.charged[name] or (self.has_grad[name] and self.poisoned[name])

    def _optimizer(self, name: str, model: nn.Module) -> torch.optim.Optimizer:
        if name == "first":
            return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        opt = torch.optim.AdamW([model.weight], lr=1e-2)
        if self.unfrozen:  # the group structure add_param_group made, for a resume
            opt.add_param_group({"params": [model.bias]})
        return opt

    def _tolerance(self):
        return TOLERANCE[self.amp.half_dtype]

    # -- rules --------------------------------------------------------------------------------------------------------
    @rule(loss_id=st.integers(0, 1), seed=st.integers(0, 50), set_to_none=st.booleans())
    def backward(self, loss_id, seed, set_to_none):
        for name in self.NAMES:
            if self.stepped[name]:  # what a loop does after a step, before the next backward
                self.zero_grad(name, set_to_none)
        for name in self.NAMES:  # before the backward, every optimizer's pending gradients take this loss's scale
            old = self.loss_of[name]
            if self.stage[name] != "ready":  # left unscaled: scaled back up and checked
                if self.stage[name] == "unscaled":
                    self.iteration |= self.checked[name]
                if self.has_grad[name]:
                    self._check(name, 0 if old is None else old, clear=True)
                else:
                    self.checked[name], self.charged[name] = set(), False
                self.stage[name] = "ready"
            elif old is not None and (old != loss_id or self.rescaled[name]) and self.has_grad[name]:
                self._check(name, old)  # another loss's, or from before an update(): rescaled and checked
            self.loss_of[name], self.rescaled[name] = loss_id, False
        g = torch.Generator().manual_seed(seed)
        x, t0, t1 = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g)
        amp, first, second = self.amp, self.models["first"], self.models["second"]
        with amp.forward_context():
            hidden = amp.cast_outputs(first(amp.cast_inputs(x)))
            if loss_id == 0:
                loss = F.mse_loss(hidden, t0)
            else:
                loss = F.mse_loss(amp.cast_outputs(second(amp.cast_inputs(torch.tanh(hidden)))), t1)
        amp.backward(loss, loss_id=loss_id)
        hidden = self.ref_models["first"](x)
        if loss_id == 0:
            F.mse_loss(hidden, t0).backward()
        else:
            F.mse_loss(self.ref_models["second"](torch.tanh(hidden)), t1).backward()
        self.stage = dict.fromkeys(self.NAMES, "ready")  # every optimizer's gradients now carry a scale
        self.has_grad["first"] = True
        if loss_id == 1:
            self.has_grad["second"] = True

    @rule(name=st.sampled_from(NAMES))
    def unscale(self, name):
        if self.stage[name] == "unscaled":
            before = [p.grad.clone() if p.grad is not None else None for p in _trained(self.opts[name], self.amp)]
            with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
                self.amp.unscale_(self.opts[name])
            for a, b in zip([p.grad for p in _trained(self.opts[name], self.amp)], before):
                assert (a is None) == (b is None)
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
            return
        self._unscaled(name)
        self.amp.unscale_(self.opts[name])

    def _unscaled(self, name):
        """The optimizer's next step decides on the overflow check made now (as GradScaler's)."""
        if self.stage[name] != "unscaled":
            self._check(name, 0 if self.loss_of[name] is None else self.loss_of[name])
            self.rescaled[name] = False
        self.stage[name] = "unscaled"

    @rule(name=st.sampled_from(NAMES), max_norm=st.sampled_from([0.05, 0.5, 50.0]))
    def clip_grad_norm(self, name, max_norm):
        self._unscaled(name)
        self.amp.clip_grad_norm_(self.opts[name], max_norm)
        torch.nn.utils.clip_grad_norm_([p for p in self.ref_models[name].parameters() if p.grad is not None], max_norm)
        self.poisoned_by_inf[name] = False  # inf * (max_norm / inf) is NaN: poisoned for good

    @precondition(lambda self: not any(self.poisoned_by_inf.values()))
    @rule(name=st.sampled_from(NAMES), clip_value=st.sampled_from([0.005, 0.05, 5.0]))
    def clip_grad_value(self, name, clip_value):
        self._unscaled(name)
        self.amp.clip_grad_value_(self.opts[name], clip_value)
        with_grad = [p for p in self.ref_models[name].parameters() if p.grad is not None]
        if with_grad:
            torch.nn.utils.clip_grad_value_(with_grad, clip_value)

    @rule(name=st.sampled_from(NAMES), value=st.sampled_from([float("inf"), float("-inf"), float("nan")]))
    def inject_nonfinite(self, name, value):
        if self.stage[name] != "ready" or not self.has_grad[name] or self.stepped[name]:
            return  # an overflow happens in a backward: while the gradients are scaled
        grad = self.models[name].weight.grad
        if grad is None:
            return
        grad[0, 0] = value
        self.poisoned[name] = True
        self.poisoned_by_inf[name] = self.poisoned_by_inf[name] or math.isinf(value)

    @precondition(lambda self: not all(self.stepped.values()))
    @rule(name=st.sampled_from(NAMES))
    def step(self, name):
        if self.stepped[name]:
            return
        opt = self.opts[name]
        before = [t.detach().clone() for t in [*_trained(opt, self.amp), *self.models[name].parameters()]]
        stepped = self.amp.step(opt)
        # The checks made since the last step decide, the step's own among them unless unscale_() made it already
        # (zeroing the gradients since does not undo a check).
        if self.stage[name] != "unscaled":
            self._check(name, 0 if self.loss_of[name] is None else self.loss_of[name])
        overflow = self.charged[name]
        self.iteration |= self.checked[name]
        self.checked[name], self.charged[name] = set(), False
        self.loss_of[name], self.rescaled[name] = None, False
        assert stepped is not overflow, f"step() returned {stepped}; expected an overflow: {overflow}"
        if stepped:
            self.ref_opts[name].step()
            for got, want in zip(_trained(opt, self.amp), _trained(self.ref_opts[name])):
                torch.testing.assert_close(got.float(), want, **self._tolerance())
        else:
            after = [*_trained(opt, self.amp), *self.models[name].parameters()]
            assert all(torch.equal(a, b) for a, b in zip(after, before)), "a skipped step changed parameters"
        self.stage[name] = "ready"
        self.stepped[name] = True

    @rule()
    def update(self):
        self.amp.update()
        for name in self.NAMES:
            if self.stage[name] == "unscaled":  # its checks count now and are forgotten; its gradients stay unscaled
                self.iteration |= self.checked[name]
                self.checked[name], self.charged[name] = set(), False
                self.stage[name] = "skipped"
        for name in self.NAMES:
            if self.stage[name] == "ready" and self.loss_of[name] in self.iteration:
                self.rescaled[name] = True  # pending gradients keep the scale they were computed with
        self.iteration = set()

    @rule(name=st.sampled_from(NAMES), set_to_none=st.booleans())
    def zero_grad(self, name, set_to_none):
        self.opts[name].zero_grad(set_to_none=set_to_none)
        self.models[name].zero_grad(set_to_none=set_to_none)  # at O2 the half model holds its own gradients
        self.ref_opts[name].zero_grad(set_to_none=set_to_none)
        self.poisoned[name] = self.poisoned_by_inf[name] = self.stepped[name] = False
        if set_to_none:
            self.has_grad[name] = False

    @precondition(lambda self: not self.unfrozen)
    @rule()
    def unfreeze_and_add_param_group(self):
        # BackboneFinetuning's move, at any point of the iteration: the frozen half bias joins the optimizer as a
        # new group (at O2 it gets its FP32 master then), in the Amp run and in the FP32 twin alike.
        pairs = ((self.models["second"], self.opts["second"]), (self.ref_models["second"], self.ref_opts["second"]))
        for model, opt in pairs:
            model.bias.requires_grad_(True)
            opt.add_param_group({"params": [model.bias]})
        self.unfrozen = True

    @rule(name=st.sampled_from(NAMES), value=st.sampled_from([0.125, -0.25, 0.0625]), through_data=st.booleans())
    def write_the_model(self, name, value, through_data):
        # Loading weights, an EMA or SWA callback, a user's clamp: a write to the model outside the step, at any
        # point of the iteration. The values are exact in half and of the weights' own size (larger ones grow the
        # half-precision error past the tolerances), so the twin gets the same ones; at O2 the masters must take
        # them before the next step instead of overwriting them.
        # ``through_data``: WGAN's ``p.data.fill_`` style, which leaves no trace on ``p``'s own version counter.
        with torch.no_grad():
            for param, ref in zip(self.models[name].parameters(), self.ref_models[name].parameters()):
                (param.data if through_data else param).fill_(value)
                ref.fill_(value)

    @rule(name=st.sampled_from(NAMES), max_norm=st.sampled_from([0.05, 50.0]), set_to_none=st.booleans())
    def skip_a_bad_batch(self, name, max_norm, set_to_none):
        # What a loop that checks the norm and skips the batch does: clip, no step, zero the gradients.
        self.clip_grad_norm(name, max_norm)
        self.zero_grad(name, set_to_none)

    @rule(fresh=st.booleans())
    def checkpoint(self, fresh):
        if not fresh:  # a round trip through the same objects, at any point: changes nothing
            self.amp.load_state_dict(copy.deepcopy(self.amp.state_dict()))
            return
        # A resume at an iteration boundary: a fresh Amp, models and optimizers restored from the saved states.
        self.amp.update()
        for name in self.NAMES:
            self.zero_grad(name, set_to_none=True)
        saved = copy.deepcopy(
            {
                "amp": self.amp.state_dict(),
                "models": {name: m.state_dict() for name, m in self.models.items()},
                "opts": {name: o.state_dict() for name, o in self.opts.items()},
            }
        )
        self.amp = Amp(self.level, **self.settings)
        self.models = {"first": nn.Linear(4, 3), "second": nn.Linear(3, 2)}
        self.models["second"].bias.requires_grad_(self.unfrozen)
        for name, model in self.models.items():
            self.amp.prepare_model(model)
            model.load_state_dict(saved["models"][name])
        self.opts = {name: self._optimizer(name, self.models[name]) for name in self.NAMES}
        for name, opt in self.opts.items():
            self.amp.prepare_optimizer(opt)
            opt.load_state_dict(saved["opts"][name])
        self.amp.load_state_dict(saved["amp"])
        self.stage = dict.fromkeys(self.NAMES, "ready")
        self._forget_checks()
        for name in self.NAMES:
            for got, want in zip(_trained(self.opts[name], self.amp), _trained(self.ref_opts[name])):
                torch.testing.assert_close(got.float(), want, **self._tolerance())

    @invariant()
    def stages_agree(self):
        if not hasattr(self, "amp"):
            return
        for name in self.NAMES:
            assert self.amp.is_unscaled(self.opts[name]) == (self.stage[name] == "unscaled"), name


AmpAgainstFP32.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_amp_against_fp32 = AmpAgainstFP32.TestCase


def test_found_inf_reports_the_flag_per_loss():
    amp = Amp("O1", num_losses=2, init_scale=256.0, half_dtype="float16")
    model = amp.prepare_model(nn.Linear(4, 2))
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert amp.found_inf(opt) is None
    amp.backward(model(torch.randn(3, 4)).float().sum(), loss_id=0)
    amp.backward(model(torch.randn(3, 4)).float().sum() * float("inf"), loss_id=1)
    amp.unscale_(opt)
    assert amp.found_inf(opt).item() > 0 and amp.found_inf(opt, 1).item() > 0
    assert amp.found_inf(opt, 0).item() == 0  # loss 0's gradients were checked (finite) before loss 1's backward
    with pytest.raises(ValueError, match=r"loss_id=2 is out of range"):
        amp.found_inf(opt, 2)
