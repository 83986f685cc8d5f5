"""Ranks of tests/test_lightning_ddp_masters.py (two CPU processes, gloo, ONE launch for every multi-rank check of O2
masters under DDP; rank 1 builds most models with another seed, so its FP32 weights differ from rank 0's). Every rank
writes ``$MPX_OUT/rank{r}.json``; a case that raises leaves its traceback in the case's ``"error"``.

* Stop 51's surfaces under Lightning's ``strategy="ddp"`` (was tests/hostile_ddp52_script.py), each against a
  "32-true" DDP twin: float targets passed into the forward at O2 and O3, rank-zero-only and synced logging,
  accumulation (``no_sync``), ``find_unused_parameters=True``, an inf gradient on rank 1 only; a checkpoint saved
  before the first step and resumed; a second ``fit`` with a new plugin; complex parameters at every level;
  ``release_masters`` on rank 0 only between two stages (Trainer and Fabric).
* Rank zero's exact FP32 weights for every rank's masters (was tests/exactddp52_script.py): the Trainer, a second
  stage, a model rank 0 made half before ``fit``, the core ``Amp`` with and without ``rank_zero_fp32``, Fabric's
  ``setup``, the Accelerate adapter's ``prepare``.
* The agreement attacked (was tests/attack2_52_script.py): Fabric's optimizer set up apart, a frozen parameter, two
  models, a Trainer ``validate`` before ``fit`` (with the FP32 weights after the evaluation: stop 53), the Accelerate
  adapter preparing two models and taking a model over after ``free_memory()`` (stop 53), models that differ between
  the ranks (a clear error on both, after which the group still works: run last).
"""

from __future__ import annotations

import datetime
import os
import warnings

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin, MixedPrecisionPlugin, release_masters
from tests.launch import case_error, finish_cases
from tests.test_complex_params import Spectral
from tests.test_fp32_buffers import _HFRotaryEmbedding

SETTINGS = {"half_dtype": "bfloat16", "loss_scale": "dynamic", "init_scale": 2.0**10}


# -- stop 51's surfaces under DDP
INF_AT = 3  # the batch (rank 1's only) whose backward leaves an inf: the last micro-batch of optimizer step 1


