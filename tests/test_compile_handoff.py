"""Compiled code under an O1 scope entered outside it makes no call into the cast hook (forward and backward) once
handed off (``CastPolicy.hand_off_compiled``), and matches eager within half precision; the plugins' paths are in
``tests/test_compile_handoff_plugins.py``.

Calls into the hook are counted as tests/compile_helpers.py says; the compiled runs use the ``aot_eager`` backend.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

from lightning_mpx import CastPolicy, disable_casts
from tests.compile_helpers import HALF, HookCounter, LossNet, assert_one_graph, step_batch

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _policy_steps(net: nn.Module, policy: CastPolicy, run: Callable[..., torch.Tensor], steps: int = 4
                  ) -> tuple[list[float], list[int]]:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses, calls = [], []
    for step in range(steps):
        batch = step_batch(step)
        with HookCounter() as counter:
            with policy.scope():
                loss = run(*batch)
            policy.backward(loss)
        calls.append(counter.calls)
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        policy.clear_cache()
    return losses, calls


def test_handed_off_compiled_module_makes_no_hook_call_and_matches_eager():
    eager_net, net = LossNet(), LossNet()
    eager_policy, policy = CastPolicy(half_dtype=HALF), CastPolicy(half_dtype=HALF)
    eager, eager_calls = _policy_steps(eager_net, eager_policy, eager_net)
    compiled = torch.compile(net, backend="aot_eager")
    handles = policy.hand_off_compiled(compiled)
    assert len(handles) == 1
    losses, calls = _policy_steps(net, policy, compiled)
    assert min(eager_calls) > 0  # eager: one call per torch call of the step
    assert calls[1:] == [0, 0, 0], calls  # forward and backward, after the first (compiling) step
    assert_one_graph()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager), rtol=1e-2, atol=1e-2)
    for handle in handles:
        handle.remove()
    assert "forward" not in net.__dict__


def test_without_hand_off_the_outer_mode_sees_the_compiled_runtime():
    # The case the hand-off exists for (and what a broken hand-off looks like).
    net, policy = LossNet(), CastPolicy(half_dtype=HALF)
    _, calls = _policy_steps(net, policy, torch.compile(net, backend="aot_eager"))
    assert min(calls) > 0


def test_handed_off_module_keeps_eager_semantics_outside_scope_disabled_and_on_error():
    net, policy = LossNet(), CastPolicy(half_dtype=HALF)
    seen: list[torch.dtype] = []
    net.fc1.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    compiled = torch.compile(net, backend="aot_eager")
    policy.hand_off_compiled(compiled)
    x, y = step_batch(0)
    compiled(x, y)  # no scope: FP32 as in eager
    with policy.scope():
        compiled(x, y)
        with disable_casts():
            compiled(x, y)  # casts disabled: FP32 as in eager
    assert seen == [torch.float32, HALF, torch.float32]
    with pytest.raises(IndexError):
        with policy.scope():
            compiled(x, torch.tensor([9] * 8))  # a class index out of range
    assert not torch.overrides._get_current_function_mode_stack()
    assert policy._handed_off is False


class _CheckpointedThenCompiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU())
        self.net = LossNet()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.pre, x, use_reentrant=False)
        return self.net(h, y)


def test_eager_checkpoint_recomputes_with_casts_after_a_compiled_backward():
    # The compiled graph's backward runs first and leaves the recompute mode; the eager checkpoint after it must
    # still recompute with the forward's casts (a dtype mismatch would raise or change the gradients).
    grads = []
    for compiled in (False, True):
        model, policy = _CheckpointedThenCompiled(), CastPolicy(half_dtype=HALF)
        if compiled:
            model.net = torch.compile(model.net, backend="aot_eager")
            policy.hand_off_compiled(model)
        x, y = step_batch(1)
        with policy.scope():
            loss = model(x, y)
        policy.backward(loss)
        grads.append({name: p.grad for name, p in model.named_parameters()})
    names = [n.replace("._orig_mod", "") for n in grads[1]]
    assert names == list(grads[0])
    for (name, grad), compiled_grad in zip(grads[0].items(), grads[1].values()):
        assert compiled_grad.dtype == torch.float32
        torch.testing.assert_close(compiled_grad, grad, rtol=2e-2, atol=2e-3, msg=name)


def test_policy_backward_is_tensor_backward_in_the_recompute_scope():
    net, policy = LossNet(), CastPolicy(half_dtype=HALF)
    x, y = step_batch(2)
    with policy.scope():
        loss = net(x, y)
    with HookCounter() as counter:
        policy.backward(loss, retain_graph=True)
    assert counter.calls == 0
    first = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    with policy.recompute_scope():
        loss.backward()
    torch.testing.assert_close([p.grad for p in net.parameters()], first)
    with pytest.raises(RuntimeError, match="implicitly created only for scalar"):
        with policy.scope():
            out = net.fc1(x)
        policy.backward(out)


def test_the_search_for_compiled_graphs_runs_once_something_was_compiled(monkeypatch):
    # An eager model's backward that recomputes a checkpoint (so enters a recompute mode) does not look for compiled
    # graphs' nodes until torch.compile has made one in the process (dynamo's count, emptied by the fresh_dynamo
    # fixture); then it does, and the compiled backward makes no call into the hook (the tests above). A backward
    # with nothing to recompute enters no mode, and has nothing to look for.
    from torch.utils.checkpoint import checkpoint

    from lightning_mpx.casting import checkpointing as cast_policy

    searched: list[int] = []
    search = cast_policy._leave_compiled_backward
    monkeypatch.setattr(
        cast_policy, "_leave_compiled_backward", lambda p, roots: searched.append(1) or search(p, roots)
    )
    net, policy = LossNet(), CastPolicy(half_dtype=HALF, engine="mode")
    x, y = step_batch(3)
    with policy.scope():
        loss = checkpoint(net, x, y, use_reentrant=False)
    policy.backward(loss)
    policy.clear_cache()
    assert searched == []
    torch.compile(nn.Linear(2, 2), backend="aot_eager")(torch.randn(1, 2, requires_grad=True)).sum().backward()
    with policy.scope():
        loss = checkpoint(net, x, y, use_reentrant=False)
    policy.backward(loss)
    policy.clear_cache()
    policy.clear_cache()  # two iteration boundaries: the checkpoint's note is gone (one is kept across a boundary)
    assert searched == [1]
    with policy.scope():
        loss = net(x, y)
    policy.backward(loss)
    assert searched == [1]
