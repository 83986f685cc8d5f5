"""``transformers.Trainer`` with an opt level, used as a Hugging Face user trains every day: ``load_best_model_at_end``
(a full model and a peft LoRA adapter) and ``save_only_model`` checkpoints resumed (what a partly frozen model exports
at O2: ``tests/test_accelerate_user_loops.py``). Each run is held to a reference: the checkpoint the Trainer chose (its
files, exactly) or transformers' own Trainer. Tiny GPT-2 built from a config (nothing downloaded), bfloat16, on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
import safetensors.torch as safetensors_torch  # noqa: E402 - a dependency of transformers

from lightning_mpx.accelerate import mpx_trainer  # noqa: E402
from tests.accelerate_helpers import accelerate_state_reset  # noqa: E402
from tests.test_hf_trainer import GPT2, SCALED, lm_data, max_diff  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

transformers.logging.set_verbosity_error()


def _lora() -> Any:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False)
    return peft.get_peft_model(transformers.GPT2LMHeadModel(GPT2), config)


def _trainer(out: Path, level: str | None, model: Any = None, **arguments: Any) -> Any:
    """A Trainer (``level=None``: transformers' own) of ``model`` (a seeded GPT-2 by default) writing to ``out``."""
    if model is None:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(GPT2)
    defaults = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
                    save_strategy="no", disable_tqdm=True, optim="adamw_torch")  # fmt: skip
    args = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], **{**defaults, **arguments})
    data = dict(model=model, args=args, train_dataset=lm_data(), eval_dataset=lm_data(4))
    if level is None:
        return transformers.Trainer(**data)
    return mpx_trainer()(**data, opt_level=level, mpx_kwargs=SCALED)


# Evaluated every 2 steps, best = highest eval loss: the early checkpoint (the loss falls), not the last one.
BEST = dict(max_steps=4, learning_rate=1e-2, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
            load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)  # fmt: skip


