"""review68a: stop 68's engine fixes attacked as a hostile user (the O2 shared masters, gaps68, the backward after
an unscale, the O2 rollback), against FP32.

Found and fixed: at O2, in an accumulation loop that clips every micro-batch (``amp.clip_grad_norm_``, which leaves
the model's half gradients scaled), a raw ``torch.optim.SGD(model.parameters()).step()`` between the clip and the next
backward stepped the half weights with the still-scaled gradients: no refusal, the run silently 6.5 off FP32 (float16,
scale 2**8). The backward after an unscale never looked for a raw step (the accumulated-backwards look of
engine/raw_steps.py ran only on gradients no unscale had touched); now it looks at O2 as any accumulated backward does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from tests.test_accelerate_shared_master import _Net  # a trunk and a head
from tests.test_lightning_shared_params_clip import _weights  # the weights as FP32 (the masters at O2), flat


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


# -- 3. a raw step between an unscale (a clip) and the next accumulated backward -------------------------------------
def _clip_each_micro_batch(level: str | None, write: str) -> torch.Tensor:
    """Two micro-batches per step, a clip after each backward; after the first micro-batch's clip ``write``: a raw
    SGD step (``"raw"``), the same step undone from a copy (``"probe"``), a clamp (``"clamp"``)."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    amp = None
    if level is not None:
        amp = Amp(opt_level=level, half_dtype="float16", init_scale=2.0**8)
        net = amp.prepare_model(net)
        opt = amp.prepare_optimizer(opt)
    raw = torch.optim.SGD(net.parameters(), lr=0.1)
    for i, (x, y) in enumerate(_batches(4)):
        if amp is None:
            F.cross_entropy(net(x), y).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        else:
            with amp.forward_context():
                loss = F.cross_entropy(net(amp.cast_inputs(x)).float(), y)
            amp.backward(loss)
            amp.clip_grad_norm_(opt, 1.0)
        if i == 0 and write != "none":
            copies = [p.detach().clone() for p in net.parameters()]
            if write == "clamp":
                with torch.no_grad():
                    for p in net.parameters():
                        p.clamp_(-0.3, 0.3)
            else:
                raw.step()
            if write == "probe":
                with torch.no_grad():
                    for p, c in zip(net.parameters(), copies):
                        p.copy_(c)
        if i % 2 == 1:
            amp.step(opt) if amp is not None else opt.step()
            if amp is not None:
                amp.update()
            opt.zero_grad()
    return _weights(net, amp)


def test_o2_raw_step_between_a_clip_and_the_next_accumulated_backward_is_refused() -> None:
    """Was let through: the half weights stepped with gradients 256 times too large, 6.5 off FP32 after 2 steps."""
    with pytest.raises(RuntimeError, match="stepped along their gradients between two backwards"):
        _clip_each_micro_batch("O2", "raw")


@pytest.mark.parametrize("write", ["probe", "clamp", "none"])
def test_o2_writes_undone_or_of_another_kind_after_a_clip_train_as_fp32(write: str) -> None:
    """A descent probe undone before the next backward and a clamp are no raw step: trained on, as FP32."""
    got, want = _clip_each_micro_batch("O2", write), _clip_each_micro_batch(None, write)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


def test_o1_raw_step_after_a_clip_steps_true_gradients_as_fp32() -> None:
    """At O1 the clip unscaled the gradients in place: the raw step applies true values, as FP32's (left alone)."""
    torch.testing.assert_close(_clip_each_micro_batch("O1", "raw"), _clip_each_micro_batch(None, "raw"), rtol=0,
                               atol=2e-3)  # fmt: skip


# -- 1. O2 shared masters: the noted FP32 gradients, against FP32 and in memory --------------------------------------


