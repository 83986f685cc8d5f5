"""Hostile review of stop 58's loss-scale compatibility writes (``scaler.pt`` in Accelerate checkpoints, Lightning's
``"MixedPrecision"`` entry): every reader that may now meet them, as users resume. transformers' Trainer resumed
without float16 loads any ``scaler.pt`` into its ``accelerator.scaler`` (``None`` there) and crashed on the
mixin's checkpoints; the others hold: Lightning's own precisions and the plugin (its own entry wins), Accelerate's own
modes and the adapter with two losses and a registered object, and a ``GradScaler`` loading the written state."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_mpx import MixedPrecisionPlugin
from tests.lightning_helpers import make_trainer
from tests.test_lightning_precision_switch_float16 import SCALING, Net, X, Y, _fit, _net


def _hf_trainer(out: str, level: str | None, steps: int, **arguments: Any) -> Any:
    import transformers

    from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer
    from tests.test_hf_trainer_habits import GPT2, lm_data

    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=out, use_cpu=True, report_to=[], max_steps=steps, per_device_train_batch_size=4, save_steps=2,
        save_strategy="steps", disable_tqdm=True, logging_strategy="no", **arguments,
    )
    made = dict(model=transformers.GPT2LMHeadModel(GPT2), args=args, train_dataset=lm_data(16))
    if level is None:
        return transformers.Trainer(**made)
    kwargs = MixedPrecisionKwargs(half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**10, growth_interval=1)
    return mpx_trainer()(**made, opt_level=level, mpx_kwargs=kwargs)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_mixin_checkpoint_resumes_under_transformers_own_bf16_trainer(tmp_path) -> None:
    """``MpxTrainerMixin`` at O2 with a dynamic scale, then ``transformers.Trainer(bf16=True)`` with
    ``resume_from_checkpoint``: it resumes (it crashed: the Trainer loads a checkpoint's scaler.pt into
    ``accelerator.scaler``, None without fp16). The mixin's own resume: tests/test_hf_trainer.py."""
    from tests.accelerate_helpers import reset_accelerate_state

    pytest.importorskip("transformers")
    out = str(tmp_path)
    first = _hf_trainer(out, "O2", 2)
    first.train()
    assert first.accelerator.amp.scalers[0].state_dict()["scale"] == 2.0**12  # dynamic: grown twice
    checkpoint = os.path.join(out, "checkpoint-2")

    reset_accelerate_state()
    plain = _hf_trainer(out, None, 3, bf16=True)
    plain.train(resume_from_checkpoint=checkpoint)
    assert plain.state.global_step == 3



class _Weights(Net):
    """Records the weights the resumed run starts from."""

    def on_train_start(self) -> None:
        self.start = [p.detach().clone() for p in self.parameters()]  # O2: half, the rounding of the masters


def _lightning_precision(spec: str) -> Any:
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    return {
        "bf16-mixed": lambda: MixedPrecision("bf16-mixed", "cpu"), "32-true": Precision,
        "O2-bfloat16": lambda: MixedPrecisionPlugin("O2", half_dtype="bfloat16"),
        "O2-float16-static": lambda: MixedPrecisionPlugin("O2", half_dtype="float16", loss_scale=128.0),
        "O0": lambda: MixedPrecisionPlugin("O0", half_dtype="float16"),
    }[spec]()


@pytest.mark.parametrize("spec", ["bf16-mixed", "32-true", "O2-bfloat16", "O2-float16-static", "O0"])
def test_an_o1_float16_checkpoint_with_the_16_mixed_entry_resumes_under_other_precisions(spec, tmp_path) -> None:
    """A checkpoint of the plugin at O1 float16 (with Lightning's ``"MixedPrecision"`` entry) resumed with
    ``ckpt_path=`` under Lightning's ``"bf16-mixed"`` (a ``MixedPrecision`` with no scaler, which reads that entry)
    and ``"32-true"``, and under the plugin at settings that do not scale dynamically: each resumes from the saved
    weights, and a static scale stays the setting (the plugin's own entry, not Lightning's, is read)."""
    path = tmp_path / "run.ckpt"
    _fit(MixedPrecisionPlugin("O1", half_dtype="float16", **SCALING), 3, save=path)
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["MixedPrecision"]["scale"] == 32.0
    model = _Weights()
    trainer = make_trainer(_lightning_precision(spec), max_steps=4, max_epochs=10)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16)
    trainer.fit(model, data, ckpt_path=path)
    assert trainer.global_step == 4
    for got, want in zip(model.start, checkpoint["state_dict"].values()):
        assert torch.equal(got, want.to(got.dtype))
    amp = getattr(trainer.precision_plugin, "amp", None)
    if amp is not None:
        assert amp.scalers[0].state_dict()["scale"] == (128.0 if spec == "O2-float16-static" else 1.0)


