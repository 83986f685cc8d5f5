"""Tiny Hugging Face models built from configs (nothing is downloaded) on scikit-learn's digits, trained through the
Lightning plugin and the Accelerate adapter, for the "real models" acceptance tests (tests/test_real_models.py).

The data is ``sklearn.datasets.load_digits``: 1797 real 8x8 images of handwritten digits, pixel values 0..16, which
ships with scikit-learn. One fixed split (1297 images to train on, 500 held out), the same for every model and run
(GPT-2 is evaluated on the first 250 held-out images: see ``SPECS``).

- ``gpt2``: ``GPT2LMHeadModel`` (tied ``wte``/``lm_head``, activation checkpointing on, transformers' default
  ``use_reentrant``) models the 65-token sequence ``[digit token] + the 64 pixel values``: next-token cross-entropy.
- ``bert``: ``BertForSequenceClassification`` (one layer) classifies ``[CLS] + 8 pixel tokens`` into the digit; the
  tokens are the image average-pooled over patches of 2 rows x 4 columns (values 0..16 again). Half-precision matrix
  products run ~25x slower than FP32 ones on CPUs without AVX512: 9 tokens and one layer keep it inside the time
  budget (17 tokens and two layers learned no faster, at twice the cost).
- ``resnet``: ``ResNetForImageClassification`` (batch norm) classifies the 1x8x8 image (pixels / 16); the stem's
  max pool is dropped (as in CIFAR ResNets), which would otherwise leave 2x2 maps after the strided stem.

Every run of a model with a given seed starts from the same weights and sees the same batches in the same order,
whatever the framework or precision: the training set is pre-shuffled per epoch into one fixed sequence of batches
(``shuffle=False`` loaders), models are built right after ``torch.manual_seed(seed)`` and have no dropout. Losses are
computed in FP32 from ``.logits`` (``F.cross_entropy(out.logits.float(), y)``) unless the model is asked to compute
its own (``labels=``). AdamW; the learning rate warms up over the first 10% of the steps, then decays linearly to
zero, so that the final weights do not hang on the noise of the last few steps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

N_TRAIN = 1297  # the other 500 images are held out
PIXEL_VALUES = 17  # pixel tokens 0..16
DIGIT_TOKEN = PIXEL_VALUES  # GPT-2: tokens 17..26 are the digit, the sequence's first token
CLS_TOKEN = PIXEL_VALUES  # BERT's [CLS]
VOCAB = 32


@functools.lru_cache(maxsize=None)
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(train_pixels, train_labels, held_out_pixels, held_out_labels)``; pixels are int64 ``(n, 64)`` in 0..16."""
    from sklearn.datasets import load_digits

    data = load_digits()
    pixels = torch.as_tensor(data.data, dtype=torch.int64)
    labels = torch.as_tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, held = order[:N_TRAIN], order[N_TRAIN:]
    return pixels[train], labels[train], pixels[held], labels[held]


def train_loader(seed: int, steps: int, batch_size: int) -> torch.utils.data.DataLoader:
    """``steps`` batches of the training set, reshuffled each epoch by ``seed``, as one unshuffled loader."""
    pixels, labels, _, _ = digits()
    g = torch.Generator().manual_seed(1000 + seed)
    needed = steps * batch_size
    epochs = -(-needed // len(labels))
    order = torch.cat([torch.randperm(len(labels), generator=g) for _ in range(epochs)])[:needed]
    dataset = torch.utils.data.TensorDataset(pixels[order], labels[order])
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)


def held_out_loader(batch_size: int = 250, images: int | None = None) -> torch.utils.data.DataLoader:
    """The held-out images (the first ``images`` of them if given), in a fixed order."""
    _, _, pixels, labels = digits()
    dataset = torch.utils.data.TensorDataset(pixels[:images], labels[:images])
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)


# -- the models -------------------------------------------------------------------------------------------------
GPT2_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, n_positions=80, n_embd=32, n_layer=2, n_head=2, n_inner=64,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=None, eos_token_id=None,
)  # fmt: skip
BERT_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
    max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=10,
    pad_token_id=VOCAB - 1, hidden_act="relu", initializer_range=0.2,
)  # fmt: skip
RESNET_CONFIG: dict[str, Any] = dict(
    num_channels=1, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10
)


def build_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(**GPT2_CONFIG))
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x's name; the old one warns there
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()
    return model


def build_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(**BERT_CONFIG))


