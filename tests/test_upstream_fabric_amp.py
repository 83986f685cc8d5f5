"""Lightning Fabric's own tests of its mixed-precision plugin, ported to ``FabricMixedPrecisionPlugin``.

Upstream (Lightning 2.6.5, the tests of the installed 2.6.6): ``tests/tests_fabric/plugins/precision/test_amp.py`` and
``tests/tests_fabric/plugins/precision/test_amp_integration.py``, which hold Fabric's ``MixedPrecision`` ("16-mixed",
"bf16-mixed") to its contract: a scaler for float16 and none for bfloat16, the forward in the half dtype, the loss
scaled before backward, the step taken through the scaler and the scale updated once per step, bad arguments refused.
Each test here is named after its upstream test and runs under O1/O2 x float16/bfloat16 on real objects where
upstream checks calls on mocks. Where the plugin differs from Fabric's own precision on purpose, the test asserts the
plugin's behaviour and docs/testing.md ("Ported framework tests") says why.
"""

from __future__ import annotations

import copy
import pickle
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric, seed_everything
from torch import nn

from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin

HALVES = ("float16", "bfloat16")
CASES = [pytest.param(level, half, id=f"{level}-{half}") for level in ("O1", "O2") for half in HALVES]
SCALE = 1024.0


def _dtype(half: str) -> torch.dtype:
    return getattr(torch, half)


def _plugin(level: str, half: str, **settings: Any) -> FabricMixedPrecisionPlugin:
    return FabricMixedPrecisionPlugin(level, half_dtype=half, **settings)


def _scaled_plugin(level: str, half: str, **settings: Any) -> FabricMixedPrecisionPlugin:
    """A plugin whose loss scale is dynamic and starts at ``SCALE`` for both half dtypes (bfloat16's default is a
    static 1.0, under which a scaled gradient cannot be told from a true one)."""
    return _plugin(level, half, loss_scale="dynamic", init_scale=SCALE, **settings)


def _fabric(plugin: FabricMixedPrecisionPlugin) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, plugins=[plugin])


class RecordingSGD(torch.optim.SGD):
    """SGD that records the keyword arguments each ``step`` received (upstream checks them on a mock)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.step_kwargs: list[dict[str, Any]] = []

    def step(self, closure: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        self.step_kwargs.append(kwargs)
        return super().step(closure)


def _linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(8, 4)


# -- tests_fabric/plugins/precision/test_amp.py ----------------------------------------------------------------------
@pytest.mark.parametrize(("level", "half"), CASES)
def test_amp_precision_default_scaler(level, half):
    """Upstream ``test_amp.py::test_amp_precision_default_scaler``: ``"16-mixed"`` builds a ``GradScaler``.

    Ours: float16 gets one dynamic loss scaler (``amp.scalers[0]``) that starts at torch's ``GradScaler`` default,
    2**16, and backs off and grows by torch's factors."""
    plugin = _plugin(level, half)
    assert len(plugin.amp.scalers) == 1
    scaler = plugin.amp.scalers[0]
    reference = torch.amp.GradScaler("cpu")
    if half == "float16":
        assert scaler.dynamic
        assert scaler.get_scale() == reference.get_scale() == 2.0**16
        assert scaler.growth_factor == reference.get_growth_factor()
        assert scaler.backoff_factor == reference.get_backoff_factor()
    else:
        assert not scaler.dynamic and scaler.get_scale() == 1.0


@pytest.mark.parametrize(("level", "half"), CASES)
def test_amp_precision_scaler_with_bf16(level, half):
    """Upstream ``test_amp.py::test_amp_precision_scaler_with_bf16``: ``"bf16-mixed"`` has no scaler and refuses one.

    Ours (a deliberate difference): bfloat16 defaults to a static scale of 1.0 (no scaling, as Fabric) but accepts
    ``loss_scale="dynamic"`` or a static scale when asked, for both half dtypes."""
    plugin = _plugin(level, half)
    assert plugin.amp.scalers[0].dynamic == (half == "float16")
    plugin = _plugin(level, half, loss_scale="dynamic", init_scale=SCALE)
    assert plugin.amp.scalers[0].dynamic and plugin.amp.scalers[0].get_scale() == SCALE
    plugin = _plugin(level, half, loss_scale=128.0)
    assert not plugin.amp.scalers[0].dynamic and plugin.amp.scalers[0].get_scale() == 128.0


