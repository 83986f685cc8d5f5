"""O2 with training code that writes the model through ``p.data``, as users do: WGAN's weight clipping in a Lightning
callback and in an Accelerate loop, a hand-kept alias of ``p.data``, and code that only reads ``p.data``.

``p.data`` is an alias with a version counter of its own, so in-place writes through it leave no trace on ``p``; the
half parameters of a model with masters tell them when their ``.data`` is handed out, and the masters take such
writes before the next step. Each run is compared with the same code in FP32.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin

from .lightning_helpers import classification_data, loader, make_trainer

CLIP = 0.05


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _clip_weights(model: nn.Module) -> None:
    for p in model.parameters():  # the WGAN critic's clipping, as the original code and its ports write it
        p.data.clamp_(-CLIP, CLIP)


class _Critic(pl.LightningModule):
    """A classifier whose weights are clipped after every batch, by ``p.data.clamp_`` in ``on_train_batch_end``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        _clip_weights(self)

    def configure_optimizers(self) -> Any:
        return torch.optim.RMSprop(self.parameters(), lr=5e-3)


def _fp32_critic_weights() -> dict[str, torch.Tensor]:
    model = _Critic()
    trainer = make_trainer(precision="32-true", max_epochs=3)
    trainer.fit(model, loader(classification_data(n=64)))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_lightning_wgan_clipping_in_a_callback_matches_fp32(half):
    reference = _fp32_critic_weights()
    plugin = MixedPrecisionPlugin("O2", half_dtype=half)
    model = _Critic()
    make_trainer(plugin, max_epochs=3).fit(model, loader(classification_data(n=64)))
    plugin.amp.refresh_masters()  # what the next step or a checkpoint does first
    for name, param in model.named_parameters():
        master = plugin.amp.master_of(param)
        assert master.to(param.dtype).abs().max() <= torch.tensor(CLIP, dtype=param.dtype), name  # clipped
        # Half precision flips an element between the bounds now and then; the mean gap stays small (about 5e-4
        # measured), where masters that lose the clamp drift to 0.15 from the FP32 run.
        assert (master - reference[name]).abs().mean() < CLIP / 20, name


def test_accelerate_loop_with_wgan_clipping_matches_fp32():
    pytest.importorskip("accelerate")
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    data = loader(classification_data(n=64))
    reference = _net()
    ref_opt = torch.optim.RMSprop(reference.parameters(), lr=5e-3)
    # float16, as the other doors' loops here (a CPU's default half dtype is bfloat16)
    handler = MixedPrecisionKwargs(half_dtype="float16")
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[handler])
    model = _net()
    model, opt, prepared_data = accelerator.prepare(model, torch.optim.RMSprop(model.parameters(), lr=5e-3), data)
    for _ in range(3):
        for (x, y), (rx, ry) in zip(prepared_data, data):
            opt.zero_grad()
            accelerator.backward(F.cross_entropy(model(x), y))
            opt.step()
            _clip_weights(model)
            ref_opt.zero_grad()
            F.cross_entropy(reference(rx), ry).backward()
            ref_opt.step()
            _clip_weights(reference)
    accelerator.amp.refresh_masters()
    for (name, param), want in zip(model.named_parameters(), reference.parameters()):
        master = accelerator.amp.master_of(param)
        assert master.half().abs().max() <= torch.tensor(CLIP, dtype=torch.float16), name
        assert (master - want.detach()).abs().mean() < CLIP / 20, name


def _core_run(write: str, steps: int = 6) -> tuple[nn.Module, Amp]:
    """SGD at O2 through the core API; ``write``: what the loop does to the weights after each step."""
    amp = Amp("O2", loss_scale=128.0)
    model = amp.prepare_model(_net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    kept = [p.data for p in model.parameters()]  # an alias taken once, as a hand-written EMA or decay keeps it
    data = classification_data(n=16)
    for step in range(steps):
        x, y = data.tensors
        with amp.forward_context():
            loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))), y)
        amp.backward(loss)
        amp.step(opt)
        amp.update()
        opt.zero_grad()
        if write == "kept-alias":
            for alias in kept:
                alias.mul_(0.5)  # a hand-written weight decay through the kept alias
        elif write == "read":
            norms = [p.data.float().norm() for p in model.parameters()]  # logging: reads only
            assert all(torch.isfinite(n) for n in norms)
    return model, amp


def _fp32_run(write: str, steps: int = 6) -> nn.Module:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = classification_data(n=16)
    for _ in range(steps):
        x, y = data.tensors
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if write == "kept-alias":
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
    return model


def test_writes_through_an_alias_of_p_data_kept_by_the_user_are_taken():
    model, amp = _core_run("kept-alias")
    reference = _fp32_run("kept-alias")
    amp.refresh_masters()
    for (name, param), want in zip(model.named_parameters(), reference.parameters()):
        # halved six times: lost writes would leave the masters about 64x larger than the reference
        torch.testing.assert_close(amp.master_of(param), want.detach(), atol=2e-3, rtol=2e-2, msg=name)


def test_reading_p_data_every_step_changes_nothing():
    quiet, quiet_amp = _core_run("none")
    reading, reading_amp = _core_run("read")
    for a, b in zip(quiet.parameters(), reading.parameters()):
        assert torch.equal(quiet_amp.master_of(a), reading_amp.master_of(b))  # the FP32 masters, bit for bit


def test_prepared_parameters_copy_pickle_and_compile_as_plain_parameters():
    model, amp = _core_run("none", steps=1)
    x = classification_data(n=4).tensors[0]
    with torch.no_grad():
        expected = model(amp.cast_inputs(x))
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    assert repr(model[0].bias).startswith("Parameter containing:\ntensor(")
    twin = copy.deepcopy(model)
    # A copy is not watched by these masters (it carries its own FP32 values: tests/test_masters_carry.py).
    assert all("_mpx_data_watch" not in p.__dict__ and isinstance(p, nn.Parameter) for p in twin.parameters())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    restored_again = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        for other in (twin, restored, restored_again):
            assert other is twin or all(type(p) is nn.Parameter for p in other.parameters())
            assert torch.equal(other(amp.cast_inputs(x)), expected)

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(amp.cast_inputs(x)), expected)
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("how", ["in_place", "p_data", "load_state_dict"])
def test_master_of_shows_a_write_made_since_the_last_step(how):
    # A user who writes the model between steps (weight clipping, an EMA swap, a reload) and reads the master, for
    # an export or a check, gets the value the next step will start from, not the one from before the write.
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 16)
    with amp.forward_context():
        loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().pow(2).mean()
    amp.backward(loss)
    amp.step(optimizer)
    amp.update()
    weight = model[0].weight
    before = amp.master_of(weight).clone()
    new = torch.full_like(weight, 0.25)
    if how == "in_place":
        with torch.no_grad():
            weight.copy_(new)
    elif how == "p_data":
        weight.data.copy_(new)
    else:
        model.load_state_dict({**model.state_dict(), "0.weight": new})
    unlooked = amp.master_of(weight, refresh=False)  # the tensor, as it was: for code that needs where .grad lives
    assert torch.equal(unlooked, before)
    master = amp.master_of(weight)
    assert master is unlooked and master.dtype == torch.float32
    # The master takes the written value wherever the old master does not round to it (where it does, the write
    # changed nothing the half model can tell, and the master keeps its FP32 digits, as a step would).
    assert torch.equal(master.to(weight.dtype), new)
    assert (master != before).float().mean() > 0.9
    assert amp.master_of(model[2].weight).dtype == torch.float32  # an unwritten one is still its own master
    assert torch.equal(amp.fp32_state_dict(model)["0.weight"], master)
