"""O3's loss policy (casting/loss_promotion.py): a loss function given floating arguments of two dtypes (the FP32
output of the boundary, a target made in the model's half dtype) runs in the widest, exactly as on the target cast
first; a loss on arguments of one dtype runs as given (a loss on the half logits inside the model stays half, as at
Apex's O3, which patches nothing); nothing changes outside the forward scope. The core ``Amp`` and the Accelerate
adapter; the Trainer and Fabric plugins are in tests/test_lightning_self_dtype.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from tests.accelerate_helpers import accelerate_state_reset

HALF = torch.bfloat16


class _LossInside(nn.Module):
    """A model that computes its loss in its own forward (a Hugging Face ``...ForSequenceClassification``'s habit)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(x)
        return F.cross_entropy(logits, labels), logits


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    return x, y, (F.one_hot(y, 4) * 0.9 + 0.025).to(HALF)


def test_core_o3_promotes_mixed_loss_arguments_exactly_and_leaves_one_dtype_losses_half() -> None:
    torch.manual_seed(0)
    amp = Amp("O3", half_dtype=HALF)
    model = amp.prepare_model(_LossInside())
    x, y, target = _batch()
    with amp.forward_context():
        inner, logits = model(amp.cast_inputs(x), y)
        out = amp.cast_outputs(logits)
        huber = F.huber_loss(out, target)
        bce = F.binary_cross_entropy(torch.sigmoid(out), target)
        kl = F.kl_div(F.log_softmax(out, -1), target, reduction="batchmean")
    # Apex's O3 patches nothing: the loss on the half logits inside the model is half, as computed without a policy.
    with torch.no_grad():
        bare = F.cross_entropy(model.net(x.to(HALF)), y)
    assert inner.dtype == HALF and torch.equal(inner.detach(), bare)
    # The mixed pairs run in FP32, bit for bit the loss on the target cast first (a half value is exact in FP32).
    wide = target.float()
    assert huber.dtype == bce.dtype == kl.dtype == torch.float32
    assert torch.equal(huber, F.huber_loss(out, wide))
    assert torch.equal(bce, F.binary_cross_entropy(torch.sigmoid(out), wide))
    assert torch.equal(kl, F.kl_div(F.log_softmax(out, -1), wide, reduction="batchmean"))
    amp.backward(huber + bce + inner)
    assert model.net.weight.grad is not None and model.net.weight.grad.dtype == HALF
    # Outside the forward scope nothing is cast (nothing is patched for the process): torch's own refusal, in the
    # backward pass.
    with pytest.raises(RuntimeError, match="BFloat16 but expected Float"):
        F.huber_loss(out.detach().requires_grad_(), target).backward()


def test_accelerate_o3_autocast_promotes_a_loss_on_a_half_target() -> None:
    """Accelerate's habit: the loss in ``accelerator.autocast()`` on the prepared model's FP32 output and a target in
    the weights' dtype (``huber_loss`` refused it at O3, as in the Trainer)."""
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    x, _, target = _batch()
    with accelerate_state_reset():
        accelerator = Accelerator(cpu=True, mixed_precision="O3",
                                  kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])
        torch.manual_seed(0)
        net = nn.Linear(16, 4)
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        before = model.weight.detach().clone()
        with accelerator.autocast():
            out = model(x)
            loss = F.huber_loss(out, target.to(model.weight.dtype))
        assert out.dtype == loss.dtype == torch.float32 and model.weight.dtype == HALF
        accelerator.backward(loss)
        optimizer.step()
        assert not torch.equal(model.weight.detach(), before)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class _Stacked(nn.Module):
    """GPT's layout: blocks in an ``nn.ModuleList`` (no forward of its own) that the root's forward iterates."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(depth))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_blocks_in_a_module_list_run_without_the_loss_mode(level: str) -> None:
    """The loss policy's mode is taken off in the loss-free submodules by hooks on them; hooks on the
    ``nn.ModuleList`` never ran (it is never called), so every op of its blocks was handed to the mode (a GPT at O3:
    297 -> 430 Python calls per Fabric step). Its blocks are hooked: the mode sees the same calls at any depth, and
    the loss is what the same engine computes with the mode on everywhere."""
    from tests.compile_helpers import HookCounter

    x, y, _ = _batch()
    seen, losses = [], []
    for depth in (1, 4):
        torch.manual_seed(0)
        amp = Amp(level, half_dtype=HALF)
        model = amp.prepare_model(_Stacked(depth))
        with HookCounter() as counter, amp.forward_context():
            loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))), y)
        seen.append(counter.calls)
        losses.append(loss)
    assert seen[0] == seen[1] <= 6, seen  # the loss, the casts, and the root's own calls
    torch.manual_seed(0)
    amp = Amp(level, half_dtype=HALF)
    model = amp.prepare_model(_Stacked(4))
    for handle in amp._models._regions_hooks[model]:
        handle.remove()  # the mode on for the whole forward
    with amp.forward_context():
        assert torch.equal(F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))), y), losses[1])


def test_a_cast_table_at_o3_is_refused_naming_the_register_route_which_promotes_a_users_own_loss() -> None:
    """``cast_table=`` is O1's; at O3 the error names the route that works there: registering a ``@dispatchable`` loss
    of one's own in the level's table with ``"promote"`` (a strict-dtype loss given an FP32 output and a half
    target then runs in FP32, as the built-in ones do)."""
    from lightning_mpx import CastTable, dispatchable

    with pytest.raises(ValueError, match=r"opt_level='O3'.*amp\.policy\.table\.register\(fn, 'float' at O2, 'promote'"):
        Amp("O3", half_dtype=HALF, cast_table=CastTable.default())

    @dispatchable
    def strict_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if output.dtype != target.dtype:
            raise RuntimeError(f"strict_loss: {output.dtype} and {target.dtype}")
        return (output - target).square().mean()

    amp = Amp("O3", half_dtype=HALF)
    model = amp.prepare_model(nn.Linear(16, 4))
    x, _, target = _batch()
    with amp.forward_context():
        out = amp.cast_outputs(model(amp.cast_inputs(x)))
        with pytest.raises(RuntimeError, match="strict_loss"):
            strict_loss(out, target)
    amp.policy.table.register(strict_loss, "promote")
    with amp.forward_context():
        out = amp.cast_outputs(model(amp.cast_inputs(x)))
        loss = strict_loss(out, target)
    assert loss.dtype == torch.float32
    assert torch.equal(loss, strict_loss(out, target.float()))
