"""Complex parameters (a spectral layer's weights, as in Fourier neural operators) at every opt level: their gradients
are unscaled, checked for overflow, measured and clipped as their real views, each against a reference (the complex
arithmetic itself, a ``torch.autocast`` loop, an Apex-style O2 loop written out, Fabric's own "bf16-mixed")."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, unscale_grads_
from lightning_mpx.casting.table import CastTable
from lightning_mpx.scaling import triton_unscale as kernels

S = 2.0**10


class Spectral(nn.Module):
    """A linear layer, then a complex per-channel weight whose real and imaginary parts both reach the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)
        self.phase = nn.Parameter(torch.polar(torch.ones(4), torch.linspace(0.0, 1.0, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x).float() * self.phase
        return z.real + 2.0 * z.imag


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


# -- the unscale call ----------------------------------------------------------------------------------------------
_ON_GPU = torch.cuda.is_available() and not kernels.interpreting()
BACKENDS = [
    ("foreach", "cpu"),
    ("reference", "cpu"),
    pytest.param("triton", "cpu", marks=pytest.mark.skipif(not kernels.interpreting(), reason="no TRITON_INTERPRET")),
    pytest.param("foreach", "cuda", marks=pytest.mark.skipif(not _ON_GPU, reason="no CUDA device")),
    pytest.param("triton", "cuda", marks=pytest.mark.skipif(not _ON_GPU, reason="no CUDA device")),
]


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_unscale_grads_takes_complex_gradients_as_the_complex_arithmetic_does(backend: str, device: str) -> None:
    """torch's ``_amp_foreach_non_finite_check_and_unscale_`` refuses complex tensors; the norm, the clip and the
    overflow flag equal those of the complex values (an inf in an imaginary part flags as one in a real value)."""
    torch.manual_seed(0)
    real = (torch.randn(5) * S).to(device)
    cplx = (torch.randn(3, dtype=torch.complex64) * S).to(device)
    grads = [real.clone(), cplx.clone()]
    found, inv = torch.zeros((), device=device), torch.tensor(1 / S, device=device)
    norm = unscale_grads_(grads, inv, found, max_norm=0.5, backend=backend)
    want_norm = torch.linalg.vector_norm(torch.cat([real / S, (cplx / S).abs()]))
    assert norm is not None and torch.allclose(norm, want_norm)
    coef = 0.5 / (want_norm + 1e-6)
    assert torch.allclose(grads[0], real / S * coef) and torch.allclose(grads[1], cplx / S * coef)
    assert grads[1].dtype == torch.complex64 and found.item() == 0.0

    # out=: a complex master that is its own gradient, unscaled in place
    masters = [torch.zeros(5, device=device), cplx.clone()]
    unscale_grads_([real.bfloat16(), masters[1]], inv, found, out=masters, backend=backend)
    assert torch.equal(masters[1], cplx / S) and found.item() == 0.0

    bad = cplx.clone()
    torch.view_as_real(bad)[1, 1] = math.inf
    unscale_grads_([real.clone(), bad], inv, found, backend=backend)
    assert found.item() == 1.0


# -- the engine ----------------------------------------------------------------------------------------------------
def _amp_run(level: str, steps: int = 2, inject: str | None = None, **settings):
    amp = Amp(level, half_dtype=torch.bfloat16, loss_scale="dynamic", **settings)  # bfloat16 alone: static 1
    model = amp.prepare_model(Spectral())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    taken = []
    for step in range(steps):
        x, y = _data(step)
        with amp.forward_context():
            loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
        amp.backward(loss)
        if inject == "imag":  # one inf in the imaginary part of the complex gradient
            torch.view_as_real(model.phase.grad)[1, 1] = math.inf
        elif inject == "real":
            model.lin.weight.grad[0, 0] = math.inf
        taken.append(amp.step(opt))
        amp.update()
        opt.zero_grad()
    return amp, model, taken


def test_a_complex_parameter_trains_at_o1_as_a_torch_autocast_loop() -> None:
    """O1 (FP32 model, bfloat16 casts, a loss scale of 2**16) gives the weights of a ``torch.autocast`` bfloat16
    loop bit for bit, the complex parameter's imaginary part included (it moved)."""
    _, got, taken = _amp_run("O1", cast_table=CastTable.autocast_aligned("cpu"))
    want = Spectral()
    opt = torch.optim.SGD(want.parameters(), lr=0.5)
    for step in range(2):
        x, y = _data(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(want(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert taken == [True, True]
    for name, value in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], value), name
    assert not torch.equal(got.phase.imag, Spectral().phase.imag)


def test_at_o2_a_complex_parameter_keeps_its_dtype_and_trains_in_fp32_as_an_apex_loop() -> None:
    """``Module.to(torch.bfloat16)`` would drop the imaginary part (a warning only); O2 keeps the complex parameter
    complex64 as its own master, the others in bfloat16 with FP32 masters: the weights of that loop written out."""
    amp, got, taken = _amp_run("O2")
    assert got.phase.dtype == torch.complex64 and got.lin.weight.dtype == torch.bfloat16
    assert amp.master_of(got.phase) is got.phase
    want = Spectral()
    masters = [want.lin.weight.detach().clone(), want.lin.bias.detach().clone(), want.phase]
    half = copy.deepcopy(want.lin).to(torch.bfloat16)
    opt = torch.optim.SGD(masters, lr=0.5)
    scale = 2.0**16
    for step in range(2):
        x, y = _data(step)
        z = half(x.bfloat16()).float() * want.phase
        loss = F.cross_entropy((z.real + 2.0 * z.imag).float(), y)
        (loss * scale).backward()
        masters[0].grad, masters[1].grad = half.weight.grad.float() / scale, half.bias.grad.float() / scale
        want.phase.grad /= scale
        opt.step()
        with torch.no_grad():
            half.weight.copy_(masters[0]), half.bias.copy_(masters[1])
        opt.zero_grad()
        half.zero_grad()
    assert taken == [True, True]
    assert torch.equal(got.phase, want.phase)
    assert torch.equal(amp.master_of(got.lin.weight), masters[0]) and torch.equal(got.lin.weight, half.weight)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_inf_in_a_complex_gradients_imaginary_part_skips_the_step_as_a_real_one_does(level: str) -> None:
    runs = {where: _amp_run(level, steps=1, inject=where) for where in ("imag", "real")}
    for where, (amp, model, taken) in runs.items():
        assert taken == [False], where
        assert amp.scalers[0].scale_tensor.item() == 2.0**15, where
        assert torch.equal(model.phase, Spectral().phase), where


@pytest.mark.parametrize(("level", "how"), [("O1", "group"), ("O1", "append"), ("O3", "append")])
def test_a_complex_parameter_added_after_steps_is_unscaled_as_one(level: str, how: str) -> None:
    """The engine notes which optimizers hold complex parameters once per number of parameters (no look at every
    gradient's dtype on each step): one added later, in a new group or appended to a group's list (the group count
    unchanged: it crashed in torch's kernel, "not implemented for 'ComplexFloat'"), is looked at again, and the step
    is plain SGD's."""
    amp = Amp(level, half_dtype=torch.bfloat16, loss_scale="dynamic")
    model = amp.prepare_model(Spectral())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.lin.parameters(), lr=0.5))
    for step in range(2):
        if step == 1 and how == "group":
            opt.add_param_group({"params": [model.phase]})
        elif step == 1:
            opt.param_groups[0]["params"].append(model.phase)
        x, y = _data(step)
        with amp.forward_context():
            loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
        amp.backward(loss)
        grad = model.phase.grad.clone() / 2.0**16
        assert amp.step(opt) is True
        amp.update()
        opt.zero_grad()
    assert torch.equal(model.phase, Spectral().phase - 0.5 * grad)


def test_telemetry_measures_a_complex_gradient_as_its_real_and_imaginary_parts() -> None:
    """``mpx/underflow`` and ``mpx/zeros`` of a complex gradient are fractions of its 2 * numel parts (never above 1):
    here 3 of 8 parts exactly zero, one below bfloat16's smallest normal number."""
    amp = Amp("O1", half_dtype=torch.bfloat16, loss_scale="dynamic")
    model = amp.prepare_model(Spectral())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    x, y = _data()
    amp.request_telemetry()
    with amp.forward_context():
        loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
    amp.backward(loss)
    model.phase.grad = torch.complex(torch.tensor([0.0, 0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 1.0, 1e-40]))
    amp.step(opt)
    amp.update()
    metrics = amp.metrics()
    assert metrics["mpx/zeros/phase"].item() == 3 / 8 and metrics["mpx/underflow/phase"].item() == 1 / 8


# -- a front door --------------------------------------------------------------------------------------------------
def _fabric_fit(level: str | None) -> nn.Module:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    if level is None:
        fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    else:
        plugin = FabricMixedPrecisionPlugin(level, half_dtype="bfloat16", loss_scale="dynamic")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = Spectral()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    for step in range(2):
        x, y = _data(step)
        fabric.backward(F.cross_entropy(model(x).float(), y))
        fabric.clip_gradients(model, opt, max_norm=0.5)
        opt.step()
        opt.zero_grad()
    return model.module


def test_fabric_trains_a_complex_parameter_at_o1_as_its_bf16_mixed_and_keeps_it_complex_at_o2() -> None:
    pytest.importorskip("lightning.fabric")
    want, got = _fabric_fit(None), _fabric_fit("O1")
    for name, value in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], value), name
    o2 = _fabric_fit("O2")
    assert o2.phase.dtype == torch.complex64 and o2.lin.weight.dtype == torch.bfloat16
    assert torch.allclose(o2.phase, want.phase, atol=1e-2) and not torch.equal(o2.phase.imag, Spectral().phase.imag)
