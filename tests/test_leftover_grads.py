"""Gradients a step leaves behind keep FP32's semantics (issue 48).

A loop that does not zero its gradients (on purpose, or by habit) adds the next backward to what the last step used,
and a second ``step()`` without a backward applies the same gradients again. FP32 does both; so must every opt level
and front door: the step leaves true values (unscaled in place) or scaled ones (O2's half model), and the next
backward or step must take them for what they are. Each test compares with the FP32 loop of the same actions (bf16
on CPU, so within bf16's error, far below the 1/scale shrink of the bug); the Apex layer with NVIDIA Apex's O1, which
stashed the gradients before a backward and added them back unscaled (FP32's result).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mpx import Amp, MixedPrecisionPlugin
from tests.lightning_helpers import make_trainer

LR = 0.05
ATOL = 3e-3  # bf16's error over a few steps; the bug moves the weights by ~LR * |grad| (0.02 and more)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    # BatchNorm: kept FP32 at O2, so its gradients are unscaled in place while the half ones keep their scale.
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)


class Loop:
    """One model trained by a sequence of actions: plain FP32 (``level=None``), the core ``Amp`` at ``level``, or
    (``bf16_ref``) a plain torch loop of the whole model in bfloat16 (O3's reference)."""

    def __init__(self, level: str | None, *, optimizers: int = 1, bf16_ref: bool = False, **amp_settings: Any):
        net = make_net()
        if bf16_ref:
            net = net.to(torch.bfloat16)
        groups = [list(net[0].parameters()), list(net[1].parameters()) + list(net[3].parameters())]
        if optimizers == 1:
            groups = [groups[0] + groups[1]]
        opts = [torch.optim.SGD(g, lr=LR) for g in groups]
        self.amp: Amp | None = None
        self.bf16 = bf16_ref
        if level is not None:
            amp_settings.setdefault("loss_scale", "dynamic")
            self.amp = Amp(level, half_dtype="bfloat16", **amp_settings)
            net = self.amp.prepare_model(net)
            opts = [self.amp.prepare_optimizer(o) for o in opts]
        self.net, self.opts = net, opts

    def backward(self, i: int = 0, *, bad: bool = False) -> None:
        x, y = batch(i)
        amp = self.amp
        if amp is None:
            out = self.net(x.to(torch.bfloat16) if self.bf16 else x).float()
            F.mse_loss(out, y).backward()
            return
        with amp.forward_context():
            out = amp.cast_outputs(self.net(amp.cast_inputs(x))).float()
        loss = F.mse_loss(out, y)
        amp.backward(loss * 1e38 if bad else loss)

    def step(self, which: int | None = None) -> None:
        for k, opt in enumerate(self.opts):
            if which is None or k == which:
                self.amp.step(opt) if self.amp is not None else opt.step()

    def update(self) -> None:
        if self.amp is not None:
            self.amp.update()

    def zero(self, set_to_none: bool = True) -> None:
        for opt in self.opts:
            opt.zero_grad(set_to_none=set_to_none)

    def clip(self, max_norm: float = 1.0) -> None:
        for opt in self.opts:
            if self.amp is not None:
                self.amp.clip_grad_norm_(opt, max_norm)
            else:
                params = [p for g in opt.param_groups for p in g["params"]]
                torch.nn.utils.clip_grad_norm_(params, max_norm)

    def clip_value(self, clip_value: float = 0.25) -> None:
        for opt in self.opts:
            if self.amp is not None:
                self.amp.clip_grad_value_(opt, clip_value)
            else:
                params = [p for g in opt.param_groups for p in g["params"]]
                torch.nn.utils.clip_grad_value_(params, clip_value)

    def unscale(self) -> None:
        # FP32 has nothing to unscale; at O2 the engine shows the true values on the half model.
        for opt in self.opts:
            if self.amp is not None:
                self.amp.unscale_(opt)

    def has_grads(self) -> bool:
        return any(p.grad is not None for p in self.net.parameters())

    def weights(self) -> list[torch.Tensor]:
        if self.amp is not None and self.amp.properties.master_weights:
            return [p.detach().clone() for opt in self.opts for p in self.amp.master_params(opt)]
        return [p.detach().float().clone() for opt in self.opts for g in opt.param_groups for p in g["params"]]


def run(loop: Loop, actions: list[str]) -> Loop:
    it = 0
    for action in actions:
        if action == "bw":
            loop.backward(it)
            it += 1
        elif action == "bad":
            loop.backward(it, bad=True)
        elif action.startswith("step"):
            loop.step(int(action[4:]) if action[4:] else None)
        elif action == "update":
            loop.update()
        elif action == "zero":
            loop.zero(True)
        elif action == "zero0":
            loop.zero(False)
        elif action == "clip":
            loop.clip()
        elif action == "clipv":
            loop.clip_value()
        elif action == "unscale":
            loop.unscale()
        else:
            raise AssertionError(action)
    return loop


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], atol: float = ATOL) -> None:
    assert len(got) == len(want)
    worst = max((g - w).abs().max().item() for g, w in zip(got, want))
    assert worst <= atol, f"max |difference| from the reference {worst:.3g} > {atol}"


