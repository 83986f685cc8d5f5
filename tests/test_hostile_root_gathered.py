"""FSDP's default for the root (``shard_model``'s ``reshard_after_forward=None``: the root stays gathered after a
forward with no backward) attacked the way users train, each run against the same run with
``reshard_after_forward=True`` (nothing left gathered by an evaluation), bit for bit.

* Through a real Trainer with ``ModelParallelStrategy`` on two CPU processes (gloo,
  ``tests/hostile_root_gathered_script.py``, run in tests/test_fsdp_reconfigure.py's launch and tested there):
  validation every epoch with the sanity check, a second Trainer fitting the same model, predict then fit, and a
  checkpoint saved right after a validation (the root gathered) resumed with ``ckpt_path=``. Lightning moves the
  model to its device at every stage (``FSDPModule._apply`` reshards every unit first), and its checkpoint reads
  ``model.state_dict()`` (FSDP's state-dict hook reshards too), so no stage builds its optimizers over gathered copies
  or saves them.
* The engine in one process (a gloo group of one): an evaluation inside gradient accumulation, an evaluation forward
  with gradients enabled and no backward, two optimizers, an optimizer rebuilt after an evaluation.
* A parameter group added after an evaluation (a fine-tuning callback unfreezing the root's modules) is refused at
  the next step, before anything moves.
* ``reshard_after_forward=False`` leaves every unit gathered after an evaluation, and ``model.reshard()`` is not
  recursive: the refusal names the call that puts them all back, and following it trains.
* Fabric with ``ModelParallelStrategy`` at O1 (the plugin prepares the model before the strategy shards it): an
  optimizer built after an evaluation is refused there too, instead of silently leaving the root untrained.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.integrations.fsdp import shard_model
from tests.hostile_root_gathered_script import Block, Model

pytest.importorskip("torch.distributed.fsdp")


# -- the engine in one process -----------------------------------------------------------------------------------
def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _evaluate(amp: Amp, net: nn.Module, *, grad: bool = False) -> None:
    """``model.eval()``, one forward (under ``no_grad``, or with gradients enabled and no backward), ``train()``."""
    net.eval()
    with torch.enable_grad() if grad else torch.no_grad(), amp.forward_context():
        net(torch.randn(8, 16))
    net.train()


def _full(net: nn.Module) -> list[torch.Tensor]:
    from lightning_mpx.engine.sharding import reshard_gathered

    reshard_gathered(net)
    return [p.full_tensor().detach().clone() for p in net.parameters()]


def _train(level: str, case: str, reshard: bool | None) -> list[torch.Tensor]:
    """Losses of six batches and the final full weights. ``case``: ``accumulate`` (steps every second batch, an
    evaluation between the two backwards), ``eval_grad`` (an evaluation with gradients enabled before every batch),
    ``two_optimizers`` (AdamW over the root's own parameters, SGD over the blocks; an evaluation before every batch)
    or ``rebuild`` (after the third step an evaluation, then the optimizer rebuilt from the old one's state dict)."""
    amp = Amp(level, half_dtype="bfloat16")
    torch.manual_seed(0)
    net = Model()
    shard_model(net, amp, blocks=Block, **({} if reshard is None else {"reshard_after_forward": reshard}))
    amp.prepare_model(net)
    if case == "two_optimizers":
        own = [p for name, p in net.named_parameters() if not name.startswith("blocks.")]
        optimizers = [torch.optim.AdamW(own, lr=0.01), torch.optim.SGD(net.blocks.parameters(), lr=0.1)]
    else:
        optimizers = [torch.optim.AdamW(net.parameters(), lr=0.01)]
    for optimizer in optimizers:
        amp.prepare_optimizer(optimizer)
    out = []
    for i, (x, y) in enumerate(_batches(6)):
        if case == "two_optimizers" or (case == "accumulate" and i % 2 == 1):
            _evaluate(amp, net)
        elif case == "eval_grad":
            _evaluate(amp, net, grad=True)
        with amp.forward_context():
            loss = F.cross_entropy(net(x).float(), y)
        amp.backward(loss)
        out.append(loss.detach())
        if case == "accumulate" and i % 2 == 0:
            continue
        for optimizer in optimizers:
            amp.step(optimizer)
            optimizer.zero_grad()
        amp.update()
        if case == "rebuild" and i == 2:
            _evaluate(amp, net)
            net.reshard()  # the refusal's fix
            old = optimizers[0]
            amp.release_optimizer(old)
            optimizers = [torch.optim.AdamW(net.parameters(), lr=0.01)]
            optimizers[0].load_state_dict(old.state_dict())
            amp.prepare_optimizer(optimizers[0])
    return out + _full(net)


@pytest.mark.parametrize("case", ["accumulate", "eval_grad", "two_optimizers", "rebuild"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_engine_habits_around_an_evaluation_train_as_the_root_resharded(one_rank, level, case):
    got, want = _train(level, case, None), _train(level, case, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_with_no_reshard_after_forward_the_refusal_names_a_fix_that_works(one_rank, level):
    """``reshard_after_forward=False``: an evaluation leaves the blocks gathered too, and ``model.reshard()`` (not
    recursive) puts back only the root. The refusal names ``reshard_gathered``, which puts back every unit; after it
    the optimizer is taken and trains as one built before the evaluation."""
    from lightning_mpx.fsdp import reshard_gathered

    def build(evaluate: bool) -> list[torch.Tensor]:
        amp = Amp(level, half_dtype="bfloat16")
        torch.manual_seed(0)
        net = Model()
        shard_model(net, amp, blocks=Block, reshard_after_forward=False)
        amp.prepare_model(net)
        if evaluate:
            _evaluate(amp, net)
            net.reshard()  # the root only
            with pytest.raises(ValueError, match=r"blocks\.0\.linear\.weight.*reshard_gathered\(model\)"):
                amp.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
            reshard_gathered(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        amp.prepare_optimizer(optimizer)
        for x, y in _batches(2):
            with amp.forward_context():
                loss = F.cross_entropy(net(x).float(), y)
            amp.backward(loss)
            amp.step(optimizer)
            optimizer.zero_grad()
            amp.update()
        return _full(net)

    for a, b in zip(build(True), build(False)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_model_state_dict_after_an_evaluation_is_the_fp32_shards(one_rank):
    """``model.state_dict()`` right after an evaluation (the root gathered in bfloat16 at O2) saves FP32 shards:
    FSDP's state-dict hook reshards first."""
    amp = Amp("O2", half_dtype="bfloat16")
    torch.manual_seed(0)
    net = shard_model(Model(), amp, blocks=Block)
    amp.prepare_model(net)
    _evaluate(amp, net)
    assert net.out.weight.dtype == torch.bfloat16
    state = net.state_dict()
    assert {(type(v).__name__, v.dtype) for v in state.values()} == {("DTensor", torch.float32)}


# -- Fabric with ModelParallelStrategy ---------------------------------------------------------------------------
def test_fabric_refuses_an_optimizer_built_after_an_evaluation():
    """Fabric's plugin prepares the model before the strategy shards it (so the engine never saw it sharded); an
    optimizer built after an evaluation holds the root's gathered copies and is refused at registration, naming the
    fix, where it used to train only the blocks. ``shard_model`` takes the Fabric plugin itself as ``precision``."""
    import torch.distributed as dist

    pytest.importorskip("lightning.fabric")
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_mpx import FabricMixedPrecisionPlugin

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    # Fabric's launch sets the process group's environment (MASTER_PORT, WORLD_SIZE, ...), which the later tests'
    # multi-process scripts would inherit: put it back as it was after the test.
    environ = dict(os.environ)
    plugin = FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16")

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        return shard_model(model, plugin, mesh=mesh["data_parallel"], blocks=Block)

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=1, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin])
    try:
        fabric.launch()
        torch.manual_seed(0)
        model = fabric.setup_module(Model())
        with torch.no_grad():
            model(torch.randn(8, 16))
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(ValueError, match=r"gathered \(unsharded\) FSDP parameter\(s\).*out\.weight.*reshard"):
            plugin.setup_optimizers(optimizer)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_param_group_added_after_an_evaluation_is_refused_at_the_step(one_rank, level):
    """A fine-tuning habit (Lightning's ``BaseFinetuning.unfreeze_and_add_param_group`` at an epoch's start, after
    the previous epoch's validation left the root gathered): ``add_param_group`` with the root's gathered copies. FSDP
    never gives them a gradient, so the step would silently not train them; the next step refuses it instead, naming
    them, before anything moves."""
    amp = Amp(level, half_dtype="bfloat16")
    torch.manual_seed(0)
    net = shard_model(Model(), amp, blocks=Block)
    amp.prepare_model(net)
    optimizer = torch.optim.SGD(net.blocks.parameters(), lr=0.1)
    amp.prepare_optimizer(optimizer)
    _evaluate(amp, net)
    optimizer.add_param_group({"params": list(net.inp.parameters())})
    x, y = _batches(1)[0]
    with amp.forward_context():
        loss = F.cross_entropy(net(x).float(), y)
    amp.backward(loss)
    before = [p.full_tensor().clone() for p in net.blocks.parameters()]
    with pytest.raises(ValueError, match=r"gathered \(unsharded\) FSDP parameter\(s\).*inp\.weight"):
        amp.step(optimizer)
    assert all(torch.equal(b, p.full_tensor()) for b, p in zip(before, net.blocks.parameters()))
