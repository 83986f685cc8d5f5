"""``fp32_modules``: modules pinned to FP32 up front, at every opt level, in the plugin, the adapter and ``Amp``."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin
from lightning_mpx.casting.policy import CastPolicy, fp32_scope
from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
from tests.lightning_helpers import make_trainer

PATTERNS = ["head", "*.norm"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.fc(x)))


class Net(nn.Module):
    """Two blocks with a layer norm each, and a two-layer head; records the dtypes its layers really see."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        self.seen: dict[str, tuple[torch.dtype, ...]] = {}
        # Hooks of the test (a pinned module's own output hook, prepended when the model is prepared, runs first).
        for name in ("blocks.0.fc", "blocks.0.norm", "head.0"):
            self.get_submodule(name).register_forward_hook(self._record(name))
        self.blocks[1].fc.register_forward_pre_hook(self._record_input("blocks.1.fc"))

    def _record(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            self.seen[name] = (module.weight.dtype, args[0].dtype, output.dtype)

        return hook

    def _record_input(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.seen[name + ":input"] = (args[0].dtype,)

        return hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def data(n: int = 32) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4] > 0).long().sum(1) % 4
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class NetModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


HALF, FP32 = torch.bfloat16, torch.float32  # the dtype is not the point here: bfloat16 is fast on a CPU


def check_seen(seen: dict[str, tuple[torch.dtype, ...]], level: str) -> None:
    """What each layer computed in, for a model with ``head`` and the norms pinned to FP32."""
    if level == "O1":
        assert seen["blocks.0.fc"] == (FP32, FP32, HALF)  # the cast table: a matmul in half
        assert seen["head.0"] == (FP32, FP32, FP32)  # the same matmul inside the pinned head: FP32
        assert seen["blocks.0.norm"] == (FP32, FP32, FP32)  # its half input cast to FP32 at its boundary
        assert seen["blocks.1.fc:input"] == (FP32,)  # O1 leaves FP32 outputs to the policy
    else:
        assert seen["blocks.0.fc"] == (HALF, HALF, HALF)
        assert seen["head.0"] == (FP32, FP32, FP32)  # FP32 parameters, inputs cast to FP32 at the head's boundary
        # FP32 weights and input (so an FP32 layer norm); the output the model sees is cast back to half
        assert seen["blocks.0.norm"] == (FP32, FP32, HALF)
        assert seen["blocks.1.fc:input"] == (HALF,)  # the norm's output goes back to half for the next half layer


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_lightning_runs_pinned_modules_in_fp32(level: str) -> None:
    module = NetModule()
    before = module.model.head[0].weight.detach().clone()
    plugin = MixedPrecisionPlugin(level, fp32_modules=PATTERNS, half_dtype=HALF)
    make_trainer(plugin, max_steps=3).fit(module, data())
    amp = plugin.amp
    assert amp.fp32_modules == ["model.blocks.0.norm", "model.blocks.1.norm", "model.head"]
    check_seen(module.model.seen, level)
    head = module.model.head[0].weight
    assert not torch.equal(head.detach(), before)  # trained
    assert amp.master_of(head) is head  # an FP32 parameter is its own master
    metrics = plugin.metrics()
    assert {k: v for k, v in metrics.items() if k.startswith("mpx/promoted/")} == {
        "mpx/promoted/model.blocks.0.norm": 1.0, "mpx/promoted/model.blocks.1.norm": 1.0, "mpx/promoted/model.head": 1.0
    }


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_accelerator_runs_pinned_modules_in_fp32(level: str) -> None:
    handler = MixedPrecisionKwargs(fp32_modules=PATTERNS, half_dtype=HALF)
    accelerator = Accelerator(mixed_precision=level, cpu=True, kwargs_handlers=[handler])
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, data())
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert accelerator.amp.fp32_modules == ["blocks.0.norm", "blocks.1.norm", "head"]
    assert torch.isfinite(loss)
    check_seen(accelerator.unwrap_model(model).seen, level)
    assert "mpx/promoted/head" in accelerator.mpx_metrics()


def test_o3_and_o0() -> None:
    for level, dtype in (("O3", HALF), ("O0", FP32)):
        model = Net()
        amp = Amp(level, fp32_modules=PATTERNS, half_dtype=HALF)
        amp.prepare_model(model)
        assert amp.fp32_modules == ["blocks.0.norm", "blocks.1.norm", "head"]
        assert model.blocks[0].fc.weight.dtype == dtype and model.head[2].weight.dtype == FP32
        out = amp.cast_outputs(model(amp.cast_inputs(torch.randn(4, 16))))
        assert out.dtype == FP32 and torch.isfinite(out).all()


def test_a_deep_copy_keeps_the_fp32_boundary() -> None:
    """EMA callbacks and ``AveragedModel`` deep-copy the model: the copy's FP32 modules still work at O2."""
    model = Net()
    amp = Amp("O2", fp32_modules=["head"], half_dtype=HALF)
    amp.prepare_model(model)
    twin = copy.deepcopy(model)
    x = amp.cast_inputs(torch.randn(4, 16))
    assert torch.equal(twin(x), model(x))
    assert twin.head[0].weight.dtype == FP32


def test_nested_patterns_pin_the_outermost_module_once() -> None:
    model = Net()
    amp = Amp("O2", fp32_modules=["blocks.0", "blocks.0.*", "*.fc"], half_dtype=HALF)
    amp.prepare_model(model)
    assert amp.fp32_modules == ["blocks.0", "blocks.1.fc"]
    assert model(amp.cast_inputs(torch.randn(4, 16))).dtype == HALF


def test_o1_fp32_scope_restores_the_policy_on_exit_and_error() -> None:
    policy = CastPolicy(half_dtype=HALF)
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with policy.scope():
        assert layer(x).dtype == HALF
        with fp32_scope():
            with fp32_scope():
                assert layer(x).dtype == FP32
            assert layer(x).dtype == FP32
        assert layer(x).dtype == HALF
        with pytest.raises(KeyError):
            with fp32_scope():
                raise KeyError("inside")
        assert layer(x).dtype == HALF

    class Failing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("inside the pinned module")

    model = nn.Sequential(nn.Linear(4, 4), Failing())
    amp = Amp("O1", fp32_modules=["1"], half_dtype=HALF)
    amp.prepare_model(model)
    with amp.forward_context():
        with pytest.raises(RuntimeError, match="inside the pinned module"):
            model(x)
        assert model[0](x).dtype == HALF  # the failed forward left the policy as it was


def test_bad_patterns_raise() -> None:
    model = Net()
    amp = Amp("O1", fp32_modules=["lm_head", "*.norm"], half_dtype=HALF)
    amp.prepare_model(model)
    with pytest.raises(ValueError, match=r"'lm_head' match no module.*'blocks\.0\.fc'"):
        amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"fp32_modules='head' must be a list.*\['head'\]"):
        Amp("O1", fp32_modules="head", half_dtype=HALF)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"fp32_modules holds 3"):
        MixedPrecisionKwargs(fp32_modules=["head", 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"empty pattern"):
        MixedPrecisionPlugin("O2", fp32_modules=[""], half_dtype=HALF)
    with pytest.raises(ValueError, match=r"'nothing\*' match no module.*'model\.blocks'"):
        make_trainer(MixedPrecisionPlugin("O2", fp32_modules=["nothing*"]), max_steps=1).fit(NetModule(), data())