@pytest.mark.parametrize(("level", "half"), CASES)
def test_amp_precision_forward_context(level, half):
    """Upstream ``test_amp.py::test_amp_precision_forward_context``: the forward context is ``torch.autocast`` in the
    half dtype, and the default dtype stays FP32.

    Ours (a deliberate difference): the forward context is the engine's; at O1 ``torch.autocast`` reports on inside it
    (as upstream; the engine's marker) and the cast table runs a matmul in the half dtype as autocast would; at O2
    the model itself is half, so an FP32 matmul stays FP32 and a loss function of half tensors runs in FP32."""
    plugin = _plugin(level, half)
    assert plugin.precision == ("bf16" if half == "bfloat16" else "16") + ("-mixed" if level == "O1" else "-true")
    assert torch.get_default_dtype() == torch.float32
    a = torch.randn(4, 4)
    h = torch.randn(4, 4, dtype=_dtype(half))
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") is (level == "O1")  # as upstream at O1 (the cast table's marker)
        assert torch.get_default_dtype() == torch.float32
        assert torch.mm(a, a).dtype == (_dtype(half) if level == "O1" else torch.float32)
        assert F.mse_loss(h, h).dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32
    assert torch.mm(a, a).dtype == torch.float32  # the context ends with the block


@pytest.mark.parametrize(("level", "half"), CASES)
def test_amp_precision_backward(level, half):
    """Upstream ``test_amp.py::test_amp_precision_backward``: backward scales the loss with the scaler and passes
    the other arguments to ``tensor.backward``.

    Ours, on a real model through ``fabric.backward``: the gradients are the FP32 model's times the loss scale, and a
    positional ``gradient`` and ``retain_graph=True`` reach ``Tensor.backward`` (a second backward on the same graph
    doubles them)."""
    plugin = _scaled_plugin(level, half)
    fabric = _fabric(plugin)
    model = _linear()
    reference = copy.deepcopy(model)
    fabric_model = fabric.setup_module(model)
    x = torch.randn(3, 8)

    loss = fabric_model(x).sum()
    fabric.backward(loss, torch.tensor(1.0), retain_graph=True)
    first = model.weight.grad.detach().float().clone()
    fabric.backward(loss)  # the graph was retained
    torch.testing.assert_close(model.weight.grad.float(), 2 * first)

    reference(x).sum().backward()
    torch.testing.assert_close(first / SCALE, reference.weight.grad, rtol=2e-2, atol=1e-2)
    assert model.weight.grad.dtype == (torch.float32 if level == "O1" else _dtype(half))


@pytest.mark.parametrize(("level", "half"), CASES)
def test_amp_precision_optimizer_step_with_scaler(level, half):
    """Upstream ``test_amp.py::test_amp_precision_optimizer_step_with_scaler``: ``optimizer_step`` calls
    ``scaler.step(optimizer, **kwargs)`` and then ``scaler.update()`` once.

    Ours, against ``torch.amp.GradScaler`` on an FP32 twin: a step on finite gradients is the optimizer's step on the
    unscaled gradients (its keyword arguments passed on), a step on an inf gradient is skipped, and the scale moves
    once per step as GradScaler's does (``growth_interval=1``: doubled after a good step, halved after a skip)."""
    plugin = _scaled_plugin(level, half, growth_interval=1)
    fabric = _fabric(plugin)
    model = _linear()
    reference = copy.deepcopy(model)
    optimizer = RecordingSGD(model.parameters(), lr=0.1)
    fabric_model, fabric_optimizer = fabric.setup(model, optimizer)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
    x = torch.randn(3, 8)

    scales = []
    for overflow in (False, True):
        before = model.weight.detach().clone()
        fabric.backward(fabric_model(x).sum())
        scaler.scale(reference(x).sum()).backward()
        if overflow:
            model.weight.grad[0, 0] = float("inf")
            reference.weight.grad[0, 0] = float("inf")
        plugin.optimizer_step(fabric_optimizer, keyword="arg")  # as upstream (Fabric's wrapper takes only a closure)
        scaler.step(ref_optimizer)
        scaler.update()
        assert plugin.step_was_skipped(fabric_optimizer) == overflow
        if overflow:
            assert torch.equal(model.weight, before)
        else:
            torch.testing.assert_close(model.weight.float(), reference.weight, rtol=2e-2, atol=1e-2)
        fabric_optimizer.zero_grad()
        ref_optimizer.zero_grad()
        plugin.metrics()  # the iteration's scale update is due at the next call into the plugin
        scales.append((plugin.amp.scalers[0].get_scale(), scaler.get_scale()))

    assert optimizer.step_kwargs == [{"keyword": "arg"}]  # the skipped step did not call the optimizer
    assert scales == [(2 * SCALE, 2 * SCALE), (SCALE, SCALE)]