PATTERNS = {
    "no_zero_grad_3_iterations": ["bw", "step", "update"] * 3,
    "step_twice": ["bw", "step", "step", "update", "zero", "bw", "step", "update"],
    "step_update_step": ["bw", "step", "update", "step", "update"],
    "step_then_backward_before_update": ["bw", "step", "bw", "step", "update", "bw", "step", "update"],
    "zero_grad_set_to_none_false": ["bw", "step", "update", "zero0"] * 2 + ["bw", "step", "update"],
    "zero0_then_step_without_backward": ["bw", "step", "update", "zero0", "step", "update", "bw", "step", "update"],
    "clip_without_zero_grad": ["bw", "clip", "step", "update"] * 4,
    "clip_after_a_step": ["bw", "step", "update", "clip", "step", "update", "bw", "step", "update"],
    "clip_value_without_zero_grad": ["bw", "clipv", "step", "update"] * 4,
    "unscale_then_clip_without_zero_grad": ["bw", "unscale", "clip", "clipv", "step", "update"] * 2
    + ["bw", "step", "step", "update"],
}


@pytest.mark.parametrize("growth_interval", [2000, 1], ids=["steady_scale", "growing_scale"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_core_amp_keeps_fp32_semantics_for_left_gradients(level, pattern, growth_interval):
    want = run(Loop(None), PATTERNS[pattern]).weights()
    loop = run(Loop(level, growth_interval=growth_interval), PATTERNS[pattern])
    assert_close(loop.weights(), want)
    assert loop.amp is not None and loop.amp.skipped_steps == [0]


def test_a_growing_scale_changes_between_iterations():
    # The premise of the growing_scale rows: the scale the left gradients carry is not the next backward's.
    loop = Loop("O2", growth_interval=1)
    scales = []
    for _ in range(3):
        run(loop, ["bw", "step", "update"])
        scales.append(loop.amp.scalers[0].get_scale())
    assert scales[0] < scales[1] < scales[2]


@pytest.mark.parametrize("pattern", ["no_zero_grad_3_iterations", "step_twice", "step_update_step"])
def test_o3_keeps_the_semantics_of_a_plain_bf16_model(pattern):
    # O3 is the whole model in half with no masters: its reference is the same model in bf16 without any amp.
    want = run(Loop(None, bf16_ref=True), PATTERNS[pattern]).weights()
    loop = run(Loop("O3", loss_scale="dynamic", growth_interval=1), PATTERNS[pattern])
    assert_close(loop.weights(), want, atol=1e-2)
    assert loop.amp.scalers[0].get_scale() > 1.0  # the scale was in play


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_several_optimizers_each_keep_their_left_gradients(level):
    actions = ["bw", "step0", "step1", "update", "bw", "step0", "update", "bw", "step1", "step0", "update",
               "zero", "bw", "step1", "step1", "step0", "update"]
    want = run(Loop(None, optimizers=2), actions).weights()
    got = run(Loop(level, optimizers=2, growth_interval=1), actions).weights()
    assert_close(got, want)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_overflow_in_a_loop_without_zero_grad_costs_what_zeroing_at_it_costs(level):
    # FP32 would keep the inf in its gradients for ever; a loop that zeros at the overflow (and at no other point)
    # ends as FP32 that skips the batch and zeros there.
    amp_actions = ["bw", "step", "update", "bw", "step", "update", "bad", "step", "zero", "update"]
    amp_actions += ["bw", "step", "update", "bw", "step", "update"]
    fp32_actions = ["bw", "step", "update", "bw", "step", "update", "zero"]
    fp32_actions += ["bw", "step", "update", "bw", "step", "update"]
    want = run(Loop(None), fp32_actions).weights()
    loop = run(Loop(level, growth_interval=1), amp_actions)
    assert_close(loop.weights(), want)
    assert loop.amp.skipped_steps == [1]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_overflow_left_in_the_gradients_skips_the_steps_that_would_apply_it(level):
    # Not zeroed: FP32 would apply the inf (NaN weights); the engine skips every step that holds it, no more.
    loop = run(Loop(level), ["bw", "step", "update", "bad", "step", "update"])
    before = loop.weights()
    run(loop, ["bw", "step", "update", "bw", "step", "update"])
    assert all(torch.isfinite(w).all() for w in loop.weights())
    assert_close(loop.weights(), before, atol=0.0)
    assert loop.amp.skipped_steps == [3]
    run(loop, ["zero", "bw", "step", "update"])  # zeroed: trains again
    assert loop.amp.skipped_steps == [3]


class _Ops(TorchDispatchMode):
    """The aten ops run inside the block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_zeroed_loop_pays_no_rescale_and_a_kept_gradient_is_rescaled(level):
    # The usual loop (zero_grad each iteration, either way) finds nothing left: no gradient is written (a multiply
    # would bump its version counter), none made. One the user kept is scaled up for the next backward.
    for set_to_none in (True, False):
        loop = Loop(level)
        run(loop, ["bw", "step", "update"])
        loop.zero(set_to_none)
        before = [p.grad for p in loop.net.parameters()]
        with _Ops() as ops:
            loop.amp.scale_loss(torch.ones((), requires_grad=True))
        assert [p.grad for p in loop.net.parameters()] == before  # the same tensors (or None)
        assert not [op for op in ops.names if "foreach" in op or "clone" in op], ops.names
    loop = Loop(level, growth_interval=1)  # the update doubles the scale
    run(loop, ["bw", "step", "update"])
    kept = loop.net[3].bias.grad
    before = kept.float().clone()
    with _Ops() as ops:
        loop.amp.scale_loss(torch.ones((), requires_grad=True))
    assert [op for op in ops.names if "foreach" in op]  # what the cleared loop above would show
    # O1: true values, scaled up to the new scale; O2: the half model's, from the old scale to the new one.
    factor = loop.amp.scalers[0].get_scale() if level == "O1" else 2.0
    torch.testing.assert_close(kept.float(), before * factor)


# -- the Trainer ------------------------------------------------------------------------------------------------------
class NoZeroGrad(pl.LightningModule):
    """A LightningModule whose ``optimizer_zero_grad`` does nothing: the gradients pile up across steps (a real
    habit, and an odd form of momentum FP32 defines)."""

    def __init__(self, zero: bool = False) -> None:
        super().__init__()
        self.net = make_net()
        self.zero = zero

    def training_step(self, data, index):
        x, y = data
        return F.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if self.zero:
            optimizer.zero_grad()


def _data(n: int = 4) -> torch.utils.data.DataLoader:
    xs, ys = zip(*(batch(i) for i in range(n)))
    dataset = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    return torch.utils.data.DataLoader(dataset, batch_size=16)


def _fit(plugin: Any, accumulate: int) -> list[torch.Tensor]:
    module = NoZeroGrad()
    trainer = make_trainer(plugin, max_epochs=1, accumulate_grad_batches=accumulate)
    trainer.fit(module, _data())
    if plugin is not None and plugin.amp.properties.master_weights:
        return [p.detach().clone() for p in plugin.amp.master_params(trainer.optimizers[0])]
    return [p.detach().float().clone() for p in module.parameters()]


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_trainer_with_an_optimizer_zero_grad_that_does_nothing_trains_as_fp32(level, accumulate):
    want = _fit(None, accumulate)
    plugin = MixedPrecisionPlugin(level, half_dtype="bfloat16", loss_scale="dynamic", growth_interval=1)
    assert_close(_fit(plugin, accumulate), want)


# -- Fabric ----------------------------------------------------------------------------------------------------------
def _fabric_run(precision: Any, actions: list[str]) -> list[torch.Tensor]:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = FabricMixedPrecisionPlugin(precision, half_dtype="bfloat16", loss_scale="dynamic", growth_interval=1) \
        if precision else None
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin] if plugin else None)
    net = make_net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    it = 0
    for action in actions:
        if action == "bw":
            x, y = batch(it)
            it += 1
            fabric.backward(F.mse_loss(model(x).float(), y))
        elif action == "step":
            opt.step()
        elif action == "zero0":
            opt.zero_grad(set_to_none=False)
        elif action == "clip":
            fabric.clip_gradients(model, opt, max_norm=1.0)
    if plugin is not None and plugin.amp.properties.master_weights:
        return [p.detach().clone() for p in plugin.amp.master_params(opt.optimizer)]
    return [p.detach().float().clone() for p in net.parameters()]


FRONT_PATTERNS = {
    "no_zero_grad": ["bw", "step"] * 3,
    "step_twice": ["bw", "step", "step", "bw", "step"],
    "clip": ["bw", "clip", "step"] * 3,
    "zero0": ["bw", "step", "zero0", "bw", "step", "bw", "step"],
}


@pytest.mark.parametrize("pattern", list(FRONT_PATTERNS))
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fabric_loop_without_zero_grad_trains_as_fp32(level, pattern):
    assert_close(_fabric_run(level, FRONT_PATTERNS[pattern]), _fabric_run(None, FRONT_PATTERNS[pattern]))


# -- Accelerate -----------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("pattern", ["no_zero_grad", "clip", "step_twice"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_accelerate_loop_without_zero_grad_trains_as_fp32(level, pattern):
    pytest.importorskip("accelerate")
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(
        mixed_precision=level,
        kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16", loss_scale="dynamic", growth_interval=1)],
    )
    net = make_net()
    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    it = 0
    for action in FRONT_PATTERNS[pattern]:
        if action == "bw":
            x, y = batch(it)
            it += 1
            accelerator.backward(F.mse_loss(model(x).float(), y))
        elif action == "step":
            opt.step()
        elif action == "clip":
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
    amp = opt.amp
    got = (
        [p.detach().clone() for p in amp.master_params(opt.optimizer)]
        if amp.properties.master_weights
        else [p.detach().float().clone() for p in net.parameters()]
    )
    ref = Loop(None)
    it = 0
    for action in FRONT_PATTERNS[pattern]:
        if action == "bw":
            ref.backward(it)
            it += 1
        elif action == "step":
            ref.step()
        elif action == "clip":
            ref.clip()
    assert_close(got, ref.weights())


# -- the Apex layer ---------------------------------------------------------------------------------------------------
def apex_loop(level: str | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The test model and its SGD, through ``lightning_mpx.apex``'s ``amp.initialize`` at ``level`` (bfloat16 at O2,
    a dynamic scale), or plain FP32 (``None``)."""
    from lightning_mpx.apex import amp

    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    if level is None:
        return net, opt
    extra = {"cast_model_type": torch.bfloat16} if level == "O2" else {}
    return amp.initialize(net, opt, opt_level=level, verbosity=0, loss_scale="dynamic", **extra)


@pytest.mark.parametrize("zero_each", [True, False], ids=["zero_grad", "no_zero_grad"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_apex_layer_without_zero_grad_gives_fp32s_result_as_apex_did(level, zero_each):
    # NVIDIA Apex's O1 stashed the gradients a block found and added them back unscaled after its backward (its O2
    # kept them in the FP32 masters): a loop that never zeros trains as FP32's.
    from lightning_mpx.apex import amp
    from lightning_mpx.apex._state import _amp_state

    def train(use_amp: bool) -> list[torch.Tensor]:
        net, opt = apex_loop(level if use_amp else None)
        for i in range(3):
            if zero_each:
                opt.zero_grad()
            x, y = batch(i)
            loss = F.mse_loss(net(x).float(), y)
            if use_amp:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            else:
                loss.backward()
            opt.step()
        params = amp.master_params(opt) if use_amp else net.parameters()
        return [p.detach().float().clone() for p in params]

    try:
        want = train(False)
        assert_close(train(True), want)
    finally:
        _amp_state.reset()


# -- random sequences ------------------------------------------------------------------------------------------------
class LeftGradients(RuleBasedStateMachine):
    """Random sequences of backward, step, update, zero_grad (either way) and clip, on FP32 and on the engine."""

    @initialize(level=st.sampled_from(["O1", "O2"]), growth=st.sampled_from([1, 2000]))
    def start(self, level: str, growth: int) -> None:
        self.fp32 = Loop(None)
        self.mixed = Loop(level, growth_interval=growth)
        self.batch = 0

    @rule()
    def backward(self) -> None:
        self.fp32.backward(self.batch)
        self.mixed.backward(self.batch)
        self.batch += 1

    @rule()
    def step(self) -> None:
        self.fp32.step()
        self.mixed.step()

    @rule()
    def update(self) -> None:
        self.mixed.update()

    @rule(set_to_none=st.booleans())
    def zero_grad(self, set_to_none: bool) -> None:
        self.fp32.zero(set_to_none)
        self.mixed.zero(set_to_none)

    @precondition(lambda self: self.fp32.has_grads())
    @rule()
    def clip(self) -> None:
        self.fp32.clip()
        self.mixed.clip()

    @invariant()
    def same_weights(self) -> None:
        assert_close(self.mixed.weights(), self.fp32.weights(), atol=5e-3)


LeftGradients.TestCase.settings = settings(
    max_examples=12, stateful_step_count=10, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_random_sequences_match_fp32 = LeftGradients.TestCase


def _body_and_head(level: str) -> tuple[Amp, nn.Sequential, torch.optim.SGD, torch.optim.SGD]:
    """A two-layer model whose body and head have optimizers of their own (a GAN-style loop), dynamic scale 256."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    amp = Amp(level, half_dtype="bfloat16", loss_scale="dynamic", init_scale=256.0)
    model = amp.prepare_model(model)
    body = amp.prepare_optimizer(torch.optim.SGD(model[0].parameters(), lr=LR))
    head = amp.prepare_optimizer(torch.optim.SGD(model[2].parameters(), lr=LR))
    return amp, model, body, head


# -- found by tests/test_checkpoint_roundtrip_stateful.py (stop 71) --------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_overflow_in_cleared_leftovers_does_not_skip_the_next_step(level):
    """Before: the overflow in the body's leftovers was charged when the next backward rescaled them and outlived
    ``zero_grad(set_to_none=True)``: the next step, on finite gradients only, was skipped and the scale halved (256 ->
    128) where ``torch.amp.GradScaler`` steps (engine/rescale.py rescale_pending)."""
    amp, model, body, head = _body_and_head(level)

    def backward(i: int, poison: bool = False) -> None:
        x, y = batch(i)
        with amp.forward_context():
            loss = F.mse_loss(model(amp.cast_inputs(x)).float(), y)
        amp.backward(loss)
        if poison:
            model[0].weight.grad[0, 0] = float("inf")  # the body's gradients overflow

    backward(0, poison=True)
    assert amp.step(head)  # a GAN-style iteration: only the head steps (its gradients are finite)
    amp.update()
    backward(1)  # the next iteration's backward, before the loop's zero_grad
    for optimizer in (body, head):
        optimizer.zero_grad(set_to_none=True)  # the user drops every gradient: the inf is gone
    backward(2)
    before = amp.master_of(model[0].weight).detach().clone()
    stepped = amp.step(body)
    amp.update()
    assert all(torch.isfinite(p.grad).all() for p in model[0].parameters())
    assert stepped, "a step on finite gradients was skipped"
    assert not torch.equal(amp.master_of(model[0].weight), before)
    assert amp.scalers[0].get_scale() == 256.0


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_overflow_in_kept_leftovers_still_skips_the_step(level):
    """The same without the ``zero_grad``: the inf is still in the gradients the step uses, so it skips and the scale
    halves (as ``torch.amp.GradScaler``'s check of the same gradients would)."""
    amp, model, body, head = _body_and_head(level)
    for i in range(2):
        x, y = batch(i)
        with amp.forward_context():
            loss = F.mse_loss(model(amp.cast_inputs(x)).float(), y)
        amp.backward(loss)
        if i == 0:
            model[0].weight.grad[0, 0] = float("inf")
            assert amp.step(head)
            amp.update()
    before = amp.master_of(model[0].weight).detach().clone()
    assert not amp.step(body)
    amp.update()
    assert torch.equal(amp.master_of(model[0].weight), before)
    assert amp.scalers[0].get_scale() == 128.0


# -- an overflow a later backward's rescale found, then dropped by zero_grad (stop 73) -----------------------------
def _overflow_then_clear(level: str | None, how: str, clear: bool | None) -> tuple[bool, list[float], torch.Tensor]:
    """The body's gradients overflow (loss 0) and it does not step (only the head does, then the update); a backward
    of loss ``1`` (``how``: "pending" or "unscaled, other loss") or loss 0 ("unscaled") follows, before the loop's
    ``zero_grad`` (``clear``: ``set_to_none``; ``None``: kept), another backward, and both steps. ``level=None``: FP32
    with one ``torch.amp.GradScaler`` per loss (its ``unscale_`` for the "unscaled" ones). Returns whether the body
    stepped, the two scales and the body's weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    body_params, head_params = model[0].parameters(), model[2].parameters()
    if level is None:
        scalers = [torch.amp.GradScaler("cpu", init_scale=256.0) for _ in range(2)]
        body, head = torch.optim.SGD(body_params, lr=LR), torch.optim.SGD(head_params, lr=LR)
    else:
        amp = Amp(level, half_dtype="bfloat16", loss_scale="dynamic", init_scale=256.0, num_losses=2)
        model = amp.prepare_model(model)
        body = amp.prepare_optimizer(torch.optim.SGD(model[0].parameters(), lr=LR))
        head = amp.prepare_optimizer(torch.optim.SGD(model[2].parameters(), lr=LR))
    second = 0 if how == "unscaled" else 1

    def backward(i: int, loss_id: int) -> None:
        x, y = batch(i)
        if level is None:
            scalers[loss_id].scale(F.mse_loss(model(x), y)).backward()
            return
        with amp.forward_context():
            loss = F.mse_loss(model(amp.cast_inputs(x)).float(), y)
        amp.backward(loss, loss_id=loss_id)

    backward(0, 0)
    model[0].weight.grad[0, 0] = float("inf")  # the body's gradients overflow
    if how != "pending":  # the loop looks at them (unscale_) and does not step the body
        scalers[0].unscale_(body) if level is None else amp.unscale_(body)
    if level is None:
        scalers[0].step(head)
        scalers[0].update()
    else:
        assert amp.step(head)
        amp.update()
    backward(1, second)  # another backward before the loop's zero_grad
    if clear is not None:
        for optimizer in (body, head):
            optimizer.zero_grad(set_to_none=clear)
    backward(2, second)
    before = model[0].weight.detach().float().clone()
    if level is None:
        scalers[second].step(body)
        scalers[second].step(head)
        scalers[second].update()
        return not torch.equal(model[0].weight, before), [s.get_scale() for s in scalers], model[0].weight.detach()
    stepped = amp.step(body)
    amp.step(head)
    amp.update()
    return stepped, [s.get_scale() for s in amp.scalers], model[0].weight.detach().float()


@pytest.mark.parametrize("clear", [True, False])
@pytest.mark.parametrize("how", ["pending", "unscaled", "unscaled, other loss"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_overflow_a_later_backward_carried_is_dropped_with_the_gradients(level, how, clear):
    """The body's overflow was found again where the next backward brought its gradients to its scale (another loss's,
    or the same one's after ``unscale_``) and charged there: it outlived the ``zero_grad`` that dropped it, so the next
    step, on finite gradients, was skipped and loss 0's scale halved (256 -> 128, or 128 -> 64) where one
    ``torch.amp.GradScaler`` per loss steps (engine/rescale.py rescale_pending, rescale_unscaled)."""
    ours = _overflow_then_clear(level, how, clear)
    ref = _overflow_then_clear(None, how, clear)
    assert ref[0], "GradScaler steps the body"
    assert ours[0], f"a step on finite gradients was skipped (scales {ours[1]}, GradScaler's {ref[1]})"
    assert ours[1] == ref[1]
    torch.testing.assert_close(ours[2], ref[2], atol=ATOL, rtol=0)


@pytest.mark.parametrize("how", ["pending", "unscaled", "unscaled, other loss"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_overflow_a_later_backward_carried_and_kept_still_skips(level, how):
    """The same with the gradients kept: the inf is in what the step uses, so it skips, as ``GradScaler``'s check of
    the same gradients does, with as many back-offs (ours are the loss's whose backward made the inf, GradScaler's
    the one's whose scaler steps: across two losses the same halvings, charged to the other scale)."""
    ours = _overflow_then_clear(level, how, None)
    ref = _overflow_then_clear(None, how, None)
    assert not ref[0] and not ours[0]
    assert ours[1][0] * ours[1][1] == ref[1][0] * ref[1][1]
    torch.testing.assert_close(ours[2], ref[2], atol=ATOL, rtol=0)
