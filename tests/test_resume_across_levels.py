"""A Lightning checkpoint saved at one opt level and resumed at another (``trainer.fit(model, ckpt_path=...)``).

Every pair of O0-O3 resumes: into FP32 masters (O0/O1/O3 to O2) the masters are the checkpoint's weights (an FP32
checkpoint's exactly); out of them (O2 to O0/O1/O3) the checkpoint's masters become the model's parameters (exact
where the model is FP32, their rounding at O3). A dynamic loss scale carries over between levels that both scale
dynamically; otherwise the level's own scaling starts. What cannot be resumed is refused naming both levels.
"""

from __future__ import annotations

import itertools
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_mpx import Amp, MixedPrecisionPlugin
from lightning_mpx.integrations.lightning_conversion import masters_from_checkpoint
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

LEVELS = ["O0", "O1", "O2", "O3"]
KEY = MixedPrecisionPlugin.__qualname__


class AtStart(pl.Callback):
    """Records, when the resumed fit starts (after the checkpoint is restored, before any step), the model's
    parameters, the FP32 weights the optimizer steps (the masters at O2), its state and the loss scale."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        amp = trainer.precision_plugin.amp
        optimizer = trainer.optimizers[0]
        self.params = {name: p.detach().clone() for name, p in module.named_parameters()}
        self.masters = {name: amp.master_of(p).detach().clone() for name, p in module.named_parameters()}
        state = optimizer.state_dict()["state"]
        self.optimizer_state = {index: {k: v.clone() for k, v in s.items()} for index, s in state.items()}
        self.scale = amp.scalers[0].get_scale()


def save(level: str, half: str, path: Any, optimizer: str = "sgd", steps: int = 2, **settings: Any) -> dict[str, Any]:
    model = Classifier(optimizer=optimizer, lr=1e-2)
    plugin = MixedPrecisionPlugin(level, half_dtype=half, **settings)
    trainer = make_trainer(plugin, max_steps=steps, max_epochs=10)
    trainer.fit(model, loader(classification_data()))
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=False)


def resume(level: str, half: str, path: Any, optimizer: str = "sgd", steps: int = 4) -> tuple[AtStart, Classifier]:
    model = Classifier(optimizer=optimizer, lr=1e-2)
    at_start = AtStart()
    trainer = make_trainer(
        MixedPrecisionPlugin(level, half_dtype=half), max_steps=steps, max_epochs=10, callbacks=[at_start]
    )
    trainer.fit(model, loader(classification_data()), ckpt_path=path)
    assert trainer.global_step == steps
    return at_start, model


def exact_weights(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The FP32 weights a checkpoint trains: its masters at O2, else its model's weights."""
    masters = checkpoint[KEY]["master_weights"]
    weights = {name: value.float() for name, value in checkpoint["state_dict"].items()}
    for saved in masters:
        weights.update(saved)
    return weights


@pytest.mark.parametrize(("saved", "resumed"), list(itertools.product(LEVELS, LEVELS)))
def test_a_checkpoint_resumes_at_every_opt_level(saved: str, resumed: str, tmp_path: Any) -> None:
    path = tmp_path / f"{saved}.ckpt"
    checkpoint = save(saved, "bfloat16", path)
    at_start, model = resume(resumed, "bfloat16", path)
    exact = exact_weights(checkpoint)
    half = torch.bfloat16
    for name in at_start.params:
        if resumed == "O2":  # the masters are the checkpoint's exact weights, the model their rounding
            assert torch.equal(at_start.masters[name], exact[name]), name
            assert torch.equal(at_start.params[name], exact[name].to(half)), name
        elif resumed == "O3":  # the half model: the rounding of the exact weights
            assert torch.equal(at_start.params[name], exact[name].to(half)), name
        else:  # an FP32 model: the exact weights
            assert torch.equal(at_start.params[name], exact[name]), name
    # The optimizer's state carries over (SGD's momentum, in the dtype of what it steps: half at O3 only).
    saved_state = checkpoint["optimizer_states"][0]["state"]
    for index, state in at_start.optimizer_state.items():
        momentum = state["momentum_buffer"]
        assert momentum.dtype == (half if resumed == "O3" else torch.float32)
        assert torch.equal(momentum, saved_state[index]["momentum_buffer"].to(momentum.dtype))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.isfinite(torch.tensor(model.losses)).all()


