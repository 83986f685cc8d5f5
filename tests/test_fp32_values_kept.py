"""O2 keeps the FP32 weights it is given: the masters start from the values the model held before its cast to half
(a pretrained model loaded in FP32), FP32 values loaded after preparing (``load_state_dict``, Fabric's
``load_raw``) go to the masters exactly, and ``fp32_modules`` keep their own FP32 values, not their half rounding.
Checked through the core, the Lightning plugin, Fabric and the Accelerate adapter against the FP32 weights
themselves; under a process group the masters are the half rounding, which DDP's broadcast keeps equal on every
rank."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp

HALF = "bfloat16"


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _fp32_weights(seed: int) -> dict[str, torch.Tensor]:
    """FP32 weights that bfloat16 cannot hold exactly (what a pretrained checkpoint in FP32 holds)."""
    weights = {k: v.detach().clone() for k, v in _net(seed).state_dict().items()}
    assert all(not torch.equal(v.to(torch.bfloat16).float(), v) for v in weights.values())
    return weights


def _assert_masters_are(amp: Amp, model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        master = amp.master_of(param)
        assert param.dtype == torch.bfloat16 and master.dtype == torch.float32, name
        assert torch.equal(master, weights[name]), name  # exactly, not the rounding
        assert torch.equal(param, weights[name].to(param.dtype)), name  # the model holds the rounding
    assert amp.fp32_state_dict(model).keys() == weights.keys()
    for key, value in amp.fp32_state_dict(model).items():
        assert torch.equal(value, weights[key]), key


def _prepared(model: nn.Module, **settings: Any) -> tuple[Amp, torch.optim.Optimizer]:
    amp = Amp("O2", half_dtype=HALF, **settings)
    amp.prepare_model(model)
    return amp, amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)) or None


@pytest.mark.parametrize("when", ["before prepare_model", "before prepare_optimizer", "after both", "after a step"])
def test_the_masters_hold_the_fp32_weights_given_before_or_after_preparing(when):
    model = _net()
    weights = _fp32_weights(seed=1)
    if when == "before prepare_model":
        model.load_state_dict(weights)
    amp = Amp("O2", half_dtype=HALF)
    amp.prepare_model(model)
    if when == "before prepare_optimizer":
        model.load_state_dict(weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.prepare_optimizer(optimizer)
    if when == "after a step":
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        with amp.forward_context():
            loss = F.cross_entropy(model(amp.cast_inputs(x)).float(), y)
        amp.scale_loss(loss).backward()
        assert amp.step(optimizer)
        optimizer.zero_grad()
    if when in ("after both", "after a step"):
        model.load_state_dict(weights)  # e.g. pretrained weights loaded into the prepared model
    _assert_masters_are(amp, model, weights)
    amp.refresh_masters()  # what the next step does first: the model's rounding agrees, the masters stay exact
    _assert_masters_are(amp, model, weights)


def test_a_submodule_loaded_on_its_own_and_half_values_keep_the_masters_exact():
    model = _net()
    weights = _fp32_weights(seed=1)
    amp, _ = _prepared(model)
    model[2].load_state_dict({"weight": weights["2.weight"], "bias": weights["2.bias"]})  # a new head
    for name in ("2.weight", "2.bias"):
        assert torch.equal(amp.master_of(dict(model.named_parameters())[name]), weights[name])
    model.load_state_dict(weights)
    model.load_state_dict(model.state_dict())  # the model's own half values (a checkpoint resume): nothing moves
    _assert_masters_are(amp, model, weights)


@pytest.mark.parametrize("level,frozen", [("O2", False), ("O2", True), ("O3", False)])
def test_fp32_modules_keep_their_own_fp32_values(level, frozen):
    model = _net()
    model[2].requires_grad_(not frozen)  # a frozen head kept FP32 in a fine-tune, too
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    amp = Amp(level, half_dtype=HALF, fp32_modules=["2"])
    amp.prepare_model(model)
    assert model[2].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    assert torch.equal(model[2].weight, weights["2.weight"]) and torch.equal(model[2].bias, weights["2.bias"])
    if level == "O2":
        amp.prepare_optimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
        assert torch.equal(amp.master_of(model[0].weight), weights["0.weight"])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_the_model_loads_without_touching_the_masters(how, tmp_path):
    """An EMA copy (``copy.deepcopy``) or a pickled model (``torch.save(model)``, ``ddp_spawn``) carries the load
    hooks without the engine: loading weights into it leaves the original's masters alone."""
    model = _net()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    amp, _ = _prepared(model)
    if how == "deepcopy":
        copied = copy.deepcopy(model)
    else:
        torch.save(model, tmp_path / "model.pt")
        copied = torch.load(tmp_path / "model.pt", weights_only=False)
    other = _fp32_weights(seed=2)
    copied.load_state_dict(other)
    assert torch.equal(copied[0].weight, other["0.weight"].to(torch.bfloat16))
    _assert_masters_are(amp, model, weights)


