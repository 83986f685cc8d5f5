"""FSDP2 at O2, a base loaded in bfloat16 and frozen beside FP32 parameters in one FSDP unit (a LoRA model's layout:
each ``Block``'s half ``fc`` with its FP32 ``adapter``; or ``shard_model`` without ``blocks``), unfrozen mid-run with
``requires_grad_(True)``, with or without giving it to the optimizer.

FSDP fixed the unit's gradient dtype (FP32, the adapters') at its first forward, so the next backward failed inside
torch's FSDP ("attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype 'BFloat16'"), and the
user was not told what happened or what to do. The half base cannot train under FSDP at O2: FSDP's FP32 shards are
the masters, and it has none (without FSDP, O2 makes its master from its half values and trains it). Lightning's
``"bf16-mixed"`` under ``ModelParallelStrategy`` and Accelerate's ``"bf16"`` fail in torch's FSDP the same way. Now
the engine's backward turns FSDP's error into a ``ValueError`` naming the parameters, why, and the fix, raised from
torch's error; nothing moved.

In-process on a gloo group of one (the core ``Amp`` with ``shard_model``, a Lightning ``Trainer`` and an Accelerate
``Accelerator``), and one two-rank launch (``tests/core_fsdp2_unfreeze_script.py``): both ranks raise it at the same
step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.integrations.fsdp import shard_model
from tests.core_fsdp2_unfreeze_script import UNFREEZE_AT, Block, Net, accelerate_run, gathered, lightning_run
from tests.launch import rank_results, run_script

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="FSDP needs torch.distributed with gloo",
)

BF16 = torch.bfloat16
STEPS = 4
NAMED = (
    "2 half parameter(s) of a model sharded by FSDP at O2 require a gradient: {prefix}{block}.fc.weight, "
    "{prefix}{block}.fc.bias."
)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(STEPS)]


def _core_run(amp: Amp, net: Net, unfreeze: str, hook: Any = None, block: str = "first") -> dict[str, Any]:
    """The engine's loop (AdamW over the trainable parameters), ``block``'s ``fc`` unfrozen before step
    ``UNFREEZE_AT`` (``unfreeze``: ``"requires_grad"`` only, or also ``"extend"`` the first group, or
    ``"add_param_group"``); returns the error raised (if any), the steps taken and whether the first block's base and
    adapter moved."""
    optimizer = amp.prepare_optimizer(torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2))
    before, adapter = gathered(net), _full(net.first.adapter.weight)
    steps = 0
    try:
        for step, (x, y) in enumerate(_batches()):
            if step == UNFREEZE_AT:
                unfrozen = getattr(net, block).fc.requires_grad_(True)
                if unfreeze == "extend":
                    optimizer.param_groups[0]["params"].extend(unfrozen.parameters())
                elif unfreeze == "add_param_group":
                    optimizer.add_param_group({"params": list(unfrozen.parameters())})
            with amp.forward_context():
                out = net(amp.cast_inputs(x))
            if hook is not None:
                out.register_hook(hook)
            amp.backward(nn.functional.cross_entropy(out.float(), y))
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()
            steps += 1
    except Exception as error:  # noqa: BLE001 - returned for the test
        return dict(error=error, steps=steps, base_moved=gathered(net) != before)
    return dict(error=None, steps=steps, base_moved=gathered(net) != before, optimizer=optimizer,
                adapter_moved=not torch.equal(_full(net.first.adapter.weight), adapter))  # fmt: skip


def _full(param: torch.Tensor) -> torch.Tensor:
    tensor = param.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).clone()


def _check_refused(error: BaseException | None, block: str = "first") -> None:
    """The refusal: a ValueError naming the unfrozen half parameters, saying why and what to do, raised from torch's
    error in FSDP's backward."""
    assert isinstance(error, ValueError), f"{type(error).__name__}: {error}"
    message = str(error)
    assert message.startswith(NAMED.format(prefix="", block=block))
    assert "no FP32 master" in message and "fixed its unit's gradient dtype" in message
    assert "keep them frozen" in message and "load the base in FP32 before sharding" in message
    assert isinstance(error.__cause__, RuntimeError) and "dtype" in str(error.__cause__)


@pytest.mark.parametrize("unfreeze", ["requires_grad", "extend", "add_param_group"])
@pytest.mark.parametrize("blocks", [Block, None], ids=["per_block", "root_only"])
def test_core_amp_refuses_the_unfrozen_half_base_at_the_backward(one_rank, blocks, unfreeze) -> None:
    """Before: torch's RuntimeError from FSDP's backward, the parameters unnamed; after: the ValueError, at the step
    of the unfreeze, the base unchanged. The adapters trained before it."""
    amp = Amp("O2", half_dtype="bfloat16")
    net = Net()
    shard_model(net, amp, blocks=blocks)
    amp.prepare_model(net)
    run = _core_run(amp, net, unfreeze)
    _check_refused(run["error"])
    assert run["steps"] == UNFREEZE_AT and not run["base_moved"]


def test_the_refusal_names_the_unfrozen_base_of_a_unit_that_a_later_unit_feeds(one_rank) -> None:
    """``second``'s unit gets its gradient in the middle of the backward (its input requires grad), while the root is
    still gathered: the root's half copies of its FP32 parameters (``head``) are not named."""
    amp = Amp("O2", half_dtype="bfloat16")
    net = Net()
    shard_model(net, amp, blocks=Block)
    amp.prepare_model(net)
    run = _core_run(amp, net, "extend", block="second")
    _check_refused(run["error"], block="second")
    assert run["steps"] == UNFREEZE_AT


