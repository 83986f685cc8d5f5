"""O2: losses the model's code reaches where its names do not show them run in FP32 (stop 58).

At O2 the loss policy's mode is off while the prepared model's loss-free children run and on for the root's own code
(``lightning_mpx/casting/loss_regions.py``). Stop 58 tried hooking a loss-free root alone (the mode off for its
whole forward), judged by a static reading of its code; each model here computes ``cross_entropy`` inside its call
where the code does not name it, and ran it in bfloat16 under that rule (taken back). It must come back float32,
equal to the FP32 loss of the half logits. A loss computed in a user's forward hook on a child runs in FP32 too,
whenever the hook was registered (the regions' forward hook is prepended); an EMA deep copy re-hooks nothing.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp

OBJECTIVES = {"ce": F.cross_entropy}  # a registry of callables indexed by name, its name no loss word


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class _DictAttribute(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.fns = {"ce": F.cross_entropy}

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fns["ce"](self.logits(x), y)


class _ListAttribute(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.fns = [F.cross_entropy]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fns[0](self.logits(x), y)


class _GlobalRegistry(_Base):
    def forward(self, x: torch.Tensor, y: torch.Tensor, name: str = "ce") -> torch.Tensor:
        return OBJECTIVES[name](self.logits(x), y)


def _make_scorer(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def scorer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fn(a, b)

    return scorer


class _Closure(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.scorer = _make_scorer(F.cross_entropy)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.scorer(self.logits(x), y)


class _ArgumentCalled(_Base):
    def forward(self, x: torch.Tensor, y: torch.Tensor, metric: Callable[..., torch.Tensor]) -> torch.Tensor:
        return metric(self.logits(x), y)


class _KeywordCalled(_Base):
    def forward(self, x: torch.Tensor, y: torch.Tensor, metric: Any = None) -> torch.Tensor:
        out = self.logits(x)
        return out if metric is None else metric(out, y)


CASES = {
    "dict_attribute": (_DictAttribute, {}),
    "list_attribute": (_ListAttribute, {}),
    "global_registry": (_GlobalRegistry, {}),
    "closure_from_init": (_Closure, {}),
    "argument_called": (_ArgumentCalled, {"metric": F.cross_entropy}),
    "keyword_argument_called": (_KeywordCalled, {"metric": F.cross_entropy}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_o2_loss_the_roots_code_reaches_unnamed_stays_fp32(case: str) -> None:
    make, kwargs = CASES[case]
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(make())
    with amp.forward_context():
        loss = model(amp.cast_inputs(x), y, **kwargs)
        logits = model.logits(amp.cast_inputs(x))
    assert logits.dtype is torch.bfloat16
    assert loss.dtype is torch.float32, case  # was bfloat16 under the root-alone rule
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), y))


@pytest.mark.parametrize("registered", ["before", "after"])
def test_o2_loss_in_a_childs_forward_hook_stays_fp32(registered: str) -> None:
    # A distillation or MoE aux-loss hook on a child: it runs outside the code read when the model was prepared.
    class _Net(_Base):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.logits(x)

    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    amp = Amp("O2", half_dtype=torch.bfloat16)
    model, aux = _Net(), []

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        aux.append((F.cross_entropy(output, y), output))

    if registered == "before":
        model.head.register_forward_hook(hook)
    model = amp.prepare_model(model)
    with amp.forward_context():
        model(amp.cast_inputs(x))  # a step before the hook
    if registered == "after":
        model.head.register_forward_hook(hook)
    for _ in range(2):
        with amp.forward_context():
            model(amp.cast_inputs(x))
        loss, logits = aux[-1]
        assert logits.dtype is torch.bfloat16 and loss.dtype is torch.float32
        torch.testing.assert_close(loss, F.cross_entropy(logits.float(), y))


def test_o2_ema_deep_copy_of_the_model_forwards_without_rehooking_the_model() -> None:
    # An EMA made by copy.deepcopy of the prepared model carries its hooks; under stop 58's root-alone rule (taken
    # back) its forward made the engine re-hook every model's regions every step. The copy runs as the original.
    import copy

    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ema = copy.deepcopy(model)
    hooks_before = [dict(m._forward_pre_hooks) for m in model.modules()]
    for _ in range(3):
        x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
        with amp.forward_context():
            logits = model(amp.cast_inputs(x))
            loss = F.cross_entropy(logits.float(), y)
        amp.backward(loss)
        amp.step(opt)
        amp.update()
        opt.zero_grad()
        with torch.no_grad(), amp.forward_context():
            out = ema(amp.cast_inputs(x))
        assert out.dtype == logits.dtype == torch.bfloat16  # the half model's output, as the original's
    assert [dict(m._forward_pre_hooks) for m in model.modules()] == hooks_before  # the same hooks, not re-made
