"""An overflow made by code between module calls (issue 21, item 7): ``h = self.blow(h) * 1e5`` in a forward, the
shape of attention scores or a residual sum computed in the parent.

The first non-finite values are the input of the module after it (``norm``), while ``blow``'s output was finite. The
record names that code (``"in <root>'s forward, between blow's output and norm's input"``) and blames ``blow``, whose
FP32 output keeps the code after it in FP32 at O1, so ``on_floor="promote"`` cures it by promoting ``blow``. Before,
forensics blamed ``norm`` (the first module whose output was non-finite), promoting it could not cure it, the
promotion escalated to the root and the run stopped. At O2 a promoted module's output goes back to half before the
code runs: the module whose forward runs the code is promoted instead (the root cannot be: the error names the code).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, LossScaleFloorError, MixedPrecisionPlugin
from lightning_mpx.health.forensics import CodeRegion
from lightning_mpx.health.promotion import FLOOR_OVERFLOWS_TO_PROMOTE
from tests.lightning_helpers import make_trainer

FLOOR = dict(init_scale=2.0**13, min_loss_scale=2.0**10)  # three backoffs to the floor
REGION = "in <root>'s forward, between blow's output and norm's input"


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return x, torch.sin(x[:, :1]) + 0.5 * x[:, 1:2]


def _layers() -> tuple[nn.Module, ...]:
    return nn.Linear(8, 16), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 1)


def _forward(model: Any, x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(model.inp(x))
    h = model.blow(h) * 1e5  # blow's output is O(1); times 1e5 it is past float16's 65504 (the norm brings it back)
    return model.out(model.norm(h))


class ParentArithmetic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.blow, self.norm, self.out = _layers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _forward(self, x)


class ScaledNorm(nn.Module):
    """Its forward starts with the arithmetic: the code runs between its own input and its norm's input."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h * 1e5)


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.out = nn.Linear(8, 16), ScaledNorm(), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(torch.tanh(self.inp(x))))


def _iteration(amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    x, y = _data()
    with amp.forward_context():
        loss = F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))), y)
    amp.backward(loss)
    stepped = amp.step(optimizer)
    amp.update()
    optimizer.zero_grad()
    return stepped


def _prepared(level: str, model: nn.Module, **settings: Any) -> tuple[Amp, torch.optim.Optimizer]:
    amp = Amp(level, **{"half_dtype": "float16", **settings})
    amp.prepare_model(model)
    return amp, amp.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_record_names_the_code_between_the_calls_and_blames_its_producer(level: str, caplog: Any) -> None:
    model = ParentArithmetic()
    seen: dict[str, bool] = {}  # the reference, from the test's own hooks: what was finite where

    def output(module: nn.Module, args: Any, out: torch.Tensor, name: str) -> None:
        seen.setdefault(f"{name} output", bool(torch.isfinite(out).all()))

    def inputs(module: nn.Module, args: Any, name: str) -> None:
        seen.setdefault(f"{name} input", bool(torch.isfinite(args[0]).all()))

    for name in ("blow", "norm"):
        getattr(model, name).register_forward_hook(functools.partial(output, name=name))
        getattr(model, name).register_forward_pre_hook(functools.partial(inputs, name=name))
    amp, optimizer = _prepared(level, model, diagnose_overflows=True, overflow_log_interval=0.0)
    with caplog.at_level(logging.INFO, logger="lightning_mpx"):
        assert not _iteration(amp, model, optimizer)
    assert seen == {"blow input": True, "blow output": True, "norm input": False, "norm output": False}
    record = amp.last_overflow
    assert record.origin == "forward" and record.region == CodeRegion("", "blow", "norm", "inf")
    assert record.region.describe() == REGION
    assert record.culprits() == ["blow"]
    assert record.first_module == "norm"  # still: the first module whose output was non-finite
    assert f"culprit blow (non-finite values (inf) first made by the code {REGION})" in caplog.text
    assert amp.metrics()["mpx/overflow_first/blow"] == 1.0


def test_in_place_arithmetic_is_code_too() -> None:
    class InPlace(ParentArithmetic):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.blow(torch.tanh(self.inp(x)))
            h.mul_(1e5)  # the same tensor object reaches the norm, written since blow returned it
            return self.out(self.norm(h))

    model = InPlace()
    amp, optimizer = _prepared("O1", model, diagnose_overflows=True)
    assert not _iteration(amp, model, optimizer)
    assert amp.last_overflow.region == CodeRegion("", "blow", "norm", "inf")


