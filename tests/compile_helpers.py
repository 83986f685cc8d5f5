"""Set-up shared by the ``torch.compile`` tests: a small model ending in its loss and its batches, a counter of the
calls into the cast hook, the one-graph check, and a model prepared by the Accelerate adapter at O1.

Calls into the hook are counted by observing the entries into the policy's ``__torch_function__`` (``sys.setprofile``
on its code object): nothing in torch is patched. The compiled runs use the ``aot_eager`` backend (dynamo and AOT
autograd, no code generation), which decides graph breaks, recompiles and the dtypes in the graph, and keeps the
tests quick on CPU. Tests that count graphs use the ``fresh_dynamo`` fixture (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from lightning_mpx.casting.mode import _CastMode

HALF = torch.bfloat16


class HookCounter:
    """Counts entries into the cast policy's ``__torch_function__`` on this thread while active."""

    def __init__(self) -> None:
        self.calls = 0
        self._code = _CastMode.__torch_function__.__code__

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is self._code:
            self.calls += 1

    def __enter__(self) -> HookCounter:
        self.calls = 0
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)


class LossNet(nn.Module):
    """A small pre-norm block ending in its loss (so that a compiled copy holds every op of the step)."""

    def __init__(self, dim: int = 16, classes: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ln = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.fc2(F.gelu(self.fc1(self.ln(x))).softmax(-1) @ torch.eye(2 * x.shape[-1]))
        return F.cross_entropy(logits, y)


def step_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of :class:`LossNet`'s step ``step`` (8 samples, its own seed)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def assert_one_graph() -> None:
    """Dynamo broke no graph and compiled one graph for all the steps (a recompile would add one)."""
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, f"{counters['stats']['unique_graphs']} graphs: a recompile"


@contextlib.contextmanager
def o1_accelerator(net: nn.Module, compile_mode: str | None = None) -> Iterator[tuple[Any, Any, Any]]:
    """``(accelerator, model, optimizer)``: ``net`` and an SGD optimizer (lr 0.1) prepared by the adapter at O1, in a
    fresh Accelerate state; ``compile_mode`` "before_prepare" or "after_prepare" compiles the model (``aot_eager``)
    then, None leaves it eager."""
    from lightning_mpx.integrations.accelerate import Accelerator
    from tests.accelerate_helpers import accelerate_state_reset

    if compile_mode not in (None, "before_prepare", "after_prepare"):
        raise ValueError(f"compile_mode={compile_mode!r}; expected None, 'before_prepare' or 'after_prepare'")
    with accelerate_state_reset():
        if compile_mode == "before_prepare":
            net = torch.compile(net, backend="aot_eager")
        accelerator = Accelerator(mixed_precision="O1")
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        if compile_mode == "after_prepare":
            model = torch.compile(model, backend="aot_eager")
        yield accelerator, model, optimizer