@pytest.mark.parametrize(
    ("saved", "resumed", "carried"),
    [("O1", "O2", True), ("O2", "O1", True), ("O1", "O3", False), ("O3", "O2", False), ("O2", "O0", False)],
)
def test_a_dynamic_loss_scale_carries_over_between_dynamic_levels(saved, resumed, carried, tmp_path) -> None:
    """float16: O1 and O2 scale dynamically and keep the checkpoint's scale; O0 and O3 have a static 1.0, which
    is their setting, not state: a level that scales otherwise starts from its own scale."""
    path = tmp_path / "saved.ckpt"
    settings = {"init_scale": 1024.0} if saved in ("O1", "O2") else {}  # not the default: carrying it is seen
    checkpoint = save(saved, "float16", path, steps=2, **settings)
    at_start, _ = resume(resumed, "float16", path, steps=3)
    if carried:
        assert at_start.scale == checkpoint[KEY]["scalers"][0]["scale"] == 1024.0
    else:
        expected = 2.0**16 if resumed in ("O1", "O2") else 1.0
        assert at_start.scale == expected


def test_the_issues_o1_checkpoint_resumed_at_o2_continues_as_o1_would(tmp_path: Any) -> None:
    """The issue's case: AdamW, an O1 checkpoint resumed at O2. The masters are its FP32 weights exactly, AdamW's
    FP32 moments are the checkpoint's, and the continued run follows the O1 continuation closely."""
    path = tmp_path / "o1.ckpt"
    checkpoint = save("O1", "bfloat16", path, optimizer="adamw")
    at_start, model = resume("O2", "bfloat16", path, optimizer="adamw", steps=6)
    for name, value in checkpoint["state_dict"].items():
        assert torch.equal(at_start.masters[name], value), name
    for index, state in at_start.optimizer_state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.float32
            assert torch.equal(state[key], checkpoint["optimizer_states"][0]["state"][index][key])
    _, continued = resume("O1", "bfloat16", path, optimizer="adamw", steps=6)
    assert model.losses == pytest.approx(continued.losses, rel=2e-2, abs=2e-2)


def test_masters_that_match_no_parameter_are_refused_naming_both_levels(tmp_path: Any) -> None:
    path = tmp_path / "o2.ckpt"
    save("O2", "bfloat16", path)
    model = Classifier(features=8)  # another model: other shapes, same names
    trainer = make_trainer(MixedPrecisionPlugin("O1", half_dtype="bfloat16"), max_steps=4)
    checkpoint = torch.load(path, weights_only=False)
    masters_from_checkpoint(checkpoint, KEY)  # the masters the state dict holds, back in the entry
    amp = trainer.precision_plugin.amp
    amp.prepare_model(model)
    with pytest.raises(ValueError, match=r"opt_level='O2' and this run is at 'O1'.*'net\.0\.weight' has shape"):
        amp.load_state_dict(checkpoint[KEY])
    renamed = dict(checkpoint[KEY])
    renamed["master_weights"] = [{"other." + k: v for k, v in saved.items()} for saved in renamed["master_weights"]]
    with pytest.raises(KeyError, match=r"opt_level='O2' and this run is at 'O1'.*'other\.net\.0\.bias'"):
        amp.load_state_dict(renamed)
    assert amp.skipped_steps == [0]  # refused: nothing changed


