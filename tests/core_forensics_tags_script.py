"""Ranks of tests/test_core_forensics_tags.py (gloo, ONE launch): the modules each per-module ``mpx/*`` tag names in a
float16 O1 run under data parallelism, where ``boom``'s forward overflows from step :data:`BLOW_AT` on (on every rank),
promoted at the floor: the Trainer and Fabric under ``strategy="ddp"`` (the plugin prepares the model before Lightning
wraps it), and the core ``Amp`` given ``torch.compile(DDP(model))`` and ``DDP(torch.compile(model))``. Each must name
the modules as the one-device run does (``enc``, ``boom``, ``norm``, ``head``: tests/test_core_doctor_tags_agree.py)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.launch import quiet_case as _quiet
from tests.launch import run_cases

STEPS = 6
BLOW_AT = 2
SETTINGS: dict[str, Any] = dict(half_dtype="float16", init_scale=4.0, min_loss_scale=1.0, on_floor="promote")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.boom, self.norm, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.boom(self.enc(x))))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def _kinds(keys: Any) -> dict[str, list[str]]:
    found: dict[str, set[str]] = {}
    for key in keys:
        kind, _, module = key[len("mpx/") :].partition("/")
        if key.startswith("mpx/") and module and kind not in ("zeros", "headroom_doublings"):
            found.setdefault(kind, set()).add(module)
    return {kind: sorted(modules) for kind, modules in found.items()}


def _blow(net: Net, step: int) -> None:
    if step == BLOW_AT:
        with torch.no_grad():
            net.boom.weight.mul_(3e5)


def _core(wrap: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_mpx import Amp

    torch.manual_seed(0)
    amp = Amp("O1", **SETTINGS)
    net = Net()
    model = (
        torch.compile(DDP(net), backend="eager") if wrap == "compile(ddp)" else DDP(torch.compile(net, backend="eager"))
    )
    model = amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    keys: set[str] = set()
    for step in range(STEPS):
        _blow(net, step)
        amp.request_telemetry()
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(_batch(step)))).float().square().mean()
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
        keys.update(amp.metrics())
    return {"tags": _kinds(keys)}


def _trainer() -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            self.keys: set[str] = set()

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            _blow(self.net, index)
            return self.net(_batch(index)).float().square().mean()

        def on_train_batch_end(self, *args: Any) -> None:
            self.keys.update(self.trainer.precision_plugin.metrics())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[MixedPrecisionPlugin("O1", **SETTINGS)], num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(STEPS, 1))))
    # the Trainer's module names its parameters net.<name>: the tags the same run on one device gives
    return {"tags": _kinds(module.keys)}


def _fabric() -> dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = FabricMixedPrecisionPlugin("O1", **SETTINGS)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin])
    fabric.launch()
    torch.manual_seed(0)
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1e-3))
    keys: set[str] = set()
    for step in range(STEPS):
        _blow(net, step)
        plugin.request_telemetry()
        fabric.backward(model(_batch(step)).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()
        keys.update(plugin.metrics())
    return {"tags": _kinds(keys)}


CASES = {
    "trainer": _quiet(_trainer),
    "fabric": _quiet(_fabric),
    "compile(ddp)": _quiet(lambda: _core("compile(ddp)")),
    "ddp(compile)": _quiet(lambda: _core("ddp(compile)")),
}


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    run_cases(CASES, timeout_s=60)