class _HalfBlock(Block):
    """A block loaded in bfloat16 whole (its adapter too): an FSDP unit of half parameters only."""

    def __init__(self) -> None:
        super().__init__()
        self.to(BF16).requires_grad_(False)


def _half_unit_net() -> Net:
    net = Net()
    net.first = _HalfBlock()
    return net


def test_a_half_unit_of_its_own_unfrozen_and_not_stepped_trains_on(one_rank) -> None:
    """Not refused where FSDP's backward works: a unit of half parameters only reduces in half; unfrozen without an
    optimizer it gets gradients that nothing steps, as without FSDP (given to an optimizer it is refused at the next
    step: tests/test_lightning_fsdp2_half_block_append.py)."""
    amp = Amp("O2", half_dtype="bfloat16")
    net = _half_unit_net()
    shard_model(net, amp, blocks=Block)
    amp.prepare_model(net)
    run = _core_run(amp, net, "requires_grad")
    assert run["error"] is None and run["steps"] == STEPS
    assert not run["base_moved"] and run["adapter_moved"] is False  # the half block: frozen, then never stepped
    assert net.first.fc.weight.grad.dtype == BF16  # reduced in half; no optimizer zeroes it, as without FSDP


def test_an_unrelated_backward_error_is_raised_as_it_is(one_rank) -> None:
    """A hook of the user's that raises in the backward, with a half parameter unfrozen (a unit of its own): its own
    error, not the refusal."""
    amp = Amp("O2", half_dtype="bfloat16")
    net = _half_unit_net()
    shard_model(net, amp, blocks=Block)
    amp.prepare_model(net)
    raised = RuntimeError("a hook's own error about a dtype")

    def hook(grad: torch.Tensor) -> None:
        if net.first.fc.weight.requires_grad:
            raise raised

    run = _core_run(amp, net, "requires_grad", hook=hook)
    assert run["error"] is raised and run["steps"] == UNFREEZE_AT


def test_without_fsdp_o2_trains_the_unfrozen_half_base_from_its_half_values() -> None:
    """The library's answer without FSDP, for comparison: the unfrozen base gets an FP32 master made from its half
    values (exact for a base loaded in half) and trains, its Adam moments FP32."""
    amp = Amp("O2", half_dtype="bfloat16")
    net = Net()
    amp.prepare_model(net)
    run = _core_run(amp, net, "extend")
    assert run["error"] is None and run["steps"] == STEPS and run["base_moved"]
    assert run["optimizer"].state[net.first.fc.weight]["exp_avg"].dtype == torch.float32


# -- Lightning and Accelerate, in this process (a gloo group of one: conftest's launched_alone) ------------------------
@pytest.mark.parametrize("front", ["lightning", "accelerate"])
def test_lightning_and_accelerate_at_o2_refuse_it_where_their_own_precisions_fail_in_torch(launched_alone, front):
    """Lightning (``ModelParallelStrategy``, ``shard_model`` per block, the base appended to the optimizer's group)
    and Accelerate (``fsdp_version=2``, the base unfrozen only): the refusal from ``trainer.fit`` and
    ``accelerator.backward``. Their own precisions (``"bf16-mixed"``: ``fully_shard`` per block and root;
    ``"bf16"``) do not train it either: torch's FSDP error, unexplained."""
    pytest.importorskip("lightning.pytorch" if front == "lightning" else "accelerate")
    if front == "lightning":
        ours, theirs = lightning_run("O2", ranks=1), lightning_run("bf16-mixed", ranks=1)
    else:
        ours = accelerate_run("O2")
        torch.distributed.destroy_process_group()  # Accelerate's next state starts its own group
        from tests.accelerate_helpers import reset_accelerate_state

        reset_accelerate_state()
        theirs = accelerate_run("bf16")
    assert ours["type"] == "ValueError" and ours["error"].startswith(
        NAMED.format(prefix="net." if front == "lightning" else "", block="first")
    )
    assert ours["cause"].startswith("RuntimeError") and "dtype" in ours["cause"]
    assert ours["steps"] == UNFREEZE_AT and ours["moved"] is False
    assert theirs["type"] in ("RuntimeError", "AssertionError") and "dtype" in theirs["error"]
    assert theirs["steps"] == UNFREEZE_AT and theirs["moved"] is False


# -- two ranks -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("fsdpunfreeze63")
    run_script("core_fsdp2_unfreeze_script.py", out, timeout=120, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return {part: rank_results(out, f"{part}_") for part in ("lightning", "accelerate")}


@pytest.mark.parametrize("front", ["lightning", "accelerate"])
def test_two_ranks_both_refuse_it_at_the_same_step(two_ranks, front) -> None:
    """Before: torch's RuntimeError on both ranks; after: the refusal on both, at the step of the unfreeze, the base
    unchanged (no rank left waiting in a collective)."""
    prefix = "net." if front == "lightning" else ""
    for rank in two_ranks[front]:
        assert "unexpected" not in rank, rank["unexpected"]
        assert rank.get("type") == "ValueError", rank
        assert rank["error"].startswith(NAMED.format(prefix=prefix, block="first")) and "dtype" in rank["cause"]
        assert rank["steps"] == UNFREEZE_AT and rank["moved"] is False