def test_two_levels_that_both_keep_masters_are_refused_naming_both() -> None:
    source = Amp("O2", half_dtype="bfloat16")
    model = source.prepare_model(torch.nn.Linear(4, 4))
    source.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    target = Amp("O3", half_dtype="bfloat16", master_weights=True)
    other = target.prepare_model(torch.nn.Linear(4, 4))
    target.prepare_optimizer(torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"opt_level='O2' and this run is at 'O3', and both keep FP32 masters"):
        target.load_state_dict(source.state_dict())


def test_the_core_engine_resumes_an_o1_state_at_o2_and_back() -> None:
    """A plain loop: the model's state dict first, then ``amp.load_state_dict``. O1 to O2: the masters are the O1
    model's FP32 weights exactly; O2 to O1: the FP32 model takes the O2 masters exactly."""

    def run(level: str, model: torch.nn.Module, state: dict[str, Any] | None = None) -> tuple[Amp, Any]:
        amp = Amp(level, half_dtype="float16", init_scale=256.0)
        model = amp.prepare_model(model)
        optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        if state is not None:
            model.load_state_dict(state["model"])
            amp.load_state_dict(state["amp"])
        return amp, optimizer

    def step(amp: Amp, model: torch.nn.Module, optimizer: Any) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().square().mean()
        amp.backward(loss)
        assert amp.step(optimizer)
        amp.update()

    torch.manual_seed(0)
    o1_model = torch.nn.Linear(8, 8)
    o1, o1_opt = run("O1", o1_model)
    step(o1, o1_model, o1_opt)
    saved = {"model": {k: v.clone() for k, v in o1_model.state_dict().items()}, "amp": o1.state_dict()}
    o2_model = torch.nn.Linear(8, 8)
    o2, o2_opt = run("O2", o2_model, saved)
    for name, param in o2_model.named_parameters():
        assert torch.equal(o2.master_of(param), saved["model"][name]), name
    assert o2.scalers[0].get_scale() == 256.0
    step(o2, o2_model, o2_opt)
    back = {"model": o2_model.state_dict(), "amp": o2.state_dict()}  # half values in the model's state dict
    o1_again = torch.nn.Linear(8, 8)
    run("O1", o1_again, back)
    for name, param in o1_again.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param, back["amp"]["master_weights"][0][name]), name


# -- the other front doors, where the model's state dict may be loaded after the engine's ---------------------------
def _train(backward: Any, model: torch.nn.Module, optimizer: Any, steps: int = 2) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


@pytest.mark.parametrize("mpx_first", [False, True], ids=["model-first", "mpx-first"])
@pytest.mark.parametrize(("saved", "resumed"), [("O2", "O1"), ("O1", "O2")])
def test_fabric_load_resumes_across_levels_in_either_order_of_the_state(saved, resumed, mpx_first, tmp_path) -> None:
    """``fabric.load`` follows the order of the user's state dict: with ``{"mpx": mpx, "model": model, ...}`` the
    engine's state is loaded before the model's, whose weights are the O2 masters' rounding. The O1 model still
    resumes from the masters exactly (and O2's masters from the O1 weights)."""
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    def setup(level: str, seed: int) -> tuple[Any, Any, Any, Any]:
        mpx = FabricMixedPrecisionPlugin(level, half_dtype="bfloat16")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
        net = _net(seed)
        model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        mpx.setup_optimizers(optimizer)
        return fabric, mpx, model, optimizer

    def state(mpx: Any, model: Any, optimizer: Any) -> dict[str, Any]:
        if mpx_first:
            return {"mpx": mpx, "model": model, "optimizer": optimizer}
        return {"model": model, "optimizer": optimizer, "mpx": mpx}

    def fp32(mpx: Any, model: Any, optimizer: Any) -> list[torch.Tensor]:
        if mpx.amp.properties.master_weights:
            return [m.detach().clone() for m in mpx.amp.master_params(optimizer.optimizer)]
        return [p.detach().clone() for p in model.parameters()]

    fabric, mpx, model, optimizer = setup(saved, 0)
    _train(fabric.backward, model, optimizer)
    fabric.save(tmp_path / "run.ckpt", state(mpx, model, optimizer))
    expected = fp32(mpx, model, optimizer)
    fabric, mpx, model, optimizer = setup(resumed, 1)
    fabric.load(tmp_path / "run.ckpt", state(mpx, model, optimizer))
    got = fp32(mpx, model, optimizer)
    assert all(t.dtype == torch.float32 for t in got)
    for index, (value, reference) in enumerate(zip(got, expected)):
        assert torch.equal(value, reference), f"parameter {index}: not the saved FP32 weights exactly"
    _train(fabric.backward, model, optimizer, steps=1)