def _regression() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 4, generator=g), 300 + 3 * torch.rand(48, generator=g)  # bfloat16 rounds y by up to 1
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class Regressor(pl.LightningModule):
    """A regression head whose forward takes the float targets and computes the loss (a Hugging Face habit)."""

    def __init__(self, inf: bool = False, reference: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.spare = nn.Linear(4, 4)  # never used: find_unused_parameters=True
        self.rotary = _HFRotaryEmbedding()  # FP32 inverse frequencies, kept FP32 at O2/O3 (DDP broadcasts buffers)
        self.inf, self.reference, self.index, self.exact = inf, reference, -1, []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = x[:, :1].float() * self.rotary.inv_freq  # FP32 angles, as a rotary module computes them
        pred = self.net(x).squeeze(-1).float() + 300.0 + 1e-3 * angles.cos().sum(-1)
        return F.mse_loss(pred, labels), pred

    def training_step(self, batch, index):
        self.index = index
        loss, pred = self(*batch)
        want = F.mse_loss(pred.detach(), batch[1])
        self.exact.append(abs(loss.item() - want.item()) / want.item())
        self.log("loss0", loss, rank_zero_only=True)
        self.log("loss", loss, sync_dist=True)
        return loss

    def on_after_backward(self) -> None:
        if self.inf and self.index == INF_AT and self.trainer.global_rank == 1:
            self.net[2].weight.grad[0, 0] = float("inf")

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.reference and self.inf and self.index == INF_AT:  # the FP32 twin skips the step as well
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.zero_()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Complex(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Spectral()

    def training_step(self, batch, index):
        return F.cross_entropy(self.net(batch[0]).float(), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _complex_data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class _Stopped(Exception):
    pass


class SaveAtStart(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)
        raise _Stopped  # a run stopped after saving, before its first step


def _fit(module, data, plugin=None, ckpt_path=None, callbacks=(), **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(find_unused_parameters=True), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        plugins=[plugin] if plugin is not None else None, precision=None if plugin is not None else "32-true",
        callbacks=list(callbacks), **{"max_epochs": 1, "accumulate_grad_batches": 2, **kwargs},
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def _weights(module, trainer, plugin=None) -> list[float]:
    """The FP32 weights trained: the masters at O2, else the parameters."""
    params = list(module.parameters())
    if plugin is not None and plugin.amp.properties.master_weights:
        params = plugin.amp.master_params(trainer.optimizers[0])
    return torch.cat([torch.view_as_real(p).flatten() if p.is_complex() else p.detach().float().flatten()
                      for p in params]).tolist()  # fmt: skip


def _fabric_stage(module: Regressor, level: str | None) -> dict:
    """A Fabric DDP loop over ``module`` (accumulating two batches under ``no_backward_sync``); the plugin at
    ``level`` or "32-true" (then zero gradients at ``INF_AT``: the skip the plugin makes there)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP

    plugin = None if level is None else FabricMixedPrecisionPlugin(level, **SETTINGS)
    strategy = FabricDDP(find_unused_parameters=True)
    precision = None if plugin else "32-true"
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=plugin, precision=precision)
    fabric.launch()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    model, optimizer = fabric.setup(module, optimizer)
    for index, (x, y) in enumerate(fabric.setup_dataloaders(_regression())):
        with fabric.no_backward_sync(model, enabled=index % 2 == 0):
            loss, pred = model(x, labels=y)
            module.exact.append(abs(loss.item() - F.mse_loss(pred.detach(), y).item()) / loss.item())
            fabric.backward(loss)
        if module.inf and index == INF_AT and (level is None or fabric.global_rank == 1):
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.zero_() if level is None else p.grad.fill_(float("inf"))
        if index % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
    params = list(module.parameters())
    if plugin is not None and plugin.amp.properties.master_weights:
        params = plugin.master_params(optimizer)
    scale = plugin.amp.scalers[0].get_scale() if plugin is not None else None
    return {"w": torch.cat([p.detach().float().flatten() for p in params]).tolist(), "exact": max(module.exact),
            "scale": scale}  # fmt: skip


# -- rank zero's exact FP32 weights
LR = 0.01
PER_RANK = 4  # batch size per rank; a one-process run takes batches of 2 * PER_RANK (the same global batches)


def data(ranks: int = 2) -> torch.utils.data.DataLoader:
    """32 samples in order: with two ranks, rank r takes samples r, r + 2, ... (batches of ``PER_RANK``); with one,
    batches of ``2 * PER_RANK``: the same global batches."""
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, generator=g))
    if ranks == 1:
        return torch.utils.data.DataLoader(dataset, batch_size=2 * PER_RANK)
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=False)  # Lightning's own would shuffle
    return torch.utils.data.DataLoader(dataset, batch_size=PER_RANK, sampler=sampler)


class Net(pl.LightningModule):
    """A small regressor whose FP32 weights (seed ``seed``) are not representable in bfloat16."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1).float()

    def training_step(self, batch, index):
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def flat(tensors) -> list[float]:
    return torch.cat([t.detach().float().flatten() for t in tensors]).tolist()


class AtStart(pl.Callback):
    """Records the masters when training starts (after DDP's set-up, before the first step)."""

    def __init__(self, plugin: MixedPrecisionPlugin) -> None:
        self.plugin, self.start = plugin, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = flat(self.plugin.amp.master_params(trainer.optimizers[0]))


def fit(module: Net, plugin: MixedPrecisionPlugin, devices: int = 2) -> tuple[list[float], list[float]]:
    """A Trainer run at O2 (``strategy="ddp"`` on two ranks); the masters before the first step and at the end."""
    start = AtStart(plugin)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, plugins=[plugin],
        callbacks=[start], max_epochs=1, use_distributed_sampler=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data(devices))
    return start.start, flat(plugin.amp.master_params(trainer.optimizers[0]))


def fabric_run(module: Net, devices: int = 2) -> tuple[list[float], list[float]]:
    """A Fabric loop at O2 (DDP on two ranks); the masters after ``setup`` (before the first step) and at the end."""
    from lightning.fabric import Fabric

    plugin = FabricMixedPrecisionPlugin("O2", **SETTINGS)
    fabric = Fabric(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", plugins=plugin)
    fabric.launch()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
    start = flat(plugin.master_params(optimizer))
    for x, y in fabric.setup_dataloaders(data(devices), use_distributed_sampler=False):
        fabric.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return start, flat(plugin.master_params(optimizer))


def _accelerate(module: Net) -> dict:
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    handlers = [MixedPrecisionKwargs(half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**10)]
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=handlers)
    model, optimizer = accelerator.prepare(module.net, torch.optim.SGD(module.net.parameters(), lr=LR))
    start = flat(accelerator.amp.master_params(optimizer.optimizer))
    for x, y in data():  # each rank its half of every global batch, as the Trainer and Fabric runs
        loss = F.mse_loss(model(x).squeeze(-1).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return {"start": start, "end": flat(accelerator.amp.master_params(optimizer.optimizer))}


# -- the agreement attacked
def net(seed: int, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))


class EvalNet(Net):
    """:class:`Net` with a validation step."""

    def validation_step(self, batch, index):
        return self.training_step(batch, index)


def _fabric_o2():
    from lightning.fabric import Fabric

    plugin = FabricMixedPrecisionPlugin("O2", **SETTINGS)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=plugin)
    fabric.launch()
    return fabric, plugin


def _trainer_validate_then_fit(rank: int, r: dict) -> None:
    """``trainer.validate`` then ``trainer.fit`` (one Trainer); the FP32 weights between them, the masters at the
    fit's first step."""
    module, plugin = EvalNet(seed=rank), MixedPrecisionPlugin("O2", **SETTINGS)
    start = AtStart(plugin)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, plugins=[plugin], callbacks=[start], max_steps=1,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.validate(module, data(), verbose=False)
    r["after_validate"] = flat(module.parameters())  # rank zero's exact FP32 weights on both (stop 53)
    r["dtypes"] = sorted({str(p.dtype) for p in module.parameters()})  # FP32 again
    trainer.fit(module, data())
    r["start"] = start.start  # the masters before the first step


def _accelerate_two(rank: int, r: dict) -> None:
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    handlers = [MixedPrecisionKwargs(half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**10)]
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=handlers)
    first, second = net(rank), net(rank + 10)
    first, opt1 = accelerator.prepare(first, torch.optim.SGD(first.parameters(), lr=LR))
    second, opt2 = accelerator.prepare(second, torch.optim.SGD(second.parameters(), lr=LR))
    r["first"] = flat(accelerator.amp.master_params(opt1.optimizer))
    r["second"] = flat(accelerator.amp.master_params(opt2.optimizer))


def _accelerate_take_over(rank: int, r: dict) -> None:
    """The Accelerate adapter's ``take_over``: a model prepared, ``free_memory()``, FP32 weights loaded on rank 0 only
    (a checkpoint read where it was saved, left to DDP's broadcast), then the model prepared again (a retried training
    function that kept it, wrapped): the new engine's masters before the first step."""
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    handlers = [MixedPrecisionKwargs(half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**10)]
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=handlers)
    module = net(rank)
    model, optimizer = accelerator.prepare(module, torch.optim.SGD(module.parameters(), lr=LR))
    accelerator.free_memory()
    if rank == 0:
        module.load_state_dict(net(20).state_dict())  # into the old engine's masters, exactly
    model, optimizer = accelerator.prepare(model, optimizer)
    r["start"] = flat(accelerator.amp.master_params(optimizer.optimizer))
    r["half"] = flat(module.parameters())


