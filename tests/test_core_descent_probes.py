"""Helper xfails67: stop 66's strict xfails turned into passes, and what those fixes also cover.

1. ``engine/raw_steps.py``'s ``stepped_along`` (an O2 write between accumulated backwards that moved the half weights
   against their gradients nearly everywhere: a raw torch optimizer's step) refused two correct habits. Now such a
   write is judged at the step (``engine/kept_writes.py``): refused where it still stands, let through where it was
   undone (a descent probe: extragradient, a first-order MAML inner step); and a write that is one factor times the
   weights (a weight decay by hand, where an L2 penalty makes the gradients the weights' own) is no raw step.

Tiny models on CPU, bfloat16.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from tests.test_core_raw_step_accumulation import REFUSAL, _batch


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _core(between: Callable[[nn.Module, Amp], None], *, penalty: float = 0.0, steps: int = 2) -> dict[str, Any]:
    """The core Amp at O2 bfloat16 (or FP32 with ``Amp`` left out: ``between(model, None)``), two accumulated
    micro-batches a step, ``between`` after the first backward; the FP32 weights it ends on."""
    amp = Amp(opt_level="O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(steps):
        for micro in range(2):
            x, y = _batch(2 * step + micro)
            loss = F.cross_entropy(model(x.bfloat16()).float(), y)
            if penalty:
                loss = loss + penalty * sum(p.float().pow(2).sum() for p in model.parameters())
            amp.backward(loss)
            if micro == 0:
                between(model, amp)
        amp.step(opt)
        amp.update()
        opt.zero_grad()
    return amp.fp32_state_dict(model)


def _reference(between: Callable[[nn.Module, Any], None], *, penalty: float = 0.0, steps: int = 2) -> dict[str, Any]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        for micro in range(2):
            x, y = _batch(2 * step + micro)
            loss = F.cross_entropy(model(x), y)
            if penalty:
                loss = loss + penalty * sum(p.pow(2).sum() for p in model.parameters())
            loss.backward()
            if micro == 0:
                between(model, None)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _close(got: dict[str, Any], want: dict[str, Any]) -> None:
    worst = max((got[k].float() - v).abs().max().item() for k, v in want.items())
    assert worst < 1e-2, worst


def _probe_undone_by_subtraction(model: nn.Module, amp: Any) -> None:
    """Extragradient's extrapolation undone by subtracting it (not from a saved copy): the half weights come back to
    their masters' rounding up to a rounding of their own."""
    params = list(model.parameters())
    moves = [-5e-2 * p.grad.float() for p in params]
    with torch.no_grad():
        for p, move in zip(params, moves):
            p.add_(move.to(p.dtype))
    x, y = _batch(100)
    dtype = params[0].dtype
    loss = F.cross_entropy(model(x.to(dtype)).float(), y) / 2
    amp.backward(loss) if amp is not None else loss.backward()
    with torch.no_grad():
        for p, move in zip(params, moves):
            p.sub_(move.to(p.dtype))


def test_o2_descent_probe_undone_by_subtraction_trains_as_fp32() -> None:
    _close(_core(_probe_undone_by_subtraction), _reference(_probe_undone_by_subtraction))


def _raw_sgd(model: nn.Module, amp: Any) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(5e-2 * p.grad.to(p.dtype))  # a raw SGD step, written out, no zero_grad


def test_o2_raw_step_standing_at_the_step_is_refused_there_naming_the_way_out() -> None:
    """Found at the backward after it, refused at the step (before the masters take anything)."""
    with pytest.raises(RuntimeError, match=REFUSAL + r".*still there at its step.*refresh_masters\(force=True\)"):
        _core(_raw_sgd)


def test_o2_raw_step_then_a_probe_undone_is_still_refused() -> None:
    """Two writes found before one step: the probe undone does not clear the raw step before it."""

    def both(model: nn.Module, amp: Any) -> None:
        _raw_sgd(model, amp)
        x, y = _batch(300)
        amp.backward(F.cross_entropy(model(x.bfloat16()).float(), y) / 2)  # the raw step found here
        _probe_undone_by_subtraction(model, amp)

    with pytest.raises(RuntimeError, match=REFUSAL):
        _core(both)


def test_o2_raw_step_taken_by_refresh_masters_force_after_the_backward_that_found_it_trains_on() -> None:
    """The way out the refusal names, taken after the backward that found the write (before the step): no refusal,
    and the write is in the masters at its half rounding (as refresh_masters promises)."""

    def taken(model: nn.Module, amp: Amp) -> None:
        _raw_sgd(model, amp)
        x, y = _batch(300)
        amp.backward(F.cross_entropy(model(x.bfloat16()).float(), y) / 2)
        amp.refresh_masters(force=True)

    got = _core(taken)
    assert all(torch.isfinite(v).all() for v in got.values())


@pytest.mark.parametrize(
    "decay",
    [
        lambda p: p.mul_(1 - 0.05),
        lambda p: p.add_(p, alpha=-0.05),
        lambda p: p.sub_(0.05 * p),  # 0.05 * p rounded first: a second rounding
    ],
    ids=["mul_", "add_alpha", "sub_product"],
)
def test_o2_weight_decay_by_hand_under_an_l2_penalty_trains_as_fp32(decay: Callable[[torch.Tensor], Any]) -> None:
    def between(model: nn.Module, amp: Any) -> None:
        with torch.no_grad():
            for p in model.parameters():
                decay(p)

    _close(_core(between, penalty=1.0), _reference(between, penalty=1.0))