def test_taking_the_masters_again_from_the_set_up_model_keeps_them_exact_in_one_process():
    """What the Lightning plugin and Fabric do once the strategy has moved (and, under DDP, broadcast) the model:
    in one process the model only moved, so a master keeps its FP32 value where the model holds its rounding."""
    model = _net()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    amp, _ = _prepared(model)
    _assert_masters_are(amp, model, weights)
    with torch.no_grad():
        model[0].bias[0] = 1.5  # a value the model was given since
    for masters in amp.master_weights:
        masters.sync_from_model()
    weights["0.bias"][0] = 1.5
    _assert_masters_are(amp, model, weights)


def test_under_a_process_group_the_masters_are_the_half_rounding(tmp_path, monkeypatch):
    """Each rank's FP32 values may differ, and DDP broadcasts rank 0's half weights: masters taken from the
    model's rounding are equal on every rank. (A group of one rank standing for two: its world size reads 2. A real
    group of one rank keeps the FP32 values, as one process does: tests/test_lightning_masters_start.py.)"""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    try:
        model = _net()
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        amp, _ = _prepared(model)
        for name, param in model.named_parameters():
            assert torch.equal(amp.master_of(param), weights[name].to(torch.bfloat16).float()), name
        model.load_state_dict(weights)  # the same FP32 values loaded on every rank: the masters take them exactly
        for masters in amp.master_weights:
            masters.sync_from_model()  # after the strategy's broadcast: every master is the model's value
        for name, param in model.named_parameters():
            assert torch.equal(amp.master_of(param), weights[name].to(torch.bfloat16).float()), name
    finally:
        torch.distributed.destroy_process_group()


# -- the frameworks -------------------------------------------------------------------------------------------------
def test_lightning_o2_masters_start_from_the_modules_fp32_weights():
    pl = pytest.importorskip("lightning.pytorch")
    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import classification_data, loader, make_trainer

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()
            self.seen: dict[str, torch.Tensor] = {}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if not self.seen:
                amp = self.trainer.precision_plugin.amp
                self.seen = {name: amp.master_of(p).detach().clone() for name, p in self.named_parameters()}
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Net()
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    make_trainer(MixedPrecisionPlugin("O2", half_dtype=HALF), max_steps=1).fit(module, loader(classification_data()))
    assert module.seen.keys() == weights.keys()
    for name, master in module.seen.items():
        assert torch.equal(master, weights[name]), name


@pytest.mark.parametrize("load_raw", [True, False])
def test_fabric_masters_hold_the_weights_given_before_setup_or_by_load_raw_after(load_raw, tmp_path):
    """litgpt's full fine-tuning sets the model up, then loads the pretrained weights with ``fabric.load_raw``."""
    lightning = pytest.importorskip("lightning")
    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
    fabric = lightning.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    weights = _fp32_weights(seed=1)
    torch.save(weights, tmp_path / "pretrained.pt")
    model = _net()
    if not load_raw:
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    if load_raw:
        fabric.load_raw(tmp_path / "pretrained.pt", model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    fabric.backward(F.cross_entropy(model(x), y))
    optimizer.step()  # at learning rate 0: the masters it stepped are the ones training starts from
    _assert_masters_are(plugin.amp, model.module, weights)


def test_accelerate_masters_hold_the_weights_given_before_and_after_prepare():
    pytest.importorskip("accelerate")
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)])
    model = _net()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    unwrapped = accelerator.unwrap_model(model)
    _assert_masters_are(accelerator.amp, unwrapped, initial)
    weights = _fp32_weights(seed=1)
    unwrapped.load_state_dict(weights)
    _assert_masters_are(accelerator.amp, unwrapped, weights)


