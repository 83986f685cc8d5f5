"""peft LoRA on config-built tiny LLaMA and GPT-2 models under the Fabric plugin, the Trainer plugin and the
Accelerate adapter, as an HF user fine-tunes: ``get_peft_model``, an optimizer over the trainable parameters,
``model.save_pretrained(dir)`` of the adapters, ``merge_and_unload()`` after training.

At O2: only the adapters train, FP32 masters for them alone (the frozen base stays half with no FP32 copy),
``save_pretrained`` writes those masters (not their half rounding) and ``merge_and_unload`` gives weights as near the
``"32-true"`` run's as a bfloat16 merge can be. In float16, an overflow forced in one micro-batch of an accumulated
step: skipped, scale halved, schedule held, adapters within float16's tolerance of torch's autocast + ``GradScaler``
loop. (Core ``Amp``'s ``save_pretrained`` writes the half values on purpose: docs/core.md.)
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's process-wide state: none left

ACCUMULATION, OVERFLOW_AT, STEPS = 2, 3, 4  # micro-batch 3: the second of step 1


def _peft_model(kind: str) -> Any:
    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)  # fmt: skip
        base = LlamaForCausalLM(config)
        targets = ["q_proj", "v_proj"]
    else:
        config = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip  # no dropout: the fronts draw it apart
        base = GPT2LMHeadModel(config)
        targets = ["c_attn"]  # a Conv1D: peft's fan_in_fan_out
    torch.manual_seed(1)  # random A and B: the merge then moves the weights
    lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(base, lora_config)


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(n)]


def _trainable(model: Any) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _loss(model: Any, batch: torch.Tensor, index: int, overflow: bool) -> torch.Tensor:
    loss = model(input_ids=batch, labels=batch).loss
    return loss * 1e6 if overflow and index == OVERFLOW_AT else loss


def _schedule(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))


def _fabric(precision: str, kind: str, half: str) -> dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    mpx = FabricMixedPrecisionPlugin(precision, half_dtype=half) if precision.startswith("O") else None
    fabric = (Fabric(accelerator="cpu", devices=1, plugins=[mpx]) if mpx is not None
              else Fabric(accelerator="cpu", devices=1, precision=precision))  # fmt: skip
    module = _peft_model(kind)
    optimizer = torch.optim.AdamW(_trainable(module).values(), lr=1e-3)
    schedule = _schedule(optimizer)
    model, optimizer = fabric.setup(module, optimizer)
    scales = []
    for index, batch in enumerate(_batches(STEPS * ACCUMULATION)):
        last = (index + 1) % ACCUMULATION == 0
        with fabric.no_backward_sync(model, enabled=not last):
            fabric.backward(_loss(model, batch, index, half == "float16") / ACCUMULATION)
        if last:
            fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
            optimizer.step()
            if mpx is None or not mpx.step_was_skipped(optimizer):
                schedule.step()
            optimizer.zero_grad()
            scales.append(float(mpx.metrics()["mpx/loss_scale"]) if mpx is not None else 1.0)
    amp = mpx.amp if mpx is not None else None
    return {"model": module, "amp": amp, "scales": scales, "lr": optimizer.param_groups[0]["lr"]}


def _trainer(precision: str, kind: str, half: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.peft = _peft_model(kind)
            self.scales: list[float] = []

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            return _loss(self.peft, batch, index, half == "float16")

        def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
            if (index + 1) % ACCUMULATION == 0:  # the step's scale, as "16-mixed" code reads it
                scaler = self.trainer.scaler
                self.scales.append(scaler.get_scale() if scaler is not None else 1.0)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(_trainable(self).values(), lr=1e-3)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": _schedule(optimizer), "interval": "step"}}

    plugin = MixedPrecisionPlugin(precision, half_dtype=half)
    module = Module()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, plugins=[plugin], accumulate_grad_batches=ACCUMULATION,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(_batches(STEPS * ACCUMULATION), batch_size=None))
    return {"model": module.peft, "amp": plugin.amp, "scales": module.scales,
            "lr": trainer.optimizers[0].param_groups[0]["lr"]}  # fmt: skip


def _accelerate(precision: str, kind: str, half: str) -> dict[str, Any]:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(mixed_precision=precision, cpu=True, gradient_accumulation_steps=ACCUMULATION,
                              kwargs_handlers=[MixedPrecisionKwargs(half_dtype=half)])  # fmt: skip
    module = _peft_model(kind)
    optimizer = torch.optim.AdamW(_trainable(module).values(), lr=1e-3)
    model, optimizer, schedule = accelerator.prepare(module, optimizer, _schedule(optimizer))
    scales = []
    for index, batch in enumerate(_batches(STEPS * ACCUMULATION)):
        with accelerator.accumulate(model):
            accelerator.backward(_loss(model, batch, index, half == "float16"))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            scales.append(float(accelerator.amp.metrics()["mpx/loss_scale"]))
    return {"model": accelerator.unwrap_model(model), "amp": accelerator.amp, "scales": scales,
            "lr": optimizer.param_groups[0]["lr"]}  # fmt: skip


def _reference(kind: str) -> dict[str, torch.Tensor]:
    """torch's autocast float16 + GradScaler loop, the schedule held on the skipped step: the adapters after it."""
    model = _peft_model(kind)
    optimizer = torch.optim.AdamW(_trainable(model).values(), lr=1e-3)
    schedule, scaler = _schedule(optimizer), torch.amp.GradScaler("cpu")
    for index, batch in enumerate(_batches(STEPS * ACCUMULATION)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model, batch, index, True)
        scaler.scale(loss / ACCUMULATION).backward()
        if (index + 1) % ACCUMULATION == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(_trainable(model).values(), 1.0)
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() >= scale:
                schedule.step()
            optimizer.zero_grad()
    return {n: p.detach().float().clone() for n, p in _trainable(model).items()}


