"""``shard_model`` with FSDP2's own default for the root (``reshard_after_forward=None``): the root keeps its
parameters gathered from its forward to the backward, one all-gather per step less than resharding it, as Lightning's
and FSDP's own ``fully_shard`` defaults do. What that default costs a user is guarded here, in one process (a gloo
group of one):

* a forward with no backward (an evaluation) leaves the root gathered, so ``model.parameters()`` returns the gathered
  copies until the next backward. An optimizer built over them would never train the root (FSDP moves every gradient
  to the shards): ``Amp.prepare_optimizer`` refuses it, naming the parameters and the fix;
* ``check_sharded_model`` and ``prepare_model`` after such an evaluation check the stored FP32 shards, not the
  gathered half copies (which O2 would refuse as half parameters stored).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.integrations.fsdp import check_sharded_model, shard_model
from tests.fsdp_reconfigure_script import Block, Model

pytest.importorskip("torch.distributed.fsdp")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 16, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(n)]


def _evaluate(amp: Amp, net: nn.Module) -> None:
    with torch.no_grad(), amp.forward_context():
        net(torch.randn(4, 16))


def _train(level: str, *, evaluate_first: bool, reshard: object = None, fix: bool = False) -> list[torch.Tensor]:
    """Losses of three steps, then the root's output weight (full), of a model sharded by ``shard_model``."""
    amp = Amp(level, half_dtype="bfloat16")
    net = _net()
    kwargs = {} if reshard is None else {"reshard_after_forward": reshard}
    shard_model(net, amp, blocks=Block, **kwargs)
    if evaluate_first:
        _evaluate(amp, net)
        if fix:
            for unit in net.modules():
                if hasattr(unit, "reshard"):
                    unit.reshard()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    amp.prepare_model(net)
    amp.prepare_optimizer(optimizer)
    losses = []
    for x, y in _batches(3):
        with amp.forward_context():
            loss = nn.functional.cross_entropy(net(x).float(), y)
        amp.backward(loss)
        amp.step(optimizer)
        optimizer.zero_grad()
        amp.update()
        losses.append(loss.detach())
    return [*losses, net.out.weight.full_tensor().detach().clone()]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_root_kept_gathered_trains_as_the_root_resharded(one_rank, level):
    """FSDP's default for the root changes when it gathers, not what it computes: the same losses and weights, bit for
    bit, as ``reshard_after_forward=True`` (every unit resharded after its forward)."""
    default = _train(level, evaluate_first=False)
    resharded = _train(level, evaluate_first=False, reshard=True)
    for got, want in zip(default, resharded):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_optimizer_built_after_an_evaluation_is_refused_naming_the_gathered_parameters(one_rank, level):
    message = r"gathered \(unsharded\) FSDP parameter\(s\).*out\.weight.*model\.reshard\(\)"
    with pytest.raises(ValueError, match=message):
        _train(level, evaluate_first=True)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_resharding_after_the_evaluation_trains_as_without_it(one_rank, level):
    """The fix the refusal names: ``reshard()`` before building the optimizer, and the root trains (its output weight
    moves exactly as in a run with no evaluation)."""
    fixed = _train(level, evaluate_first=True, fix=True)
    plain = _train(level, evaluate_first=False)
    for got, want in zip(fixed, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_checks_after_an_evaluation_read_the_stored_shards(one_rank):
    """At O2 the gathered root is bfloat16: read as stored, O2 would refuse it as half parameters stored. The check
    (and ``prepare_model``, which runs it) puts the root back to its FP32 shards first."""
    amp = Amp("O2", half_dtype="bfloat16")
    net = _net()
    shard_model(net, amp, blocks=Block)
    _evaluate(amp, net)
    assert net.out.weight.dtype == torch.bfloat16  # FSDP's default: the root stays gathered after its forward
    check_sharded_model(net, amp.settings)
    assert {type(p).__name__ for p in net.parameters()} == {"DTensor"}
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    amp.prepare_model(net)  # no refusal either


def test_the_refusal_comes_at_prepare_optimizer_before_any_step(one_rank):
    """The error comes where the optimizer is handed over, not later at its first step."""
    amp = Amp("O2", half_dtype="bfloat16")
    net = _net()
    shard_model(net, amp, blocks=Block)
    _evaluate(amp, net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    amp.prepare_model(net)
    with pytest.raises(ValueError, match=r"out\.weight"):
        amp.prepare_optimizer(optimizer)
