"""Host calls of an O2 forward whose model computes no loss (issue 41's host-bound step, stop 58).

At O2 the loss policy's mode is taken off the stack while the model's loss-free code runs
(``lightning_mpx/casting/loss_regions.py``). It took a pair of forward hooks on each topmost loss-free child of the
prepared model, about 7 Python calls per hooked child per step (torch's hooked call path, the two hooks, a dynamo
question in each): 35 of Fabric's 61 calls beyond "bf16-mixed" on the census GPT, growing with every block. A prepared
model whose whole tree computes no loss (the loss computed after the call, as a Fabric or core loop does) is now
hooked alone: one pair, whatever its depth (census GPT: core O2 320 to 286 calls a step, Fabric O2 350 to 316).
Asserted here from the user's side: the calls do not grow per block beyond the unprepared model's; the mode is off
inside the blocks and on for the loss after the call; a ``forward`` put on the model's instance after it was prepared
(Lightning's and Fabric's redirection of ``training_step`` or a marked method through the model's call) keeps the
mode on, so its loss stays FP32; a module with a ``training_step`` (a LightningModule: the Trainer runs its training
code outside its forward) and Accelerate's prepared model (its forward wrapper pushes the mode inside the call)
keep their children's hooks.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.casting.mode import _CastMode

# Python calls of one O2 forward (scope, boundary casts, the model) beyond the unprepared model's call, this model at
# any depth (32 at depth 1 before stop 58, 60 at depth 5); per-block growth must be the unprepared model's.
CORE_O2_FORWARD_EXTRA = 27


def _cast_modes() -> int:
    return sum(isinstance(m, _CastMode) for m in torch.overrides._get_current_function_mode_stack())


class _Block(nn.Module):
    def __init__(self, seen: list[int]) -> None:
        super().__init__()
        self.linear, self.seen = nn.Linear(8, 8), seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(_cast_modes())  # the O2 mode on the stack while a loss-free block runs (0: taken off)
        return torch.relu(self.linear(x))


class _Net(nn.Module):
    """A GPT's layout in small: loss-free blocks iterated by the root, a head; the loss is the caller's."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.seen: list[int] = []
        self.blocks = nn.ModuleList(_Block(self.seen) for _ in range(depth))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _calls(fn: Callable[[], Any]) -> int:
    counted = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal counted
        counted += event == "call"

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counted


def _forward_calls(depth: int, level: str | None) -> int:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    if level is None:
        model = _Net(depth)
        call: Callable[[], Any] = lambda: model(x)  # noqa: E731
    else:
        amp = Amp(level, half_dtype=torch.bfloat16)
        model = amp.prepare_model(_Net(depth))

        def call() -> Any:
            with amp.forward_context():
                return amp.cast_outputs(model(amp.cast_inputs(x)))

    call()
    call()  # the first ones resolve the table and the hooks' thread-local list
    return _calls(call)


def test_o2_forward_calls_do_not_grow_per_block_beyond_the_plain_model() -> None:
    plain = {depth: _forward_calls(depth, None) for depth in (1, 5)}
    o2 = {depth: _forward_calls(depth, "O2") for depth in (1, 5)}
    assert o2[5] - o2[1] == plain[5] - plain[1], (o2, plain)  # was 7 calls more per block (a hook pair each)
    assert o2[1] - plain[1] <= CORE_O2_FORWARD_EXTRA, (o2, plain)


def test_o2_mode_is_off_in_the_blocks_and_on_for_the_loss_after_the_call() -> None:
    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(_Net(3))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with amp.forward_context():
        out = model(amp.cast_inputs(x))
        assert _cast_modes() == 1
        loss = F.cross_entropy(out, y)
    assert model.seen == [0, 0, 0] and out.dtype is torch.bfloat16 and loss.dtype is torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(out.float(), y))
    with pytest.raises(RuntimeError), amp.forward_context():
        model(torch.randn(4, 7, dtype=torch.bfloat16))  # a shape error: the stack is whole again after it
    assert _cast_modes() == 0
    # A block called directly (not through the model) runs with the mode on: the same dtypes, at the mode's cost.
    with amp.forward_context():
        assert model.blocks[0](amp.cast_inputs(x)).dtype is torch.bfloat16
    assert model.seen[-1] == 1


