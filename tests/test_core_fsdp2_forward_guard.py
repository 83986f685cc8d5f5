"""FSDP2 at O2, a base loaded in bfloat16 and frozen beside FP32 parameters in one FSDP unit (the LoRA layout: each
``Block``'s half ``fc`` with its FP32 ``adapter``), unfrozen with ``requires_grad_(True)`` after the optimizer was
built and BEFORE the model's first forward: Lightning's ``BaseFinetuning`` whose ``finetune_function`` unfreezes at
epoch 0 (``on_train_epoch_start``), or a user who builds the optimizer, then calls ``requires_grad_(True)``.

FSDP sets its units up lazily, in the root's forward pre-hook at the first forward, and there a unit's trainable
parameters must share one dtype: the first forward failed with torch's bare ``AssertionError: FSDP expects uniform
original parameter dtype but got {torch.float32, torch.bfloat16}``, naming no unit and no parameter (unfrozen AFTER the
first forward, the backward fails instead: ``tests/test_core_fsdp2_unfreeze.py``). Lightning's ``"bf16-mixed"``
(``ModelParallelStrategy``, Trainer and Fabric) and Accelerate's ``"bf16"`` (``fsdp_version=2``) fail with that same
bare ``AssertionError`` on this flow (checked here: ``theirs`` in the Trainer, Fabric and Accelerate tests). Now every
door of ours on the forward's path raises a ``ValueError`` from it naming the parameters, why and what to do:
``Amp.forward_context`` (the cast policy's scope, on the error's path only), so the Lightning plugin's
``train_step_context``; the Accelerate adapter, whose forward wrapper runs after FSDP's pre-hook, through a guard on
that pre-hook that gives FSDP's own hook back after the first forward that got through it (no call per step). Fabric
at O2 refuses FSDP's strategies at ``fabric.setup``, before any forward.

In-process on a gloo group of one (``one_rank``; Lightning and Accelerate start theirs: ``launched_alone``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.integrations.fsdp import shard_model
from tests.core_fsdp2_unfreeze_script import Block, Net, accelerate_prepared, gathered, lightning_module, shard_blocks

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="FSDP needs torch.distributed with gloo",
)

BF16 = torch.bfloat16
TORCHS = "FSDP expects uniform original parameter dtype"
NAMED = (
    "2 half parameter(s) of a model sharded by FSDP at O2 require a gradient: {prefix}first.fc.weight, "
    "{prefix}first.fc.bias."
)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def _check_named(error: BaseException | None, prefix: str = "") -> None:
    """The refusal: a ValueError naming the unfrozen half parameters, why (FSDP's set-up at the first forward, no FP32
    master) and what to do (shard again, keep them frozen or load the base in FP32), raised from torch's error."""
    assert isinstance(error, ValueError), f"{type(error).__name__}: {error}"
    message = str(error)
    assert message.startswith(NAMED.format(prefix=prefix)), message
    assert "before its first forward" in message and "sets its units up at the first forward" in message
    assert "no FP32 master" in message and "No step ran" in message
    assert "build and shard the model again" in message and "keep them frozen" in message
    assert "load the base in FP32 before sharding" in message
    assert isinstance(error.__cause__, AssertionError) and TORCHS in str(error.__cause__)


# -- the core engine --------------------------------------------------------------------------------------------------
def _core_first_step(net: nn.Module, blocks: Any = Block) -> dict[str, Any]:
    """The engine's loop at O2 (``shard_model``, AdamW over the trainable parameters), ``first.fc`` unfrozen after the
    optimizer was prepared, then one step; the error raised (if any) and whether the base moved."""
    amp = Amp("O2", half_dtype="bfloat16")
    shard_model(net, amp, blocks=blocks)
    amp.prepare_model(net)
    optimizer = amp.prepare_optimizer(torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2))
    before = gathered(net)
    net.first.fc.requires_grad_(True)
    x, y = _batch()
    try:
        with amp.forward_context():
            out = net(amp.cast_inputs(x))
        amp.backward(nn.functional.cross_entropy(out.float(), y))
        amp.step(optimizer)
        amp.update()
    except Exception as error:  # noqa: BLE001 - returned for the test
        return dict(error=error, moved=gathered(net) != before)
    return dict(error=None, moved=gathered(net) != before)