@pytest.mark.parametrize("stepped", [True, False])
@pytest.mark.parametrize("resumed_seed", [0, 5])
def test_a_resumed_run_makes_the_masters_it_had_not_made_yet_as_the_run_it_came_from(stepped, resumed_seed):
    """The FP32 values are kept until their masters are made, whatever steps come first. A layer joins the optimizer
    after a checkpoint: in the run that was never interrupted its master comes from the kept FP32 value. A run
    resumed from that checkpoint, its model built as the first one was or initialised differently, must do the
    same: the checkpoint carries the kept values."""

    def build(seed: int) -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
        model = _net(seed)
        amp = Amp("O2", half_dtype=HALF)
        amp.prepare_model(model)
        return amp, model, amp.prepare_optimizer(torch.optim.AdamW(model[0].parameters(), lr=1e-2))

    def step(amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(3)), torch.tensor([0, 1, 2, 3] * 2)
        with amp.forward_context():
            loss = F.cross_entropy(model(amp.cast_inputs(x)).float(), y)
        amp.scale_loss(loss).backward()
        amp.step(optimizer)
        amp.update()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    straight = build(seed=0)
    if stepped:
        step(*straight)
    saved = copy.deepcopy({"model": straight[1].state_dict(), "optimizer": straight[2].state_dict(),
                           "amp": straight[0].state_dict()})  # fmt: skip
    resumed = build(seed=resumed_seed)
    resumed[1].load_state_dict(saved["model"])
    resumed[2].load_state_dict(saved["optimizer"])
    resumed[0].load_state_dict(saved["amp"])
    for amp, model, optimizer in (straight, resumed):
        optimizer.add_param_group({"params": list(model[2].parameters())})  # the head joins now
    assert torch.equal(step(*straight), step(*resumed))
    for a, b in zip(straight[1].parameters(), resumed[1].parameters()):
        assert torch.equal(a, b) and torch.equal(straight[0].master_of(a), resumed[0].master_of(b))


def test_a_model_prepared_after_the_first_step_gets_exact_masters_and_its_values_are_kept_until_they_are_made():
    """A second model joins an engine that has stepped (a GAN's discriminator set up late): its masters start from
    its FP32 weights too; the values of its parameters no optimizer holds are kept, and checkpointed, whatever steps
    come, until an optimizer takes them: their masters are then those FP32 weights."""
    amp = Amp("O2", half_dtype=HALF)
    first = _net(0)
    amp.prepare_model(first)
    first_optimizer = amp.prepare_optimizer(torch.optim.SGD(first.parameters(), lr=0.1))
    x = torch.randn(4, 16)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        with amp.forward_context():
            loss = model(amp.cast_inputs(x)).float().square().mean()
        amp.scale_loss(loss).backward()
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad(set_to_none=True)

    step(first, first_optimizer)
    assert amp.state_dict()["fp32_values"] is None
    late = _net(1)
    weights = {k: v.detach().clone() for k, v in late.state_dict().items()}
    amp.prepare_model(late)
    late_optimizer = amp.prepare_optimizer(torch.optim.SGD(late[0].parameters(), lr=0.1))  # its head: in none
    assert torch.equal(amp.master_of(late[0].weight), weights["0.weight"])
    kept = amp.state_dict()["fp32_values"]
    assert [sorted(k) for k in kept] == [[], ["model1.2.bias", "model1.2.weight"]]  # the second model's names
    assert torch.equal(kept[1]["model1.2.weight"], weights["2.weight"])
    step(late, late_optimizer)
    step(first, first_optimizer)
    assert sorted(amp.state_dict()["fp32_values"][1]) == ["model1.2.bias", "model1.2.weight"]  # still kept
    late_optimizer.add_param_group({"params": list(late[2].parameters()), "lr": 0.0})  # stepped, not moved
    step(late, late_optimizer)
    for name in ("weight", "bias"):
        assert torch.equal(amp.master_of(getattr(late[2], name)), weights[f"2.{name}"]), name
    assert amp.state_dict()["fp32_values"] is None  # every master made: nothing kept


def test_a_hugging_face_gpt2_through_the_accelerator_keeps_its_fp32_weights_as_masters():
    """A transformers GPT-2 (built from a config, FP32) prepared by the Accelerate adapter at O2: every master is
    its FP32 weight (the tied embedding and head included), and FP32 weights loaded after ``prepare`` replace them
    exactly; a training step then starts from them."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    def gpt2(seed: int) -> Any:
        torch.manual_seed(seed)
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
        return transformers.GPT2LMHeadModel(config)

    accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)])
    model = gpt2(0)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.0))
    unwrapped = accelerator.unwrap_model(model)
    for name, param in unwrapped.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(accelerator.amp.master_of(param), initial[name]), name
    pretrained = gpt2(1).state_dict()
    unwrapped.load_state_dict(pretrained)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()  # learning rate 0: the masters it stepped are the ones it starts from
    for name, param in unwrapped.named_parameters():
        assert torch.equal(accelerator.amp.master_of(param), pretrained[name]), name