def _shared(
    sequence: tuple[str, ...],
    half: str | None,
    *,
    update: bool = True,
    level: str = "O2",
    iters: int = 3,
    zero: bool = True,
) -> tuple[torch.Tensor, Amp | None]:
    """The whole model's optimizer and the head's own (momentum), ``iters`` iterations of ``sequence``;
    ``update=False``: no ``amp.update()`` after the steps (Fabric's iteration ends at the next backward);
    ``zero=False``: the gradients never cleared (FP32 accumulates them over the iterations;
    test_core_shared_gradients_unscale)."""
    torch.manual_seed(0)
    net: nn.Module = _Net()
    whole = torch.optim.SGD(net.parameters(), lr=0.1)
    head = torch.optim.SGD(net.head.parameters(), lr=0.2, momentum=0.9)
    amp = None
    if half is not None:
        amp = Amp(opt_level=level, half_dtype=half, **({"init_scale": 2.0**12} if half == "float16" else {}))
        net = amp.prepare_model(net)
        whole, head = amp.prepare_optimizer(whole), amp.prepare_optimizer(head)
    opts = {"whole": whole, "head": head}
    for x, y in _batches(iters):
        if amp is None:
            F.cross_entropy(net(x), y).backward()
        else:
            with amp.forward_context():
                loss = F.cross_entropy(net(amp.cast_inputs(x)).float(), y)
            amp.backward(loss)
        for call in sequence:
            verb, name = call.split(" ")
            opt = opts.get(name)
            if verb == "unscale" and amp is not None:
                amp.unscale_(opt)
            elif verb == "clip":
                amp.clip_grad_norm_(opt, 0.05) if amp else torch.nn.utils.clip_grad_norm_(net.head.parameters(), 0.05)
            elif verb == "step":
                amp.step(opt) if amp else opt.step()
            elif verb in ("zero", "zeros"):  # set_to_none=True / False between the two steps
                opt.zero_grad(set_to_none=verb == "zero")
            elif verb == "clone":  # the model's gradients replaced by copies (same values)
                for p in net.parameters():
                    p.grad = p.grad.clone()
            elif verb == "halve":  # the gradients the optimizer steps with replaced by half of them
                for p in amp.master_params(opt) if amp else [p for g in opt.param_groups for p in g["params"]]:
                    p.grad = p.grad * 0.5
        if amp is not None and update:
            amp.update()
        if zero:
            whole.zero_grad()
            head.zero_grad()
    values = amp.fp32_state_dict(net) if amp is not None and level == "O2" else net.state_dict()
    return torch.cat([v.detach().float().flatten() for v in values.values()]), amp


@pytest.mark.parametrize(
    "sequence",
    [
        ("unscale whole", "unscale head", "step whole", "zero whole", "step head"),  # the head then steps nothing
        ("unscale whole", "step whole", "zeros whole", "step head"),  # zeros: the head's momentum alone
        ("clip head", "step head", "step whole"),
    ],
)
def test_o2_shared_master_cleared_between_the_two_steps_trains_as_fp32(sequence: tuple[str, ...]) -> None:
    got, _ = _shared(sequence, "float16")
    torch.testing.assert_close(got, _shared(sequence, None)[0], rtol=0, atol=2e-3)


def test_o2_shared_masters_fp32_gradients_are_freed_by_the_last_step() -> None:
    """Were kept alive through ``zero_grad`` and the next forward (by the engine's notes, until the next backward,
    where Fabric and Accelerate end the iteration): every master's FP32 gradient, which a step frees (unshared too)."""
    import gc
    import weakref

    torch.manual_seed(0)
    amp = Amp(opt_level="O2", half_dtype="bfloat16")
    net = amp.prepare_model(_Net())
    whole = amp.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    head = amp.prepare_optimizer(torch.optim.SGD(net.head.parameters(), lr=0.2))
    x, y = _batches(1)[0]
    with amp.forward_context():
        loss = F.cross_entropy(net(amp.cast_inputs(x)).float(), y)
    amp.backward(loss)
    amp.clip_grad_norm_(head, 0.05)
    amp.unscale_(whole)
    made = [weakref.ref(m.grad) for opt in (whole, head) for m in amp.master_params(opt) if m.grad is not None]
    amp.step(whole)
    amp.step(head)
    whole.zero_grad()
    head.zero_grad()
    gc.collect()
    assert made and [ref() for ref in made] == [None] * len(made)


# -- 2. gaps68's load between the backward and the step, then a raw step over the loaded parameters ------------------
@pytest.mark.parametrize(("level", "half"), [("O2", "bfloat16"), ("O1", "float16")])
@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_a_raw_step_over_parameters_a_load_wrote_between_backward_and_step_is_refused(level: str, half: str) -> None:
    """The whole model loaded between the backward and the step, then a raw SGD step over the head (no optimizer of
    the engine holds it; scaled gradients, at O2 no master): was let through (the load's parameters were left out of
    the look, the raw step's write with them). A load writes each parameter once: a version past that is a write
    after it (engine.optimizers ``loaded_since_step``)."""
    from tests.test_core_shared_head_groups import _loose_head_run

    with pytest.raises(RuntimeError, match="which no optimizer prepared by lightning_mpx holds"):
        _loose_head_run(level, half, "whole", raw=True)


