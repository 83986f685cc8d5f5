"""Run by tests/test_core_fsdp2_unfreeze.py: FSDP2 at O2 on two CPU ranks (gloo), a LoRA-like model whose base was
loaded in bfloat16 and frozen (each ``Block``'s ``fc``: half, sharing the block's FSDP unit with its FP32
``adapter``), the first block's base unfrozen after two steps, as a user of progressive unfreezing does. The test
also calls ``lightning_run`` and ``accelerate_run`` in its own process, on a gloo group of one, with Lightning's and
Accelerate's own precisions (``"bf16-mixed"``, ``"bf16"``).

- ``lightning``: ``Trainer(strategy=ModelParallelStrategy(data_parallel_size=2))``, sharded per ``Block`` in
  ``configure_model`` (``shard_model`` with the plugin at O2; ``fully_shard`` per block and root for
  ``"bf16-mixed"``), the base unfrozen and appended to the optimizer's first group in ``on_train_batch_start``.
- ``accelerate``: ``FullyShardedDataParallelPlugin(fsdp_version=2)``, each ``Block`` a unit, through
  ``lightning_mpx.accelerate.Accelerator`` (Accelerate's shared state told the processes are ``MULTI_GPU`` on
  ``cpu``, as in tests/accelerate_fsdp2_lora_script.py); the base unfrozen only (``requires_grad_(True)``, not given to
  the optimizer).

Every rank writes ``$MPX_OUT/{part}_rank{r}.json``: the error (its type, message and its cause's) or what the run
left (steps, whether the unfrozen base moved).
"""

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.launch import end_ranks, write_rank_results

BF16 = torch.bfloat16
UNFREEZE_AT = 2
STEPS = 4


class Block(nn.Module):
    """``fc``: the base (loaded in bfloat16, frozen); ``adapter``: FP32, trained."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.adapter = nn.Linear(8, 8, bias=False)
        self.fc.to(BF16).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x) + self.adapter(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.head = Block(), Block(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + int(os.environ["RANK"]))
    return torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def gathered(net: Net) -> list[float]:
    weight = net.first.fc.weight.detach()
    return (weight.full_tensor() if hasattr(weight, "full_tensor") else weight).float().flatten().tolist()


def failure(error: BaseException, steps: int, moved: bool) -> dict:
    cause = error.__cause__
    return dict(type=type(error).__name__, error=str(error), steps=steps, moved=moved,
                cause=None if cause is None else f"{type(cause).__name__}: {cause}")  # fmt: skip


def shard_blocks(net: nn.Module, plugin: Any, mesh: Any) -> nn.Module:
    """``net`` sharded by FSDP2 on ``mesh``, each ``Block`` a unit: by ``shard_model`` with ``plugin`` (ours at O2), or
    by ``fully_shard`` per block and root (the frameworks' own precisions, ``plugin`` None)."""
    from torch.distributed.fsdp import fully_shard

    from lightning_mpx.fsdp import shard_model

    if plugin is not None:
        return shard_model(net, plugin, mesh=mesh, blocks=Block)
    for block in (net.first, net.second):
        fully_shard(block, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def lightning_module(precision: str) -> Any:
    """A ``LightningModule`` class over :class:`Net` for ``ModelParallelStrategy``: sharded per ``Block`` in
    ``configure_model`` (:func:`shard_blocks`, with the Trainer's plugin at O2), cross-entropy, AdamW over the
    trainable parameters."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def configure_model(self) -> None:
            plugin = self.trainer.precision_plugin if precision == "O2" else None
            shard_blocks(self.net, plugin, self.device_mesh["data_parallel"])

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)

    return Module


def lightning_run(precision: str, ranks: int = 2) -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    class Module(lightning_module(precision)):
        def __init__(self) -> None:
            super().__init__()
            self.before: list[float] = []

        def on_fit_start(self) -> None:
            self.before = gathered(self.net)

        def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
            if batch_idx == UNFREEZE_AT:
                self.net.first.fc.requires_grad_(True)
                self.trainer.optimizers[0].param_groups[0]["params"].extend(self.net.first.fc.parameters())

    module = Module()
    loader = torch.utils.data.DataLoader([batch(step) for step in range(STEPS)], batch_size=None)
    strategy = ModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1)
    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16") if precision == "O2" else None
    trainer = make_trainer(plugin, devices=ranks, strategy=strategy, use_distributed_sampler=False,
                           **({} if plugin else {"precision": precision}))  # fmt: skip
    try:
        trainer.fit(module, loader)
    except Exception as error:  # noqa: BLE001 - reported by the test
        return failure(error, trainer.global_step, gathered(module.net) != module.before)
    return dict(steps=trainer.global_step, moved=gathered(module.net) != module.before)


def accelerate_prepared(mixed_precision: str) -> tuple[Any, nn.Module, Any]:
    """``fsdp_version=2`` (each ``Block`` a unit) through ``lightning_mpx.accelerate.Accelerator`` (``"O2"``, or
    Accelerate's own ``mixed_precision``; its shared state told the process is ``MULTI_GPU`` on ``cpu``: see the
    module docstring), the optimizer over the trainable parameters: ``(accelerator, model, optimizer)`` as
    ``prepare`` returned them."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    PartialState._shared_state["device"] = torch.device("cpu")
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
    )
    handlers = [MixedPrecisionKwargs(half_dtype="bfloat16")] if mixed_precision == "O2" else []
    accelerator = Accelerator(mixed_precision=mixed_precision, fsdp_plugin=plugin, cpu=True, kwargs_handlers=handlers)
    assert accelerator.distributed_type == DistributedType.FSDP, accelerator.distributed_type
    net = Net()
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    net, optimizer = accelerator.prepare(net, optimizer)
    return accelerator, net, optimizer


def accelerate_run(mixed_precision: str) -> dict:
    accelerator, net, optimizer = accelerate_prepared(mixed_precision)
    before = gathered(net)
    steps = 0
    try:
        for step in range(STEPS):
            if step == UNFREEZE_AT:
                net.first.fc.requires_grad_(True)
            x, y = batch(step)
            with accelerator.autocast():
                loss = nn.functional.cross_entropy(net(x).float(), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    except Exception as error:  # noqa: BLE001 - reported by the test
        return failure(error, steps, gathered(net) != before)
    return dict(steps=steps, moved=gathered(net) != before)


def main() -> None:
    for name, run in (("lightning", lightning_run), ("accelerate", accelerate_run)):
        try:
            result = run("O2")
        except Exception as error:  # noqa: BLE001 - reported by the test
            result = {"unexpected": f"{type(error).__name__}: {error}"[-3000:]}
        write_rank_results(result, prefix=f"{name}_", rank=int(os.environ["RANK"]))
        if dist.is_initialized():
            dist.barrier()
    end_ranks()


if __name__ == "__main__":
    sys.exit(main())
