"""The last stop's newest surfaces driven as their users drive them: Accelerate's take-over of a model prepared
again (a retried training function that keeps its model and optimizer, a second Accelerator), master-weight name
prefixes changed on load (twin submodules of the same shapes), and what the Apex layer and the telemetry carry.
Each case is compared with a reference (the run uninterrupted, bit for bit) or must be refused changing nothing."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.masters.renames import prefix_change
from tests.test_hostile_checkpoints import HALF, _net


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


# -- master-weight prefixes: twins of the same shapes --------------------------------------------------------------
class _Twin(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.encoder, self.decoder = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.relu(self.encoder(x)))


class _Holder(nn.Module):  # a LightningModule's ``self.net``
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _trained(model: nn.Module, steps: int = 2) -> tuple[Amp, nn.Module, Any]:
    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(steps):
        x, _ = _batch(step)
        with amp.forward_context():
            out = amp.cast_outputs(model(amp.cast_inputs(x)))
        amp.backward(out.float().square().mean())
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
    return amp, model, optimizer


def _masters(amp: Amp, model: nn.Module) -> list[torch.Tensor]:
    return [amp.master_of(p).detach().clone() for p in model.parameters()]


def test_masters_of_one_layer_into_a_model_with_two_twin_layers_are_refused_changing_nothing() -> None:
    """Finding (fixed): a ``Linear``'s masters (``weight``, ``bias``) loaded into a model with two ``Linear`` twins
    of that shape went to ``encoder.`` or ``decoder.`` as the process's hash seed ordered a set (both prefixes fit),
    and the other twin silently kept its own; now refused, naming both prefixes, with nothing loaded."""
    names = ["weight", "bias"]
    live = ["encoder.weight", "encoder.bias", "decoder.weight", "decoder.bias"]
    with pytest.raises(KeyError, match=r"more than one name prefix \('decoder.' added, 'encoder.' added\)"):
        prefix_change(names, live)
    with pytest.raises(KeyError, match=r"'m.' removed, 'm.a.' removed"):  # stripping more maps onto another one
        prefix_change(["m.a.w"], ["a.w", "w"])

    saving = _trained(nn.Linear(8, 8))  # kept alive: the engine holds its model weakly
    saved = saving[0].state_dict()
    amp, twin, _ = _trained(_Twin(1))
    before = _masters(amp, twin)
    with pytest.raises(KeyError, match="more than one name prefix"):
        amp.load_state_dict(saved)
    assert _same(_masters(amp, twin), before)


def test_twin_masters_saved_under_a_holder_prefix_load_exactly_into_the_bare_model_and_back() -> None:
    """What held: the right prefix change is still found among twins (one fits), and loads the masters exactly."""
    for saved_model, loaded_model, saved_name in [
        (_Holder(_Twin(0)), _Twin(1), lambda name: "net." + name),
        (_Twin(0), _Holder(_Twin(1)), lambda name: name.removeprefix("net.")),
    ]:
        saving = _trained(saved_model)
        saved = saving[0].state_dict()
        resumed, model, _ = _trained(loaded_model, steps=1)
        resumed.load_state_dict(saved)
        values = saved["master_weights"][0]
        assert _same(_masters(resumed, model), [values[saved_name(name)] for name, _ in model.named_parameters()])


# -- Accelerate: free_memory() and the model prepared again ---------------------------------------------------------
accelerate_only = pytest.mark.usefixtures("fresh_accelerate_state")


def _accelerator(half: str = HALF) -> Any:
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    return Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=half)])


def _train(accelerator: Any, model: nn.Module, optimizer: Any, steps: range) -> None:
    for step in steps:
        x, y = _batch(step)
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


@accelerate_only
@pytest.mark.parametrize("again", ["raw", "prepared"])
def test_a_retry_that_prepares_the_same_adamw_again_goes_on_bit_for_bit(again: str) -> None:
    """Finding (fixed): a retried training function that keeps its optimizer (``free_memory()``, then
    ``prepare(model, optimizer)`` with the AdamW it made before) failed at the first step with "optimizer.step() was
    called ... outside Amp.step()" (the released engine's hooks stayed on it); the prepared wrapper passed again
    failed with "was not registered". Now the new engine steps it with its moments and step count: the run is the
    uninterrupted one, bit for bit (masters, Adam state)."""
    accelerator = _accelerator()
    raw_model = _net()
    raw = torch.optim.AdamW(raw_model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(raw_model, raw)
    _train(accelerator, model, optimizer, range(4))
    want = [p.detach().clone() for p in accelerator.amp.master_params(raw)]

    accelerator = _accelerator()
    raw_model = _net()
    raw = torch.optim.AdamW(raw_model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(raw_model, raw)
    _train(accelerator, model, optimizer, range(2))
    accelerator.free_memory()
    model, optimizer = accelerator.prepare(model, raw if again == "raw" else optimizer)
    _train(accelerator, model, optimizer, range(2, 4))
    assert _same([p.detach().clone() for p in accelerator.amp.master_params(raw)], want)
    assert all(int(state["step"]) == 4 for state in raw.state_dict()["state"].values())


@accelerate_only
def test_a_second_accelerator_cannot_take_a_model_the_first_still_trains() -> None:
    """Finding (fixed): a second Accelerator's ``prepare`` took the model over while the first one's optimizer still
    trained it: both engines then wrote their own FP32 masters into the same weights, each undoing the other's steps.
    Now refused with what to do, and the first Accelerator trains on untouched."""
    first = _accelerator()
    model = _net()
    model, optimizer = first.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    _train(first, model, optimizer, range(1))
    before = [p.detach().clone() for p in model.parameters()]

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    second = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)])
    with pytest.raises(RuntimeError, match=r"still train it.*free_memory\(\)"):
        second.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    assert _same([p.detach().clone() for p in model.parameters()], before)
    assert first.unwrap_model(model).forward._amp is first.amp
    _train(first, model, optimizer, range(1, 2))
    assert not optimizer.step_was_skipped

    first.free_memory()  # released: now the second one may take it over
    model, optimizer = second.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    _train(second, model, optimizer, range(2, 3))
    assert second.unwrap_model(model).forward._amp is second.amp


@accelerate_only
def test_save_state_after_a_take_over_resumes_bit_for_bit_in_a_fresh_accelerator(tmp_path: Any) -> None:
    """What held: the engine that took the model over saves and loads its masters exactly."""
    accelerator = _accelerator()
    model = _net()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(accelerator, model, optimizer, range(2))
    accelerator.free_memory()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(accelerator, model, optimizer, range(2, 3))
    accelerator.save_state(str(tmp_path))
    _train(accelerator, model, optimizer, range(3, 5))
    want = [p.detach().clone() for p in accelerator.amp.master_params(optimizer.optimizer)]

    resumed = _accelerator()
    model2 = _net(7)
    model2, optimizer2 = resumed.prepare(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2))
    resumed.load_state(str(tmp_path))
    _train(resumed, model2, optimizer2, range(3, 5))
    assert _same([p.detach().clone() for p in resumed.amp.master_params(optimizer2.optimizer)], want)


def test_an_optimizer_released_by_the_engine_still_saves_its_state() -> None:
    """Finding (fixed): after ``Amp.release_optimizer`` at O2 the optimizer's state stayed keyed by the FP32 masters
    while its groups held the half parameters, so ``optimizer.state_dict()`` raised a bare ``KeyError(<id>)``. The
    state now goes back to the parameters, and the state dict holds the masters' Adam moments as they were."""
    amp, model, optimizer = _trained(_net())
    moments = [optimizer.state[m]["exp_avg"].clone() for m in amp.master_params(optimizer)]
    amp.release_optimizer(optimizer)
    state = optimizer.state_dict()
    assert len(state["state"]) == len(list(model.parameters()))
    assert _same([state["state"][i]["exp_avg"] for i in range(len(moments))], moments)


