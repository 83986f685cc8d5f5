"""The demo job: a small character-level transformer trained with Lightning and :class:`MixedPrecisionPlugin`.

The text is the Python standard library's own source, so nothing is downloaded. The pieces are reusable (the
convergence benchmark trains the same model): :func:`load_corpus`, :class:`CharTransformer`, :func:`train`.

The half dtype defaults to ``"auto"`` (:func:`choose_half_dtype`): float16 on a GPU, the classic loss-scaling case;
bfloat16 with a dynamic loss scale on a CPU, where float16 matmuls are often emulated (many x86 CPUs have bfloat16
instructions but none for float16 arithmetic, and there oneDNN's float16 matmul is tens of times slower).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx.common.imports import require

_pl = require("lightning.pytorch", extra="lightning", feature="the lightning-mpx demo")

from lightning.pytorch import Callback, LightningModule  # noqa: E402


def load_corpus(max_bytes: int = 2_000_000) -> bytes:
    """Up to ``max_bytes`` of the standard library's ``.py`` files, in a fixed (sorted) order.

    The same Python version gives the same text, so runs are comparable.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes]
    if len(text) < 10_000:
        raise RuntimeError(f"found only {len(text)} bytes of Python source under {stdlib}; the demo needs more.")
    return text


class CharWindows(torch.utils.data.Dataset):
    """Windows of ``seq_len + 1`` bytes (inputs and next-byte targets), ``stride`` apart."""

    def __init__(self, data: torch.Tensor, seq_len: int, stride: int | None = None) -> None:
        self.data = data
        self.seq_len = seq_len
        self.stride = stride or seq_len
        self.count = max(0, (len(data) - seq_len - 1) // self.stride + 1)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.stride
        window = self.data[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # Written out (not fused attention) so the cast table's matmul/softmax split is what runs.
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class CharTransformer(LightningModule):
    """A GPT-style byte-level language model.

    Args:
        dim, layers, heads, seq_len: Model size.
        lr, warmup: AdamW learning rate with linear warm-up then cosine decay over ``total_steps``.
        total_steps: Length of the schedule.
    """

    def __init__(
        self,
        dim: int = 128,
        layers: int = 2,
        heads: int = 4,
        seq_len: int = 64,
        lr: float = 3e-3,
        warmup: int = 20,
        total_steps: int = 300,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(256, dim)
        self.position = nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self) -> Any:
        hparams: Any = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hparams.lr, weight_decay=0.01)
        warmup, total = hparams.warmup, max(hparams.total_steps, hparams.warmup + 1)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


#: ``DemoConfig.half_dtype`` choices.
HALF_DTYPES = ("auto", "float16", "bfloat16")


@dataclass
class DemoConfig:
    """Settings of one demo run (the CLI's flags).

    ``half_dtype="auto"`` (the default) lets :func:`choose_half_dtype` pick float16 or bfloat16 for the device.
    """

    opt_level: str = "O1"
    half_dtype: str = "auto"
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 64
    dim: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    seed: int = 0
    val_every: int = 100
    val_batches: int = 4
    corpus_bytes: int = 2_000_000
    run_dir: str | None = None
    accelerator: str = "auto"
    progress_bar: bool = True
    log_every_n_steps: int = 10
    # A short growth interval, so that the scaler's probing (doubling, then halving at an overflow) shows in a short
    # run; production runs keep the default of 2000.
    growth_interval: int = 50
    plugin_kwargs: dict[str, Any] = field(default_factory=dict)
    #: Why this half dtype runs (set by :func:`resolve_half_dtype`; shown under the summary).
    half_dtype_reason: str = ""
    #: CPU threads for the run (``torch.set_num_threads``, restored afterwards); ``None`` leaves torch's setting.
    threads: int | None = None


@dataclass
class DemoResult:
    """What the closing summary shows."""

    run_dir: str
    opt_level: str
    half_dtype: str
    dtype_reason: str
    loss_scale_mode: str
    device: str
    threads: int
    steps: int
    train_loss: float
    val_loss: float
    skipped_steps: int
    loss_scale: float
    tokens_per_second: float
    seconds: float
    val_curve: list[tuple[int, float]] = field(default_factory=list)


class _ValCurve(Callback):
    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking and "val/loss" in trainer.callback_metrics:
            self.points.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))


