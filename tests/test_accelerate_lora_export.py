"""Hostile habits against the stop-50 fixes of the Accelerate adapter and the ``transformers.Trainer`` mixin: the FP32
export at O2 (``get_state_dict``, ``save_model``, the Trainer's ``save_model``) of a peft LoRA model and of GPT-2's
tied embeddings, an optimizer that stepped before its model was prepared, and the mixin's class checks. Each case is
held to a reference: the masters themselves (the same storage, bit for bit), Accelerate's own ``"no"``, or the run
prepared in one call. Tiny GPT-2 from a config, bfloat16, on CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402
from tests.accelerate_helpers import accelerate_state_reset, reset_accelerate_state  # noqa: E402
from tests.test_hf_trainer import GPT2, SCALED, lm_data  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

transformers.logging.set_verbosity_error()


def _accelerator(level: str) -> Accelerator:
    reset_accelerate_state()  # a fresh Accelerator, as in a new process
    handlers = [MixedPrecisionKwargs(half_dtype="bfloat16", init_scale=2.0**8)] if level.startswith("O") else None
    return Accelerator(mixed_precision=level, kwargs_handlers=handlers, cpu=True)


def _lora() -> Any:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False)
    return peft.get_peft_model(transformers.GPT2LMHeadModel(GPT2), config)


def _ids(step: int) -> torch.Tensor:
    return torch.stack([row["input_ids"] for row in lm_data(8)[2 * step : 2 * step + 2]])


def _train(accelerator: Accelerator, model: nn.Module, steps: int = 2) -> tuple[nn.Module, Any]:
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    for step in range(steps):
        accelerator.backward(model(input_ids=_ids(step), labels=_ids(step)).loss)
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh_bytes(state: dict[str, Any], *owners: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors in ``state`` that share storage with none of ``owners``' tensors: what making it cost."""
    own = {t.untyped_storage().data_ptr() for owner in owners for t in owner.values() if torch.is_tensor(t)}
    fresh = [t for t in state.values() if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in own]
    return sum(t.numel() * t.element_size() for t in fresh)


# -- the O2 export of a LoRA model: the masters handed, the frozen half base not copied to FP32 ----------------------
def test_o2_get_state_dict_of_a_lora_model_hands_the_masters_and_copies_no_frozen_weight():
    """Found at stop 50 (attack): ``get_state_dict`` of a peft LoRA model at O2 (so ``save_model``, ``save_state``,
    ``save_pretrained(state_dict=...)``) upcast the whole frozen bfloat16 base to a fresh FP32 copy on the model's
    device, 120320 bytes of a 124416-byte state dict here, twice the base's own memory (a 7B base: 28 GB more at every
    save, where the run itself fits), though the base has no masters and the upcast adds no information. Now the
    masters are handed as they are (same storage), the rest as the model holds it: nothing is allocated, the adapter
    entries are the masters bit for bit; a model prepared for evaluation only gives its half weights as such (the
    Trainer's rule for a predict-only save)."""
    accelerator = _accelerator("O2")
    model, opt = _train(accelerator, _lora())
    inner = accelerator.unwrap_model(model)
    state = accelerator.get_state_dict(model)
    masters = {id(m) for m in accelerator.amp.master_params(opt.optimizer)}
    own = inner.state_dict()
    assert _fresh_bytes(state, own, dict(enumerate(accelerator.amp.master_params(opt.optimizer)))) == 0
    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    assert len(adapters) == 4 and all(v.dtype == torch.float32 for v in adapters.values())
    held = {name: p for name, p in inner.named_parameters() if p.requires_grad}
    assert all(accelerator.amp.master_of(held[k]).data_ptr() == v.data_ptr() for k, v in adapters.items())
    assert len(masters) == 4
    base = {k: v for k, v in state.items() if k not in adapters}
    assert all(torch.equal(v, own[k]) and v.dtype == own[k].dtype for k, v in base.items())
    # A model prepared for evaluation only (no masters, no FP32 values kept): its half weights as such, not copied.
    evaluated = accelerator.prepare_model(_net(), evaluation_mode=True)
    state = accelerator.get_state_dict(evaluated)
    assert _fresh_bytes(state, evaluated.state_dict()) == 0 and {v.dtype for v in state.values()} == {torch.bfloat16}


# -- a model prepared after its optimizer, inside an accumulation window -------------------------------------------
def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def _head_prepared_mid_window(level: str) -> list[torch.Tensor]:
    """An encoder and a head trained by one SGD with 2 accumulation steps, the head prepared after the first
    micro-batch (its gradient already accumulated); the FP32 weights after 3 optimizer steps."""
    reset_accelerate_state()
    kwargs = [MixedPrecisionKwargs(half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**8)]
    accelerator = Accelerator(mixed_precision=level, kwargs_handlers=kwargs if level != "no" else None, cpu=True,
                              gradient_accumulation_steps=2)  # fmt: skip
    encoder = _net()
    torch.manual_seed(1)
    head = nn.Linear(3, 3)
    opt = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=1e-2)
    encoder, opt = accelerator.prepare(encoder, opt)
    for step in range(6):
        if step == 1:
            head = accelerator.prepare(head)
        with accelerator.accumulate(encoder):
            x, y = _batch(step)
            accelerator.backward(F.cross_entropy(head(encoder(x)), y))
            opt.step()
            opt.zero_grad()
    weights = []
    for model in (encoder, head):
        inner = accelerator.unwrap_model(model)
        weights += list((accelerator.amp.fp32_state_dict(inner) if level == "O2" else inner.state_dict()).values())
    return weights


