"""Through the Lightning plugin (a compiled submodule, ``trainer.fit(torch.compile(model))``) and the Accelerate adapter
(a model compiled before or after ``prepare``), a steady-state O1 step of a compiled model makes no call into the
cast hook, forward and backward, and matches eager within half precision.

Calls into the hook are counted as tests/compile_helpers.py says; the compiled runs use the ``aot_eager`` backend.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from tests.compile_helpers import HookCounter, LossNet, assert_one_graph, o1_accelerator, step_batch

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _lightning_module(compiled_net: bool) -> Any:
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            net = LossNet()
            self.net = torch.compile(net, backend="aot_eager") if compiled_net else net
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(*batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module()


def _fit(module: Any, fit_model: Any) -> tuple[list[float], list[int]]:
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from lightning_mpx.integrations.lightning import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    class Count(pl.Callback):
        def __init__(self) -> None:
            self.counter, self.calls, self.losses = HookCounter(), [], []

        def on_train_batch_start(self, *args: Any) -> None:
            self.counter.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
            self.counter.__exit__()
            self.calls.append(self.counter.calls)
            self.losses.append(float(outputs["loss"]))

    data = torch.utils.data.TensorDataset(*map(torch.cat, zip(*(step_batch(i) for i in range(5)))))
    count = Count()
    trainer = make_trainer(MixedPrecisionPlugin("O1", half_dtype="bfloat16"), callbacks=[count])
    trainer.fit(fit_model, torch.utils.data.DataLoader(data, batch_size=8))
    assert not torch.overrides._get_current_function_mode_stack()
    return count.losses, count.calls


@pytest.fixture(scope="module")
def lightning_eager() -> tuple[list[float], list[int]]:
    pytest.importorskip("lightning")
    eager_module = _lightning_module(compiled_net=False)
    return _fit(eager_module, eager_module)


def test_trainer_with_a_compiled_submodule_makes_no_hook_call_per_step(lightning_eager):
    eager, eager_calls = lightning_eager
    module = _lightning_module(compiled_net=True)
    losses, calls = _fit(module, module)
    assert min(eager_calls) > 0
    assert calls[1:] == [0] * 4, calls
    assert_one_graph()
    assert "forward" not in module.net.__dict__ or not hasattr(module.net.__dict__["forward"], "policy")  # restored
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager), rtol=1e-2, atol=1e-2)


def test_trainer_fitting_a_compiled_lightning_module_makes_no_hook_call_per_step(lightning_eager):
    eager, _ = lightning_eager
    module = _lightning_module(compiled_net=False)
    losses, calls = _fit(module, torch.compile(module, backend="aot_eager"))  # Lightning compiles training_step
    assert calls[1:] == [0] * 4, calls
    assert not counters["graph_break"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager), rtol=1e-2, atol=1e-2)


def _accelerate_run(compile_mode: str | None) -> tuple[list[float], list[int]]:
    pytest.importorskip("accelerate")
    with o1_accelerator(LossNet(), compile_mode) as (accelerator, model, opt):
        losses, calls = [], []
        for step in range(5):
            batch = step_batch(step)
            with HookCounter() as counter:
                loss = model(*batch)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            calls.append(counter.calls)
            losses.append(loss.item())
    return losses, calls


@pytest.fixture(scope="module")
def accelerate_eager() -> tuple[list[float], list[int]]:
    return _accelerate_run(None)


@pytest.mark.parametrize("compile_mode", ["before_prepare", "after_prepare"])
def test_accelerator_with_a_compiled_model_makes_no_hook_call_per_step(compile_mode, accelerate_eager):
    eager, eager_calls = accelerate_eager
    losses, calls = _accelerate_run(compile_mode)
    assert min(eager_calls) > 0
    assert calls[1:] == [0] * 4, calls
    assert_one_graph()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager), rtol=1e-2, atol=1e-2)
