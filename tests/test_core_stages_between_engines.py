"""Models handed between engines (stages): exactly one engine's hooks and forward on the model after N stages, an
Accelerate-trained model fine-tuned by Lightning's Trainer or Fabric at another half dtype, and a model converted
under torch's tensor swapping (``torch.__future__.set_swap_module_params_on_conversion``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_mpx import Amp

pytest.importorskip("lightning.pytorch")
from lightning.fabric import Fabric  # noqa: E402

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer  # noqa: E402


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _hooks(model: nn.Module) -> list[tuple[int, ...]]:
    """Per submodule: its forward (pre-)hooks, backward hooks, load/state-dict hooks, its parameters' hooks, and
    whether an engine's forward replaces its own."""
    return [
        (
            len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks), len(m._backward_pre_hooks),
            len(m._load_state_dict_pre_hooks), len(m._state_dict_hooks), len(m._load_state_dict_post_hooks),
            sum(len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
                for p in m.parameters(recurse=False)),
            int("forward" in m.__dict__),
        )
        for m in model.modules()
    ]


def _stage(level: str, model: nn.Module) -> Amp:
    amp = Amp(level, half_dtype=torch.bfloat16, fp32_modules=["2"])
    amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    optimizer.zero_grad()
    with amp.forward_context():
        out = amp.cast_outputs(model(amp.cast_inputs(torch.randn(4, 8))))
    amp.backward(out.float().pow(2).mean())
    amp.step(optimizer)
    amp.update()
    return amp


def test_three_stages_leave_the_hooks_of_one_engine_as_on_a_model_it_prepared_fresh() -> None:
    """O2 -> O2 -> O1 (fp32_modules pinned): each stage added its FP32-boundary hooks beside the earlier stages'
    (Promotion kept them per engine, not per model): two more per stage on the pinned module. After each stage the
    model carries what that stage's engine puts on a model it prepares fresh, nothing of the earlier ones."""
    model, engines = _net(), []
    for level in ("O2", "O2", "O1"):
        engines.append(_stage(level, model))  # the engines stay alive: their hooks must come off all the same
        fresh = _net()
        _stage(level, fresh)
        assert _hooks(model) == _hooks(fresh), level


def test_two_trainer_fits_with_fp32_modules_leave_one_set_of_hooks() -> None:
    """A second ``Trainer.fit`` with a new ``MixedPrecisionPlugin`` (a second stage) left the first plugin's boundary
    hooks on the pinned module: two more per fit."""
    data = loader(classification_data(n=16))
    model, counts = Classifier(optimizer="adamw", lr=1e-2), []
    for _ in range(2):
        make_trainer(MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16, fp32_modules=["net.2"]), max_steps=1).fit(
            model, data
        )
        counts.append(_hooks(model))
    assert counts[0] == counts[1]


def _accelerate_trained() -> tuple[nn.Module, list[torch.Tensor]]:
    from lightning_mpx.accelerate import Accelerator

    model = Classifier(optimizer="adamw", lr=1e-2)
    accelerator = Accelerator(mixed_precision="O2", cpu=True)
    module, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    accelerator.backward(module(torch.randn(4, 16)).float().pow(2).mean())
    optimizer.step()
    return model, [accelerator.amp.master_of(p, refresh=False).detach().clone() for p in model.parameters()]


def test_an_accelerate_trained_model_fine_tuned_by_the_trainer_at_another_half_dtype() -> None:
    """Trained with the Accelerate adapter (float16 on CPU), fine-tuned by a Trainer at bfloat16: the adapter's
    forward stayed on the model and refused every step ("converted to torch.bfloat16 after prepare_model()"). The
    Trainer's engine takes the masters exactly and the model's own forward runs under its rules alone."""
    model, trained = _accelerate_trained()
    half = torch.bfloat16 if next(model.parameters()).dtype == torch.float16 else torch.float16
    plugin = MixedPrecisionPlugin("O2", half_dtype=half)
    trainer = make_trainer(plugin, max_steps=0)
    trainer.fit(model, loader(classification_data(n=16)))
    assert "forward" not in model.__dict__ and "_original_forward" not in model.__dict__
    assert all(torch.equal(plugin.amp.master_of(p, refresh=False), t) for p, t in zip(model.parameters(), trained))
    make_trainer(plugin, max_steps=2).fit(model, loader(classification_data(n=32)))
    assert all(p.dtype == half and torch.isfinite(p).all() for p in model.parameters())


def test_an_accelerate_trained_model_fine_tuned_by_fabric_at_another_half_dtype() -> None:
    """The same with Fabric as the second stage."""
    model, trained = _accelerate_trained()
    half = torch.bfloat16 if next(model.parameters()).dtype == torch.float16 else torch.float16
    plugin = FabricMixedPrecisionPlugin("O2", half_dtype=half)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module, optimizer = fabric.setup(model.net, torch.optim.AdamW(model.net.parameters(), lr=1e-2))
    assert "forward" not in model.__dict__
    assert all(torch.equal(a, t) for a, t in zip(plugin.amp.fp32_state_dict(model.net).values(), trained))
    for _ in range(2):
        optimizer.zero_grad()
        fabric.backward(module(torch.randn(4, 16)).float().pow(2).mean())
        optimizer.step()
    assert all(p.dtype == half and torch.isfinite(p).all() for p in model.parameters())


def test_a_model_with_masters_converted_under_tensor_swapping_is_refused_before_anything_changes() -> None:
    """``model.float()`` of an O2 model with ``set_swap_module_params_on_conversion(True)`` failed inside torch
    ("Couldn't swap Linear.weight": the masters hold the parameters weakly).
    It is refused first, naming the ways that work; its deep copy converts to the masters exactly."""
    model = _net()
    amp = _stage("O2", model)
    masters = [amp.master_of(p, refresh=False).detach().clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match="swap_module_params_on_conversion.*copy.deepcopy"):
            model.float()
        copied = copy.deepcopy(model).to(torch.float32)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(p.detach(), m) and type(p) is nn.Parameter for p, m in zip(copied.parameters(), masters))
