"""At O2 the loss policy's mode is off inside the submodules whose code computes no loss (issue 25, item 5).

The O2 forward policy runs loss functions in FP32 through a torch-function mode; the mode is taken off the stack while
the topmost loss-free submodules run, so a half model's blocks pay no Python per op, while a loss computed by the
model's own code (Hugging Face heads, a LightningModule's step, a loss in a helper) stays FP32. The reference is the
same engine with the mode on for the whole forward (the behaviour before): same losses and weights, bit for bit.
"""

from __future__ import annotations

import copy
import io
import pickle
import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_mpx import Amp, dispatchable
from lightning_mpx.casting.loss_regions import LossRegions
from tests.compile_helpers import HookCounter
from tests.test_o2_losses import _bert

transformers = pytest.importorskip("transformers")


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 3, (8,), generator=g)


@pytest.fixture
def mode_everywhere(monkeypatch):
    """The engine before: the O2 mode on for the whole forward (no region hooks)."""
    monkeypatch.setattr(LossRegions, "install", lambda self, root, **kwargs: [])


def _train_bert(steps: int = 3) -> tuple[list[float], nn.Module, int]:
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_bert())
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, calls = [], 0
    for step in range(steps):
        tokens, labels = _batch(step)
        with HookCounter() as counter, amp.forward_context():
            out = model(input_ids=tokens, labels=labels)
        calls = counter.calls
        assert out.loss.dtype == torch.float32
        torch.testing.assert_close(out.loss, F.cross_entropy(out.logits.float(), labels), rtol=1e-6, atol=0)
        amp.backward(out.loss)
        amp.step(optimizer)
        optimizer.zero_grad()
        losses.append(out.loss.item())
    return losses, model, calls


def test_hf_blocks_pay_no_python_and_the_run_is_the_same(monkeypatch):
    losses, model, calls = _train_bert()
    # The encoder, dropout and classifier run with the mode off: only the head's own code (the loss) is handed over.
    assert calls <= 12, calls
    with monkeypatch.context() as patch:
        patch.setattr(LossRegions, "install", lambda self, root, **kwargs: [])
        expected, reference, reference_calls = _train_bert()
    assert reference_calls > 10 * calls  # every op of the encoder went through the mode before
    assert losses == expected
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def _regions() -> LossRegions:
    amp = Amp("O2", half_dtype="bfloat16")
    return amp._loss_regions


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def _helper_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


class InlineLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.block(x), target)


class HelperMethodLoss(InlineLoss):
    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._score(self.block(x), target)

    def _score(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._inner(out, target)

    def _inner(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.smooth_l1_loss(out, target)


class HelperFunctionLoss(InlineLoss):
    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _helper_loss(self.block(x), target)


class AttributeLoss(InlineLoss):
    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = F.l1_loss  # a plain function held by the module

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.block(x), target)


class CriterionModule(InlineLoss):
    def __init__(self) -> None:
        super().__init__()
        self.crit = nn.MSELoss()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.crit(self.block(x), target)


class Scorer(nn.Module):
    """A child whose loss is in a method other than ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def score(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.huber_loss(out, target)


class ChildMethodLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = Scorer()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.head.score(self.head(self.block(x)), target)


class Outer(nn.Module):
    """The loss computed one level down, by a child: the child is not free, its block is."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.pre = Block()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.inner(self.pre(x), target)


@pytest.mark.parametrize(
    "kind", [InlineLoss, HelperMethodLoss, HelperFunctionLoss, AttributeLoss, CriterionModule, ChildMethodLoss]
)
def test_a_loss_in_a_submodule_is_fp32_wherever_its_code_puts_it(kind):
    amp = Amp("O2", half_dtype="bfloat16")
    torch.manual_seed(0)
    model = amp.prepare_model(Outer(kind()))
    free = amp._loss_regions.free_modules(model)
    assert model.inner not in free and model.pre in free and model.inner.block in free
    x, target = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    with amp.forward_context():
        loss = model(x, target)
    assert loss.dtype == torch.float32


@dispatchable
def _user_metric(t: torch.Tensor) -> torch.Tensor:
    return t.square().sum()


class _MetricBlock(nn.Module):
    """A submodule that calls the user's own function, which the user registers as FP32 in O2's table."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.seen = nn.Linear(8, 8), []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        self.seen.append(_user_metric(out).dtype)
        return out


class _WithMetric(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.metric = Block(), _MetricBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.metric(self.pre(x))


@pytest.mark.parametrize("when", ["before prepare", "after prepare", "after a forward", "table replaced"])
def test_a_row_the_user_registers_is_fp32_in_every_submodule(when):
    """The regions follow O2's table: a function registered FP32 (before or after the model was prepared, or a new
    table put in place) runs in FP32 inside a submodule that calls it, and the blocks that do not stay mode-free."""
    amp = Amp("O2", half_dtype="bfloat16")
    if when == "before prepare":
        amp.policy.table.register(_user_metric, "float")
    model = amp.prepare_model(_WithMetric())
    x = torch.randn(2, 8).bfloat16()
    if when == "after a forward":
        with amp.forward_context():
            model(x)
        assert model.metric.seen == [torch.bfloat16]  # not registered yet: the half model's dtype
    if when in ("after prepare", "after a forward"):
        amp.policy.table.register(_user_metric, "float")
    if when == "table replaced":
        table = amp.policy.table.copy()
        table.register(_user_metric, "float")
        amp.policy.table = table
    with amp.forward_context():
        model(x)
    assert model.metric.seen[-1] == torch.float32
    free = amp._loss_regions.free_modules(model)
    assert model.pre in free and model.metric not in free
    with HookCounter() as counter, amp.forward_context():
        model.pre(x)
    assert counter.calls == 0  # the block that calls no registered function stays mode-free

    amp.policy.table.unregister(_user_metric)
    with amp.forward_context():
        model(x)
    assert model.metric.seen[-1] == torch.bfloat16
    assert model.metric in amp._loss_regions.free_modules(model)


def test_a_row_registered_mid_training_is_fp32_through_the_trainer():
    """Through Lightning's Trainer: a function registered FP32 on the plugin's table after two batches runs in FP32 in
    the submodule that calls it from the next batch on (the half model's dtype before), and training goes on."""
    import lightning.pytorch as pl

    from lightning_mpx.integrations.lightning import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _WithMetric()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return self.net(x).float().square().mean()

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 2:
                plugin.amp.policy.table.register(_user_metric, "float")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(10, 8)), batch_size=2)
    make_trainer(plugin).fit(module, data)
    assert module.net.metric.seen == [torch.bfloat16] * 2 + [torch.float32] * 3