def build_resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    model = ResNetForImageClassification(ResNetConfig(**RESNET_CONFIG))
    model.resnet.embedder.pooler = nn.Identity()
    return model


def gpt2_forward(model: nn.Module, pixels: torch.Tensor, labels: torch.Tensor, model_loss: bool = False) -> Any:
    ids = torch.cat([(labels + DIGIT_TOKEN)[:, None], pixels], dim=1)
    return model(input_ids=ids, labels=ids) if model_loss else model(input_ids=ids)


def gpt2_loss(out: Any, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    ids = torch.cat([(labels + DIGIT_TOKEN)[:, None], pixels], dim=1)
    logits = out.logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def bert_forward(model: nn.Module, pixels: torch.Tensor, labels: torch.Tensor, model_loss: bool = False) -> Any:
    pooled = pixels.view(-1, 4, 2, 2, 4).sum((2, 4)).div(8, rounding_mode="floor").reshape(-1, 8)  # 0..16
    ids = torch.cat([torch.full_like(pooled[:, :1], CLS_TOKEN), pooled], dim=1)
    return model(input_ids=ids, labels=labels) if model_loss else model(input_ids=ids)


def resnet_forward(model: nn.Module, pixels: torch.Tensor, labels: torch.Tensor, model_loss: bool = False) -> Any:
    images = (pixels.float() / 16.0).view(-1, 1, 8, 8)
    return model(pixel_values=images, labels=labels) if model_loss else model(pixel_values=images)


def classification_loss(out: Any, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.float(), labels)


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    build: Callable[[], nn.Module]
    forward: Callable[..., Any]  # (model, pixels, labels, model_loss=False) -> the model's ModelOutput
    loss: Callable[..., torch.Tensor]  # (output, pixels, labels) -> the FP32 loss computed from output.logits
    steps: int
    batch_size: int
    lr: float
    held_out: int | None = None  # the held-out images evaluated (the first ones): all 500 if None


#: Steps per run and batch sizes: as little half-precision compute as keeps O0's held-out loss well under 0.7 of the
#: untrained model's (measured: GPT-2 0.59, BERT 0.59, ResNet 0.58 of it) with every case's gap to O0 under 0.8%.
#: A step's cost here is mostly per operation, not per sample (BERT at O2 in bfloat16: 29 ms a step at a batch of 32
#: or 64, against 11 ms in FP32), so BERT takes fewer, larger batches at a higher rate; GPT-2, whose cost is per token,
#: evaluates on 250 of the held-out images (its 64 predicted tokens each; its evaluation was a third of a run). The
#: suite's slowest file: 20 steps of 8 / 75 of 64 / 40 of 16 before (82 s of CPU, every gap under 0.6%); 40 steps of
#: 16 / 75 of 64 with two layers and 17 tokens / 40 of 32 before that (2.5 minutes, every gap under 0.7%).
SPECS = {
    "gpt2": Spec("gpt2", build_gpt2, gpt2_forward, gpt2_loss, steps=16, batch_size=8, lr=1e-2, held_out=250),
    "bert": Spec("bert", build_bert, bert_forward, classification_loss, steps=45, batch_size=96, lr=7e-3),
    "resnet": Spec("resnet", build_resnet, resnet_forward, classification_loss, steps=40, batch_size=16, lr=3e-3),
}


def make_optimizer(params: Any, spec: Spec) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.01)
    warmup = max(1, spec.steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (spec.steps - step) / (spec.steps - warmup))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


@dataclasses.dataclass
class Result:
    eval_loss: float
    skipped_steps: int
    train_losses: list[float]
    checks: dict[str, Any]


