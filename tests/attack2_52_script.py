"""Ranks of tests/test_attack2_52.py (two CPU processes, gloo, one launch): the rank-zero agreement of O2 masters
under DDP, attacked. Rank 1 builds its models with another seed (its FP32 weights differ from rank 0's). Cases: Fabric
``setup_module`` then ``setup_optimizers`` (the optimizer set up apart), a frozen parameter, two models set up apart,
a Trainer ``validate`` before ``fit``, the Accelerate adapter preparing two models, and models that differ between
the ranks (a layer's width, a parameter frozen on one rank only) through the core ``Amp`` and Fabric: a clear error
on both ranks, after which the process group still works. Every rank writes ``$MPX_OUT/rank{r}.json``."""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.exactddp52_script import LR, SETTINGS, AtStart, Net, data, flat
from tests.launch import case_error, end_ranks, write_rank_results


def net(seed: int, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))


class EvalNet(Net):
    """:class:`Net` with a validation step."""

    def validation_step(self, batch, index):
        return self.training_step(batch, index)


def _fabric():
    from lightning.fabric import Fabric

    plugin = FabricMixedPrecisionPlugin("O2", **SETTINGS)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=plugin)
    fabric.launch()
    return fabric, plugin


def _trainer_validate_then_fit(rank: int, r: dict) -> None:
    import lightning.pytorch as pl

    module, plugin = EvalNet(seed=rank), MixedPrecisionPlugin("O2", **SETTINGS)
    start = AtStart(plugin)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, plugins=[plugin], callbacks=[start], max_steps=1,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.validate(module, data(), verbose=False)
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


def main() -> None:
    # A short timeout: a mismatched collective fails here rather than waiting for the default 30 minutes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    results: dict = {"world": dist.get_world_size()}
    with case_error(results.setdefault("fabric_apart", {})) as r:  # the optimizer set up after the model
        fabric, plugin = _fabric()
        module = net(rank)
        fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=LR))
        r["start"] = flat(plugin.master_params(optimizer))
    with case_error(results.setdefault("fabric_frozen", {})) as r:  # a frozen bias; a second model set up apart
        fabric, plugin = _fabric()
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
    with case_error(results.setdefault("core_width", {})):  # a layer 16 wide on rank 0, 8 on rank 1
        Amp("O2", half_dtype="bfloat16").prepare_model(net(0, width=16 if rank == 0 else 8), rank_zero_fp32=True)
    with case_error(results.setdefault("fabric_frozen_on_one", {})):  # a bias frozen on rank 1 only
        fabric, _ = _fabric()
        module = net(0)
        module[0].bias.requires_grad_(rank == 0)
        fabric.setup(module, torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=LR))
    with case_error(results.setdefault("after", {})) as r:  # the group still works after the errors
        total = torch.ones(1)
        dist.all_reduce(total)
        r["sum"] = total.item()
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    main()