def device_type(accelerator: str) -> str:
    """The device type Lightning's ``accelerator`` setting resolves to (for a single device)."""
    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if accelerator in ("auto", "gpu", "mps") and mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def choose_half_dtype(device_type: str) -> tuple[str, str]:
    """The half dtype ``half_dtype="auto"`` runs on ``device_type``, and why (for the summary).

    float16 on a GPU, where its kernels are native and it is the classic loss-scaling case. bfloat16 on a CPU: many
    x86 CPUs have bfloat16 instructions (AVX512-BF16, AMX) but none for float16 arithmetic, and there oneDNN emulates
    float16 matmuls tens of times slower (the demo took 8x longer in float16 on such a machine). A fixed rule rather
    than a timing probe: the same machine always runs the same demo, and a probe read on a loaded machine misleads.
    """
    if device_type != "cpu":
        return "float16", f"{device_type} runs float16 natively"
    return "bfloat16", (
        "on a CPU, where float16 matmuls are often emulated (tens of times slower than bfloat16 without "
        "AVX512-FP16/AMX-FP16)"
    )


def resolve_half_dtype(config: DemoConfig) -> DemoConfig:
    """``config`` with ``half_dtype="auto"`` replaced by :func:`choose_half_dtype`'s choice and ``half_dtype_reason``
    saying why (a config with a named dtype comes back unchanged but for the reason).

    When the choice is bfloat16 at an opt level whose float16 preset scales the loss dynamically (O1, O2), the run
    keeps a dynamic loss scale (``loss_scale="dynamic"``; bfloat16's own default is a static 1.0), so that the
    scale's staircase shows as it would in float16, unless ``plugin_kwargs`` names a loss scale.

    Raises:
        ValueError: for a ``half_dtype`` that is not one of :data:`HALF_DTYPES`.
    """
    from lightning_mpx.opt_levels import resolve_properties

    if config.half_dtype not in HALF_DTYPES:
        raise ValueError(f"half_dtype={config.half_dtype!r} is not valid; valid choices: {', '.join(HALF_DTYPES)}.")
    if config.half_dtype != "auto":
        return dataclasses.replace(config, half_dtype_reason=config.half_dtype_reason or "chosen by --half-dtype")
    half_dtype, why = choose_half_dtype(device_type(config.accelerator))
    plugin_kwargs = dict(config.plugin_kwargs)
    reason = f"{half_dtype} (auto): {why}"
    if (
        half_dtype == "bfloat16"
        and "loss_scale" not in plugin_kwargs
        and resolve_properties(config.opt_level, half_dtype="float16").dynamic_loss_scale
    ):
        plugin_kwargs["loss_scale"] = "dynamic"
        reason += '; with loss_scale="dynamic", as float16 would scale'
    if half_dtype == "bfloat16":
        reason += "; --half-dtype float16 runs float16 anyway"
    return dataclasses.replace(config, half_dtype=half_dtype, plugin_kwargs=plugin_kwargs, half_dtype_reason=reason)


