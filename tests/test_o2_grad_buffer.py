"""O2's FP32 master gradients of a step are views of one new buffer (``lightning_mpx.masters.pairs.GradLayout``).

Before, each master got a gradient of its own per step (``grad.float()``: an allocation and a copy kernel per
parameter, so on a GPU a launch per parameter and step). Now a step makes one buffer and fills it with one
multi-tensor copy: the kernels a step dispatches no longer grow with the number of parameters. What a user sees is
unchanged: the same values, gradients freed when the step ends, masters whose layout differs (channels-last
convolutions) keep gradients of their own layout.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mpx import Amp

# Ops that make views or read metadata: no kernel on a GPU.
_NO_KERNEL = {"as_strided", "view", "_record_function_enter_new", "_record_function_exit", "detach", "alias"}


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _kernels_per_step(layers: int, backend: str) -> collections.Counter[str]:
    torch.manual_seed(0)
    amp = Amp("O2", half_dtype="bfloat16", unscale_backend=backend)
    model = amp.prepare_model(nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)]))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, foreach=True))
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    for step in range(3):
        with amp.forward_context():
            loss = model(x).float().sum()
        amp.backward(loss)
        if step == 2:
            ops = _Ops()
            with ops:
                amp.step(optimizer)
        else:
            amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
    return collections.Counter({k: v for k, v in ops.counts.items() if k not in _NO_KERNEL})


@pytest.mark.parametrize("backend", ["foreach", "reference"])
def test_the_kernels_of_an_o2_step_do_not_grow_with_the_parameters(backend):
    """A deterministic proxy of a GPU step's launches: the ops dispatched by ``amp.step`` that are not views, for 20
    and for 80 parameters. The same count (the reference backend's per-tensor unscale loop aside, which grows by
    design)."""
    small, large = _kernels_per_step(10, backend), _kernels_per_step(40, backend)
    if backend == "foreach":
        assert large == small, (small, large)
    assert large["_to_copy"] == small["_to_copy"] == 0  # no gradient copied one parameter at a time
    assert large["empty"] == small["empty"] == 1  # one buffer for every master's gradient


def _o2(model: nn.Module, x: torch.Tensor) -> tuple[Amp, torch.optim.Optimizer, list[torch.Tensor]]:
    amp = Amp("O2", half_dtype="bfloat16", loss_scale=128.0)
    model = amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with amp.forward_context():
        loss = model(x).float().square().mean()
    amp.backward(loss)
    half_grads = [p.grad.detach().clone() for p in model.parameters()]
    amp.unscale_(optimizer)
    return amp, optimizer, half_grads


def test_master_gradients_share_one_aligned_buffer_and_hold_the_unscaled_half_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    amp, optimizer, half_grads = _o2(model, torch.randn(4, 5, dtype=torch.bfloat16))
    masters = amp.master_params(optimizer)
    grads = [m.grad for m in masters]
    storages = {g.untyped_storage().data_ptr() for g in grads}
    assert len(storages) == 1  # views of one buffer
    assert all((g.data_ptr() - grads[0].data_ptr()) % 256 == 0 for g in grads)  # each view 256-byte aligned
    for grad, half in zip(grads, half_grads):
        assert grad.dtype == torch.float32 and grad.shape == half.shape and grad.is_contiguous()
        torch.testing.assert_close(grad, half.float() / 128.0, rtol=0, atol=0)  # exact: a power-of-two scale
    amp.step(optimizer)
    assert all(m.grad is None for m in masters)  # freed when the step ends, as before


def test_channels_last_masters_keep_gradients_of_their_own_layout():
    """A channels-last convolution's master is not contiguous: the masters then get gradients of their own, in
    their layout, as before (a buffer of views would hand the unscale mismatched layouts)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3)).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    amp, optimizer, half_grads = _o2(model, x)
    masters = amp.master_params(optimizer)
    for master, half in zip(masters, half_grads):
        assert master.grad.stride() == master.stride()
        torch.testing.assert_close(master.grad, half.float() / 128.0, rtol=0, atol=0)
