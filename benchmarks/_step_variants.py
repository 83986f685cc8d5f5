"""step.py's variants: their names, the two models and their batches, and how each variant trains and is timed.

A variant is a Lightning Trainer row (:data:`LIGHTNING_VARIANTS`), a Lightning Fabric loop (:data:`FABRIC_VARIANTS`)
or a hand-written loop (:data:`LOOP_VARIANTS`); ``benchmarks/step.py`` measures them (a child process per run, or
rounds in one process) and the other scripts build on the same pieces. ``step.py`` re-exports every name here.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable

LIGHTNING_VARIANTS = (
    "fp32",
    "mpx-O1-fp16",
    "mpx-O1-bf16",
    "mpx-O2-fp16",
    "mpx-O2-bf16",
    "mpx-O3-fp16",
    "mpx-O3-bf16",
    "lightning-16-mixed",
    "lightning-bf16-mixed",
    # torch.compile'd network (inductor) under the same Trainer: O1 compiled against Lightning's AMP compiled.
    "mpx-O1-fp16-compiled",
    "lightning-16-mixed-compiled",
    # O1 with CastTable.autocast_aligned(device): no difference from torch.autocast, no Python mode (issue 25).
    "mpx-O1-fp16-aligned",
    "mpx-O1-bf16-aligned",
    # gradient_clip_val=1.0: the clip (unscale, norm and clip in the plugin's fused pass on CUDA) against Lightning's
    # "16-mixed" clip (GradScaler.unscale_ and torch's clip_grad_norm_)
    "lightning-16-mixed-clip",
    "mpx-O1-fp16-clip",
    "mpx-O2-fp16-clip",
    # AdamW(fused=True): Lightning's own AMP (GradScaler skips an overflowed step on the device at "16-mixed",
    # "bf16-mixed" checks nothing) against the plugin with skip_on_device=True (the flag handed to the fused step)
    "lightning-16-mixed-fused",
    "lightning-bf16-mixed-fused",
    "mpx-O1-fp16-fused",
    "mpx-O1-bf16-fused",
    "mpx-O2-fp16-fused",
)
#: Lightning Fabric loops: the Fabric plugin at O2 against Fabric's own float16 AMP.
FABRIC_VARIANTS = ("fabric-mpx-O2-fp16", "fabric-16-mixed")
LOOP_VARIANTS = (
    "loop-fp32",
    "torch-autocast-fp16",
    "torch-autocast-bf16",
    "core-O1-fp16",
    "core-O1-bf16",
    "core-O2-fp16",
    "core-O2-bf16",
    "core-O1-fp16-aligned",
    "core-O1-bf16-aligned",
    # The bfloat16 autocast loop with the skip guarantee Amp gives, in torch alone (loop_step's "autocast-checked"),
    # and AdamW(fused=True) loops, where GradScaler skips an overflowed step on the device without a host read.
    "torch-autocast-checked-bf16",
    "torch-autocast-fused-fp16",
    "torch-autocast-fused-bf16",
    "core-O1-fused-fp16",
    "core-O1-fused-bf16",
    # Amp with skip_on_device=True on the fused AdamW: the step skipped on the device, no host read of the flag
    "core-O1-devskip-fp16",
    "core-O1-devskip-bf16",
    # Amp with unscale_backend="foreach" (torch's multi-tensor kernel, as GradScaler) instead of the default, which
    # is the fused Triton kernels on CUDA: the unscale backend's share of a step on the GPU.
    "core-O1-foreach-fp16",
    "core-O1-foreach-bf16",
    # O2 on torch's kernels on CUDA too (the masters' gradients made by copies, the copy back by torch's copy)
    "core-O2-foreach-fp16",
)
VARIANTS = LIGHTNING_VARIANTS + FABRIC_VARIANTS + LOOP_VARIANTS
MODELS = ("gpt", "resnet")
REFERENCES = ("lightning-16-mixed", "lightning-bf16-mixed", "fabric-16-mixed", "lightning-16-mixed-clip",
              "lightning-16-mixed-fused", "lightning-bf16-mixed-fused")
#: Name endings that change how a row runs, not what it computes in.
SUFFIXES = ("-compiled", "-aligned", "-clip", "-fused")


def base_variant(variant: str) -> str:
    """The variant without its :data:`SUFFIXES` (``mpx-O2-fp16-clip`` -> ``mpx-O2-fp16``)."""
    for suffix in SUFFIXES:
        variant = variant.removesuffix(suffix)
    return variant


def is_fp16(variant: str) -> bool:
    """Whether the variant computes in float16 (``lightning-16-mixed`` only on a GPU: on CPU Lightning uses bf16)."""
    return base_variant(variant).endswith("fp16")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one benchmark model and its batch."""

    batch: int
    # gpt
    vocab: int = 0
    seq: int = 0
    dim: int = 0
    layers: int = 0
    heads: int = 0
    # resnet
    image: int = 0
    width: int = 0
    blocks: tuple[int, ...] = ()
    classes: int = 10


