"""review68b: stop 68's Apex-layer and report fixes attacked from the user's side, against ``torch.amp.GradScaler``
(one ``update()`` an iteration) and FP32."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx.apex import _amp_state, amp
from tests.test_apex_delayed_chain_fixes import _batches, _Net  # a trunk and a head, each with its own optimizer


@pytest.fixture(autouse=True)
def _reset():
    _amp_state.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    _amp_state.reset()


# -- 1. an optimizer not named in a block that overflowed --------------------------------------------------------------
def _set_up(apex: bool) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer, torch.amp.GradScaler]:
    """The net, the trunk's and the head's SGD, and a GradScaler at 2**16; ``apex``: through ``amp.initialize`` at
    O1 with a dynamic scale (the GradScaler then unused)."""
    torch.manual_seed(0)
    model = _Net()
    trunk = torch.optim.SGD(model.trunk.parameters(), lr=0.1)
    head = torch.optim.SGD(model.head.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    if apex:
        model, (trunk, head) = amp.initialize(model, [trunk, head], opt_level="O1", loss_scale="dynamic", verbosity=0)
    return model, trunk, head, scaler


def _head_every_other(apex: bool) -> list[float]:
    """O1: the head's optimizer never named, stepped on odd iterations, ``model.zero_grad()`` each iteration; an inf
    loss at iteration 2 (the head not stepped then), an inf in the head's gradients alone at iteration 3. The scale
    after each iteration (``GradScaler``'s with ``apex=False``)."""
    model, trunk, head, scaler = _set_up(apex)
    scales = []
    for i, (x, y) in enumerate(_batches(6)):
        model.zero_grad()
        loss = F.cross_entropy(model(x), y) * (math.inf if i == 2 else 1.0)
        if i == 3:
            loss = loss + model.head.weight.sum() * 3e38  # times the scale: inf in the head's gradients only
        if apex:
            with amp.scale_loss(loss, trunk) as scaled:
                scaled.backward()
            trunk.step()
            if i % 2:
                head.step()
            scales.append(_amp_state.loss_scalers[0].loss_scale())
        else:
            scaler.scale(loss).backward()
            scaler.step(trunk)
            if i % 2:
                scaler.step(head)
            scaler.update()
            scales.append(scaler.get_scale())
    return scales


def test_apex_unnamed_optimizer_charged_while_not_stepping_counts_its_own_later_overflow() -> None:
    """Was [.., 32768, 32768, 32768]: the charge of iteration 2's overflow stayed on the head's optimizer (not stepped
    then) and swallowed its own overflow of iteration 3 (skipped, no back-off). Now backed off (at the next iteration's
    update, as any overflow of an optimizer no block names), ending at ``GradScaler``'s scale."""
    got, want = _head_every_other(apex=True), _head_every_other(apex=False)
    assert want == [65536.0, 65536.0, 32768.0, 16384.0, 16384.0, 16384.0]
    assert got == [65536.0, 65536.0, 32768.0, 32768.0, 16384.0, 16384.0]


def _two_blocks(apex: bool, delay: bool) -> list[float]:
    """O1: two blocks of loss 0 naming the trunk's optimizer per step (the head's never named), an inf in the first
    block at iteration 2; both optimizers stepped."""
    model, trunk, head, scaler = _set_up(apex)
    scales = []
    for i, (x, y) in enumerate(_batches(4)):
        trunk.zero_grad()
        head.zero_grad()
        for k in range(2):
            loss = F.cross_entropy(model(x), y) * (math.inf if (i, k) == (2, 0) else 1.0)
            if apex:
                with amp.scale_loss(loss, trunk, delay_unscale=delay and k == 0) as scaled:
                    scaled.backward()
            else:
                scaler.scale(loss).backward()
        if apex:
            trunk.step()
            head.step()
            scales.append(_amp_state.loss_scalers[0].loss_scale())
        else:
            scaler.step(trunk)
            scaler.step(head)
            scaler.update()
            scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("delay", [False, True], ids=["plain", "delayed"])
def test_apex_unnamed_optimizer_charged_through_two_blocks_of_one_loss_backs_off_once(delay: bool) -> None:
    """The charge holds while a later block of the loss adds to the unnamed optimizer's gradients (the same tensors):
    one back-off, as ``GradScaler``'s."""
    assert _two_blocks(apex=True, delay=delay) == _two_blocks(apex=False, delay=delay)


def _two_losses(named_second: str) -> list[tuple[float, float]]:
    """O1, ``num_losses=2``: loss 0's block names the trunk's optimizer, loss 1's the trunk's or the head's; the head's
    optimizer stepped after the trunk's. Loss 0 is inf at iteration 2: the scales of both losses after each step."""
    torch.manual_seed(0)
    model = _Net()
    trunk = torch.optim.SGD(model.trunk.parameters(), lr=0.1)
    head = torch.optim.SGD(model.head.parameters(), lr=0.1)
    model, (trunk, head) = amp.initialize(model, [trunk, head], opt_level="O1", loss_scale="dynamic", verbosity=0,
                                          num_losses=2)  # fmt: skip
    scales = []
    for i, (x, y) in enumerate(_batches(4)):
        trunk.zero_grad()
        head.zero_grad()
        for loss_id in (0, 1):
            loss = F.cross_entropy(model(x), y) * (math.inf if (i, loss_id) == (2, 0) else 1.0)
            named = trunk if loss_id == 0 or named_second == "trunk" else head
            with amp.scale_loss(loss, named, loss_id=loss_id) as scaled:
                scaled.backward()
        trunk.step()
        head.step()
        scales.append((_amp_state.loss_scalers[0].loss_scale(), _amp_state.loss_scalers[1].loss_scale()))
    return scales


@pytest.mark.parametrize("named_second", ["trunk", "head"])
def test_apex_two_losses_one_overflow_backs_off_that_loss_once(named_second: str) -> None:
    """Was: naming the trunk's optimizer, loss 0 backed off a second time at the next iteration (the head's step, after
    the update, counted the inf again); naming the head's, loss 1 backed off for loss 0's inf (its block's check took
    every loss's flag). Each loss's own overflow counts once, as one ``GradScaler`` per loss."""
    want = [(65536.0, 65536.0), (65536.0, 65536.0), (32768.0, 65536.0), (32768.0, 65536.0)]
    assert _two_losses(named_second) == want


# -- 2. and 3. delay_unscale chains ------------------------------------------------------------------------------------
class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _chain(opt_level: str | None, delays: list[bool], *, between=None, inf_block: int | None = None,
           dead: int | None = None, iterations: int = 1) -> list[torch.Tensor]:  # fmt: skip
    """Blocks of one step (``delays``: their ``delay_unscale``), ``between(model)`` after block 1; block ``inf_block``
    of the first iteration inf (FP32, ``opt_level=None``: that iteration left out), block ``dead``'s loss through a
    dead ReLU (every gradient a positive zero). The FP32 weights at the end."""
    torch.manual_seed(0)
    model = _Small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if opt_level:
        model, opt = amp.initialize(model, opt, opt_level=opt_level, loss_scale="dynamic", max_loss_scale=1024.0,
                                    verbosity=0)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    for it in range(iterations):
        for i, delay in enumerate(delays):
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            out = model(x.to(next(model.parameters()).dtype)).float()
            loss = torch.relu(out - 1e3).sum() if i == dead else F.mse_loss(out, y)
            if it == 0 and i == inf_block:
                loss = loss * math.inf
            if opt_level:
                with amp.scale_loss(loss, opt, delay_unscale=delay) as scaled:
                    scaled.backward()
            elif not (it == 0 and inf_block is not None):
                loss.backward()
            if i == 1 and between is not None:
                between(model)
        if opt_level or not (it == 0 and inf_block is not None):
            opt.step()
        opt.zero_grad()
    return [p.detach().float().clone() for p in (amp.master_params(opt) if opt_level else model.parameters())]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.allclose(g, w, atol=1e-3) for g, w in zip(got, want))


