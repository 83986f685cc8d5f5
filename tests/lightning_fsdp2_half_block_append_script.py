"""Run by tests/test_lightning_fsdp2_half_block_append.py: FSDP2 at O2 on two CPU ranks (gloo), a block loaded in
bfloat16 and frozen (a unit of its own: FSDP reduces its gradients in bfloat16), unfrozen after two steps by appending
its parameters to the optimizer's first group (``optimizer.param_groups[0]["params"].extend(...)``, no
``add_param_group``), as a user of progressive unfreezing does.

- ``lightning``: ``Trainer(strategy=ModelParallelStrategy(data_parallel_size=2))``, ``shard_model(blocks=Block)`` in
  ``configure_model``, the unfreezing in ``on_train_batch_start``.
- ``accelerate``: ``FullyShardedDataParallelPlugin(fsdp_version=2)``, each ``Block`` a unit, through
  ``lightning_mpx.accelerate.Accelerator(mixed_precision="O2")`` (Accelerate's shared state told the processes are
  ``MULTI_GPU`` on ``cpu``, as in tests/accelerate_fsdp2_lora_script.py).

Every rank writes ``$MPX_OUT/{part}_rank{r}.json``: the error (its last line) or what the half block became.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from tests.launch import end_ranks, write_rank_results

BF16 = torch.bfloat16
UNFREEZE_AT = 2
STEPS = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Net(nn.Module):
    """``first``: loaded in bfloat16 and frozen (its whole FSDP unit half); ``second`` and ``head``: FP32, trained."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.head = Block(), Block(), nn.Linear(8, 4)
        self.first.to(BF16).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + int(os.environ["RANK"]))
    return torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def unfreeze(net: Net, optimizer: torch.optim.Optimizer) -> None:
    net.first.requires_grad_(True)
    optimizer.param_groups[0]["params"].extend(net.first.parameters())


def gathered(net: Net) -> list[float]:
    weight = net.first.fc.weight.detach()
    return (weight.full_tensor() if hasattr(weight, "full_tensor") else weight).float().flatten().tolist()


def outcome(result: dict, net: Net, optimizer: torch.optim.Optimizer, before: list[float], steps: int) -> dict:
    """What a run that did not raise left: whether the half block moved and the dtype of its Adam moments."""
    state = optimizer.state.get(net.first.fc.weight, {})
    result.update(steps=steps, moved=gathered(net) != before, dtype=str(net.first.fc.weight.dtype),
                  moments=str(state["exp_avg"].dtype) if "exp_avg" in state else None)  # fmt: skip
    return result


def lightning_run() -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_mpx import MixedPrecisionPlugin
    from lightning_mpx.fsdp import shard_model
    from tests.lightning_helpers import make_trainer

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            self.before: list[float] = []

        def configure_model(self) -> None:
            shard_model(self.net, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"], blocks=Block)

        def on_fit_start(self) -> None:
            self.before = gathered(self.net)

        def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
            if batch_idx == UNFREEZE_AT:
                unfreeze(self.net, self.trainer.optimizers[0])

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)

    result: dict = {}
    module = Module()
    loader = torch.utils.data.DataLoader([batch(step) for step in range(STEPS)], batch_size=None)
    trainer = make_trainer(
        MixedPrecisionPlugin("O2", half_dtype="bfloat16"), devices=2, use_distributed_sampler=False,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    )  # fmt: skip
    try:
        trainer.fit(module, loader)
    except ValueError as error:
        return dict(error=str(error), steps=trainer.global_step, moved=gathered(module.net) != module.before)
    return outcome(result, module.net, trainer.optimizers[0], module.before, trainer.global_step)


def accelerate_run() -> dict:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    PartialState(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU  # see the module docstring
    PartialState._shared_state["device"] = torch.device("cpu")
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
    )
    accelerator = Accelerator(mixed_precision="O2", fsdp_plugin=plugin, cpu=True,
                              kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])  # fmt: skip
    assert accelerator.distributed_type == DistributedType.FSDP, accelerator.distributed_type
    net = Net()
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    net, optimizer = accelerator.prepare(net, optimizer)
    before = gathered(net)
    steps = 0
    try:
        for step in range(STEPS):
            if step == UNFREEZE_AT:
                unfreeze(net, optimizer.optimizer)
            x, y = batch(step)
            accelerator.backward(nn.functional.cross_entropy(net(x).float(), y))
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    except ValueError as error:
        return dict(error=str(error), steps=steps, moved=gathered(net) != before)
    return outcome({}, net, optimizer.optimizer, before, steps)


def main() -> None:
    for name, run in (("lightning", lightning_run), ("accelerate", accelerate_run)):
        try:
            result = run()
        except Exception as error:  # noqa: BLE001 - reported by the test
            result = {"unexpected": f"{type(error).__name__}: {error}"[-3000:]}
        write_rank_results(result, prefix=f"{name}_", rank=int(os.environ["RANK"]))
        if dist.is_initialized():
            dist.barrier()
    end_ranks()


if __name__ == "__main__":
    sys.exit(main())