@pytest.mark.parametrize("blocks", [Block, None], ids=["per_block", "root_only"])
def test_core_forward_context_names_the_half_base_unfrozen_before_the_first_forward(one_rank, blocks) -> None:
    """Before: torch's bare AssertionError from FSDP's lazy set-up in the first forward; after: the ValueError from it,
    out of ``amp.forward_context()``; the base unchanged."""
    run = _core_first_step(Net(), blocks)
    _check_named(run["error"])
    assert run["moved"] is False


class _AssertingNet(Net):
    """``first`` a block loaded in bfloat16 whole (a unit of half parameters only: FSDP's set-up accepts it unfrozen),
    and a forward with an assertion of the user's about a dtype that fails."""

    def __init__(self) -> None:
        super().__init__()
        self.first.to(BF16).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float64, f"my model wants float64 inputs, got dtype {x.dtype}"
        return super().forward(x)


def test_a_users_own_assertion_error_in_the_forward_is_raised_as_it_is(one_rank) -> None:
    """A half parameter unfrozen (in a half unit of its own: FSDP's set-up succeeds) and the user's own
    ``AssertionError`` about a dtype raised in the forward, inside ``amp.forward_context()``: raised as it is, not
    taken for FSDP's (it was not raised in torch's FSDP package)."""
    run = _core_first_step(_AssertingNet())
    assert type(run["error"]) is AssertionError and "my model wants float64" in str(run["error"])
    assert run["error"].__cause__ is None


# -- Lightning and Accelerate, in this process (a gloo group of one: conftest's launched_alone) ------------------------
def _trainer_run(precision: str) -> dict[str, Any]:
    """``Trainer(strategy=ModelParallelStrategy())``, sharded per ``Block`` in ``configure_model``, the optimizer over
    the trainable parameters, and a ``BaseFinetuning`` callback that makes ``first.fc`` trainable at epoch 0 (in
    ``on_train_epoch_start``, before the first forward)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BaseFinetuning
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    class UnfreezeAtStart(BaseFinetuning):
        def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
            pass  # the base was loaded frozen

        def finetune_function(self, pl_module: pl.LightningModule, current_epoch: int, optimizer: Any) -> None:
            if current_epoch == 0:
                self.make_trainable(pl_module.net.first.fc)

    module = lightning_module(precision)()
    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16") if precision == "O2" else None
    trainer = make_trainer(
        plugin, strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
        use_distributed_sampler=False, callbacks=[UnfreezeAtStart()], max_steps=1,
        **({} if plugin else {"precision": precision}),
    )  # fmt: skip
    before = gathered(module.net)
    try:
        trainer.fit(module, torch.utils.data.DataLoader([_batch()], batch_size=None))
    except Exception as error:  # noqa: BLE001 - returned for the test
        return dict(error=error, steps=trainer.global_step, moved=gathered(module.net) != before)
    return dict(error=None, steps=trainer.global_step)


def test_trainer_with_base_finetuning_unfreezing_at_epoch_0_names_the_half_base(launched_alone) -> None:
    """The plugin's training step context (``Amp.forward_context``): the ValueError from ``trainer.fit`` before any
    step. Lightning's own ``"bf16-mixed"`` on the same flow: torch's bare AssertionError."""
    pytest.importorskip("lightning.pytorch")
    ours = _trainer_run("O2")
    _check_named(ours["error"], prefix="net.")
    assert ours["steps"] == 0 and ours["moved"] is False
    torch.distributed.destroy_process_group()  # the next Trainer's strategy starts its own group
    theirs = _trainer_run("bf16-mixed")
    assert type(theirs["error"]) is AssertionError and str(theirs["error"]).startswith(TORCHS)
    assert theirs["steps"] == 0


def _fabric_run(precision: str) -> BaseException | None:
    """Fabric with ``ModelParallelStrategy`` (``fully_shard`` per block and root in ``parallelize_fn``; ``shard_model``
    with the plugin at O2), the optimizer set up over the trainable parameters, ``first.fc`` unfrozen, one forward."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16") if precision == "O2" else None

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        return shard_blocks(model, plugin, mesh["data_parallel"])

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=1, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy,
                    **({"plugins": [plugin]} if plugin else {"precision": precision}))  # fmt: skip
    fabric.launch()
    try:
        model = fabric.setup_module(Net())
        fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
        model.first.fc.requires_grad_(True)
        model(_batch()[0])
    except Exception as error:  # noqa: BLE001 - returned for the test
        return error
    return None