def main() -> None:
    # A short timeout: a mismatched collective (the last cases) fails here rather than waiting for 30 minutes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out = os.environ["MPX_OUT"]
    results: dict = {"world": dist.get_world_size()}

    # -- stop 51's surfaces under DDP (test_lightning_ddp_masters.py: "hostile" tests)
    ref = Regressor(inf=True, reference=True)
    with case_error(results.setdefault("ref", {})) as r:
        r["w"] = _weights(ref, _fit(ref, _regression()))
    with case_error(results.setdefault("o2", {})) as r:
        plugin, module = MixedPrecisionPlugin("O2", **SETTINGS), Regressor(inf=True)
        trainer = _fit(module, _regression(), plugin)
        r["w"], r["exact"] = _weights(module, trainer, plugin), max(module.exact)
        r["loss"] = float(trainer.callback_metrics["loss"])
        r["inv_freq"] = [str(module.rotary.inv_freq.dtype), module.rotary.inv_freq.tolist()]
        r["scale"] = plugin.amp.scalers[0].get_scale()
    with case_error(results.setdefault("o3", {})) as r:
        plugin, module = MixedPrecisionPlugin("O3", **SETTINGS), Regressor(inf=True)
        trainer = _fit(module, _regression(), plugin)
        r["w"], r["exact"] = _weights(module, trainer, plugin), max(module.exact)
        r["scale"], r["dtype"] = plugin.amp.scalers[0].get_scale(), str(module.net[0].weight.dtype)
        r["inv_freq"] = [str(module.rotary.inv_freq.dtype), module.rotary.inv_freq.tolist()]
    with case_error(results.setdefault("resume", {})) as r:
        path = os.path.join(out, "start.ckpt")
        try:
            plugin = MixedPrecisionPlugin("O2", **SETTINGS)
            _fit(Regressor(inf=True), _regression(), plugin, callbacks=[SaveAtStart(path)])
        except _Stopped:
            pass
        plugin, module = MixedPrecisionPlugin("O2", **SETTINGS), Regressor(inf=True)
        r["w"] = _weights(module, _fit(module, _regression(), plugin, ckpt_path=path), plugin)
    with case_error(results.setdefault("stages_ref", {})) as r:
        module = Regressor()
        _fit(module, _regression())
        r["w"] = _weights(module, _fit(module, _regression()))
    with case_error(results.setdefault("stages", {})) as r:
        first, module = MixedPrecisionPlugin("O2", **SETTINGS), Regressor()
        trainer = _fit(module, _regression(), first)
        second = MixedPrecisionPlugin("O2", **SETTINGS)
        r["w"] = _weights(module, _fit(module, _regression(), second), second)
        try:
            first.amp.master_params(trainer.optimizers[0])
            r["refused"] = False
        except RuntimeError:
            r["refused"] = True
    with case_error(results.setdefault("released", {})) as r:
        first, module = MixedPrecisionPlugin("O2", **SETTINGS), Regressor()
        _fit(module, _regression(), first)
        if rank == 0:  # export on rank 0: the model kept in half, its masters let go
            release_masters(module)
        second = MixedPrecisionPlugin("O2", **SETTINGS)
        r["w"] = _weights(module, _fit(module, _regression(), second), second)
    with case_error(results.setdefault("fabric_stages_ref", {})) as r:
        module = Regressor(inf=True)
        r["first"], r["second"] = _fabric_stage(module, None), _fabric_stage(module, None)
    with case_error(results.setdefault("fabric_stages", {})) as r:
        module = Regressor(inf=True)
        r["first"] = _fabric_stage(module, "O2")
        if rank == 0:  # export on rank 0, then a second stage on both
            release_masters(module)
        r["second"] = _fabric_stage(module, "O2")
    for level in ("32", "O1", "O2", "O3"):
        with case_error(results.setdefault(f"complex/{level}", {})) as r:
            plugin = None if level == "32" else MixedPrecisionPlugin(level, **SETTINGS)
            module = Complex()
            r["w"] = _weights(module, _fit(module, _complex_data(), plugin), plugin)
            r["dtype"] = str(module.net.phase.dtype)

    # -- rank zero's exact FP32 weights ("exact" tests)
    with case_error(results.setdefault("trainer", {})) as r:
        module = Net(seed=rank)  # rank 1's FP32 weights differ from rank 0's
        r["start"], r["end"] = fit(module, MixedPrecisionPlugin("O2", **SETTINGS))
        r["stage2_start"], r["stage2_end"] = fit(module, MixedPrecisionPlugin("O2", **SETTINGS))
    with case_error(results.setdefault("half_on_rank0", {})) as r:
        module = Net(seed=0)
        if rank == 0:  # made half before set-up on rank 0 only: no FP32 value there, so none on any rank
            module.to(torch.bfloat16)
        else:  # rank 0's weights a little off (a load that differs in the last bits): the same bfloat16 rounding
            with torch.no_grad():
                for param in module.parameters():
                    param.mul_(1 + 2**-20)
        r["start"], r["end"] = fit(module, MixedPrecisionPlugin("O2", **SETTINGS))
    with case_error(results.setdefault("core", {})) as r:  # the core engine: a collective only when asked
        for key, agree in (("own", False), ("agreed", True)):
            amp, module = Amp("O2", half_dtype="bfloat16"), Net(seed=rank)
            amp.prepare_model(module, rank_zero_fp32=agree)
            optimizer = amp.prepare_optimizer(torch.optim.SGD(module.parameters(), lr=LR))
            r[key] = flat(amp.master_params(optimizer))
    with case_error(results.setdefault("fabric_exact", {})) as r:
        r["start"], r["end"] = fabric_run(Net(seed=rank))
    with case_error(results.setdefault("accelerate", {})) as r:
        r.update(_accelerate(Net(seed=rank)))

    # -- the agreement attacked ("attack" tests)
    with case_error(results.setdefault("fabric_apart", {})) as r:  # the optimizer set up after the model
        fabric, plugin = _fabric_o2()
        module = net(rank)
        fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=LR))
        r["start"] = flat(plugin.master_params(optimizer))
    with case_error(results.setdefault("fabric_frozen", {})) as r:  # a frozen bias; a second model set up apart
        fabric, plugin = _fabric_o2()
        module, other = net(rank), net(rank + 10)
        module[0].bias.requires_grad_(False)
        trainable = [p for p in module.parameters() if p.requires_grad]
        _, optimizer = fabric.setup(module, torch.optim.SGD(trainable, lr=LR))
        _, other_optimizer = fabric.setup(other, torch.optim.SGD(other.parameters(), lr=LR))
        r["start"] = flat(plugin.master_params(optimizer))
        r["other"] = flat(plugin.master_params(other_optimizer))
        r["bias"] = flat([module[0].bias])
    with case_error(results.setdefault("trainer_validate_fit", {})) as r:
        _trainer_validate_then_fit(rank, r)
    with case_error(results.setdefault("accelerate_two", {})) as r:
        _accelerate_two(rank, r)
    with case_error(results.setdefault("accelerate_take_over", {})) as r:
        _accelerate_take_over(rank, r)
    with case_error(results.setdefault("core_width", {})):  # a layer 16 wide on rank 0, 8 on rank 1
        Amp("O2", half_dtype="bfloat16").prepare_model(net(0, width=16 if rank == 0 else 8), rank_zero_fp32=True)
    with case_error(results.setdefault("fabric_frozen_on_one", {})):  # a bias frozen on rank 1 only
        fabric, _ = _fabric_o2()
        module = net(0)
        module[0].bias.requires_grad_(rank == 0)
        fabric.setup(module, torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=LR))
    finish_cases(results)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    main()
