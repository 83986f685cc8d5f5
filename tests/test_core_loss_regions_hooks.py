"""O2's loss regions against user hooks, copies and lifetimes (stop 58's hostile review).

At O2 the loss policy's mode is off while a prepared model's loss-free children run (``casting/loss_regions.py``).
Stop 58 tried hooking a loss-free root alone (taken back); under it each case here failed: a loss in a user's hook
ran in bfloat16, hooks put and removed each step re-hooked the models, dropped models were kept alive. A loss computed
in a user's hook must come back float32, equal to the FP32 loss of the half values; nothing may re-hook the models
each step, nor keep a dropped model alive.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _count_rehooks(amp: Amp) -> list[Any]:
    calls: list[Any] = []
    models = amp._models
    original = models._hook_regions_again

    def spy(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        original(*args, **kwargs)

    models._hook_regions_again = spy  # type: ignore[method-assign]
    return calls


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)


def test_o2_loss_in_a_root_pre_hook_put_after_prepare_model_stays_fp32() -> None:
    # A forward pre-hook on the prepared root (an input-side auxiliary loss) runs after the root's own: it ran with
    # the mode off, the loss in bfloat16 (float32 before the root-alone rule). Put and removed each step, it must not
    # re-hook the models each step either.
    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(_Net())
    rehooks = _count_rehooks(amp)
    x, y = _data()
    for _ in range(4):
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        handle = model.register_forward_pre_hook(
            lambda module, args: seen.append((F.cross_entropy(args[0][:, :4], y), args[0])))
        with amp.forward_context():
            out = model(amp.cast_inputs(x))
        handle.remove()
        loss, inputs = seen[0]
        assert out.dtype is inputs.dtype is torch.bfloat16 and loss.dtype is torch.float32
        # float32 math (bfloat16's own is off by ~1e-2 here), as before the rule
        torch.testing.assert_close(loss, F.cross_entropy(inputs[:, :4].float(), y), rtol=1e-3, atol=1e-3)
    assert len(rehooks) <= 1  # once, when the hook is first found; not per step


def test_o2_loss_in_a_hook_on_an_averaged_models_child_stays_fp32() -> None:
    # An EMA teacher (AveragedModel: a deep copy carrying the root's hooks) with a hook on one of its children that
    # computes a loss (distillation): before the rule its children were hooked, the hook's loss in FP32; the copy ran
    # as the original, the mode off around that hook too.
    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(_Net())
    teacher = torch.optim.swa_utils.AveragedModel(model)
    rehooks = _count_rehooks(amp)
    x, y = _data()
    with amp.forward_context():
        teacher(amp.cast_inputs(x))  # a step before the hook
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    teacher.module.head.register_forward_hook(lambda module, args, out: seen.append((F.cross_entropy(out, y), out)))
    for _ in range(3):
        with amp.forward_context():
            logits = model(amp.cast_inputs(x))
            teacher(amp.cast_inputs(x))
        teacher.update_parameters(model)
        loss, out = seen[-1]
        assert logits.dtype is out.dtype is torch.bfloat16 and loss.dtype is torch.float32
        torch.testing.assert_close(loss, F.cross_entropy(out.float(), y))
    assert not rehooks  # the prepared model is not hooked again for the teacher's hook


def test_o2_models_made_hooked_and_dropped_with_one_amp_are_collected() -> None:
    # A hook closure holding its model (a feature extractor keeping a reference) put on a free child after
    # prepare_model: the engine kept the children's hook dicts by the root's id, and through them every model made
    # and dropped in the loop.
    amp = Amp("O2", half_dtype=torch.bfloat16)
    x, _ = _data()
    refs = []
    for _ in range(6):
        model = amp.prepare_model(_Net())
        model.head.register_forward_hook(lambda module, args, out, model=model: None)
        with amp.forward_context():
            model(amp.cast_inputs(x))
        refs.append(weakref.ref(model))
        del model
        gc.collect()
    assert [ref() for ref in refs] == [None] * 6