def test_the_written_grad_scaler_state_at_hysteresis_and_the_floor_loads_into_a_grad_scaler(tmp_path) -> None:
    """A dynamic scale with ``hysteresis=2`` backed off to its ``min_loss_scale`` by overflows, saved by the plugin:
    Lightning's ``"16-mixed"`` resumes at that scale (a ``GradScaler`` has no floor nor hysteresis: the settings it
    cannot hold are left out, its own growth settings carried); a checkpoint before any step writes ``init_scale``."""

    class Overflowing(Net):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.cross_entropy(self.net(batch[0]).float(), batch[1])
            return loss * float("inf") if batch_idx < 3 else loss

    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=8.0, hysteresis=2, min_loss_scale=2.0,
                                  growth_interval=3, on_floor="continue")  # fmt: skip
    trainer = make_trainer(plugin, max_steps=3, max_epochs=10)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16)
    trainer.fit(Overflowing(), data)
    trainer.save_checkpoint(tmp_path / "floor.ckpt")
    entry = torch.load(tmp_path / "floor.ckpt", weights_only=False)["MixedPrecision"]
    assert entry["scale"] == 2.0 and entry["growth_interval"] == 3  # 8 -> (hysteresis) 8 -> 4 -> 2 (the floor)
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(entry)
    assert scaler.get_scale() == 2.0 and scaler.get_growth_interval() == 3

    trainer = make_trainer(MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=64.0), max_steps=0)
    trainer.fit(Net(), data)
    trainer.save_checkpoint(tmp_path / "unstepped.ckpt")
    assert torch.load(tmp_path / "unstepped.ckpt", weights_only=False)["MixedPrecision"]["scale"] == 64.0


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _accelerator(mixed_precision: str) -> tuple[Any, Any, Any, _Counter]:
    from accelerate import Accelerator as Upstream

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    if mixed_precision.startswith("O"):
        kwargs = MixedPrecisionKwargs(half_dtype="float16", num_losses=2, **SCALING)
        accelerator = Accelerator(mixed_precision=mixed_precision, cpu=True, kwargs_handlers=[kwargs])
    else:
        accelerator = Upstream(mixed_precision=mixed_precision, cpu=True)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    net = _net()
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-2))
    return accelerator, model, optimizer, counter


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_an_adapter_checkpoint_of_two_losses_and_a_registered_object_loads_everywhere(tmp_path) -> None:
    """``save_state(safe_serialization=False)`` at O2 float16 with ``num_losses=2`` and an object registered for
    checkpointing: the adapter's ``load_state`` restores both scales (not loss 0's everywhere) and the object, and
    Accelerate's own ``"bf16"`` (no scaler: the scaler.pt is not read) loads the weights and the object."""
    accelerator, model, optimizer, counter = _accelerator("O2")
    for step in range(3):
        accelerator.backward(F.cross_entropy(model(X[:16]).float(), Y[:16]), loss_id=step % 2)
        optimizer.step()
        optimizer.zero_grad()
    counter.n = 7
    accelerator.save_state(str(tmp_path), safe_serialization=False)
    saved = [scaler.state_dict() for scaler in accelerator.amp.scalers]
    assert saved[0]["scale"] != saved[1]["scale"] and os.path.isfile(tmp_path / "scaler.pt")

    accelerator, model, optimizer, counter = _accelerator("O2")
    accelerator.load_state(str(tmp_path))
    assert [scaler.state_dict() for scaler in accelerator.amp.scalers] == saved and counter.n == 7

    upstream, model, optimizer, counter = _accelerator("bf16")
    upstream.load_state(str(tmp_path))
    assert upstream.scaler is None and counter.n == 7
    for got, want in zip(model.parameters(), torch.load(tmp_path / "pytorch_model.bin").values()):
        assert torch.equal(got, want) and got.dtype == torch.float32