@pytest.mark.parametrize(("level", "half"), CASES)
def test_amp_precision_optimizer_step_without_scaler(level, half):
    """Upstream ``test_amp.py::test_amp_precision_optimizer_step_without_scaler``: without a scaler (bfloat16),
    ``optimizer_step`` is ``optimizer.step(**kwargs)``.

    Ours: with a static scale of 1.0 (bfloat16's default; asked for float16) the step is the optimizer's own step on
    the gradients as they are (at O2 on the FP32 masters, then copied to the half model)."""
    settings = {} if half == "bfloat16" else {"loss_scale": 1.0}
    plugin = _plugin(level, half, **settings)
    fabric = _fabric(plugin)
    model = _linear()
    fp32_weight = model.weight.detach().clone()
    optimizer = RecordingSGD(model.parameters(), lr=0.1)
    fabric_model, fabric_optimizer = fabric.setup(model, optimizer)

    fabric.backward(fabric_model(torch.randn(3, 8)).sum())
    grad = model.weight.grad.detach().float().clone()
    plugin.optimizer_step(fabric_optimizer, keyword="arg")

    expected = fp32_weight - 0.1 * grad
    if level == "O2":
        torch.testing.assert_close(plugin.amp.master_of(model.weight), expected)
        expected = expected.to(_dtype(half))
    torch.testing.assert_close(model.weight.detach(), expected)
    assert optimizer.step_kwargs == [{"keyword": "arg"}]


@pytest.mark.parametrize("plugin_cls", ["fabric", "trainer"])
def test_amp_precision_parameter_validation(plugin_cls):
    """Upstream ``test_amp.py::test_amp_precision_parameter_validation``: ``MixedPrecision("16")``, ``(16)``,
    ``("bf16")`` raise ``ValueError`` naming the argument and the valid choices.

    Ours, for both plugins: a bad ``opt_level`` or ``half_dtype`` raises ``ValueError`` naming the argument, the
    value and the valid choices, when the plugin is built."""
    from lightning_mpx import MixedPrecisionPlugin

    cls = FabricMixedPrecisionPlugin if plugin_cls == "fabric" else MixedPrecisionPlugin
    for level in ("O1", "O2"):
        for half in HALVES:
            cls(level, half_dtype=half)  # should not raise
    levels = "valid choices: 'O0', 'O1', 'O2', 'O3'"
    for bad in ("16", 16, "bf16", "16-mixed", "O4"):
        with pytest.raises(ValueError, match=re.escape(f"opt_level={bad!r} is not an opt level; {levels}")):
            cls(bad)
    with pytest.raises(ValueError, match="the letter O, not the digit zero: did you mean 'O1'"):
        cls("01")
    with pytest.raises(ValueError, match=r"half_dtype='float32' is not a half-precision dtype; valid choices: .*"):
        cls("O1", half_dtype="float32")


# -- tests_fabric/plugins/precision/test_amp_integration.py -----------------------------------------------------------
class MixedPrecisionModule(nn.Module):
    """Upstream's module, recording what it sees in its forward instead of asserting there (so that each dtype is
    checked on its own, and the O1 input's, a deliberate difference, apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)
        self.seen: dict[str, Any] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.layer(x)
        self.seen = {"input": x.dtype, "output": output.dtype, "autocast": torch.is_autocast_enabled(x.device.type)}
        return output


def _test_amp(fabric: Fabric) -> dict[str, Any]:
    """Upstream's ``_test_amp``: one step, returning the dtypes it saw and whether the FP32 weights moved."""
    model = MixedPrecisionModule()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    plugin = fabric._precision

    batch = torch.rand(2, 32, device=fabric.device)
    seen: dict[str, Any] = {"weight": model.layer.weight.dtype, "batch": batch.dtype}
    output = model(batch)
    seen.update(model.module.seen, wrapped_output=output.dtype)

    loss = torch.nn.functional.mse_loss(output, torch.ones_like(output))
    fabric.backward(loss)
    seen["grad"] = model.layer.weight.grad.dtype
    plugin.unscale_gradients(optimizer)
    seen["main_grads"] = sorted({str(p.grad.dtype) for p in plugin.main_params(optimizer)})

    before = plugin.amp.master_of(model.layer.weight).clone()
    optimizer.step()
    seen["stepped"] = not torch.equal(plugin.amp.master_of(model.layer.weight), before)
    optimizer.zero_grad()
    return seen