#: ``tiny``: the test suite's size (``--check`` runs and the tests of the scripts): every code path, no figure worth
#: reading (half-precision matmuls crawl on CPUs without their kernels); ``small``: a CPU's; ``real``: a GPU's.
SPECS: dict[tuple[str, str], ModelSpec] = {
    ("gpt", "tiny"): ModelSpec(batch=2, vocab=64, seq=16, dim=16, layers=1, heads=2),
    ("resnet", "tiny"): ModelSpec(batch=2, image=8, width=4, blocks=(1, 1)),
    ("gpt", "small"): ModelSpec(batch=8, vocab=512, seq=64, dim=64, layers=2, heads=4),
    ("gpt", "real"): ModelSpec(batch=8, vocab=50257, seq=512, dim=768, layers=12, heads=12),
    ("resnet", "small"): ModelSpec(batch=16, image=32, width=16, blocks=(1, 1, 1)),
    ("resnet", "real"): ModelSpec(batch=128, image=32, width=64, blocks=(2, 2, 2, 2)),
}


# -- models (built in the child; torch is imported there) -------------------------------------------------------------
def build_model(kind: str, spec: ModelSpec) -> Any:
    """The network (an ``nn.Module`` that maps a batch's input to logits)."""
    import math

    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(y)
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        """GPT-2's layout (learned positions, pre-norm blocks, tied input/output embedding)."""

        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(spec.vocab, spec.dim)
            self.pos = nn.Embedding(spec.seq, spec.dim)
            self.blocks = nn.ModuleList(Block(spec.dim, spec.heads) for _ in range(spec.layers))
            self.ln = nn.LayerNorm(spec.dim)
            self.head = nn.Linear(spec.dim, spec.vocab, bias=False)
            self.head.weight = self.tok.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    class Basic(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.short = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                if stride != 1 or cin != cout
                else nn.Identity()
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.short(x))

    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = spec.width
            self.stem = nn.Sequential(nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
            layers, cin = [], w
            for stage, count in enumerate(spec.blocks):
                cout = w * 2**stage
                for i in range(count):
                    layers.append(Basic(cin, cout, 2 if i == 0 and stage > 0 else 1))
                    cin = cout
            self.layers = nn.Sequential(*layers)
            self.fc = nn.Linear(cin, spec.classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.layers(self.stem(x)).mean((2, 3)))

    return GPT() if kind == "gpt" else ResNet()


def make_batches(kind: str, spec: ModelSpec, count: int, device: Any) -> list[tuple[Any, Any]]:
    """``count`` distinct random batches (tokens and next tokens, or images and labels), the same for every variant."""
    import torch

    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(count):
        if kind == "gpt":
            tokens = torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), generator=g)
            batches.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
        else:
            images = torch.randn(spec.batch, 3, spec.image, spec.image, generator=g)
            labels = torch.randint(0, spec.classes, (spec.batch,), generator=g)
            batches.append((images.to(device), labels.to(device)))
    return batches


