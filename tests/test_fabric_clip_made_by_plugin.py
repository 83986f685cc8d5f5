"""review69b: stop 69's O2 write-after-clip fixes attacked (Fabric's clip made by the plugin, the Accelerate adapter's
and the HF Trainer's shows, the core's refusal), against FP32 and the frameworks' own precisions.

Fixed: the core refused a write to the model's gradients after ``unscale_()`` and the engine's
``clip_grad_norm_`` whose norm was within ``max_norm`` (a clip that changed nothing: the write was on the values the
step uses, and FP32 trains with it); it is taken now (``rescale._clipped_nothing``, read on the refusal's path only).

Fixed: a Fabric strategy subclass whose ``clip_gradients_norm`` clips ``precision.main_params`` itself (not through
``super()``) at O2: a write to ``p.grad`` after ``fabric.clip_gradients`` was lost, silently (the plugin showed the
masters' clipped gradients over it at the step); refused now (``fabric_clipping.note_unseen_clip``).

Cheaper: the plugin's clip of the masters takes torch's kernels without its Python (Fabric O2 clip row 595 -> 505
calls per step), bit for bit torch's.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn


def _flat(values: Any) -> torch.Tensor:
    return torch.cat([v.detach().float().flatten() for v in values])


# -- the core: unscale_(), the engine's clip, a write --------------------------------------------------------------
def _halve(model: nn.Module, opt: Any) -> None:
    for p in model.parameters():
        p.grad.mul_(0.5)


def _clear_keep(model: nn.Module, opt: Any) -> None:
    opt.zero_grad(set_to_none=False)


def _zeros(model: nn.Module, opt: Any) -> None:
    for p in model.parameters():
        p.grad = torch.zeros_like(p.grad)


def _core(level: str | None, write: Callable[[nn.Module, Any], None], max_norm: float) -> torch.Tensor:
    """Three SGD steps (momentum) at O2 (bfloat16, a static scale of 2**10): ``unscale_``, the engine's clip by norm,
    ``write``; FP32 (``level=None``): torch's clip of the model's gradients, ``write``."""
    from lightning_mpx import Amp

    amp = Amp(opt_level="O2", half_dtype="bfloat16", loss_scale=2.0**10)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = net if level is None else amp.prepare_model(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = opt if level is None else amp.prepare_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        loss = F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        if level is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        else:
            amp.backward(loss)
            amp.unscale_(opt)
            amp.clip_grad_norm_(opt, max_norm)
        write(model, opt)
        if level is None:
            opt.step()
        else:
            amp.step(opt)
            amp.update()
        opt.zero_grad()
    return _flat((amp.fp32_state_dict(net) if level is not None else net.state_dict()).values())


def test_core_o2_write_after_unscale_and_a_clip_that_changed_nothing_trains_as_fp32() -> None:
    """``unscale_``, ``clip_grad_norm_(opt, 1e6)`` (the norm within it: nothing clipped), then ``p.grad.mul_(0.5)``:
    the write is on the values the step uses; it was refused as if the clip had been undone. Trains as FP32; a clip
    that clipped is still refused."""
    got = _core("O2", _halve, 1e6)
    assert (got - _core(None, _halve, 1e6)).abs().max() < 2e-3  # bfloat16 against FP32 over 3 steps: ~3e-4
    with pytest.raises(RuntimeError, match=r"after unscale_\(\) showed"):
        _core("O2", _halve, 0.05)


@pytest.mark.parametrize("write", [_clear_keep, _zeros], ids=["zero_grad_keep", "zeros"])
def test_core_o2_a_clear_after_unscale_and_the_clip_is_not_refused(write: Callable[[nn.Module, Any], None]) -> None:
    """``zero_grad(set_to_none=False)`` or a write of zeros after ``unscale_`` and a clip that clipped: a clear, taken
    (no step moves the weights but momentum, as FP32's)."""
    assert (_core("O2", write, 0.05) - _core(None, write, 0.05)).abs().max() < 2e-3


# -- Fabric at O2: the plugin's clip ---------------------------------------------------------------------------------
def _fabric(
    level: str | None, norm_type: float, strategy: Any = None, *, write: bool = True
) -> tuple[torch.Tensor, list[float]]:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    kwargs: dict[str, Any] = {} if strategy is None else {"strategy": strategy(device=torch.device("cpu"))}
    if strategy is None:
        kwargs["accelerator"], kwargs["devices"] = "cpu", 1
    if level is None:
        fabric = Fabric(precision="32-true", **kwargs)
    else:
        plugin = FabricMixedPrecisionPlugin(level, half_dtype="bfloat16", loss_scale=2.0**10)
        fabric = Fabric(plugins=[plugin], **kwargs)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=g) * 4, torch.randn(8, 3, generator=g)
        fabric.backward(F.mse_loss(model(x).float(), y))
        norms.append(float(fabric.clip_gradients(model, opt, max_norm=0.3, norm_type=norm_type)))
        for p in model.parameters() if write else ():
            p.grad.mul_(0.5)
        opt.step()
        opt.zero_grad()
    amp = getattr(fabric._precision, "amp", None)
    return _flat((amp.fp32_state_dict(net) if amp is not None else net.state_dict()).values()), norms