def _halve(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad.mul_(0.5)


def test_apex_o1_chain_plain_delayed_delayed_plain_with_a_halving_steps_as_fp32() -> None:
    """A halving of the gradients after the first delayed block reaches the earlier block's (unscaled, added back at
    its end) and scales the second delayed block's backward correctly (it adds to true values)."""
    delays = [False, True, True, False]
    assert _close(_chain("O1", delays, between=_halve), _chain(None, delays, between=_halve))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_apex_overflow_in_a_delayed_block_after_a_plain_one_skips_and_the_next_iteration_is_clean(opt_level) -> None:
    """Block 1 of ``[plain, delayed, delayed]`` inf: the step skipped, what was kept aside dropped with it, the next
    iteration as FP32's that never saw the first."""
    delays = [False, True, True]
    got = _chain(opt_level, delays, inf_block=1, iterations=2)
    assert _amp_state.loss_scalers[0].loss_scale() == 512.0
    assert _close(got, _chain(None, delays, inf_block=1, iterations=2))


def test_apex_o2_delayed_block_whose_gradients_are_all_positive_zeros_keeps_what_was_kept_aside() -> None:
    """A delayed block through a dead ReLU (every gradient +0.0, as a clear through ``.data`` leaves them) after a
    plain block: no clear, the plain block's gradients stepped, as FP32's."""
    delays = [False, True]
    assert _close(_chain("O2", delays, dead=1), _chain(None, delays, dead=1))


# -- 4. reports --------------------------------------------------------------------------------------------------------
def _underflow_groups(compiled: bool) -> list[str]:
    from lightning_mpx import Amp

    engine = Amp(opt_level="O1", half_dtype="bfloat16")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = engine.prepare_model(torch.compile(model, backend="eager") if compiled else model)
    opt = engine.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.request_telemetry()
    engine.backward(model(torch.randn(3, 4)).float().square().mean())
    engine.step(opt)
    return sorted(key for key in engine.metrics() if key.startswith("mpx/underflow/"))


def test_a_compiled_models_underflow_tags_are_those_of_its_uncompiled_resume() -> None:
    """Was ``mpx/underflow/_orig_mod.0``: a run compiled and its resume without ``torch.compile`` logged two sets of
    tags (two curves per module in TensorBoard, the doctor's groups split)."""
    assert (
        _underflow_groups(compiled=True)
        == _underflow_groups(compiled=False)
        == [
            "mpx/underflow/0",
            "mpx/underflow/2",
        ]
    )


def test_module_groups_keep_an_fsdp1_flat_parameter_whole_and_drop_wrapper_segments() -> None:
    from lightning_mpx.telemetry import module_groups

    flat = "[flat: 0.weight, 0.bias, 2.weight, +1 more]"  # engine.sharding.parameter_names' root flat parameter
    assert module_groups([flat]) == [flat]  # was "[flat: 0.weight, 0.bias, 2"
    names = ["_orig_mod.model.trunk.0.weight", "_orig_mod.model._checkpoint_wrapped_module.head.weight"]
    assert module_groups(names) == ["model.trunk", "model.head"]
    assert module_groups(["net.inner.weight"]) == ["net.inner"]  # a lone chain down to one parameter tensor
    assert module_groups(["0.0.weight", "0.0.bias", "0.2.weight"]) == ["0.0", "0.0", "0.2"]  # Sequential in Sequential


def test_doctor_does_not_call_a_run_with_a_nan_loss_throughout_healthy() -> None:
    from lightning_mpx import doctor

    steps = range(50)
    series = {"mpx/loss_scale": [(s, 1.0) for s in steps], "mpx/overflows": [(s, 0.0) for s in steps],
              "mpx/skipped_steps": [(s, 0.0) for s in steps], "loss": [(s, math.nan) for s in steps]}  # fmt: skip
    diagnosis = doctor.diagnose_scalars(series)
    assert diagnosis.exit_status != 0
    (finding,) = [f for f in diagnosis.findings if f.problem]
    assert finding.kind == "non_finite_loss" and finding.since_step == 0, finding
    # the loss NaN from step 30 on (20 steps): the same problem, since 30
    series["loss"] = [(s, 0.5 if s < 30 else math.inf) for s in steps]
    (finding,) = [f for f in doctor.diagnose_scalars(series).findings if f.problem]
    assert finding.since_step == 30 and "inf" in finding.evidence[0], finding
    # two non-finite points at the very end of a finite run: too few to call it broken (healthy, exit 0)
    series["loss"] = [(s, 0.5 if s < 48 else math.nan) for s in steps]
    assert doctor.diagnose_scalars(series).exit_status == 0
