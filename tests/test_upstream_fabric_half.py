"""Lightning Fabric's own tests of its half-precision plugin, ported to ``FabricMixedPrecisionPlugin``.

Upstream (Lightning 2.6.5, the tests of the installed 2.6.6): ``tests/tests_fabric/plugins/precision/test_half.py``,
which holds Fabric's ``HalfPrecision`` ("bf16-true", "16-true") to its contract: the precision it reports, the dtype
it casts inputs to, the default dtype inside its module-init and forward contexts, and the module it converts. O2 is
the plugin's "*-true" level (it reports "bf16-true"/"16-true"); O1 reports "*-mixed" and is held here to Fabric's
``MixedPrecision`` instead (FP32 weights, the default dtype left alone). Each test is named after its upstream test
and runs under O1/O2 x float16/bfloat16; docs/testing.md ("Ported framework tests") lists each deliberate difference.
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin

HALVES = ("float16", "bfloat16")
CASES = [pytest.param(level, half, id=f"{level}-{half}") for level in ("O1", "O2") for half in HALVES]


def _dtype(half: str) -> torch.dtype:
    return getattr(torch, half)


def _expected_default_dtype(level: str, half: str) -> torch.dtype:
    """Fabric's "*-true" (``HalfPrecision``) makes the half dtype the default; its "*-mixed" leaves FP32.

    Ours (a deliberate difference at O2, docs/fabric.md "What differs"): FP32 at every level. A model built in
    ``fabric.init_module()`` keeps its FP32 weights until set-up casts it, so that O2's masters are those FP32 values
    and not their rounding; in the forward, tensors made without a dtype (a mask, a loss's constant) stay FP32, as
    the losses O2 runs in FP32 expect."""
    return torch.float32


@pytest.mark.parametrize(("level", "half"), CASES)
def test_selected_dtype(level, half):
    """Upstream ``test_half.py::test_selected_dtype``: ``plugin.precision`` is the precision asked for and the inputs
    are converted to its dtype (``_desired_input_dtype``).

    Ours: the plugin reports Fabric's name of what it does ("16-true"/"bf16-true" at O2, whose model is half;
    "16-mixed"/"bf16-mixed" at O1) and at O2 a set-up model's floating inputs are cast to the half dtype, other
    tensors left alone. (O1's inputs: ``test_upstream_fabric_amp.py::test_amp_input_dtype``.)"""
    plugin = FabricMixedPrecisionPlugin(level, half_dtype=half)
    prefix = "bf16" if half == "bfloat16" else "16"
    assert plugin.precision == f"{prefix}-true" if level == "O2" else f"{prefix}-mixed"
    if level == "O2":
        data = {"x": torch.randn(2), "ids": torch.arange(2), "x64": torch.randn(2, dtype=torch.float64)}
        converted = plugin.convert_input(data)
        assert converted["x"].dtype == converted["x64"].dtype == _dtype(half)
        assert converted["ids"].dtype == torch.int64


@pytest.mark.parametrize(("level", "half"), CASES)
def test_module_init_context(level, half):
    """Upstream ``test_half.py::test_module_init_context``: inside ``module_init_context()`` the default dtype is the
    half dtype, and a module built there has half weights (Fabric's "*-mixed": FP32 both). Ours: FP32 at O1 and O2
    (see ``_expected_default_dtype``); set-up casts an O2 model to half (``test_module_init_context_then_setup``)."""
    plugin = FabricMixedPrecisionPlugin(level, half_dtype=half)
    expected = _expected_default_dtype(level, half)
    with plugin.module_init_context():
        model = torch.nn.Linear(2, 2)
        assert torch.get_default_dtype() == expected
    assert model.weight.dtype == expected
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(("level", "half"), CASES)
def test_module_init_context_then_setup(level, half):
    """Upstream ``test_half.py::test_module_init_context``'s end result, through Fabric: a module built in
    ``fabric.init_module()`` and set up holds half weights at O2 (FP32 at O1), and trains."""
    # float16: a first scale of 1024, not 2**16, under which this loss's gradients overflow
    plugin = FabricMixedPrecisionPlugin(level, half_dtype=half, init_scale=1024.0)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    with fabric.init_module():
        model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    assert model.weight.dtype == model.bias.dtype == (_dtype(half) if level == "O2" else torch.float32)
    before = plugin.amp.master_of(model.weight).clone()
    fabric.backward(model(torch.randn(3, 2)).sum())
    optimizer.step()
    assert not plugin.step_was_skipped(optimizer)
    assert not torch.equal(plugin.amp.master_of(model.weight), before)


@pytest.mark.parametrize(("level", "half"), CASES)
def test_forward_context(level, half):
    """Upstream ``test_half.py::test_forward_context``: inside ``forward_context()`` the default dtype is the half
    dtype, and FP32 again after it (Fabric's "*-mixed": FP32 throughout). Ours: FP32 throughout at O1 and O2 (see
    ``_expected_default_dtype``)."""
    plugin = FabricMixedPrecisionPlugin(level, half_dtype=half)
    assert torch.get_default_dtype() == torch.float32
    with plugin.forward_context():
        assert torch.get_default_dtype() == _expected_default_dtype(level, half)
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(("level", "half"), CASES)
def test_convert_module(level, half):
    """Upstream ``test_half.py::test_convert_module``: the module's weight and bias become the half dtype.

    Ours: at O2 they do, in place (the same module and parameters); at O1 they stay FP32, as with Fabric's
    "*-mixed". Batch norm stays FP32 at O2 (``keep_batchnorm_fp32``, a deliberate difference from "*-true", which
    casts it too)."""
    plugin = FabricMixedPrecisionPlugin(level, half_dtype=half)
    module = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    linear, norm = module
    weight = linear.weight
    assert linear.weight.dtype == linear.bias.dtype == torch.float32
    assert plugin.convert_module(module) is module
    expected = _dtype(half) if level == "O2" else torch.float32
    assert linear.weight is weight
    assert linear.weight.dtype == linear.bias.dtype == expected
    assert norm.weight.dtype == norm.bias.dtype == norm.running_mean.dtype == torch.float32