def _loss(logits: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


# -- pieces the other scripts reuse (plugin_overhead.py, gpu_host_profile.py) -----------------------------------------
class ListDataset:
    """Cycles through a few prepared batches (a ``batch_size=None`` loader: each item is a batch)."""

    def __init__(self, batches: list[Any], length: int = 10**6) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.batches[index % len(self.batches)]


def lightning_module(net: Any, fused: bool = False) -> Any:
    """A LightningModule that trains ``net`` with AdamW (lr 1e-3; ``fused=True`` when ``fused``) on
    ``(input, target)`` batches."""
    import lightning.pytorch as pl
    import torch

    class Wrapper(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return _loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, **({"fused": True} if fused else {}))

    return Wrapper()


def precision(level: str | None = None, half_dtype: Any = None, lightning: str | None = None,
              cast_table: Any = None, skip_on_device: bool = False) -> dict[str, Any]:
    """The Trainer's precision arguments: Lightning's own ``precision`` string, or ``MixedPrecisionPlugin(level)``
    (``on_floor="continue"``: a run must go on to be timed, O3 float16 overflows; ``skip_on_device``: the plugin's,
    which needs a fused Adam or AdamW)."""
    if level is None:
        return {"precision": lightning}
    from lightning_mpx import MixedPrecisionPlugin

    return {"plugins": [MixedPrecisionPlugin(level, half_dtype=half_dtype, on_floor="continue",
                                             cast_table=cast_table, skip_on_device=skip_on_device)]}


def aligned_table(variant: str, device: Any) -> Any:
    """``CastTable.autocast_aligned`` for the device of an ``-aligned`` variant, else ``None`` (the default)."""
    if not variant.endswith("-aligned"):
        return None
    import torch

    from lightning_mpx import CastTable

    return CastTable.autocast_aligned(torch.device(device).type)


def fit(net: Any, batches: list[Any], total: int, device: str, callbacks: list[Any], logger: Any = False,
        fused: bool = False, **precision_kwargs: Any) -> Any:
    """``total`` steps of ``Trainer.fit`` of :func:`lightning_module` (net, fused) over ``batches``, cycled; no
    progress bar, checkpoint, model summary or sanity check. Returns the Trainer."""
    trainer, module, loader = fit_parts(net, batches, total, device, callbacks, logger, fused, **precision_kwargs)
    trainer.fit(module, loader)
    return trainer


def fit_parts(net: Any, batches: list[Any], total: int, device: str, callbacks: list[Any], logger: Any = False,
              fused: bool = False, **precision_kwargs: Any) -> tuple[Any, Any, Any]:
    """The Trainer (``max_steps=total``), LightningModule and loader that :func:`fit` runs."""
    import lightning.pytorch as pl
    import torch

    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        max_steps=total,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **precision_kwargs,
    )
    loader = torch.utils.data.DataLoader(ListDataset(batches), batch_size=None, shuffle=False)
    return trainer, lightning_module(net, fused), loader


def fit_more(trainer: Any, module: Any, loader: Any, steps: int) -> None:
    """Continue a finished fit of ``module`` for ``steps`` more steps: ``Trainer.fit`` again with ``max_steps``
    raised, as a user continues a run. The model, precision plugin and step count carry on; the optimizer does not:
    Lightning calls ``configure_optimizers`` at every fit, so each round starts a new AdamW (its moments from zero,
    made at its first step, which is timed) that the plugin prepares again, every row alike."""
    trainer.fit_loop.epoch_loop.max_steps += steps
    trainer.fit(module, loader)