def test_o2_forward_redirected_through_the_model_keeps_its_loss_fp32() -> None:
    # Lightning's and Fabric's _ForwardRedirection: another method (training_step, a marked method) put on the
    # instance as forward and run through the model's call; the code judged loss-free is not what runs then.
    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(_Net(2))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))

    def step(inputs: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(type(model).forward(model, inputs), y)

    model.forward = step
    try:
        with amp.forward_context():
            loss = model(amp.cast_inputs(x))
    finally:
        del model.forward
    assert loss.dtype is torch.float32
    with amp.forward_context():
        assert model(amp.cast_inputs(x)).dtype is torch.bfloat16  # its own forward again: hooked as before
    assert model.seen[-2:] == [0, 0]


def test_o2_module_with_a_training_step_keeps_its_childrens_hooks() -> None:
    class _Steps(nn.Module):  # a LightningModule's shape: the training code outside forward, the loss in it
        def __init__(self) -> None:
            super().__init__()
            self.net = _Net(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.net(x), y)

    amp = Amp("O2", half_dtype=torch.bfloat16)
    module = amp.prepare_model(_Steps())
    assert not amp._loss_regions.runs_alone(module)
    with amp.forward_context():
        loss = module.training_step(amp.cast_inputs(torch.randn(4, 8)), torch.randint(0, 4, (4,)))
    assert loss.dtype is torch.float32 and module.net.seen == [0, 0]  # the child's hooks took the mode off


def test_accelerate_o2_forward_keeps_the_mode_off_in_its_blocks() -> None:
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="O2",
                                  kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])
        net = _Net(2)
        model = accelerator.prepare(net)
        model(torch.randn(4, 8))
        # The forward wrapper pushes the mode inside the model's call: the blocks' own hooks take it off.
        assert net.seen == [0, 0] and not accelerator.amp._loss_regions.runs_alone(net)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _handed_loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(a, b)


class _Criterion:
    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(a, b)


_GLOBAL_CE = nn.CrossEntropyLoss()


class _GlobalCriterion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _GLOBAL_CE(self.body(x), y)


class _ClassAttribute(nn.Module):
    score = nn.CrossEntropyLoss()

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.score(self.body(x), y)


class _DefaultArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor,
                fn: Callable[..., torch.Tensor] = F.cross_entropy) -> torch.Tensor:
        return fn(self.body(x), y)


class _LossInForward(nn.Module):
    """A model whose own forward computes its loss through a callable its code does not name: handed to
    ``__init__`` (a function, a lambda, a criterion object) or looked up by name."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        self.fn = fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.body(x)
        if self.fn is None:
            return getattr(F, "cross_entropy")(logits, y)
        return self.fn(logits, y)


@pytest.mark.parametrize(
    "fn", [_handed_loss, lambda a, b: F.cross_entropy(a, b), _Criterion(), None, _GlobalCriterion, _DefaultArgument,
           _ClassAttribute],
    ids=["function", "lambda", "criterion_object", "getattr", "global_loss_module", "default_argument",
         "class_attribute"],
)
def test_o2_loss_in_the_forward_through_a_handed_callable_stays_fp32(fn: Any) -> None:
    # A root hooked alone runs its own code with the mode off: a loss reached through a callable its names do not
    # show ran in bfloat16 there (stop 58's first root-alone rule: all seven cases; before it, and now, FP32: the
    # root keeps its children's hooks and the mode for its own code).
    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(fn() if isinstance(fn, type) else _LossInForward(fn))
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with amp.forward_context():
        loss = model(amp.cast_inputs(x), y)
    assert loss.dtype == torch.float32
    assert not amp._models.loss_regions.runs_alone(model)