@pytest.mark.parametrize(("saved", "resumed"), [("O2", "O1"), ("O1", "O2")])
def test_accelerate_load_state_resumes_across_levels(saved, resumed, tmp_path, fresh_accelerate_state) -> None:
    """``accelerator.load_state`` loads the engine's state (a load-state pre-hook) before the models, whose saved
    weights at O2 are the masters' rounding: an O2 checkpoint resumed at O1 still starts from the masters exactly."""
    from accelerate.state import AcceleratorState, GradientState

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    def setup(level: str, seed: int) -> tuple[Any, Any, Any]:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(mixed_precision=level, cpu=True,
                                  kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])  # fmt: skip
        model = _net(seed)
        return (accelerator, *accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2)))

    def fp32(accelerator: Any, model: Any, optimizer: Any) -> list[torch.Tensor]:
        if accelerator.amp.properties.master_weights:
            return [m.detach().clone() for m in accelerator.amp.master_params(optimizer.optimizer)]
        return [p.detach().clone() for p in model.parameters()]

    accelerator, model, optimizer = setup(saved, 0)
    _train(accelerator.backward, model, optimizer)
    accelerator.save_state(str(tmp_path / "checkpoint"))
    expected = fp32(accelerator, model, optimizer)
    accelerator, model, optimizer = setup(resumed, 1)
    accelerator.load_state(str(tmp_path / "checkpoint"))
    got = fp32(accelerator, model, optimizer)
    for index, (value, reference) in enumerate(zip(got, expected)):
        assert value.dtype == torch.float32 and torch.equal(value, reference), f"parameter {index}"
    _train(accelerator.backward, model, optimizer, steps=1)


def test_the_core_engine_keeps_the_exact_weights_when_the_model_loads_after_it_and_not_other_weights() -> None:
    """O2 to O1 with ``amp.load_state_dict`` first and the model's state dict (the masters' rounding) after it: the
    model keeps the masters exactly, tied weights included; a later load of other weights goes through."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 8)
            self.head = torch.nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x))

    torch.manual_seed(0)
    o2 = Amp("O2", half_dtype="bfloat16")
    model = o2.prepare_model(Tied())
    optimizer = o2.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    x = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(0))
    with o2.forward_context():
        loss = o2.cast_outputs(model(x)).float().square().mean()
    o2.backward(loss)
    assert o2.step(optimizer)
    o2.update()
    saved = {"model": model.state_dict(), "amp": o2.state_dict()}
    masters = saved["amp"]["master_weights"][0]
    o1 = Amp("O1", half_dtype="bfloat16")
    resumed = o1.prepare_model(Tied())
    o1.load_state_dict(saved["amp"])  # the engine first: Accelerate's order, fabric.load of {"mpx": ..., "model": ...}
    resumed.load_state_dict(saved["model"])  # "head.weight" and "emb.weight": both names load the tied parameter
    assert resumed.emb.weight.dtype == torch.float32
    assert torch.equal(resumed.emb.weight, masters["emb.weight"])
    assert not torch.equal(resumed.emb.weight, saved["model"]["emb.weight"].float())  # the rounding differs
    other = {name: torch.randn_like(value) for name, value in saved["model"].items()}
    other["head.weight"] = other["emb.weight"]
    resumed.load_state_dict(other)  # the user's own later load is not second-guessed
    assert torch.equal(resumed.emb.weight, other["emb.weight"].float())