def test_code_at_the_start_of_a_forward_blames_the_module_that_runs_it() -> None:
    model = Nested()
    amp, optimizer = _prepared("O1", model, diagnose_overflows=True)
    assert not _iteration(amp, model, optimizer)
    region = amp.last_overflow.region
    assert region == CodeRegion("block", None, "block.norm", "inf")
    assert region.describe() == "in block's forward, between its input and block.norm's input"
    assert amp.last_overflow.culprits() == ["block"]


def test_data_that_is_already_non_finite_is_no_code_region() -> None:
    model = ParentArithmetic()
    amp, optimizer = _prepared("O1", model, diagnose_overflows=True)
    x, y = _data()
    x[3, 1] = float("nan")
    with amp.forward_context():
        loss = F.mse_loss(model(x), y)
    amp.backward(loss)
    assert not amp.step(optimizer)
    record = amp.last_overflow
    assert record.region is None and record.first_module == "inp" and record.culprits() == ["inp"]


class ParentArithmeticModule(pl.LightningModule):
    """``where="forward"``: the arithmetic in the LightningModule's forward (called as ``self(x)``);
    ``"training_step"``: in the training step itself, outside every module's forward."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.blow, self.norm, self.out = _layers()
        self.where = where
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _forward(self, x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        pred = self(x) if self.where == "forward" else _forward(self, x)  # the code in the training step itself
        loss = F.mse_loss(pred, y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _fit(where: str, plugin: MixedPrecisionPlugin, steps: int) -> ParentArithmeticModule:
    module = ParentArithmeticModule(where)
    data = torch.utils.data.TensorDataset(*_data())
    trainer = make_trainer(plugin, max_steps=steps, max_epochs=-1)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=64))
    return module


@pytest.mark.parametrize(
    ("where", "region"),
    [
        ("forward", REGION),
        ("training_step", "outside the modules' forwards (in the training step or the loop), between blow's output "
                          "and norm's input"),
    ],
    ids=["forward", "training_step"],
)
def test_trainer_o1_promote_recovers_by_promoting_the_producer(where: str, region: str, caplog: Any) -> None:
    steps = 30
    reference = _fit(where, MixedPrecisionPlugin("O0", half_dtype="float16"), steps)
    plugin = MixedPrecisionPlugin("O1", on_floor="promote", **{"half_dtype": "float16", **FLOOR})
    with caplog.at_level(logging.WARNING, logger="lightning_mpx"):
        module = _fit(where, plugin, steps)
    amp = plugin.amp
    assert amp.fp32_modules == ["blow"]
    evidence = amp.promoted_modules["blow"]
    assert evidence["origin"] == "forward" and evidence["region"] == region
    assert "running blow in FP32 from now on" in caplog.text and region in caplog.text
    # Three backoffs to the floor, FLOOR_OVERFLOWS_TO_PROMOTE overflows there, then it trains.
    assert amp.skipped_steps == [3 + FLOOR_OVERFLOWS_TO_PROMOTE]
    # From then on it trains as the FP32 run did from the start (the skipped steps changed nothing).
    skipped = amp.skipped_steps[0]
    torch.testing.assert_close(
        torch.tensor(module.losses[skipped:]), torch.tensor(reference.losses[: steps - skipped]), rtol=0.01, atol=0
    )


def test_o2_promotes_the_module_whose_forward_runs_the_code() -> None:
    model = Nested()
    amp, optimizer = _prepared("O2", model, on_floor="promote", **FLOOR)
    stepped = [_iteration(amp, model, optimizer) for _ in range(10)]
    # ``block``'s own forward runs the code: promoting it keeps it in FP32 (promoting a module that fed it would not:
    # its output goes back to half first).
    assert amp.fp32_modules == ["block"]
    assert amp.promoted_modules["block"]["region"] == "in block's forward, between its input and block.norm's input"
    assert stepped == [False] * (3 + FLOOR_OVERFLOWS_TO_PROMOTE) + [True] * 5
    assert model.inp.weight.dtype == torch.float16 and model.block.norm.weight.dtype == torch.float32


def test_o2_code_in_the_root_forward_stops_with_the_code_named() -> None:
    model = ParentArithmetic()
    amp, optimizer = _prepared("O2", model, on_floor="promote", **FLOOR)
    with pytest.raises(LossScaleFloorError, match="cannot run the code " + REGION.replace("<", ".").replace(">", ".")):
        for _ in range(10):
            _iteration(amp, model, optimizer)
    assert amp.fp32_modules == []  # nothing promoted in vain