def loop_step(kind: str, net: Any, device: Any, half_dtype: Any = None, lr: float = 1e-3, cast_table: Any = None,
              fused: bool = False, unscale_backend: str = "auto", skip_on_device: bool = False
              ) -> tuple[Callable[[Any, Any], None], Any]:
    """One iteration of a hand-written AdamW loop over ``net`` (moved to ``device``), and its ``Amp`` (or None).

    ``kind``: ``"fp32"`` (plain), ``"autocast"`` (``torch.autocast`` in ``half_dtype``, with ``GradScaler`` for
    float16; bfloat16 has FP32's range and torch's recipe scales nothing), ``"autocast-checked"`` (the same, but at
    bfloat16 the gradients are checked for non-finite values in torch's one kernel and the step is skipped when one
    is found, read on the host: the skip guarantee that ``Amp`` gives, written with torch alone; float16 as
    ``"autocast"``, whose ``GradScaler`` does that already), or an opt level (``"O1"``, ``"O2"``, ...: ``Amp`` with
    ``on_floor="continue"``: forward in ``forward_context``, ``backward``, ``step``, ``update``). ``fused``: AdamW
    with ``fused=True`` (``GradScaler`` then skips on the device, without reading the flag on the host).
    ``unscale_backend``, ``skip_on_device``: ``Amp``'s (the opt-level loops; ``skip_on_device=True`` hands the flag
    to the fused AdamW's step, as ``GradScaler`` does, and needs ``fused=True``: ``Amp`` refuses an unfused one).
    """
    import torch

    from lightning_mpx import Amp

    dev = torch.device(device)
    net = net.to(dev)
    make_optimizer = functools.partial(torch.optim.AdamW, lr=lr, **({"fused": True} if fused else {}))
    if kind.startswith("O"):
        amp = Amp(kind, half_dtype=half_dtype, on_floor="continue", cast_table=cast_table,
                  unscale_backend=unscale_backend, skip_on_device=skip_on_device)
        net = amp.prepare_model(net)
        optimizer = amp.prepare_optimizer(make_optimizer(net.parameters()))

        def core(x: Any, y: Any) -> None:
            with amp.forward_context():
                loss = _loss(amp.cast_outputs(net(amp.cast_inputs(x))), y)
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad(set_to_none=True)

        return core, amp
    if kind not in ("fp32", "autocast", "autocast-checked"):
        raise ValueError(f"kind={kind!r} is not a loop; valid choices: 'fp32', 'autocast', 'autocast-checked', or an "
                         "opt level 'O0'-'O3'")  # fmt: skip
    optimizer = make_optimizer(net.parameters())
    autocast = kind != "fp32"
    context = (lambda: torch.autocast(dev.type, dtype=half_dtype)) if autocast else contextlib.nullcontext
    scaler = torch.amp.GradScaler(dev.type) if autocast and half_dtype == torch.float16 else None
    checked = kind == "autocast-checked" and scaler is None
    found, one = torch.zeros(1, device=dev), torch.ones(1, device=dev)

    def plain(x: Any, y: Any) -> None:
        with context():
            loss = _loss(net(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        elif checked:
            loss.backward()
            found.zero_()
            grads = [p.grad for p in net.parameters() if p.grad is not None]
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
            if not found.item():
                optimizer.step()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return plain, None


def half_dtype_of(variant: str) -> Any:
    """The half dtype a variant's name ends with (``-fp16``, ``-bf16``), or ``None``."""
    import torch

    name = base_variant(variant)
    return torch.float16 if name.endswith("fp16") else torch.bfloat16 if name.endswith("bf16") else None



def _lightning_steps(variant: str, net: Any, batches: list[tuple[Any, Any]], total: int, device: str,
                     sync: Callable[[], None], compile_backend: str = "inductor"
                     ) -> tuple[list[float], dict[str, Any]]:
    import torch

    if variant.endswith("-compiled"):
        # The LightningModule holds the compiled module; its parameters are the network's own.
        net = torch.compile(net, backend=compile_backend)
    timer = _step_timer(sync)
    trainer = fit(net, batches, total, device, [timer], **_trainer_precision(variant, device))
    return timer.times, _trainer_extra(variant, trainer)


def _step_timer(sync: Callable[[], None]) -> Any:
    """A Lightning callback that times each training batch (``times``, seconds) between two syncs."""
    import lightning.pytorch as pl

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            sync()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            sync()
            self.times.append(time.perf_counter() - self._start)

    return Timer()


def _trainer_precision(variant: str, device: str) -> dict[str, Any]:
    """The Trainer's precision arguments of a Lightning variant (``-compiled`` ignored), ``gradient_clip_val=1.0``
    for a ``-clip`` one, and for a ``-fused`` one ``fused=True`` (:func:`fit`'s AdamW with ``fused=True``) with
    Lightning's own precision string, or the plugin with ``skip_on_device=True``."""
    if variant.endswith("-clip"):
        return {**_trainer_precision(variant.removesuffix("-clip"), device), "gradient_clip_val": 1.0}
    if variant.endswith("-fused"):
        variant = variant.removesuffix("-fused")
        if variant.startswith("lightning-"):
            return {**precision(lightning=variant.removeprefix("lightning-")), "fused": True}
        return {**precision(variant.split("-")[1], half_dtype_of(variant), skip_on_device=True), "fused": True}
    variant = variant.removesuffix("-compiled")
    if variant == "fp32":
        return precision(lightning="32-true")
    if variant.startswith("lightning-"):
        return precision(lightning=variant.removeprefix("lightning-"))
    return precision(variant.split("-")[1], half_dtype_of(variant), cast_table=aligned_table(variant, device))


def _trainer_extra(variant: str, trainer: Any) -> dict[str, Any]:
    """What a Lightning run records besides its times: the precision it ran, and the plugin's skipped steps."""
    from lightning_mpx import MixedPrecisionPlugin

    extra: dict[str, Any] = {"lightning_precision": str(trainer.precision)}
    plugin = trainer.precision_plugin
    if variant.startswith("lightning-"):
        # What Lightning actually ran: it replaces "16-mixed" by "bf16-mixed" on CPU.
        extra["effective_dtype"] = "bfloat16" if getattr(plugin, "precision", "") == "bf16-mixed" else "float16"
    if isinstance(plugin, MixedPrecisionPlugin):
        extra["skipped_steps"] = sum(plugin.amp.skipped_steps)
    return extra


def _fabric_steps(variant: str, net: Any, batches: list[tuple[Any, Any]], total: int, device: str,
                  sync: Callable[[], None]) -> tuple[list[float], dict[str, Any]]:
    """A Lightning Fabric loop over ``net`` with AdamW: the Fabric plugin at O2, or Fabric's own "16-mixed"."""
    import torch
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    settings: dict[str, Any] = dict(accelerator="cuda" if device == "cuda" else "cpu", devices=1)
    if variant == "fabric-16-mixed":
        fabric = Fabric(precision="16-mixed", **settings)
    else:  # fabric-mpx-O2-fp16 (on_floor="continue", as the Trainer rows)
        mpx = FabricMixedPrecisionPlugin(variant.split("-")[2], half_dtype=half_dtype_of(variant), on_floor="continue")
        fabric = Fabric(plugins=[mpx], **settings)
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    times: list[float] = []
    for i in range(total):
        x, y = batches[i % len(batches)]
        sync()
        start = time.perf_counter()
        fabric.backward(_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
    plugin = fabric.strategy.precision
    if isinstance(plugin, FabricMixedPrecisionPlugin):
        return times, {"skipped_steps": sum(plugin.amp.skipped_steps)}
    # What Fabric actually ran: it replaces "16-mixed" by "bf16-mixed" on CPU.
    return times, {"effective_dtype": "bfloat16" if getattr(plugin, "precision", "") == "bf16-mixed" else "float16"}


def loop_of(variant: str, net: Any, dev: Any, lr: float = 1e-3) -> tuple[Callable[[Any, Any], None], Any]:
    """:func:`loop_step` for a loop variant's name: ``loop-fp32``, ``torch-autocast[-checked|-fused]-<dtype>``,
    ``core-<level>[-fused|-foreach|-devskip]-<dtype>[-aligned]`` (``-foreach``: ``unscale_backend="foreach"``;
    ``-devskip``: ``fused=True`` with ``skip_on_device=True``)."""
    parts = variant.split("-")
    if variant == "loop-fp32":
        return loop_step("fp32", net, dev, lr=lr)
    devskip = "devskip" in parts
    fused = "fused" in parts or devskip
    if variant.startswith("torch-autocast-"):
        kind = "autocast-checked" if "checked" in parts else "autocast"
        return loop_step(kind, net, dev, half_dtype_of(variant), lr=lr, fused=fused)
    if variant.startswith("core-"):
        return loop_step(parts[1], net, dev, half_dtype_of(variant), lr=lr, cast_table=aligned_table(variant, dev),
                         fused=fused, unscale_backend="foreach" if "foreach" in parts else "auto",
                         skip_on_device=devskip)  # fmt: skip
    raise ValueError(f"variant={variant!r} is not a loop; valid choices: {', '.join(LOOP_VARIANTS)}")


def _loop_steps(variant: str, net: Any, batches: list[tuple[Any, Any]], total: int, dev: Any,
                sync: Callable[[], None]) -> tuple[list[float], dict[str, Any]]:
    one, amp = loop_of(variant, net, dev)
    times = time_steps(one, batches, total, sync)
    return times, _loop_extra(amp)


def _loop_extra(amp: Any) -> dict[str, Any]:
    """What a loop run records besides its times: ``Amp``'s skipped steps (None: nothing), the steps it skipped on
    the device (``skip_on_device``) read first, after the timed steps."""
    if amp is None:
        return {}
    amp.read_step_outcomes()
    return {"skipped_steps": sum(amp.skipped_steps)}


def time_steps(one: Callable[[Any, Any], None], batches: list[tuple[Any, Any]], total: int,
               sync: Callable[[], None]) -> list[float]:
    """Seconds of each of ``total`` calls ``one(x, y)`` over ``batches`` in turn, each timed between two syncs."""
    times: list[float] = []
    for i in range(total):
        x, y = batches[i % len(batches)]
        sync()
        start = time.perf_counter()
        one(x, y)
        sync()
        times.append(time.perf_counter() - start)
    return times
