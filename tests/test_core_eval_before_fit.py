"""Two silent precision losses of stop 52, from the user's side.

* A baseline evaluation before training at O2 (``trainer.validate(model)``/``predict`` then ``trainer.fit(model)``)
  converted the model to half without keeping its FP32 weights: the fit's masters started from their rounding. The
  stage now gives the FP32 model back when it ends, and the fit trains bit for bit as the fit without it. Fabric (a
  model set up and evaluated before its optimizer exists) already did: pinned here.
* A raw ``optimizer.step()`` at O1 with a dynamic scale applied the gradients still multiplied by the loss scale
  (the weights turned NaN silently): the prepared optimizer now refuses it, naming the call for each front door;
  a step after ``amp.unscale_`` works, and once the engine lets the optimizer go it is a plain optimizer again.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx.engine.amp import Amp
from lightning_mpx.settings import MixedPrecisionSettings

REFUSED = r"outside Amp\.step\(\).*scale"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


# -- 1. evaluation before the first fit at O2 ------------------------------------------------------------------------
def test_a_baseline_validate_before_fit_at_o2_trains_as_the_fit_without_it() -> None:
    pytest.importorskip("lightning.pytorch")
    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

    data = loader(classification_data(n=32))

    def run(evaluate_first: bool) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
        plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
        model = Classifier(optimizer="adamw", lr=0.01)
        trainer = make_trainer(plugin, max_steps=3)
        if evaluate_first:
            fp32 = {name: (p.detach().clone(), p.data_ptr()) for name, p in model.named_parameters()}
            trainer.validate(model, data, verbose=False)
            trainer.predict(model, data)
            assert model.hidden_dtypes == {"val": torch.bfloat16, "predict": torch.bfloat16}  # the stages ran half
            # ... and gave back the FP32 model itself (its own tensors: nothing else is kept for a model only
            # evaluated), as Lightning's "bf16-mixed" leaves it.
            for name, p in model.named_parameters():
                assert p.dtype == torch.float32 and torch.equal(p, fp32[name][0]) and p.data_ptr() == fp32[name][1]
            assert model.dtype == torch.float32 and plugin.amp.master_weights == []
        trainer.fit(model, data)
        masters = [m.detach().clone() for m in plugin.amp.master_params(trainer.optimizers[0])]
        return model, masters, [p.detach().clone() for p in model.parameters()]

    _, masters, params = run(evaluate_first=False)
    model, masters_after_eval, params_after_eval = run(evaluate_first=True)
    assert all(torch.equal(a, b) for a, b in zip(masters, masters_after_eval))  # bit for bit, masters and model
    assert all(torch.equal(a, b) for a, b in zip(params, params_after_eval))
    assert model.net[0].weight.dtype == torch.bfloat16  # fitted: the half model with its masters, as before


def test_fabric_evaluating_before_the_optimizer_exists_trains_as_without() -> None:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    def run(evaluate_first: bool) -> list[torch.Tensor]:
        net = _net()
        plugin = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = fabric.setup_module(net)
        x, y = _batch()
        if evaluate_first:
            with torch.no_grad():
                model.eval()
                model(x)
                model.train()
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(net.parameters(), lr=0.01))
        for _ in range(2):
            fabric.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        return [m.detach().clone() for m in plugin.master_params(optimizer)]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_fabric_an_inference_only_model_keeps_no_fp32_values() -> None:
    # Fabric cannot tell a model only ever evaluated: a trainable one keeps its FP32 values for the masters an
    # optimizer will make. A frozen model (requires_grad_(False), the inference habit) keeps none.
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    net = _net().requires_grad_(False)
    plugin = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
    model = Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup_module(net)
    with torch.no_grad():
        assert model(_batch()[0]).dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())
    assert not any(w.keeps_value(p) for w in plugin.amp.master_weights for p in net.parameters())


# -- 2. a raw optimizer step with scaled gradients ---------------------------------------------------------------------
def _o1(**settings: Any) -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    amp = Amp.from_settings(MixedPrecisionSettings.from_kwargs("O1", **settings))
    model = amp.prepare_model(_net())
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return amp, model, optimizer


def _backward(amp: Amp, model: nn.Module) -> None:
    x, y = _batch()
    with amp.forward_context():
        loss = F.cross_entropy(model(x), y)
    amp.backward(loss)


def test_core_o1_a_raw_step_with_scaled_gradients_is_refused_and_one_after_unscale_trains() -> None:
    amp, model, optimizer = _o1(half_dtype="float16")
    before = [p.detach().clone() for p in model.parameters()]
    _backward(amp, model)
    with pytest.raises(RuntimeError, match=REFUSED + r".*amp\.step\(optimizer\).*amp\.unscale_"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing was applied

    # After amp.unscale_ the raw step applies the true gradients: as the engine's own step.
    ref_amp, ref_model, ref_optimizer = _o1(half_dtype="float16")
    _backward(ref_amp, ref_model)
    assert ref_amp.step(ref_optimizer)
    amp.unscale_(optimizer)
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters()))
    amp.update()
    # Engine steps go on as before; released, the optimizer is the user's plain optimizer again.
    _backward(amp, model)
    assert amp.step(optimizer)
    amp.update()
    amp.release_optimizer(optimizer)
    model.zero_grad()
    _backward(amp, model)
    optimizer.step()


def test_core_a_unit_static_scale_leaves_a_raw_step_alone() -> None:
    amp, model, optimizer = _o1(half_dtype="bfloat16", loss_scale=1.0)
    _backward(amp, model)
    optimizer.step()  # the gradients carry no scale: nothing to refuse
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fabric_o1_a_raw_step_of_the_wrapped_optimizer_is_refused() -> None:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = FabricMixedPrecisionPlugin("O1", half_dtype="float16")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    plugin.setup_optimizers(optimizer)
    x, y = _batch()
    fabric.backward(F.cross_entropy(model(x), y))
    with pytest.raises(RuntimeError, match=REFUSED + r".*fabric\.setup\(\) returned"):
        optimizer.optimizer.step()
    optimizer.step()  # the optimizer fabric.setup returned: through the engine
    assert all(torch.isfinite(p).all() for p in net.parameters())


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_o1_a_raw_step_of_the_wrapped_optimizer_is_refused() -> None:
    pytest.importorskip("accelerate")
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(
        mixed_precision="O1", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="float16")]
    )
    net = _net()
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _batch()
    accelerator.backward(F.cross_entropy(model(x), y))
    with pytest.raises(RuntimeError, match=REFUSED + r".*accelerator\.prepare\(\) returned"):
        optimizer.optimizer.step()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_fabric_o1_a_raw_step_before_the_plugin_met_the_optimizer_is_refused() -> None:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O1", half_dtype="float16")])
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _batch()
    fabric.backward(F.cross_entropy(model(x), y))
    with pytest.raises(RuntimeError, match=REFUSED):
        optimizer.optimizer.step()