def _adapter(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoRA entries of a PeftModel's state dict, keyed as its saved adapter file."""
    return {k.replace(".default.", "."): v.float() for k, v in state.items() if ".lora_" in k}


def test_load_best_model_at_end_o2_masters_and_export_are_the_best_checkpoint(tmp_path):
    """A full model at O2: after ``load_best_model_at_end`` the FP32 masters are the best checkpoint's weights
    (exactly, not their bfloat16 rounding, not the last step's), so ``save_model()`` exports the best model."""
    with accelerate_state_reset():
        tr = _trainer(tmp_path / "run", "O2", **BEST)
        tr.train()
        best = Path(tr.state.best_model_checkpoint)
        assert best.name == "checkpoint-2"
        saved = safetensors_torch.load_file(str(best / "model.safetensors"))
        masters = tr.accelerator.amp.fp32_state_dict(tr.model)
        assert max_diff({k: masters[k] for k in saved}, saved) == 0.0
        tr.save_model(str(tmp_path / "final"))
    final = safetensors_torch.load_file(str(tmp_path / "final" / "model.safetensors"))
    assert max_diff(final, saved) == 0.0


def test_peft_load_best_model_at_end_o2_keeps_the_trained_parameters(tmp_path):
    """peft's ``load_adapter`` (what ``load_best_model_at_end`` calls for a PeftModel) upcasts the adapter to FP32 by
    replacing its parameters: at O2 the model then held new FP32 LoRA parameters with the best weights' bfloat16
    rounding (1.1e-3 off), which no optimizer held, and save_model() wrote those, with a base model's config.json.
    The best adapter now goes into the parameters the optimizer and their FP32 masters hold: ``save_model()`` writes
    it exactly, as transformers' own Trainer does, without a ``config.json`` (the base is not saved), and a resume
    on the same Trainer trains the model's parameters."""
    with accelerate_state_reset():
        tr = _trainer(tmp_path / "o2", "O2", model=_lora(), **BEST)
        trained = {id(p) for p in tr.model.parameters() if p.requires_grad}
        tr.train()
        best = Path(tr.state.best_model_checkpoint)
        assert best.name == "checkpoint-2"
        lora = {n: p for n, p in tr.model.named_parameters() if p.requires_grad}
        assert {id(p) for p in lora.values()} == trained  # the optimizer's parameters, still the model's
        assert {p.dtype for p in lora.values()} == {torch.bfloat16}
        best_adapter = safetensors_torch.load_file(str(best / "adapter_model.safetensors"))
        assert max_diff(_adapter(tr.accelerator.amp.fp32_state_dict(tr.model)), best_adapter) == 0.0
        tr.save_model(str(tmp_path / "final"))
        final = safetensors_torch.load_file(str(tmp_path / "final" / "adapter_model.safetensors"))
        assert max_diff(final, best_adapter) == 0.0
        assert (tmp_path / "final" / "adapter_config.json").is_file()
        assert not (tmp_path / "final" / "config.json").exists()  # transformers' Trainer writes none for an adapter
        # Resumed on the same Trainer (its model prepared): the load went to new FP32 parameters, and the optimizer's
        # then belonged to no model ("optimizer holds 4 half parameter(s) that belong to no model prepared ...").
        tr.args.max_steps, tr.args.eval_strategy, tr.args.save_strategy = 3, "no", "no"
        tr.args.load_best_model_at_end = False
        tr.train(resume_from_checkpoint=str(best))
        assert {id(p) for p in tr.model.parameters() if p.requires_grad} == trained and tr.state.global_step == 3
        assert max_diff(_adapter(tr.model.state_dict()), best_adapter) > 1e-3  # trained on from the best


def test_save_only_model_checkpoint_resumes_with_the_weights_as_the_trainer_does(tmp_path):
    """``save_only_model=True`` writes the weights only (no optimizer, scheduler or scaler: nor the opt level's
    state); transformers' Trainer resumes from such a checkpoint with those weights and a fresh optimizer. At O2 it
    was refused as 'not saved with an opt level'; it now resumes the same way: the FP32 masters from the checkpoint's
    FP32 weights exactly, the loss scale from its initial value, with a warning saying so."""
    only_model = dict(max_steps=2, save_strategy="steps", save_steps=2, save_only_model=True)
    with accelerate_state_reset():
        _trainer(tmp_path / "run", "O2", **only_model).train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    saved = safetensors_torch.load_file(str(checkpoint / "model.safetensors"))
    masters_at_start: list[float] = []

    class AtStart(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            fp32 = resumed.accelerator.amp.fp32_state_dict(model)
            masters_at_start.append(max_diff({k: fp32[k] for k in saved}, saved))

    with accelerate_state_reset():
        resumed = _trainer(tmp_path / "resumed", "O2", max_steps=3)
        resumed.add_callback(AtStart())
        with pytest.warns(UserWarning, match=r"checkpoint-2.*weights only.*save_only_model.*loss scale"):
            resumed.train(resume_from_checkpoint=str(checkpoint))
        assert masters_at_start == [0.0] and resumed.state.global_step == 3
        logged = [log for log in resumed.state.log_history if "loss" in log]
        assert logged[0]["mpx/loss_scale"] == 1024.0  # SCALED's initial scale, as the optimizer starts afresh


def test_o2_save_model_after_predict_only_saves_the_half_weights_as_such(tmp_path):
    """A Trainer without a ``train_dataset`` (inference): ``predict()`` at O2 casts the model to bfloat16 for good, as
    the Trainer's own ``bf16_full_eval=True`` does. ``save_model()`` then wrote those values upcast, under a
    ``config.json`` saying float32 (2.4e-4 off the FP32 weights it claimed); it now saves what the Trainer's
    ``bf16_full_eval`` run saves: the same bfloat16 tensors, ``config.json`` saying bfloat16."""
    saved = {}
    for name, level, arguments in (("native", None, dict(bf16_full_eval=True)), ("o2", "O2", {})):
        with accelerate_state_reset():
            torch.manual_seed(0)
            model = transformers.GPT2LMHeadModel(GPT2)
            out = str(tmp_path / name)
            args = transformers.TrainingArguments(output_dir=out, use_cpu=True, report_to=[], **arguments)
            cls = transformers.Trainer if level is None else mpx_trainer()
            tr = cls(model=model, args=args, **({} if level is None else dict(opt_level=level, mpx_kwargs=SCALED)))
            tr.predict(lm_data(4))
            tr.save_model(str(tmp_path / name / "final"))
        final = tmp_path / name / "final"
        saved[name] = json.loads((final / "config.json").read_text())["dtype"], safetensors_torch.load_file(
            str(final / "model.safetensors")
        )
    assert saved["o2"][0] == saved["native"][0] == "bfloat16"
    assert saved["o2"][1].keys() == saved["native"][1].keys()
    assert all(torch.equal(saved["o2"][1][k], v) for k, v in saved["native"][1].items())


def test_a_replaced_parameter_with_other_values_goes_to_the_one_the_optimizer_holds():
    """A load that replaces a parameter with other values (not peft's upcast of the same ones): the optimizer's
    parameter is put back and takes them, its O2 master exactly."""
    from types import SimpleNamespace

    from lightning_mpx.accelerate import Accelerator
    from lightning_mpx.integrations.hf_trainer import _keeping_parameters

    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[SCALED])
    net = torch.nn.Linear(4, 4)
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    held = model.weight
    loaded = torch.randn(4, 4)

    def load() -> None:
        model.weight = torch.nn.Parameter(loaded.clone())

    _keeping_parameters(SimpleNamespace(model=model, accelerator=accelerator, is_fsdp_enabled=False), load)
    assert model.weight is held and held.dtype == torch.bfloat16
    assert torch.equal(accelerator.amp.master_of(held), loaded)


def test_the_mixin_after_the_trainer_in_the_bases_is_refused_at_the_class():
    """``class MyTrainer(Trainer, MpxTrainerMixin)``: the Trainer's methods came first, so it trained in FP32 without a
    word (or failed with ``Trainer.__init__() got an unexpected keyword argument 'opt_level'``)."""
    from lightning_mpx.accelerate import MpxTrainerMixin

    with pytest.raises(TypeError, match=r"class Wrong\(Seq2SeqTrainer, MpxTrainerMixin\): MpxTrainerMixin comes after"):
        type("Wrong", (transformers.Seq2SeqTrainer, MpxTrainerMixin), {})
    right = type("Right", (MpxTrainerMixin, transformers.Seq2SeqTrainer), {})
    assert type("Sub", (right,), {}).__mro__[2] is MpxTrainerMixin
