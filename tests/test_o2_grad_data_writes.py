"""O2 with training code that writes the model's gradients through ``p.grad.data`` between the unscale (or a clip)
and the step (``p.grad.data.mul_(s)`` after a clip, ``.clamp_``), in the core loop, each run against the same code in
FP32 or against the same code writing ``p.grad`` itself.

``.data`` is an alias with a version counter of its own, so such a write moves no counter the engine follows; the
engine looks for it once per optimizer, at its first unscale or clip (engine/data_writes.py), and keeps looking at
every step of an optimizer where it found one (docs/master_weights.md, "Writes through p.grad.data").
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from lightning_mpx import Amp
from tests.test_fabric_write_after_clip import _batch, _net  # the same small classifier and batches

HABIT = "a write through p.grad.data"
REFUSED = r"between clip_grad_norm_\(\)/clip_grad_value_\(\) and step\(\)"




def _halve(params: list[torch.Tensor], how: str) -> None:
    for p in params:
        (p.grad.data if how == "data" else p.grad).mul_(0.5)


class _Loop:
    """The same loop at O2 float16 (a dynamic scale of 2**8) or in FP32 (``level=None``)."""

    def __init__(self, level: str | None) -> None:
        self.net = _net()
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)
        self.amp = None
        if level is not None:
            self.amp = Amp(level, half_dtype="float16", init_scale=2.0**8)
            self.net, self.opt = self.amp.prepare_model(self.net), self.amp.prepare_optimizer(self.opt)

    def backward(self, i: int) -> None:
        x, y = _batch(i)
        if self.amp is None:
            F.cross_entropy(self.net(x), y).backward()
            return
        with self.amp.forward_context():
            loss = F.cross_entropy(self.net(self.amp.cast_inputs(x)).float(), y)
        self.amp.backward(loss)
        self.amp.unscale_(self.opt)

    def clip(self, show: bool = True) -> None:
        """The engine's norm clip (FP32: torch's); ``show``: its values shown on the model before user code."""
        if self.amp is None:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), 0.5)
            return
        self.amp.clip_grad_norm_(self.opt, 0.5)
        if show:
            self.amp.show_unscaled_on_model(self.opt)

    def step(self) -> None:
        if self.amp is None:
            self.opt.step()
        else:
            self.amp.step(self.opt)
            self.amp.update()
        self.opt.zero_grad()

    def trained(self) -> torch.Tensor:
        values = self.amp.fp32_state_dict(self.net) if self.amp is not None else self.net.state_dict()
        return torch.cat([v.float().flatten() for v in values.values()])


def _run(level: str | None, data_from: int, steps: int = 4) -> torch.Tensor:
    """``steps`` steps of: unscale_, torch's ``clip_grad_value_`` of the model, the engine's clip shown on the model,
    the gradients halved through ``.data`` from step ``data_from`` on, the step."""
    loop = _Loop(level)
    for i in range(steps):
        loop.backward(i)
        torch.nn.utils.clip_grad_value_(list(loop.net.parameters()), 0.05)
        loop.clip()
        if i >= data_from:
            _halve(list(loop.net.parameters()), "data")
        loop.step()
    return loop.trained()


def test_a_grad_data_habit_from_the_first_step_trains_as_fp32_with_one_warning() -> None:
    """Torch's clip of the model's gradients, the engine's clip, then ``p.grad.data.mul_(0.5)`` at every step: as
    FP32 (1.9e-5 off over 4 steps; without the look the halving was lost: 9.1e-3 off), one warning naming the habit
    (not one per step)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run("O2", data_from=0)
    assert sum(HABIT in str(w.message) for w in caught) == 1
    torch.testing.assert_close(got, _run(None, data_from=0), rtol=0, atol=2e-4)


@pytest.mark.filterwarnings(f"ignore:{HABIT}")
@pytest.mark.parametrize("how", ["mul_", "data"])
def test_a_write_after_torchs_clip_then_the_engines_clip_is_refused_through_data_too(how: str) -> None:
    """``amp.unscale_``, torch's ``clip_grad_value_`` of the model's gradients, the engine's clip (not shown on the
    model), then the gradients halved: a write between the engine's clip and the step, refused (docs/master_weights.md)
    for ``p.grad.mul_``. Before: through ``.data`` it was not seen, the step applied the clip alone (the halving lost:
    2x FP32's update), silently: the engine's clip took torch's write and noted the gradients again, but the copy the
    look compares with was left at the unscale's, so the look skipped every gradient (moved since it)."""
    loop = _Loop("O2")
    loop.backward(0)
    torch.nn.utils.clip_grad_value_(list(loop.net.parameters()), 0.05)
    loop.clip(show=False)
    _halve(list(loop.net.parameters()), how)
    with pytest.raises(RuntimeError, match=REFUSED):
        loop.amp.step(loop.opt)  # type: ignore[union-attr]


@pytest.mark.xfail(
    strict=True,
    reason="engine/data_writes.py:ended: O2, a p.grad.data write habit that starts after an optimizer's first "
    "unscale or clip (a callback from step 100, a warm-up) is never seen: the first look found no write and ended, "
    "the step applies the masters' unwritten gradients (6.8e-3 off FP32 after 3 such steps, float16; 9.8e-3 in "
    "Fabric's and Accelerate's clip loops), silently. Looking at every clipped step costs a copy and a host read "
    "there (stop 71's design, rejected); write p.grad itself (p.grad.mul_), which costs nothing",
)
def test_a_grad_data_habit_from_the_second_step_trains_as_fp32() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, want = _run("O2", data_from=1), _run(None, data_from=1)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
