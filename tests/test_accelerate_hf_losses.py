"""Hugging Face models driven as their users drive them, in ways the other real-model tests leave out, each against
the framework's own precision on the same seed: a regression head's float ``labels=`` (the loss computed inside the
model) through the Accelerate adapter and the Trainer plugin, and LLaMA's rotary embedding at long positions against
transformers' own bfloat16 model. Tiny configs, bfloat16, CPU.

At O2 the boundary casts round a ``labels=`` keyword to half for compute, and the model's FP32 loss takes the cast's
FP32 source (lightning_mpx/casting/targets.py). The O2/O3 conversion keeps the rotary ``inv_freq`` that transformers
keeps FP32 (masters/fp32_buffers.py).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402
from tests.accelerate_helpers import reset_accelerate_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")
transformers.logging.set_verbosity_error()
HALF = "bfloat16"


def _accelerator(level: str) -> Accelerator:
    reset_accelerate_state()
    handlers = [MixedPrecisionKwargs(half_dtype=HALF)] if level.startswith("O") else None
    return Accelerator(mixed_precision=level, cpu=True, kwargs_handlers=handlers)


def _regressor() -> Any:
    """LLaMA with one output (a regression head): ``labels=`` float targets, the model's own MSE loss."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                                      pad_token_id=0)  # fmt: skip
    return transformers.LlamaForSequenceClassification(config)


def _regression_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets in [300, 303): bfloat16's spacing there is 2, so a rounded target is off by up to 1."""
    g = torch.Generator().manual_seed(step)
    return torch.randint(1, 64, (8, 10), generator=g), 300 + 3 * torch.rand(8, generator=g)


def _regression_losses(level: str, steps: int = 2) -> list[tuple[float, float]]:
    """Per step: the model's own loss and the MSE of its returned logits against the FP32 targets."""
    accelerator = _accelerator(level)
    model = _regressor()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for step in range(steps):
        ids, targets = _regression_batch(step)
        out = model(input_ids=ids, labels=targets)
        assert targets.dtype == torch.float32  # the caller's tensor is not touched
        losses.append((out.loss.item(), F.mse_loss(out.logits.squeeze(-1).float(), targets).item()))
        accelerator.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def test_accelerate_o2_loss_from_the_returned_logits_follows_bf16s():
    """The workaround before the fix below (docs/accelerate.md): at O2 the MSE of the logits the model
    returns (FP32) against the caller's FP32 targets follows Accelerate's ``"bf16"`` run (to 3e-5 over two steps:
    the half model's own rounding), and the caller's targets are not touched."""
    ours, native = _regression_losses("O2"), _regression_losses("bf16")
    for (_, from_logits), (native_loss, _) in zip(ours, native):
        assert from_logits == pytest.approx(native_loss, rel=1e-4)


def test_accelerate_o2_computes_the_models_own_loss_on_the_fp32_labels():
    """At O2 the model's own MSE loss is the MSE of the logits it returned against the FP32 targets, as under
    Accelerate's ``"no"`` and ``"bf16"``. It was not (the boundary cast rounded ``labels=`` to bfloat16): at targets
    near 300 (bfloat16's spacing there is 2) the first loss was 90726.0 against 90776.9 with ``"bf16"`` (90776.8
    from the very logits O2 returned), the second 90460.7 against 90570.3. Now O2's loss policy takes the FP32
    source of the cast labels (lightning_mpx/casting/targets.py)."""
    for loss, from_logits in _regression_losses("O2"):
        assert loss == pytest.approx(from_logits, rel=1e-6)


def test_the_trainer_plugins_o2_loss_on_float_labels_is_bf16_mixeds():
    """A LightningModule around the regression model, its loss from ``labels=``: at O2 the first loss is
    Lightning's ``"bf16-mixed"``'s (90776.89, ``"32-true"`` 90776.87; O2 gave 90726.04 before the fix, the FP32 loss
    of the targets rounded to bfloat16; ``"bf16-true"``, which rounds the whole batch and computes the loss in bfloat16,
    90624.0)."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning_mpx import MixedPrecisionPlugin

    def first_loss(**precision: Any) -> float:
        losses: list[float] = []

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = _regressor()

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                loss = self.model(input_ids=batch[0], labels=batch[1]).loss
                losses.append(loss.item())
                return loss

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.0)

        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_regression_batch(0)), batch_size=8)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, enable_progress_bar=False, logger=False,
                             enable_checkpointing=False, enable_model_summary=False, **precision)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Module(), loader)
        return losses[0]

    ours = first_loss(plugins=[MixedPrecisionPlugin("O2", half_dtype=HALF)])
    assert ours == pytest.approx(first_loss(precision="bf16-mixed"), rel=1e-4)


# -- rotary embeddings: transformers keeps the inverse frequencies FP32 in a bfloat16 model ------------------------
def _llama_config() -> Any:
    return transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=48, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=2,
                                    max_position_embeddings=4096)  # fmt: skip


def _rotary_cos(model: Any, dtype: torch.dtype) -> torch.Tensor:
    positions = torch.arange(4096)[None]
    cos, _ = model.model.rotary_emb(torch.zeros(1, 4096, 128, dtype=dtype), positions)
    return cos.float()


def test_hugging_faces_own_bfloat16_llama_keeps_rope_within_bfloat16s_rounding():
    """The reference of the expected failure below: a LLaMA that transformers builds in bfloat16
    (``_from_config(config, dtype=torch.bfloat16)``, as ``from_pretrained(..., dtype=torch.bfloat16)`` builds it)
    keeps its rotary ``inv_freq`` FP32, and its cos table is FP32's to bfloat16's rounding at every position."""
    fp32 = _rotary_cos(transformers.LlamaForCausalLM(_llama_config()), torch.float32)
    native = transformers.LlamaForCausalLM._from_config(_llama_config(), dtype=torch.bfloat16)
    assert native.model.rotary_emb.inv_freq.dtype == torch.float32
    assert (_rotary_cos(native, torch.bfloat16) - fp32).abs().max().item() <= 2**-8


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_o2_keeps_hugging_faces_rotary_frequencies_as_its_bfloat16_model_does(level):
    """A LLaMA prepared at O2/O3 by the Accelerate adapter (the conversion is every front door's): its rotary cos
    table is within bfloat16's rounding of FP32's at every position up to 4096, as transformers' own bfloat16
    model's."""
    torch.manual_seed(0)
    fp32 = _rotary_cos(transformers.LlamaForCausalLM(_llama_config()), torch.float32)
    accelerator = _accelerator(level)
    model = accelerator.unwrap_model(accelerator.prepare(transformers.LlamaForCausalLM(_llama_config())))
    assert (_rotary_cos(model, torch.bfloat16) - fp32).abs().max().item() <= 2**-8
