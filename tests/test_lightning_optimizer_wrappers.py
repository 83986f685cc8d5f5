"""Optimizer-side habits through the Lightning Trainer and the core ``Amp`` loop at O2 bfloat16, each compared with
Lightning's own ``"bf16-mixed"`` on the same seed: a Lookahead wrapper handed to the Trainer as THE optimizer, a torch
optimizer subclass whose ``step()`` rescales the weights after ``super().step()``, and transformers' ``Adafactor`` with
a linear warm-up schedule (docs/master_weights.md, "Optimizer-side habits")."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin
from tests.lightning_helpers import make_trainer


class _Lookahead(torch.optim.Optimizer):
    """lookahead-pytorch: the inner optimizer's ``param_groups`` shared, slow weights in its own state, ``copy_`` into
    the parameters every ``k`` steps inside ``step()``. ``init=False``: as lookahead-pytorch, never running
    ``Optimizer.__init__``."""

    def __init__(self, inner: torch.optim.Optimizer, k: int = 2, alpha: float = 0.5, init: bool = True) -> None:
        if init:
            super().__init__(inner.param_groups, inner.defaults)
        self.inner, self.k, self.alpha = inner, k, alpha
        self.param_groups = inner.param_groups
        self.state: Any = defaultdict(dict)
        self.defaults = inner.defaults
        for group in self.param_groups:
            group["counter"] = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self.inner.step(closure)
        for group in self.param_groups:
            if group["counter"] == 0:
                for fast in group["params"]:
                    slow = self.state[fast].setdefault("slow", fast.detach().clone())
                    slow += (fast - slow) * self.alpha
                    fast.copy_(slow)
            group["counter"] = (group["counter"] + 1) % self.k
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}


class _RescaledSGD(torch.optim.SGD):
    """A subclass doing extra work in ``step()``: rows of a weight matrix rescaled to norm <= 1 after the update."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() == 2:
                    p.div_(p.norm(dim=1, keepdim=True).clamp(min=1.0))
        return loss


def _optimizer(habit: str, params: Any) -> Any:
    if habit == "lookahead":
        return _Lookahead(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    if habit == "lookahead_no_init":
        return _Lookahead(torch.optim.SGD(params, lr=0.1), init=False)
    if habit == "rescaled_sgd":
        return _RescaledSGD(params, lr=0.5)
    from transformers.optimization import Adafactor, get_linear_schedule_with_warmup

    opt = Adafactor(params, lr=1e-2, relative_step=False, scale_parameter=False)
    schedule = get_linear_schedule_with_warmup(opt, 2, 8)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


class _Module(pl.LightningModule):
    def __init__(self, habit: str, manual: bool) -> None:
        super().__init__()
        self.net, self.habit = _net(), habit
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = F.mse_loss(self.net(batch[0]).float(), batch[1])
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self) -> Any:
        return _optimizer(self.habit, self.parameters())


def _fit(habit: str, manual: bool = False, **precision: Any) -> dict[str, torch.Tensor]:
    xs, ys = zip(*map(_batch, range(6)))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8)
    module = _Module(habit, manual)
    make_trainer(**precision).fit(module, data)
    return {k: v.detach().float() for k, v in module.net.state_dict().items()}


def _o2() -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("O2", half_dtype="bfloat16")


@pytest.mark.parametrize(
    ("habit", "manual"), [("lookahead", False), ("rescaled_sgd", True), ("adafactor_linear_warmup", False)]
)
def test_optimizer_habit_trains_at_o2_as_bf16_mixed(habit: str, manual: bool) -> None:
    want, fp32 = _fit(habit, manual, precision="bf16-mixed"), _fit(habit, manual)
    got = _fit(habit, manual, plugin=_o2())
    assert any(not torch.equal(want[k], _net().state_dict()[k]) for k in want)  # it trained
    errors = {k: (got[k] - want[k]).abs().max().item() for k in want}
    assert max(errors.values()) <= 2e-3 + max((want[k] - fp32[k]).abs().max().item() for k in want), errors


def test_lookahead_that_never_ran_optimizer_init_is_refused_at_setup_by_name() -> None:
    # lookahead-pytorch shares the inner optimizer's groups without Optimizer.__init__: no step or state-dict hooks
    # to put on it (an AttributeError from deep inside the set-up before); the message names the way out.
    with pytest.raises(TypeError, match=r"optimizer=_Lookahead never ran torch.optim.Optimizer.__init__.*inner"):
        _fit("lookahead_no_init", plugin=_o2())


def test_lookahead_state_dict_at_o2() -> None:
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    opt = amp.prepare_optimizer(_optimizer("lookahead", model.parameters()))
    x, y = _batch(0)
    with amp.forward_context():
        loss = F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
    amp.backward(loss)
    amp.step(opt)
    amp.update()
    state = opt.state_dict()["inner"]["state"]
    assert set(state) == {0, 1, 2, 3} and all(s["momentum_buffer"].dtype == torch.float32 for s in state.values())