def test_o2_raw_sgd_under_an_l2_penalty_is_still_refused() -> None:
    """The gradients are mostly the penalty's (the weights'), not only: a raw step is no one factor times them."""
    with pytest.raises(RuntimeError, match=REFUSAL):
        _core(_raw_sgd, penalty=1.0)


# -- 2. the Apex layer: a delay_unscale chain after an unscaled block ------------------------------------------------
def _apex_blocks(opt_level: str, between: Callable[[nn.Module], None] | None, *, apex: bool) -> list[torch.Tensor]:
    """A block, then a ``delay_unscale`` block whose loss is zeroed (``loss * 0``), ``between(model)``, the step."""
    from lightning_mpx.apex import amp
    from tests.test_core_raw_head_beside import Net
    from tests.test_core_raw_head_beside import _batch as _net_batch

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if apex:
        net, opt = amp.initialize(net, opt, opt_level=opt_level, loss_scale=128.0, verbosity=0)
    for i, (scale, delay) in enumerate([(1.0, False), (0.0, True)]):
        x, y = _net_batch(i)
        loss = F.mse_loss(net(x.to(next(net.parameters()).dtype)).float(), y) * scale
        if apex:
            with amp.scale_loss(loss, opt, delay_unscale=delay) as scaled:
                scaled.backward()
        else:
            loss.backward()
    if between is not None:
        between(net)
    opt.step()
    return [p.detach().float().clone() for p in (amp.master_params(opt) if apex else net.parameters())]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize(
    "between",
    [
        lambda net: torch.nn.utils.clip_grad_norm_(list(net.parameters()), 10.0),
        lambda net: net.zero_grad(set_to_none=False),
    ],
    ids=["clip_grad_norm", "zero_grad_in_place"],
)
def test_apex_zero_loss_delayed_block_then_an_in_place_write_steps_as_fp32(opt_level: str, between: Any) -> None:
    """The clip (a multiply by 1 on all-zero gradients) keeps the first block's gradients; a model.zero_grad(
    set_to_none=False) gives the batch up (the step moves nothing): both as FP32."""
    from lightning_mpx.apex import _amp_state

    want = _apex_blocks(opt_level, between, apex=False)
    _amp_state.reset()
    try:
        got = _apex_blocks(opt_level, between, apex=True)
    finally:
        _amp_state.reset()
    assert all(torch.allclose(g, w, atol=2e-3) for g, w in zip(got, want)), [
        (g - w).abs().max() for g, w in zip(got, want)
    ]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_apex_a_step_with_no_block_since_counts_for_no_loss_scale(opt_level: str) -> None:
    """A step before any scale_loss block (no gradient at all), then a given-up chain (optimizer.zero_grad()) and a
    step: Apex updated a scaler only at the end of a block it unscaled."""
    from lightning_mpx.apex import _amp_state, amp
    from tests.test_core_raw_head_beside import Net
    from tests.test_core_raw_head_beside import _batch as _net_batch

    _amp_state.reset()
    try:
        torch.manual_seed(0)
        net = Net()
        net, opt = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level=opt_level,
                                  loss_scale="dynamic", verbosity=0)  # fmt: skip
        opt.step()
        x, y = _net_batch(0)
        with amp.scale_loss(F.mse_loss(net(x.to(next(net.parameters()).dtype)).float(), y), opt,
                            delay_unscale=True) as scaled:  # fmt: skip
            scaled.backward()
        opt.zero_grad()
        opt.step()
        assert amp.state_dict()["loss_scaler0"]["unskipped"] == 0
    finally:
        _amp_state.reset()


def test_apex_gradients_scaled_in_place_after_a_delayed_block_step_as_fp32() -> None:
    """``p.grad.mul_(0.5)`` between a ``delay_unscale`` block and the step halves the earlier block's gradients too, as
    FP32's (was: kept aside until the step, they reached it unhalved). O1: added back into the chain's at its end."""
    from lightning_mpx.apex import _amp_state

    def halve(net: nn.Module) -> None:
        for p in net.parameters():
            p.grad.mul_(0.5)

    want = _apex_blocks("O1", halve, apex=False)
    _amp_state.reset()
    try:
        got = _apex_blocks("O1", halve, apex=True)
    finally:
        _amp_state.reset()
    assert all(torch.allclose(g, w, atol=2e-3) for g, w in zip(got, want))


# -- 3. the Trainer at O2: a checkpoint's state_dict edited in place by a callback ------------------------------------
def test_trainer_o2_in_place_edit_of_the_last_checkpoint_reaches_masters_and_model_exactly(tmp_path: Any) -> None:
    """As "bf16-mixed", whose checkpoint state_dict holds its live weights: the edit made in on_save_checkpoint after
    the fit's last step stands, in the FP32 masters exactly and in the half model as their rounding (was: the masters
    kept it until the next refresh, which took the model's unedited half weights back)."""
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin
    from tests.test_core_raw_head_beside import Net
    from tests.test_core_raw_head_beside import _batch as _net_batch

    class Tune(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return F.mse_loss(self.net(batch[0]).float(), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    edited: dict[str, torch.Tensor] = {}

    class Halve(pl.Callback):
        def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
            for key, value in checkpoint["state_dict"].items():
                value.mul_(0.5)
                edited[key] = value.detach().clone()

    module = Tune()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[Halve()],
        plugins=[MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16)],
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader([_net_batch(i) for i in range(2)], batch_size=None))
    got = trainer.precision_plugin.amp.fp32_state_dict(module)
    assert edited and all(torch.equal(got[k], v) for k, v in edited.items())
    params = dict(module.named_parameters())
    assert all(torch.equal(params[k], v.to(params[k].dtype)) for k, v in edited.items())