@accelerate_only
def test_the_scale_and_the_counts_go_on_across_free_memory() -> None:
    """Finding (fixed): ``free_memory()`` dropped the released engine's overflow counts not read yet, so the retry's
    first read reported ``mpx/overflows=0`` for an overflow it never reported, and the scale went back to
    ``init_scale`` (Accelerate's own ``GradScaler`` is kept across ``free_memory()``): a float16 retry redid its early
    skips. The new engine now goes on from the old one's scale, totals and readers."""
    accelerator = _accelerator("float16")
    model = _net()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batch(0)
    accelerator.backward(F.cross_entropy(model(x), y) * float("inf"))
    optimizer.step()
    optimizer.zero_grad()
    scale = accelerator.amp.scalers[0].get_scale()
    accelerator.free_memory()
    assert accelerator.amp.scalers[0].get_scale() == scale  # halved by the overflow, not back to init_scale
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _train(accelerator, model, optimizer, range(1, 2))
    metrics = accelerator.mpx_metrics()
    assert metrics["mpx/overflows"] == 1.0 and metrics["mpx/skipped_steps"] == 1.0
    assert float(metrics["mpx/loss_scale"]) == scale
    assert accelerator.mpx_metrics()["mpx/overflows"] == 0.0  # reported once


# -- the Apex layer: a plain backward between a block and another optimizer's step ---------------------------------
def _small(out: torch.Tensor) -> torch.Tensor:
    return out.float().mean() * 0.01  # no overflow at Apex's initial scale


def test_a_plain_backward_after_another_optimizers_block_is_refused_at_that_step() -> None:
    """Finding (fixed): two optimizers (``num_losses=2``); a block for the first, then ``loss2.backward()`` outside any
    block and the second's ``step()``: any block of the engine counted as one for every optimizer, so the step divided
    the unscaled gradients by 65536 (a silent 1/65536 learning rate; Apex's O2 left the weights as they were). Now
    refused as a step after no block at all; the block's way follows FP32 as before."""
    from lightning_mpx.apex import _amp_state, amp

    def setup() -> tuple[nn.Module, nn.Module, Any, Any, nn.Module]:
        _amp_state.reset()
        torch.manual_seed(0)
        body, head = nn.Linear(4, 2), nn.Linear(4, 2)
        reference = copy.deepcopy(head)
        opts = [torch.optim.SGD(body.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)]
        [body, head], [o1, o2] = amp.initialize([body, head], opts, opt_level="O2", num_losses=2, verbosity=0)
        return body, head, o1, o2, reference

    x = torch.randn(4, 4)
    try:
        body, head, o1, o2, _ = setup()
        with amp.scale_loss(_small(body(x)), o1, loss_id=0) as scaled:
            scaled.backward()
        o1.step()
        _small(head(x)).backward()
        with pytest.raises(RuntimeError, match=r"gradients appeared after the last block ended"):
            o2.step()

        body, head, o1, o2, reference = setup()
        with amp.scale_loss(_small(body(x)), o1, loss_id=0) as scaled:
            scaled.backward()
        o1.step()
        before = head.weight.float()
        with amp.scale_loss(_small(head(x)), o2, loss_id=1) as scaled:
            scaled.backward()
        o2.step()
        _small(reference(x)).backward()
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        assert not torch.equal(head.weight.float(), before)  # stepped, not skipped
        torch.testing.assert_close(head.weight.float(), reference.weight, atol=2e-3, rtol=0)
    finally:
        _amp_state.reset()