def _check_amp(seen: dict[str, Any], level: str, half: str) -> None:
    half_dtype = _dtype(half)
    # Fabric's "*-mixed" keeps FP32 weights and gradients; O2 (a deliberate difference) holds the model in half, its
    # gradients in half, and the FP32 values in the masters the optimizer steps.
    weights = torch.float32 if level == "O1" else half_dtype
    assert seen["weight"] == seen["grad"] == weights
    assert seen["main_grads"] == ["torch.float32"]
    assert seen["batch"] == torch.float32
    assert seen["output"] == half_dtype  # the layer ran in half
    assert seen["wrapped_output"] == torch.float32  # and the set-up model's output comes back in FP32
    # O1: torch.autocast reports on inside the forward, as upstream asserts (the cast table runs the casts; since stop
    # 73 O1 turns autocast on as a marker so that a user's torch.autocast(enabled=False) block is honoured); O2: the
    # half model, no autocast (a deliberate difference)
    assert seen["autocast"] is (level == "O1")
    assert seen["stepped"]


@pytest.mark.parametrize(("level", "half"), CASES)
def test_amp(level, half):
    """Upstream ``test_amp_integration.py::test_amp`` (there under ``ddp_spawn`` on two CPU processes; here on one,
    see ``test_amp_ddp_spawn_pickle``): inside the forward the input and the layer's output are in the half
    dtype, outside the model the output is FP32, weights and gradients FP32 (at O2: half, with FP32 gradients on
    the masters the optimizer steps, a deliberate difference), and the step runs.

    The input's dtype is checked in ``test_amp_input_dtype``."""
    seen = _test_amp(_fabric(_plugin(level, half, init_scale=SCALE)))
    _check_amp(seen, level, half)


@pytest.mark.parametrize(("level", "half"), CASES)
def test_amp_input_dtype(level, half):
    """Upstream ``test_amp_integration.py::test_amp``'s ``assert x.dtype == self.expected_dtype``: Fabric's mixed
    precision casts the floating inputs of a set-up model to the half dtype.

    Ours (a deliberate difference at O1, docs/fabric.md "What differs"): O2 casts them (its model is half); O1 passes
    them on in FP32, because the cast table casts op by op: an op it keeps in FP32 (a softmax, a loss, a norm on the
    input) sees the input itself, not its rounding, and a matmul casts it there."""
    seen = _test_amp(_fabric(_plugin(level, half, init_scale=SCALE)))
    assert seen["input"] == (_dtype(half) if level == "O2" else torch.float32)


@pytest.mark.parametrize(("level", "half"), CASES)
def test_amp_ddp_spawn_pickle(level, half):
    """Upstream ``test_amp_integration.py::test_amp`` runs under ``strategy="ddp_spawn"``, which pickles Fabric and its
    precision plugin into each new process. Here the plugin goes through the same pickling and the unpickled one
    trains as ``test_amp`` does, in this process (two spawned processes cost tens of seconds on two cores; the
    plugin's two-process DDP run: ``tests/test_fabric.py::test_ddp_two_processes_skip_together_and_stay_identical``)."""
    plugin = pickle.loads(pickle.dumps(_plugin(level, half, init_scale=SCALE)))
    assert (plugin.opt_level, plugin.amp.half_dtype) == (level, _dtype(half))
    _check_amp(_test_amp(_fabric(plugin)), level, half)


@pytest.mark.parametrize(("level", "half"), CASES)
def test_amp_fused_optimizer_parity(level, half):
    """Upstream ``test_amp_integration.py::test_amp_fused_optimizer_parity`` (CUDA and float16 there; torch has a
    fused CPU Adam, so here on CPU): the fused and the unfused Adam give the same losses and weights through the
    plugin. Unlike Fabric's "16-mixed", the plugin, not the fused optimizer, unscales."""

    def run(fused: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[bool]]:
        seed_everything(1234, verbose=False)
        plugin = _plugin(level, half, init_scale=SCALE)  # float16: 2**16 would skip most of the five steps
        fabric = _fabric(plugin)
        model = nn.Linear(10, 10)
        optimizer = torch.optim.Adam(model.parameters(), lr=1.0, fused=fused)
        model, optimizer = fabric.setup(model, optimizer)
        assert plugin.amp.scalers[0].dynamic == (half == "float16")

        data = torch.randn(10, 10)
        target = torch.randn(10, 10)
        losses, skipped = [], []
        for _ in range(5):
            optimizer.zero_grad()
            output = model(data)
            loss = (output - target).abs().sum()
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.detach())
            skipped.append(plugin.step_was_skipped(optimizer))
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()], skipped

    losses, params, skipped = run(fused=False)
    losses_fused, params_fused, skipped_fused = run(fused=True)
    assert skipped == skipped_fused == [False] * 5  # every step taken: the comparison is of five Adam steps
    torch.testing.assert_close(losses, losses_fused)
    for p, q in zip(params, params_fused):
        torch.testing.assert_close(p, q)