@pytest.mark.parametrize("norm_type", [1.0, math.inf, 3.0])
def test_fabric_o2_clip_gradients_by_any_norm_then_a_write_trains_as_fp32(norm_type: float) -> None:
    """The stand-in Fabric's clip gets (one element, its gradient the norm) returns the norm for the 1- and
    infinity norms and a 3-norm too (a one-element p-norm is the absolute value): norms and weights as FP32's."""
    got, got_norms = _fabric("O2", norm_type)
    want, want_norms = _fabric(None, norm_type)
    assert (got - want).abs().max() < 2e-3
    torch.testing.assert_close(got_norms, want_norms, rtol=1e-2, atol=0)


def _own_clip_strategy() -> Any:
    from lightning.fabric.strategies import SingleDeviceStrategy

    class OwnClip(SingleDeviceStrategy):
        """A strategy of the user's that clips ``precision.main_params`` itself (as FSDP's and DeepSpeed's do)."""

        def clip_gradients_norm(self, module: Any, optimizer: Any, max_norm: Any, norm_type: Any = 2.0,
                                error_if_nonfinite: bool = True) -> torch.Tensor:  # fmt: skip
            self.precision.unscale_gradients(optimizer)
            params = self.precision.main_params(optimizer)
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    return OwnClip


def test_fabric_o2_a_strategys_own_clip_then_a_write_is_refused_and_without_one_trains_as_fp32() -> None:
    """A strategy of one's own whose ``clip_gradients_norm`` clips ``precision.main_params`` itself (not Lightning's,
    which the plugin tells by its code object): the masters' gradients clipped alone, a write to ``p.grad`` after
    ``fabric.clip_gradients`` was overwritten by the show at the step, lost (7.5e-2 off FP32, silently). It is refused
    at the step; without a write the run trains as FP32."""
    with pytest.raises(RuntimeError, match=r"after unscale_\(\) showed"):
        _fabric("O2", 2.0, _own_clip_strategy())
    got, _ = _fabric("O2", 2.0, _own_clip_strategy(), write=False)
    want, _ = _fabric(None, 2.0, _own_clip_strategy(), write=False)
    assert (got - want).abs().max() < 2e-3


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_fabric_o2_clip_of_the_masters_is_torchs_bit_for_bit(norm_type: float, max_norm: float) -> None:
    """The plugin's clip of the masters' gradients (torch's kernels without its Python: the Fabric O2 clip row's
    calls per step 595 -> 505) gives torch's ``clip_grad_norm_``'s norm and gradients bit for bit, a parameter
    without a gradient among them; a float64 one with them falls back to torch's clip."""
    from lightning_mpx.integrations.fabric_clipping import _clip_norm

    g = torch.Generator().manual_seed(3)
    for extra in (torch.float32, torch.float64):
        ours = [torch.zeros(s, requires_grad=True) for s in (5, 7, 3)] + [torch.zeros(2, dtype=extra)]
        for p, scale in zip(ours, (1.0, 3.0, 0.1, 2.0)):
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) * scale
        ours[1].grad = None
        theirs = [p.detach().clone() for p in ours]
        for p, q in zip(theirs, ours):
            p.grad = None if q.grad is None else q.grad.clone()
        got = _clip_norm(ours, max_norm, norm_type)
        want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=norm_type)
        assert torch.equal(got, want)
        for p, q in zip(ours, theirs):
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