def test_a_model_prepared_inside_an_accumulation_window_keeps_its_accumulated_gradient():
    """Found at stop 50 (attack): at O2 a model prepared after its optimizer, between two micro-batches of an
    accumulation window, lost the gradient it had accumulated (the conversion to half dropped it): its first step took
    one micro-batch of two, 1.07e-3 off Accelerate's ``"no"`` running the same calls. The gradient is kept (in half,
    scaled as the next micro-batch's): 1.0e-5 off, as the run prepared in one call."""
    native = _head_prepared_mid_window("no")
    torch.testing.assert_close(_head_prepared_mid_window("O2"), native, atol=1e-4, rtol=0)


# -- the Trainer: a LoRA model with two adapters, the best one loaded at the end, then saved ------------------------
def test_trainer_o2_saves_the_best_adapter_of_two_without_copying_the_base(tmp_path):
    """A PeftModel with a second (inactive, frozen) adapter, ``load_best_model_at_end`` at O2, then ``save_model()``.
    Found at stop 50 (attack): the Trainer's save at O2 upcast the whole frozen base to a fresh FP32 copy before peft
    kept only the adapters (122880 bytes here, twice the half base, at every checkpoint save), and
    ``mpx_trainer(cls)`` of a class that has the mixin already failed with "Cannot create a consistent method
    resolution order"; ``save_model()`` after ``trainer.accelerator.free_memory()`` read the fresh engine, which has no
    masters, and wrote the half weights (a full GPT-2: 1.5e-3 off the masters, under a ``config.json`` saying float32).
    Now the state dict handed to ``save_pretrained`` costs nothing (the masters and the model's own
    tensors), the active adapter is the best checkpoint's bit for bit, the second adapter is saved as the model holds
    it, the save after ``free_memory()`` is the same, and ``mpx_trainer`` returns a class with the mixin as it is."""
    from pathlib import Path

    from safetensors.torch import load_file

    from lightning_mpx.accelerate import mpx_trainer

    cls = mpx_trainer()
    assert mpx_trainer(cls) is cls
    model = _lora()
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["c_fc"], fan_in_fan_out=True,
                                                init_lora_weights=False))  # fmt: skip
    second = {k: v.clone() for k, v in model.state_dict().items() if ".second." in k}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), use_cpu=True, report_to=[], max_steps=4, per_device_train_batch_size=4,
        learning_rate=1e-2, logging_steps=1, disable_tqdm=True, optim="adamw_torch", eval_strategy="steps",
        eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
        metric_for_best_model="loss", greater_is_better=True,  # the early checkpoint: the loss falls
    )
    handed: dict[str, Any] = {}
    with accelerate_state_reset():
        tr = cls(model=model, args=args, train_dataset=lm_data(), eval_dataset=lm_data(4), opt_level="O2",
                 mpx_kwargs=SCALED)  # fmt: skip
        tr.train()
        assert Path(tr.state.best_model_checkpoint).name == "checkpoint-2"
        save_pretrained = tr.model.save_pretrained

        def capture(directory: str, state_dict: Any = None, **kwargs: Any) -> Any:
            handed.update(state_dict)
            return save_pretrained(directory, state_dict=state_dict, **kwargs)

        tr.model.save_pretrained = capture  # this instance only: what the Trainer hands peft
        tr.save_model(str(tmp_path / "final"))
        amp = tr.accelerator.amp
        masters = {i: amp.master_of(p, refresh=False) for i, p in enumerate(tr.model.parameters())}
        assert _fresh_bytes(handed, tr.model.state_dict(), masters) == 0
        # Memory released before the export: the save read the fresh engine, without masters, and wrote the half
        # adapter (the masters' rounding) where the Accelerator's get_state_dict gives the masters.
        tr.accelerator.free_memory()
        tr.save_model(str(tmp_path / "after_free_memory"))
    best = load_file(str(Path(tr.state.best_model_checkpoint) / "adapter_model.safetensors"))
    final = load_file(str(tmp_path / "final" / "adapter_model.safetensors"))
    assert final.keys() == best.keys() and all(torch.equal(final[k], v) for k, v in best.items())
    freed = load_file(str(tmp_path / "after_free_memory" / "adapter_model.safetensors"))
    assert freed.keys() == best.keys() and all(torch.equal(freed[k], v) for k, v in best.items())
    saved_second = load_file(str(tmp_path / "final" / "second" / "adapter_model.safetensors"))
    assert len(saved_second) == len(second) == 4
    assert all(torch.equal(saved_second[k.replace(".second.", ".")], v.to(torch.bfloat16)) for k, v in second.items())