def test_fabric_at_o2_refuses_fsdp_at_setup_before_any_forward(launched_alone) -> None:
    """Fabric's plugin at O2 refuses ``ModelParallelStrategy`` at ``fabric.setup`` (Fabric converts the model before
    the strategy shards it), so the unfrozen half base never reaches FSDP's set-up there (were it let through, its
    ``forward_context`` is ``Amp.forward_context``: the core test's door). Fabric's own ``"bf16-mixed"`` on this flow:
    torch's bare AssertionError in the first forward."""
    pytest.importorskip("lightning.fabric")
    environ = dict(os.environ)  # Fabric's launch writes the process group's environment: put back after
    try:
        ours = _fabric_run("O2")
        assert isinstance(ours, RuntimeError) and "cannot train a model sharded by FSDP" in str(ours)
        torch.distributed.destroy_process_group()
        theirs = _fabric_run("bf16-mixed")
        assert type(theirs) is AssertionError and str(theirs).startswith(TORCHS)
    finally:
        os.environ.clear()
        os.environ.update(environ)


def _accelerate_step(accelerator: Any, net: nn.Module, optimizer: Any, autocast: bool = False) -> None:
    x, y = _batch()
    if autocast:
        with accelerator.autocast():
            out = net(x)
    else:
        out = net(x)
    accelerator.backward(nn.functional.cross_entropy(out.float(), y))
    optimizer.step()
    optimizer.zero_grad()


def _accelerate_unfrozen(mixed_precision: str, autocast: bool = False) -> tuple[BaseException | None, bool]:
    """``first.fc`` unfrozen after ``prepare``, then one step (``autocast``: the forward under
    ``accelerator.autocast()``): the error raised and whether the base moved."""
    accelerator, net, optimizer = accelerate_prepared(mixed_precision)
    before = gathered(net)
    net.first.fc.requires_grad_(True)
    try:
        _accelerate_step(accelerator, net, optimizer, autocast)
    except Exception as error:  # noqa: BLE001 - returned for the test
        return error, gathered(net) != before
    return None, gathered(net) != before


@pytest.mark.parametrize("autocast", [False, True], ids=["plain_call", "under_autocast"])
def test_accelerate_names_the_half_base_unfrozen_before_the_first_forward(launched_alone, autocast) -> None:
    """The adapter: FSDP's root pre-hook (its set-up) runs before the forward wrapper enters the policy's scope, so
    ``model(x)`` is met by the guard on that hook, also under ``accelerator.autocast()`` (the guard is innermost: the
    scope lets its ValueError pass). Accelerate's own ``"bf16"``: torch's bare AssertionError."""
    pytest.importorskip("accelerate")
    error, moved = _accelerate_unfrozen("O2", autocast)
    _check_named(error)
    assert moved is False
    if autocast:
        return  # Accelerate's own precision, once
    torch.distributed.destroy_process_group()  # Accelerate's next state starts its own group
    theirs, _ = _accelerate_unfrozen("bf16")
    assert type(theirs) is AssertionError and str(theirs).startswith(TORCHS)


def test_accelerate_gives_fsdp_its_own_pre_hook_back_after_the_first_forward(launched_alone) -> None:
    """The guard is on the first forward's path only: once FSDP set the units up, the root's pre-hook is FSDP's own
    again, in the same place (no call added per step), and training goes on (the base frozen: nothing refused)."""
    pytest.importorskip("accelerate")
    from lightning_mpx.engine.sharding import _SetUpGuard

    accelerator, net, optimizer = accelerate_prepared("O2")
    hooks = net._forward_pre_hooks
    key = net._get_fsdp_state()._pre_forward_hook_handle.id
    guard, order = hooks[key], list(hooks)
    assert isinstance(guard, _SetUpGuard)
    adapter = net.first.adapter.weight.detach().full_tensor().clone()
    for _ in range(2):
        _accelerate_step(accelerator, net, optimizer)
    assert hooks[key] is guard.hook and list(hooks) == order
    assert not torch.equal(net.first.adapter.weight.detach().full_tensor(), adapter)  # trained on
