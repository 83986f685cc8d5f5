"""Under FSDP at O2, FSDP's sharded FP32 parameters are the master weights: no separate FP32 master is made. Since
fsdplora62 a sharded model may store FROZEN parameters in half (a LoRA model on a base loaded in bfloat16). A half
parameter in an O2 optimizer would be stepped in half once it trains (unfrozen before or after the optimizer was
prepared, or added with ``add_param_group``): silent precision loss, where an unsharded model gets an FP32 master.
The engine refuses an O2 optimizer holding any half parameter of a sharded model, where it meets the optimizer
(``prepare_optimizer``) and where its groups change (the next step): no cost per step.

In one process (a gloo group of one, the ``one_rank`` fixture), FSDP2's ``fully_shard`` through ``shard_model``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.integrations.fsdp import shard_model
from tests.test_lightning_fsdp2_lora_state_reads import Lora  # a frozen bfloat16 base, an FP32 adapter and head

pytest.importorskip("torch.distributed.fsdp")

BF16 = torch.bfloat16


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(n)]


def _prepared(sharded: bool = True) -> tuple[Amp, Lora]:
    amp = Amp("O2", half_dtype=BF16)
    model = Lora()
    if sharded:
        shard_model(model, amp)
    amp.prepare_model(model)
    return amp, model


def _steps(amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer, n: int) -> list[float]:
    losses = []
    for x, y in _batches(n):
        with amp.forward_context():
            loss = nn.functional.cross_entropy(model(x.to(BF16)).float(), y)  # as the sharded root casts
        amp.backward(loss)
        amp.step(optimizer)
        optimizer.zero_grad()
        amp.update()
        losses.append(loss.item())
    return losses


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


REFUSAL = (
    r"half parameter\(s\) of a model sharded by FSDP at O2: base\.weight, base\.bias\..*stepped in half.*requires_grad"
)


def test_an_optimizer_over_all_parameters_with_the_frozen_half_base_is_refused(one_rank):
    """``AdamW(model.parameters())`` holds the frozen bfloat16 base: unfrozen later it would step in half."""
    amp, model = _prepared()
    with pytest.raises(ValueError, match=REFUSAL):
        amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def test_a_half_base_unfrozen_before_prepare_optimizer_is_refused(one_rank):
    amp, model = _prepared()
    model.base.requires_grad_(True)
    with pytest.raises(ValueError, match=REFUSAL):
        amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def test_an_optimizer_over_the_trainable_parameters_trains_as_the_unsharded_o2_run(one_rank):
    """The fix the refusal names: the adapter and head train, in FP32 shards, as the unsharded O2 engine trains them
    through its masters; the base stays as loaded."""
    amp, model = _prepared()
    base = model.base.weight.full_tensor().clone()
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(_trainable(model), lr=1e-2))
    losses = _steps(amp, model, optimizer, 4)
    ref_amp, ref = _prepared(sharded=False)
    want = _steps(ref_amp, ref, ref_amp.prepare_optimizer(torch.optim.AdamW(_trainable(ref), lr=1e-2)), 4)
    torch.testing.assert_close(losses, want, rtol=1e-2, atol=1e-2)
    assert losses[-1] < losses[0]
    adapter = model.adapter.weight
    assert adapter.dtype == torch.float32 and optimizer.param_groups[0]["params"][0] is adapter  # FSDP's FP32 shard
    assert torch.equal(model.base.weight.full_tensor(), base)


def test_a_half_parameter_added_with_add_param_group_is_refused_at_the_next_step_before_it_moves(one_rank):
    """A frozen half parameter added later (to unfreeze it then, which no check would see) is refused where the
    engine meets the new group: the next step, before any weight moves. (Unfrozen first, FSDP2's backward itself
    fails on this torch: its FP32 reduce-scatter cannot be assigned to a bfloat16 parameter's gradient.)"""
    amp, model = _prepared()
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(_trainable(model), lr=1e-2))
    _steps(amp, model, optimizer, 1)
    optimizer.add_param_group({"params": [model.base.weight]})
    adapter = model.adapter.weight.full_tensor().clone()
    with pytest.raises(ValueError, match=r"half parameter\(s\) of a model sharded by FSDP at O2: base\.weight\."):
        _steps(amp, model, optimizer, 1)
    assert torch.equal(model.adapter.weight.full_tensor(), adapter)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_prepare_of_an_optimizer_over_all_parameters_is_refused(one_rank):
    """The same refusal through the Accelerate adapter: ``accelerator.prepare(model, optimizer)`` with the model
    sharded by the user and the optimizer over ``model.parameters()``; over the trainable ones it prepares."""
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    model = Lora()
    shard_model(model, Amp("O2", half_dtype=BF16))
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype=BF16)])
    with pytest.raises(ValueError, match=REFUSAL):
        accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    accelerator.prepare(model, torch.optim.AdamW(_trainable(model), lr=1e-2))
