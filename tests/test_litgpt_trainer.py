"""litgpt models under the Lightning Trainer plugin, as a litgpt user who moved to a ``LightningModule`` trains them:
a LLaMA-shaped ``litgpt.GPT`` (RoPE, RMSNorm, SwiGLU, grouped queries) with ``max_seq_length`` set, gradient
accumulation, ``gradient_clip_val``, a per-step schedule, ``trainer.save_checkpoint``, then greedy ``generate`` with
the KV cache; and ``litgpt.lora.GPT`` with ``mark_only_lora_as_trainable`` and the optimizer over all its parameters
(litgpt's habit), in float16 with an overflow forced in one micro-batch. Against Lightning's own ``"bf16-mixed"`` /
``"16-mixed"`` (a CPU ``GradScaler``) and ``"32-true"``. Fabric's litgpt rows are in
``tests/test_fabric_litgpt_lora.py``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("litgpt")
pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from litgpt import lora  # noqa: E402
from litgpt.generate.base import generate  # noqa: E402
from litgpt.model import GPT, Config  # noqa: E402
from litgpt.utils import chunked_cross_entropy  # noqa: E402

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402

SEQ, OVERFLOW_AT = 24, 3  # max_seq_length; the micro-batch whose loss overflows float16 (the second of step 1)
LLAMA = dict(name="tiny-llama", block_size=32, vocab_size=128, padded_vocab_size=128, n_layer=1, n_head=4,
             n_query_groups=2, n_embd=32, rotary_percentage=1.0, parallel_residual=False, bias=False,
             norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64)  # fmt: skip
LORA = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_value=True, lora_projection=True,
            lora_mlp=True)  # fmt: skip


def _data(n: int) -> list[torch.Tensor]:
    """Arithmetic progressions modulo the vocabulary: learnable in a few steps."""
    g = torch.Generator().manual_seed(0)
    start, stride = torch.randint(0, 128, (n, 2, 1), generator=g), torch.randint(1, 4, (n, 2, 1), generator=g)
    return list((start + stride * torch.arange(SEQ + 1)) % 128)


class _Module(pl.LightningModule):
    def __init__(self, with_lora: bool = False, overflow: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        if with_lora:
            self.model: Any = lora.GPT(lora.Config(**LLAMA, **LORA))
            for name, param in self.model.named_parameters():
                if "lora_B" in name:  # litgpt starts B at zero: a non-zero B makes A's gradients count at once
                    torch.nn.init.normal_(param, std=0.02)
            lora.mark_only_lora_as_trainable(self.model)
        else:
            self.model = GPT(Config(**LLAMA))
        self.model.max_seq_length = SEQ
        self.overflow, self.losses = overflow, []

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        loss = chunked_cross_entropy(self.model(batch[:, :SEQ], lm_head_chunk_size=8), batch[:, 1:])
        self.losses.append(loss.item())
        return loss * 1e6 if self.overflow and index == OVERFLOW_AT else loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)  # litgpt's: frozen ones included
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _fit(precision: str, tmp: Path, *, half: str = "bfloat16", with_lora: bool = False) -> dict[str, Any]:
    plugin: Any = None
    if precision.startswith("O"):
        plugin = MixedPrecisionPlugin(precision, half_dtype=half)
    elif precision == "16-mixed":
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    module = _Module(with_lora, overflow=half == "float16")
    settings: dict[str, Any] = {"plugins": [plugin]} if plugin is not None else {"precision": precision}
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=0.5,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, **settings)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(_data(8), batch_size=None))
        path = tmp / f"{precision}-{half}-{with_lora}.ckpt"
        trainer.save_checkpoint(path)
    amp = plugin.amp if precision.startswith("O") else None
    weights = amp.fp32_state_dict(module) if amp is not None else {k: v.float() for k, v in module.state_dict().items()}
    model = module.model.eval()
    model.set_kv_cache(batch_size=1)
    tokens = generate(model, _data(1)[0][0, :5], max_returned_tokens=12, temperature=0.0)
    return {"losses": module.losses, "weights": weights, "checkpoint": torch.load(path, weights_only=False),
            "tokens": tokens.tolist(), "amp": amp, "module": module}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("litgpt_trainer")
    return {precision: _fit(precision, tmp) for precision in ("32-true", "bf16-mixed", "O1", "O2")}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_litgpt_llama_tracks_bf16_mixed(runs, level):
    """Losses per micro-batch within bfloat16's tolerance of ``"bf16-mixed"``; the weights as near ``"32-true"``'s as
    ``"bf16-mixed"``'s are; the checkpoint's ``state_dict`` is FP32 and holds them exactly (O2: the masters); greedy
    generation with the KV cache after ``fit`` gives ``"bf16-mixed"``'s tokens."""
    ours, theirs, fp32 = runs[level], runs["bf16-mixed"], runs["32-true"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=2e-3, atol=0)
    ours_off = max((ours["weights"][k] - v).abs().max().item() for k, v in fp32["weights"].items())
    theirs_off = max((theirs["weights"][k] - v).abs().max().item() for k, v in fp32["weights"].items())
    assert ours_off < 2 * theirs_off + 1e-3, (ours_off, theirs_off)
    saved = ours["checkpoint"]["state_dict"]
    assert {v.dtype for v in saved.values()} == {torch.float32} and set(saved) == set(ours["weights"])
    for name, value in ours["weights"].items():
        assert torch.equal(saved[name], value), name
    if level == "O2":
        assert all(p.dtype == torch.bfloat16 for p in ours["module"].parameters())  # the half model, as trained
    assert ours["tokens"] == theirs["tokens"]


def test_litgpt_lora_float16_overflow_masters_for_the_adapters_only(tmp_path):
    """litgpt's LoRA at O2 in float16, an overflow in the second micro-batch of step 1: masters for the LoRA matrices
    alone (the optimizer holds the frozen base too), the scale backed off once as under ``"16-mixed"``, the LoRA
    weights (the masters) within float16's tolerance of ``"16-mixed"``'s, and ``merge_lora_weights`` after training
    as near ``"32-true"``'s merge as ``"16-mixed"``'s is."""
    ours = _fit("O2", tmp_path, half="float16", with_lora=True)
    theirs = _fit("16-mixed", tmp_path, half="float16", with_lora=True)
    amp, model = ours["amp"], ours["module"].model
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    held = sum(v.numel() for weights in amp.master_weights for v in weights.fp32_values().values())
    assert held == sum(p.numel() for p in trainable.values()) < sum(p.numel() for p in model.parameters()) / 4
    assert float(amp.metrics()["mpx/loss_scale"]) == 2.0**15 == theirs["module"].trainer.scaler.get_scale()
    assert float(amp.metrics()["mpx/skipped_steps"]) == 1
    for name in trainable:
        key = f"model.{name}"
        torch.testing.assert_close(ours["weights"][key], theirs["weights"][key], rtol=0, atol=2e-3, msg=key)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-3, atol=0)
    lora.merge_lora_weights(model)
    lora.merge_lora_weights(theirs["module"].model)
    merged, reference = model.state_dict(), theirs["module"].model.state_dict()
    for name, value in reference.items():
        if "lora_" not in name:
            torch.testing.assert_close(merged[name].float(), value.float(), rtol=0, atol=4e-3, msg=name)
