"""O2's model-boundary casts inside ``forward_context`` (issue 41's host-bound step, stop 55).

``Amp.cast_inputs`` and ``Amp.cast_outputs`` run inside the forward scope, whose torch-function mode would be handed
each dtype read and each cast (a call into the mode and its table lookup, which pass both through). With only the
policy's mode on, in eager code, they now run with torch-function handling off: the same casts and source notes, no
call into the mode. A user's own torch-function mode around the loop still sees them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_mpx import Amp
from lightning_mpx.casting.mode import _CastMode


class _Seen(TorchFunctionMode):
    """A user's mode that records the torch functions it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.funcs: list[object] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def _prepared() -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return amp, model, optimizer


def test_o2_boundary_casts_inside_forward_context_make_no_call_into_the_mode(monkeypatch) -> None:
    amp, model, optimizer = _prepared()
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    handed: list[object] = []
    original = _CastMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        handed.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(_CastMode, "__torch_function__", counting)  # this test's mode class only
    with amp.forward_context():
        inputs = amp.cast_inputs(x)
        handed_by_inputs = list(handed)
        output = model(inputs)
        handed.clear()
        logits = amp.cast_outputs(output)
        handed_by_outputs = list(handed)
        loss = F.cross_entropy(logits, y)
    assert handed_by_inputs == [] and handed_by_outputs == [], (handed_by_inputs, handed_by_outputs)
    # the same casts as outside any scope
    assert inputs.dtype == torch.bfloat16 and torch.equal(inputs, x.to(torch.bfloat16))
    assert output.dtype == torch.bfloat16 and logits.dtype == torch.float32 and torch.equal(logits, output.float())
    assert loss.dtype == torch.float32
    amp.backward(loss)
    assert amp.step(optimizer)
    amp.update()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_o2_boundary_casts_stay_visible_to_a_users_own_mode() -> None:
    amp, model, _ = _prepared()
    x = torch.randn(4, 8)
    with _Seen() as seen, amp.forward_context():
        inputs = amp.cast_inputs(x)
        amp.cast_outputs(model(inputs))
    assert inputs.dtype == torch.bfloat16
    casts = [f for f in seen.funcs if f is torch.Tensor.to]
    assert len(casts) >= 2, seen.funcs  # the input's cast and the output's, as before