FRONTS = {"fabric": _fabric, "trainer": _trainer, "accelerate": _accelerate}


def _run(front: str, precision: str, kind: str, half: str = "bfloat16") -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FRONTS[front](precision, kind, half)


def _merged(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.merge_and_unload().state_dict().items()}


@pytest.fixture(scope="module")
def fp32_merged() -> dict[str, dict[str, torch.Tensor]]:
    return {kind: _merged(_run("fabric", "32-true", kind)["model"]) for kind in ("llama", "gpt2")}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("front", list(FRONTS))
def test_o2_lora_masters_for_adapters_saved_and_merged(front, kind, fp32_merged, tmp_path: Path):
    """O2 bfloat16: the adapters alone train and hold FP32 masters (under a tenth of the model), the base stays half;
    ``save_pretrained`` writes the masters exactly (FP32, off bfloat16's grid); ``merge_and_unload`` is within a few
    bfloat16 roundings of the ``"32-true"`` run's merge."""
    run = _run(front, "O2", kind)
    model, amp = run["model"], run["amp"]
    trainable = _trainable(model)
    assert trainable and all("lora_" in n for n in trainable)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    held = sum(v.numel() for weights in amp.master_weights for v in weights.fp32_values().values())
    assert held == sum(p.numel() for p in trainable.values()) < sum(p.numel() for p in model.parameters()) / 10
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert len(saved) == len(trainable)
    for name, param in trainable.items():
        value = saved[name.replace(".default", "")]
        assert value.dtype == torch.float32 and torch.equal(value, amp.master_of(param)), name
    assert any(not torch.equal(v, v.bfloat16().float()) for v in saved.values())  # not the half rounding
    merged, reference = _merged(model), fp32_merged[kind]
    assert set(merged) == set(reference)
    for name, value in reference.items():
        rounding = (value - value.bfloat16().float()).abs().max().item()
        assert (merged[name] - value).abs().max().item() <= 4 * rounding + 1e-3, name


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("front", list(FRONTS))
def test_float16_lora_overflow_in_an_accumulated_step(front, level):
    """float16 on the LLaMA: the overflow in micro-batch 3 skips step 1, the scale halves there and nowhere else,
    the schedule holds (three steps taken of four), the adapters are GradScaler's loop's within float16's
    tolerance."""
    run = _run(front, level, "llama", half="float16")
    assert run["scales"] == [2.0**16, 2.0**15, 2.0**15, 2.0**15]
    assert run["lr"] == pytest.approx(1e-3 / 4)  # LambdaLR 1/(s+1) after three steps
    assert float(run["amp"].metrics()["mpx/skipped_steps"]) == 1
    reference = _reference("llama")
    adapters = run["amp"].fp32_state_dict(run["model"]) if level == "O2" else run["model"].state_dict()
    for name, value in reference.items():
        torch.testing.assert_close(adapters[name].float(), value, rtol=0, atol=5e-4, msg=name)
