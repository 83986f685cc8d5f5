"""``torch.compile`` as a user writes it around the Trainer and Fabric, with the recompiles counted against the
framework's own "bf16-mixed" on the same code (dynamo's counts, ``aot_eager``; tests/test_compile_doors.py's
``_counted`` for Fabric).

Found and fixed: ``trainer.fit(torch.compile(model))`` a second time (a new Trainer, the same compiled model) at O1
recompiled the training step's graph (O1: 7 graphs after the second fit against 6 after the first): Lightning's
``from_compiled`` then records as the "original" step the one its first fit compiled (left on the module), and the
plugin's hand-off wrapped that compiled function, which dynamo cannot unwrap through the wrapper (guard
``___check_type_id(fn.fn, ...)`` at ``casting/compiled.py`` ``_ScopeInside.__call__``: a function where the first fit
had a method). The plugin now hands off the uncompiled method, as dynamo unwraps a compiled function itself
(``integrations/lightning_model_hooks.py``). "bf16-mixed": no graph at the second fit.

Fixed at stop 63: through Fabric at O2, ``torch.compile`` over a user's function that enters ``fabric.autocast()``
around the model (the set-up model's module, inputs cast by the user) recompiled once at the second call (2/0/1
against "bf16-mixed"'s 1/0/0): the scope's new-group check iterates the engine's optimizers, and the plugin met the
optimizer only at its first ``optimizer.step()``, so dynamo's guard ``len(fabric._precision.amp._machine.optimizers)
!= 0`` failed once. The plugin now registers the optimizers given to ``fabric.setup`` there (one set up apart by
``fabric.setup_optimizers`` still recompiles once unless ``plugin.setup_optimizers(opt)``).

Measured, left: at O2 the second ``trainer.fit`` still recompiles the steps once (11 graphs after it against 8, two
epochs then one, 20 samples): the new plugin registers the boundary casts' forward hooks on the model's children again,
with new hook ids, and dynamo guards ``___dict_contains(1, ..._modules['net']._forward_hooks_always_called)``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.test_compile_doors import _batch, _counted, _Net

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _fabric_user_compiled(level: str, register: bool) -> tuple[int, int, int]:
    """Counts of ``STEPS`` steps (2 here: the recompile is the second call's) of ``torch.compile`` over
    ``with fabric.autocast(): F.cross_entropy(model(x), y)`` (the set-up model's module; ``register``:
    ``plugin.setup_optimizers(opt)`` after ``fabric.setup``)."""
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric

    from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin

    plugin = None if level.startswith("bf16") else FabricMixedPrecisionPlugin(level, half_dtype="bfloat16")
    fabric = Fabric(accelerator="cpu", devices=1, **({"plugins": [plugin]} if plugin else {"precision": level}))
    net = _Net()
    _, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    if register:
        plugin.setup_optimizers(opt)
    dtype = next(net.parameters()).dtype  # O2: the user casts the inputs of the half module

    @torch.compile(backend="aot_eager")
    def loss_at(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with fabric.autocast():
            return F.cross_entropy(net(x.to(dtype)).float(), y)

    def step(i: int) -> float:
        loss = loss_at(*_batch(i))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return _counted(step)[0]


def test_fabric_autocast_inside_a_compiled_function_with_the_optimizer_registered_compiles_as_bf16_mixed(monkeypatch):
    """O2, ``plugin.setup_optimizers(opt)`` after ``fabric.setup``: one graph, no break, no recompile ("bf16-mixed":
    1/0/0 on the same code, measured)."""
    monkeypatch.setattr("tests.test_compile_doors.STEPS", 2)
    assert _fabric_user_compiled("O2", register=True) == (1, 0, 0)


def test_fabric_autocast_inside_a_compiled_function_recompiles_nothing(monkeypatch):
    monkeypatch.setattr("tests.test_compile_doors.STEPS", 2)
    assert _fabric_user_compiled("O2", register=False)[2] == 0


class _Recompiles(logging.Handler):
    """The guard failures dynamo logs for each recompile."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def two_fits() -> dict[str, Any]:
    """``trainer.fit(torch.compile(model))`` twice at O1 (new Trainers, the same compiled model): an epoch each,
    validation after each (train, eval, then train at the second fit; Lightning evaluates a compiled model under
    ``no_grad``); 12 samples, trained in batches of 8 (a last batch of 4), validated in batches of 4. Graphs after
    each fit and the recompiles' guard failures."""
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mpx.integrations.lightning import MixedPrecisionPlugin

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Net()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x).float(), y)

        def validation_step(self, batch: Any, index: int) -> None:
            x, y = batch
            self.log("val", F.cross_entropy(self(x).float(), y))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(12, 16, generator=g), torch.randint(0, 4, (12,), generator=g))
    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(Module(), backend="aot_eager")
    handler, log = _Recompiles(), logging.getLogger("torch._dynamo.guards.__recompiles")
    torch._logging.set_logs(recompiles=True)
    log.addHandler(handler)
    graphs = []
    try:
        for epochs in (1, 1):
            trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 num_sanity_val_steps=0,
                                 plugins=[MixedPrecisionPlugin("O1", half_dtype="bfloat16")])
            trainer.fit(model, DataLoader(data, batch_size=8), DataLoader(data, batch_size=4))
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        log.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()
    return {"graphs": graphs, "recompiles": handler.messages}


def test_trainer_second_fit_of_a_compiled_model_compiles_no_graph(two_fits):
    """The second ``trainer.fit`` of the same compiled model: no graph compiled (as "bf16-mixed"; before: the
    training step recompiled, guard ``___check_type_id(fn.fn, ...)`` at casting/compiled.py)."""
    first, second = two_fits["graphs"]
    assert first > 0 and second == first, f"graphs after each fit: {two_fits['graphs']}"


def test_trainer_compiled_validation_recompiles_on_no_guard_of_ours(two_fits):
    ours = [m for m in two_fits["recompiles"] if "_recomputes_seen" in m]
    assert not ours, ours[0]