def test_the_mode_is_back_after_a_block_raises():
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.boom = Boom()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.boom(x)

    amp = Amp("O2", half_dtype="bfloat16")
    net = amp.prepare_model(Net())
    with amp.forward_context():
        depth = torch._C._len_torch_function_stack()
        with pytest.raises(RuntimeError, match="boom"):
            net.boom(torch.randn(2, 4))
        assert torch._C._len_torch_function_stack() == depth
        h = torch.randn(2, 4).bfloat16()
        assert F.mse_loss(h, h.flip(0)).dtype == torch.float32  # the step's own loss: the mode is back


def test_threads_and_reentry_keep_their_own_stacks():
    amp = Amp("O2", half_dtype="bfloat16")
    torch.manual_seed(0)
    model = amp.prepare_model(Outer(InlineLoss()))
    x, target = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        for _ in range(20):
            with amp.forward_context():
                depth = torch._C._len_torch_function_stack()
                model.pre(model.pre(x))  # a free module called twice in a row
                loss = model(x, target)
                results[name] = (loss.dtype, torch._C._len_torch_function_stack() - depth)

    threads = [threading.Thread(target=run, args=(str(i),)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {str(i): (torch.float32, 0) for i in range(3)}


def test_copies_and_pickles_of_a_prepared_model_still_run():
    amp = Amp("O2", half_dtype="bfloat16")
    torch.manual_seed(0)
    model = amp.prepare_model(Outer(InlineLoss()))
    x, target = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    averaged = torch.optim.swa_utils.AveragedModel(model)
    twin = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    unpickled = pickle.loads(pickle.dumps(model))
    with amp.forward_context():
        expected = model(x, target)
        for other in (averaged.module, twin, loaded, unpickled):
            assert torch.equal(other(x, target), expected)


def test_checkpointed_free_block_gives_the_same_gradients():
    class Net(nn.Module):
        def __init__(self, use_checkpoint: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.block = Block()
            self.use_checkpoint = use_checkpoint

        def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            h = checkpoint(self.block, x, use_reentrant=False) if self.use_checkpoint else self.block(x)
            return F.mse_loss(h, target)

    grads = []
    for use in (False, True):
        amp = Amp("O2", half_dtype="bfloat16")
        net = amp.prepare_model(Net(use))
        amp.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
        x, target = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
        with amp.forward_context():
            loss = net(x, target)
        assert loss.dtype == torch.float32
        amp.backward(loss)
        grads.append([p.grad.clone() for p in net.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_unreadable_forwards_count_as_computing_a_loss():
    class Callable:
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return x

    class Odd(nn.Module):
        pass

    odd = Odd()
    odd.forward = Callable()  # an instance-level forward with no code to read
    assert _regions().computes_loss(odd)
    assert not _regions().computes_loss(nn.Linear(2, 2))
    assert _regions().computes_loss(nn.CrossEntropyLoss())
