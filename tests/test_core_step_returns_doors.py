"""Stop 60 (odds60b): a custom optimizer's ``step()`` return value at every door, and Fabric's ``generate`` of a
Whisper at O2 (odds60's two strict xfails, made to pass), from the user's side against Lightning's own precisions,
``torch.amp.GradScaler`` and Accelerate's own "bf16"."""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mpx import Amp
from tests.accelerate_helpers import accelerate_state_reset
from tests.test_core_step_returns_save_pretrained import _fabric, _generate, _whisper

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


class _DictSGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        super().step(closure)
        return {"custom": 1}


class _DictAdam(torch.optim.Adam):  # fused: its step skips on the device (skip_on_device)
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        super().step(closure)
        return {"fused": 1}


def _fabric_returns(level: str, optimizer: Any, half: str, losses: list[float]) -> list[Any]:
    from lightning.fabric import Fabric

    from lightning_mpx.fabric import FabricMixedPrecisionPlugin

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin(level, half_dtype=half)])
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    model, opt = fabric.setup(model, optimizer(model.parameters()))
    returned = []
    for factor in losses:
        fabric.backward(model(torch.ones(1, 2)).float().sum() * factor)
        returned.append(opt.step())
        opt.zero_grad()
    return returned


def test_fabric_o2_float16_skipped_step_returns_none_as_grad_scaler() -> None:
    # the reference: torch's GradScaler.step returns None on a skip, the optimizer's value otherwise
    model = nn.Linear(2, 2)
    scaler, opt = torch.amp.GradScaler("cpu"), _DictSGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
    want = [scaler.step(opt)]
    scaler.update()
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    want.append(scaler.step(opt))
    assert want == [None, {"custom": 1}]
    got = _fabric_returns("O2", lambda p: _DictSGD(p, lr=0.1), "float16", [float("inf"), 1.0])
    assert got == want


def test_fabric_o1_fused_step_returns_the_optimizers_value() -> None:
    # skipped on the device: GradScaler.step returns the optimizer's step's value whatever the flag
    got = _fabric_returns("O1", lambda p: _DictAdam(p, lr=0.1, fused=True), "bfloat16", [1.0, 1.0])
    assert got == [{"fused": 1}] * 2


def test_core_amp_step_returns_whether_it_stepped() -> None:
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(nn.Linear(2, 2))
    opt = amp.prepare_optimizer(_DictSGD(model.parameters(), lr=0.1))
    amp.backward(amp.cast_outputs(model(amp.cast_inputs(torch.ones(1, 2)))).sum())
    assert amp.step(opt) is True  # documented: whether it stepped (the optimizer's value is the doors')


def test_accelerate_o2_step_returns_none_as_accelerate_bf16() -> None:
    from accelerate import Accelerator as HFAccelerator

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    returned = []
    for make in (lambda: HFAccelerator(mixed_precision="bf16", cpu=True),
                 lambda: Accelerator(
                     mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])):
        with accelerate_state_reset():
            accelerator = make()
            model = nn.Linear(2, 2)
            model, opt = accelerator.prepare(model, _DictSGD(model.parameters(), lr=0.1))
            accelerator.backward(model(torch.ones(1, 2)).float().sum())
            returned.append(opt.step())
    assert returned == [None, None]  # Accelerate's AcceleratedOptimizer.step returns nothing


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return transformers.GPT2LMHeadModel(config)


def test_fabric_o2_generate_of_gpt2_as_bf16_mixed() -> None:
    ids = {"input_ids": torch.randint(2, 32, (2, 4), generator=torch.Generator().manual_seed(1))}
    assert torch.equal(_generate("O2", _gpt2, ids), _generate("bf16-mixed", _gpt2, ids))


def test_fabric_o2_whisper_generate_marked_copied_and_pickled() -> None:
    features = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    want = _generate("bf16-mixed", _whisper, {"input_features": features})
    fabric = _fabric("O2")
    model = _whisper()
    wrapped, _ = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    wrapped.mark_forward_method("generate")  # Fabric checks that generate is a method
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(wrapped.generate(input_features=features, max_new_tokens=3, do_sample=False), want)
        twin = copy.deepcopy(model)  # still bfloat16: its own casts
        assert torch.equal(twin.generate(input_features=features, max_new_tokens=3, do_sample=False), want)
        fp32 = copy.deepcopy(model).float()  # converted: no casts
        assert fp32.generate(input_features=features, max_new_tokens=3, do_sample=False).shape == want.shape
        loaded = pickle.loads(pickle.dumps(model))
        assert loaded.generate(input_features=features.bfloat16(), max_new_tokens=3, do_sample=False).shape \
            == want.shape


def test_trainer_manual_o2_float16_skipped_step_returns_none_as_grad_scaler() -> None:
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.automatic_optimization, self.returned = nn.Linear(2, 2), False, []

        def training_step(self, batch: Any, index: int) -> None:
            opt = self.optimizers()
            factor = float("inf") if index == 0 else 1.0  # the first step overflows

            def closure() -> torch.Tensor:
                loss = self.layer(batch[0]).float().sum() * factor
                self.manual_backward(loss)
                return loss.detach()

            self.returned.append(opt.step(closure=closure))  # its loss not returned on a skip
            opt.zero_grad()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _DictSGD(self.parameters(), lr=0.1)

    module = Manual()
    trainer = make_trainer(MixedPrecisionPlugin("O2", half_dtype="float16"), max_steps=2)
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(2, 2)), batch_size=1))
    assert module.returned == [None, {"custom": 1}]  # as test_fabric_o2_float16_skipped_step_returns_none_...


def test_apex_o2_step_returns_the_optimizers_value_and_none_on_a_skip() -> None:
    from lightning_mpx.apex import _amp_state, amp

    _amp_state.reset()
    try:
        torch.manual_seed(0)
        model = nn.Linear(2, 2)
        model, opt = amp.initialize(model, _DictSGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
        returned = []
        for factor in (float("inf"), 1.0):  # float16: the first step overflows and is skipped, as Apex's skip_step
            opt.zero_grad()
            with amp.scale_loss(model(torch.ones(1, 2).half()).float().sum() * factor, opt) as scaled:
                scaled.backward()
            returned.append(opt.step())
        assert returned == [None, {"custom": 1}]  # Apex's patched step returns the optimizer's step's value
    finally:
        _amp_state.reset()


def test_fabric_o2_set_up_model_with_generate_is_freed_at_once_when_dropped() -> None:
    """The ``generate`` casts make no reference cycle (the method is bound to a weak reference of its module): a set-up
    GPT-2 the user drops is freed without a garbage-collector pass, so a second ``fabric.setup`` of a new model (a
    notebook cell run again) is the engine's only model (tests/test_lightning_surgery_doors.py met this)."""
    import gc
    import weakref

    fabric = _fabric("O2")
    model = _gpt2()
    wrapped, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "generate" in model.__dict__  # the casts are on
    gone = weakref.ref(model)
    gc.disable()
    try:
        del model, wrapped, optimizer
        assert gone() is None
    finally:
        gc.enable()