def _held_raw_after_load(level: str, half: str) -> None:
    """The whole model loaded between a backward and the next, then a raw SGD step over the trunk, which the engine's
    optimizer holds (its zero_grad clears the trunk's gradients), then the next backward and the step."""
    import tests.test_core_shared_head_groups as gaps

    net = gaps._net()
    amp = Amp(level, half_dtype=half)
    amp.prepare_model(net)
    opt = amp.prepare_optimizer(torch.optim.SGD(gaps._trunk(net), lr=0.05))
    saved = {k: v.float().clone() for k, v in net.state_dict().items()}
    for step in range(2):
        gaps._forward_backward(amp, net, *gaps._batch(step))
        if step == 1:
            net.load_state_dict(saved)
            raw = torch.optim.SGD(gaps._trunk(net), lr=0.05)
            raw.step()
            raw.zero_grad()
            gaps._forward_backward(amp, net, *gaps._batch(5))
        amp.step(opt)
        amp.update()
        opt.zero_grad()


@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_a_raw_step_over_held_parameters_after_a_load_is_refused() -> None:
    with pytest.raises(RuntimeError, match="were written and their gradients cleared"):
        _held_raw_after_load("O2", "bfloat16")


# -- a shared parameter's gradient replaced after an unscale (fixed by xfails69) --------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_shared_gradient_replaced_after_an_unscale_is_not_divided_again(level: str) -> None:
    """``p.grad = p.grad.clone()`` after one optimizer's ``unscale_`` (true values): the other optimizer's unscale
    divided the new tensor by the scale again (float16, 0.2-0.3 off FP32); now taken as true values."""
    sequence = ("unscale whole", "clone x", "step whole", "step head")
    got, _ = _shared(sequence, "float16", level=level)
    torch.testing.assert_close(got, _shared(sequence, None)[0], rtol=0, atol=2e-3)


def test_o2_shared_master_gradient_replaced_by_the_user_reaches_both_steps() -> None:
    """``m.grad = m.grad * 0.5`` over ``amp.master_params`` after an unscale: the other optimizer stepped the FP32
    gradient the first unscale made (0.12 off FP32); now the user's tensor."""
    sequence = ("unscale whole", "halve whole", "step whole", "step head")
    got, _ = _shared(sequence, "bfloat16")
    torch.testing.assert_close(got, _shared(sequence, None)[0], rtol=0, atol=2e-3)


def _clip_then_halve(level: str | None, way: str = "model") -> torch.Tensor:
    """One optimizer: a clip, then the gradients halved in place, then the step. ``way``: ``"model"`` halves the
    model's gradients after the engine's clip; ``"masters"`` the masters' (amp.master_params); ``"unscale"`` calls
    unscale_ first, then torch's clip and the halving on the model's gradients."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    amp = None
    if level is not None:
        amp = Amp(opt_level=level, half_dtype="float16", init_scale=2.0**8)
        net, opt = amp.prepare_model(net), amp.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in _batches(2):
        if amp is None:
            F.cross_entropy(net(x), y).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        else:
            with amp.forward_context():
                loss = F.cross_entropy(net(amp.cast_inputs(x)).float(), y)
            amp.backward(loss)
            if way == "unscale":
                amp.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            else:
                amp.clip_grad_norm_(opt, 1.0)
        params = amp.master_params(opt) if amp is not None and way == "masters" else list(net.parameters())
        for p in params:
            p.grad.mul_(0.5)
        amp.step(opt) if amp is not None else opt.step()
        if amp is not None:
            amp.update()
        opt.zero_grad()
    return _weights(net, amp)


def test_o2_model_gradients_written_after_the_engines_clip_are_refused_naming_the_ways_out() -> None:
    """At O2 the engine's clip unscales into the masters' gradients only: the model's still hold the scaled, unclipped
    values, and a write on them taken as true values stepped 12 off FP32 (float16 at 2**8; 2.9e3 at 2**12), silently.
    Refused at the step; the two ways the error names train as FP32."""
    with pytest.raises(RuntimeError, match=r"written between clip_grad_norm_\(\)/clip_grad_value_\(\) and step\(\)"):
        _clip_then_halve("O2")
    reference = _clip_then_halve(None)
    for way in ("masters", "unscale"):
        torch.testing.assert_close(_clip_then_halve("O2", way), reference, rtol=0, atol=2e-3)