class _Trainee:
    """What both frameworks' loops do with a batch: forward, the loss, and records of the first step."""

    def __init__(self, spec: Spec, model_loss: bool) -> None:
        self.spec, self.model_loss = spec, model_loss
        self.train_losses: list[float] = []
        self.checks: dict[str, Any] = {}
        self.eval_total, self.eval_count = 0.0, 0

    def train_loss(self, model: nn.Module, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self.spec.forward(model, pixels, labels, self.model_loss)
        loss = out.loss if self.model_loss else self.spec.loss(out, pixels, labels)
        if not self.train_losses:
            with torch.no_grad():
                self.checks["output_type"] = type(out)
                self.checks["logits_dtype"] = out.logits.dtype
                self.checks["loss_dtype"] = loss.dtype
                self.checks["first_loss"] = loss.item()
                # The same loss computed in FP32 from the logits the model returned.
                self.checks["first_loss_fp32"] = self.spec.loss(out, pixels, labels).item()
                self.checks["training"] = model.training
                self.checks["checkpointing"] = getattr(_unwrap(model), "is_gradient_checkpointing", None)
        self.train_losses.append(loss.item())
        return loss

    @torch.no_grad()
    def eval_batch(self, model: nn.Module, pixels: torch.Tensor, labels: torch.Tensor) -> None:
        out = self.spec.forward(model, pixels, labels)
        self.eval_total += self.spec.loss(out, pixels, labels).item() * len(labels)
        self.eval_count += len(labels)

    def result(self, model: nn.Module, amp: Any) -> Result:
        checks = dict(self.checks)
        checks.update(_structure_checks(_unwrap(model), amp))
        return Result(self.eval_total / self.eval_count, amp.skipped_steps[0] if amp else 0, self.train_losses, checks)


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def run_lightning(spec: Spec, level: str, half_dtype: str, seed: int, *, model_loss: bool = False) -> Result:
    """Train through a Lightning ``Trainer`` with ``MixedPrecisionPlugin(level, half_dtype=...)``, then evaluate with
    ``trainer.validate`` (same plugin). ``level="32-true"`` trains with Lightning's own FP32 precision instead."""
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    trainee = _Trainee(spec, model_loss)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.model = spec.build()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return trainee.train_loss(self.model, *batch)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            trainee.eval_batch(self.model, *batch)

        def configure_optimizers(self) -> Any:
            opt, sched = make_optimizer(self.parameters(), spec)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    if level == "32-true":
        plugin, trainer = None, make_trainer(precision="32-true")
    else:
        plugin = MixedPrecisionPlugin(level, half_dtype=half_dtype)
        trainer = make_trainer(plugin)
    module = Module()
    trainer.fit(module, train_loader(seed, spec.steps, spec.batch_size))
    assert len(trainee.train_losses) == spec.steps
    trainer.validate(module, held_out_loader(images=spec.held_out), verbose=False)
    return trainee.result(module.model, plugin.amp if plugin is not None else None)


def run_accelerate(spec: Spec, level: str, half_dtype: str, seed: int, *, model_loss: bool = False) -> Result:
    """Train through ``lightning_mpx.integrations.accelerate.Accelerator(mixed_precision=level)`` with a plain loop,
    then evaluate the prepared model (its forward still the opt level's) in eval mode."""
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import accelerate_state_reset

    with accelerate_state_reset():
        accelerator = Accelerator(
            mixed_precision=level, cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype=half_dtype)]
        )
        trainee = _Trainee(spec, model_loss)
        torch.manual_seed(seed)
        model = spec.build()
        opt, sched = make_optimizer(model.parameters(), spec)
        loader = train_loader(seed, spec.steps, spec.batch_size)
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
        model.train()
        for pixels, labels in loader:
            loss = trainee.train_loss(model, pixels, labels)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        assert len(trainee.train_losses) == spec.steps
        model.eval()
        for pixels, labels in held_out_loader(images=spec.held_out):
            trainee.eval_batch(model, pixels, labels)
        return trainee.result(accelerator.unwrap_model(model), accelerator.amp)


RUNNERS = {"lightning": run_lightning, "accelerate": run_accelerate}


def untrained_eval_loss(spec: Spec, seed: int = 0) -> float:
    torch.manual_seed(seed)
    model = spec.build().eval()
    trainee = _Trainee(spec, model_loss=False)
    for pixels, labels in held_out_loader(images=spec.held_out):
        trainee.eval_batch(model, pixels, labels)
    return trainee.eval_total / trainee.eval_count


def _structure_checks(model: nn.Module, amp: Any) -> dict[str, Any]:
    """What the tests assert on the trained model: parameter dtypes, tied weights, one master per shared tensor."""
    checks: dict[str, Any] = {"param_dtypes": {name: p.dtype for name, p in model.named_parameters()}}
    if hasattr(model, "lm_head"):
        head, embedding = model.lm_head.weight, model.transformer.wte.weight
        checks["tied"] = head is embedding
        if amp is not None and amp.master_weights:
            checks["one_master"] = amp.master_of(head) is amp.master_of(embedding)
            pairs = [half for masters in amp.master_weights for half, _ in masters.half_pairs]
            checks["masters_of_embedding"] = sum(half is embedding for half in pairs)
            checks["masters"] = len(pairs)
            checks["half_params"] = len({id(p) for p in model.parameters() if p.dtype != torch.float32})
    return checks