@contextlib.contextmanager
def _cpu_threads(threads: int | None) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside the block, torch's previous setting after it (``None``: as it is)."""
    if threads is None:
        yield
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r} must be a positive integer or None.")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train(config: DemoConfig) -> DemoResult:
    """Train :class:`CharTransformer` with ``MixedPrecisionPlugin(config.opt_level)``; logs to TensorBoard under
    ``config.run_dir`` and returns the summary. ``half_dtype="auto"`` is resolved first (:func:`resolve_half_dtype`).
    """
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_mpx.integrations.lightning import MixedPrecisionPlugin

    config = resolve_half_dtype(config)
    half_dtype, reason = config.half_dtype, config.half_dtype_reason
    plugin_kwargs = {"growth_interval": config.growth_interval, **config.plugin_kwargs}
    _pl.seed_everything(config.seed, verbose=False)
    text = torch.frombuffer(bytearray(load_corpus(config.corpus_bytes)), dtype=torch.uint8)
    split = int(len(text) * 0.9)
    train_set = CharWindows(text[:split], config.seq_len, stride=config.seq_len // 2)
    val_set = CharWindows(text[split:], config.seq_len)
    generator = torch.Generator().manual_seed(config.seed)
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=config.batch_size, shuffle=True, generator=generator, drop_last=True
    )
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=config.batch_size)

    run_dir = Path(config.run_dir or f"runs/demo-{config.opt_level}-{half_dtype}-{time.strftime('%Y%m%d-%H%M%S')}")
    plugin = MixedPrecisionPlugin(config.opt_level, half_dtype=half_dtype, **plugin_kwargs)
    curve = _ValCurve()
    trainer = _pl.Trainer(
        accelerator=config.accelerator,
        devices=1,
        plugins=[plugin],
        max_steps=config.steps,
        # The epochs those steps take: without it Lightning's max_epochs is -1 (no limit) and its progress bar
        # reads "Epoch 0/-2".
        max_epochs=math.ceil(config.steps / max(1, len(train_loader))),
        val_check_interval=min(config.val_every, len(train_loader)),
        check_val_every_n_epoch=None,
        limit_val_batches=config.val_batches,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(str(run_dir.parent), name=run_dir.name, version=""),
        log_every_n_steps=min(config.log_every_n_steps, max(1, config.steps // 5)),  # short runs get curves too
        enable_checkpointing=False,
        enable_progress_bar=config.progress_bar,
        enable_model_summary=False,
        callbacks=[curve],
    )
    model = CharTransformer(
        dim=config.dim,
        layers=config.layers,
        heads=config.heads,
        seq_len=config.seq_len,
        lr=config.lr,
        total_steps=config.steps,
    )
    with _cpu_threads(config.threads):
        start = time.perf_counter()
        trainer.fit(model, train_loader, val_loader)
        seconds = time.perf_counter() - start
        # Read before the closing validation: ``validate`` starts a new stage and clears the training metrics.
        train_loss = float(trainer.callback_metrics.get("train/loss", float("nan")))
        if not curve.points or curve.points[-1][0] != trainer.global_step:
            trainer.validate(model, val_loader, verbose=False)
            curve.points.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))
    metrics = plugin.metrics()
    properties = plugin.amp.properties
    return DemoResult(
        run_dir=str(run_dir),
        opt_level=config.opt_level,
        half_dtype=half_dtype,
        dtype_reason=reason,
        loss_scale_mode="dynamic" if properties.dynamic_loss_scale else f"static {float(properties.loss_scale):g}",  # type: ignore[arg-type]
        device=str(trainer.strategy.root_device),
        threads=torch.get_num_threads() if config.threads is None else config.threads,
        steps=trainer.global_step,
        train_loss=train_loss,
        val_loss=curve.points[-1][1],
        skipped_steps=int(metrics.get("mpx/skipped_steps", 0)),
        loss_scale=metrics.get("mpx/loss_scale", float("nan")),
        tokens_per_second=trainer.global_step * config.batch_size * config.seq_len / seconds,
        seconds=seconds,
        val_curve=curve.points,
    )


def _scale_text(scale: float) -> str:
    """``4194304 (2^22)`` for a power of two (what a dynamic scale always is), else ``%g``."""
    if scale >= 1 and math.isfinite(scale) and math.log2(scale).is_integer():
        return f"{int(scale)} (2^{int(math.log2(scale))})"
    return f"{scale:g}"


def format_summary(result: DemoResult) -> str:
    """The closing table of ``lightning-mpx demo``, and a line that says why this half dtype ran."""
    rows = [
        ("opt level", f"{result.opt_level} ({result.half_dtype}, {result.loss_scale_mode} loss scale)"),
        ("device", result.device + (f", {result.threads} thread(s)" if result.device == "cpu" else "")),
        ("steps", f"{result.steps}"),
        ("final train loss", f"{result.train_loss:.4f}"),
        ("final val loss", f"{result.val_loss:.4f}"),
        ("skipped steps", f"{result.skipped_steps}"),
        ("final loss scale", _scale_text(result.loss_scale)),
        ("tokens / second", f"{result.tokens_per_second:,.0f}"),
        ("wall time", f"{result.seconds:.1f} s"),
        ("TensorBoard logs", result.run_dir),
    ]
    width = max(len(k) for k, _ in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * (max(len(v) for _, v in rows) + 2) + "+"
    body = [f"| {k:<{width}} | {v:<{len(line) - width - 7}} |" for k, v in rows]
    return "\n".join([line, *body, line, f"half dtype: {result.dtype_reason}"])



