"""At O2 a loss computed inside the half model's own forward (Hugging Face ``...ForSequenceClassification``,
``ResNetForImageClassification``) is computed in FP32, in the core, the Lightning plugin and the Accelerate adapter.

Before, it came back computed in half: a relative error of about 1e-3 (float16) to 5e-3 (bfloat16) against the FP32
loss of the same logits, even where a boundary cast then turned it into an FP32 tensor.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_mpx import Amp, CastPolicy, CastTable

transformers = pytest.importorskip("transformers")
HALVES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _bert() -> Any:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 3, (8,), generator=g)


def _assert_fp32_loss_of_the_logits(out: Any, labels: torch.Tensor) -> None:
    assert out.loss.dtype == torch.float32
    # The loss of the same (half) logits computed in FP32: equal up to FP32 rounding, not half rounding.
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits.float(), labels), rtol=1e-6, atol=0)


@pytest.mark.parametrize("half", HALVES)
def test_core_o2_loss_inside_the_model_is_fp32(half):
    amp = Amp("O2", half_dtype=half)
    model = amp.prepare_model(_bert())
    tokens, labels = _batch()
    with amp.forward_context():
        out = model(input_ids=tokens, labels=labels)
    assert out.logits.dtype == HALVES[half]  # the model itself stays half
    _assert_fp32_loss_of_the_logits(out, labels)
    amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    amp.backward(out.loss)
    assert all(p.grad is not None and p.grad.dtype == HALVES[half] for p in model.parameters() if p.requires_grad)


def test_core_o2_resnet_loss_is_fp32():
    torch.manual_seed(0)
    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3
    )
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(transformers.ResNetForImageClassification(config))
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 1])
    with amp.forward_context():
        out = model(pixel_values=amp.cast_inputs(images), labels=labels)
    _assert_fp32_loss_of_the_logits(out, labels)


def test_the_o2_table_holds_losses_only():
    table = CastTable.default_o2()
    assert {entry.category for entry in table} == {"float"}
    assert F.cross_entropy in table and torch.kl_div in table and F.binary_cross_entropy in table
    assert F.softmax not in table and F.layer_norm not in table and F.linear not in table
    # Softmax, norms and matmuls of the half model are left alone: no FP32 output meets a half weight.
    h = torch.randn(4, 8).bfloat16()
    with CastPolicy(table, "bfloat16").scope():
        assert F.softmax(h, -1).dtype == torch.bfloat16
        assert F.layer_norm(h, (8,)).dtype == torch.bfloat16
        assert F.mse_loss(h, h.flip(0)).dtype == torch.float32


def test_o0_has_no_forward_policy_and_o3_promotes_the_o2_losses():
    """O3 (and O2 without masters) promotes the loss functions O2 runs in FP32 (casting/loss_promotion.py)."""
    assert Amp("O0").policy is None
    o2 = {(entry.function, entry.category) for entry in Amp("O2").policy.table}
    for amp in (Amp("O3"), Amp("O2", master_weights=False)):
        assert {(entry.function, entry.category) for entry in amp.policy.table} == {(f, "promote") for f, _ in o2}
        assert amp.policy.engine_in_use == "mode"


pl = pytest.importorskip("lightning.pytorch")


class _LitBert(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _bert()
        self.checked = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        out = self.model(input_ids=tokens, labels=labels)
        _assert_fp32_loss_of_the_logits(out, labels)
        self.checked = True
        return out.loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_o2_loss_inside_the_model_is_fp32():
    from lightning_mpx import MixedPrecisionPlugin

    from .lightning_helpers import make_trainer

    module = _LitBert()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_batch()), batch_size=8)
    make_trainer(MixedPrecisionPlugin("O2", half_dtype="bfloat16"), max_steps=1).fit(module, data)
    assert module.checked


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_o2_loss_inside_the_model_is_fp32():
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])
    model = accelerator.prepare(_bert())
    tokens, labels = _batch()
    out = model(input_ids=tokens, labels=labels)
    # The adapter hands the logits back in FP32; the loss must be the FP32 loss of the half logits.
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels), rtol=1e-6, atol=0)
