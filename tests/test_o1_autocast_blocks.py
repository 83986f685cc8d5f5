"""A user's ``torch.autocast(enabled=False)`` block (and the blocks nested in it, ``custom_fwd``/``custom_bwd``
Functions, activation checkpoints around it) inside the core ``Amp("O1")`` forward on the CPU (the Python cast
policy), against ``torch.autocast("cpu", dtype=torch.bfloat16)`` running the same code: the same dtypes, values and
gradients, bit for bit where both run the same kernels. Before the scope's marker (casting.scopes.policy_scope) the
policy ignored every such block (cast inside it: the rotary test's frequency gradient 0.22 off, where it is 0.09 at
most), and ``custom_bwd`` refused its backward (``grad @ b.t()`` of a bfloat16 gradient and an FP32 weight: autocast
was not on at the forward, so not at the backward either)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_mpx import Amp


class _Nested(torch.nn.Module):
    """Disabled, re-enabled and another device's blocks, nested as users and libraries write them."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outer = a @ b
        with torch.autocast("cpu", enabled=False):
            off = a.float() @ b.float()
            with torch.autocast("cpu", dtype=torch.bfloat16):  # re-enabled inside: the policy again
                again = a @ b
            after = a @ b  # back in the disabled block
        with torch.autocast("cuda", enabled=False):  # another device's switch: no CPU FP32 region for autocast
            other = a @ b
        return outer, off, again, after, other


def _positions() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(512.0)[:, None], torch.full((1, 4), 0.9999)


def test_nested_blocks_give_autocasts_dtypes_and_values() -> None:
    a, b = _positions()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _Nested()(a, b)
    amp = Amp("O1", half_dtype="bfloat16")
    model = amp.prepare_model(_Nested())
    with amp.forward_context():
        got = model(a, b)
    assert [t.dtype for t in got] == [t.dtype for t in expected] == [
        torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    for mine, theirs in zip(got, expected):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)


class _Fp32Function(torch.autograd.Function):
    """A user's FP32 Function: ``custom_fwd(cast_inputs=torch.float32)`` runs it with autocast off."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return grad @ b.t(), a.t() @ grad


class _AutocastFunction(_Fp32Function):
    """A Function that runs under autocast both ways: ``custom_bwd`` runs its backward under the forward's autocast
    (its FP32 ``b`` meets the bfloat16 gradient: only autocast makes ``grad @ b.t()`` legal)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a @ b


class _Functions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16).view(4, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _Fp32Function.apply(x, self.weight), _AutocastFunction.apply(x, self.weight)


@pytest.mark.parametrize("which", [0, 1], ids=["custom_fwd_fp32", "custom_fwd_custom_bwd"])
def test_custom_fwd_functions_give_autocasts_outputs_and_gradients(which: int) -> None:
    x = torch.linspace(-3.0, 300.0, 32).view(8, 4).requires_grad_()

    def run(context: Any, model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
        x.grad = model.weight.grad = None
        with context:
            out = model(x)[which]
        (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out, x.grad, model.weight.grad

    expected = run(torch.autocast("cpu", dtype=torch.bfloat16), _Functions())
    amp = Amp("O1", half_dtype="bfloat16")
    model = amp.prepare_model(_Functions())
    got = run(amp.forward_context(), model)
    assert got[0].dtype == expected[0].dtype == (torch.float32, torch.bfloat16)[which]
    for mine, theirs in zip(got, expected):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)


class _Rotary(torch.nn.Module):
    """A projection in the half dtype scaled by an FP32 rotary table made in the user's disabled block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 4)
        self.freq = torch.nn.Parameter(torch.linspace(0.9, 1.0, 4)[None])

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        with torch.autocast("cpu", enabled=False):
            angles = positions.float() @ self.freq.float()
            table = angles.cos()
        return h * table.to(h.dtype)


class _Checkpointed(_Rotary):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, positions, use_reentrant=self.reentrant)


def _rotary_grads(model: torch.nn.Module, context: Any, backward: Any = None) -> list[torch.Tensor]:
    x = torch.linspace(-1.0, 1.0, 512 * 4).view(512, 4).requires_grad_()
    positions = torch.arange(512.0)[:, None]
    with context:
        out = model(x, positions)
    loss = out.float().pow(2).mean()
    (backward or torch.Tensor.backward)(loss)
    return [p.grad for p in (model.proj.weight, model.freq)]


def test_backward_through_the_block_gives_autocasts_gradients() -> None:
    """The rotary frequencies' gradient goes through the FP32 table: under the bug its angles were bfloat16 (the
    gradient 0.22 off, where it is 0.09 at most; autocast's and O1's are now the same)."""
    expected = _rotary_grads(_Rotary(), torch.autocast("cpu", dtype=torch.bfloat16))
    amp = Amp("O1", half_dtype="bfloat16")
    got = _rotary_grads(amp.prepare_model(_Rotary()), amp.forward_context(), amp.backward)
    for mine, theirs in zip(got, expected):
        assert mine.dtype == theirs.dtype == torch.float32
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpoint_recomputes_the_block_as_its_forward(reentrant: bool) -> None:
    """An activation checkpoint around the block recomputes it in FP32 as the forward ran it (the recompute runs
    under the forward's autocast state, which torch.utils.checkpoint restores): the same gradients as without."""
    amp = Amp("O1", half_dtype="bfloat16")
    plain = _rotary_grads(amp.prepare_model(_Rotary()), amp.forward_context(), amp.backward)
    amp = Amp("O1", half_dtype="bfloat16")
    got = _rotary_grads(amp.prepare_model(_Checkpointed(reentrant)), amp.forward_context(), amp.backward)
    for mine, theirs in zip(got, plain):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)
    expected = _rotary_grads(_Rotary(), torch.autocast("cpu", dtype=torch.bfloat16))
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)
