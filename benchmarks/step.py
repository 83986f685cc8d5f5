"""Training-step speed and memory: lightning_mpx against FP32, Lightning's own AMP and plain torch.autocast.

Two models, a GPT-2-like decoder on random tokens and a ResNet-style convolutional net with batch norm on random
images (``--size small`` for CPU, ``--size real`` for a GPU: GPT-2 small's shape at sequence 512, a CIFAR ResNet-18).
Every variant runs in its own fresh subprocess with the same seed, data, optimizer (AdamW) and thread count, so peak
memory is per variant and nothing leaks from one to the next; with ``--repeats N`` the whole variant list is run N
times, in order, and the per-run medians are combined by their median.

Variants (``--variants`` picks a subset):

* ``fp32``: Lightning, ``precision="32-true"``;
* ``mpx-O{1,2,3}-{fp16,bf16}``: Lightning with ``MixedPrecisionPlugin``;
* ``lightning-16-mixed``, ``lightning-bf16-mixed``: Lightning's own AMP (on CPU Lightning runs "16-mixed" as
  bfloat16 autocast: the JSON records the dtype it actually used);
* ``mpx-O1-fp16-compiled``, ``lightning-16-mixed-compiled``: the same Trainer rows with the network passed through
  ``torch.compile`` (inductor): O1 compiled against Lightning's AMP compiled;
* ``lightning-16-mixed-clip``, ``mpx-O1-fp16-clip``, ``mpx-O2-fp16-clip``: the same Trainer rows with
  ``gradient_clip_val=1.0`` (the habit of most fine-tuning recipes): the plugin's clip runs the fused kernels on CUDA,
  its plain step torch's; compared with Lightning's "16-mixed" with the same clip;
* ``lightning-16-mixed-fused``, ``lightning-bf16-mixed-fused``, ``mpx-O1-fp16-fused``, ``mpx-O1-bf16-fused``,
  ``mpx-O2-fp16-fused``: the same Trainer rows with ``AdamW(fused=True)``, the plugin's with ``skip_on_device=True``
  (the overflow flag handed to the fused step, not read on the host, as ``GradScaler`` does for a fused optimizer);
  each compared with Lightning's own AMP of the same dtype with the same fused AdamW;
* ``fabric-mpx-O2-fp16``, ``fabric-16-mixed``: a Lightning Fabric loop (``fabric.setup``, ``fabric.backward``,
  ``optimizer.step``) with ``FabricMixedPrecisionPlugin("O2")`` and with Fabric's own ``precision="16-mixed"`` (on
  CPU Fabric runs it as bfloat16 autocast, recorded as for Lightning's rows);
* ``torch-autocast-{fp16,bf16}``: a hand-written loop with ``torch.autocast`` (+ ``torch.amp.GradScaler`` for fp16);
* ``loop-fp32``, ``core-O1-{fp16,bf16}``, ``core-O2-{fp16,bf16}``: hand-written loops, plain and with ``Amp``;
* ``torch-autocast-fused-{fp16,bf16}``, ``core-O1-fused-{fp16,bf16}``, ``core-O1-devskip-{fp16,bf16}``: the loops
  with ``AdamW(fused=True)``: torch's (``GradScaler`` skips on the device at fp16), ``Amp`` reading the overflow flag
  on the host, and ``Amp`` with ``skip_on_device=True`` (the flag handed to the fused step, no host read).

Step time is the median over ``--steps`` steps after ``--warmup`` (forward, backward, optimizer step; measured by a
Lightning callback from ``on_train_batch_start`` to ``on_train_batch_end`` or around the (Fabric) loop body, with
``torch.cuda.synchronize()`` on GPU). Peak memory is ``torch.cuda.max_memory_allocated`` on GPU and the child's peak
RSS on CPU (which includes the ~0.5 GB of the imported libraries). The ratios compare throughput with Lightning's
"16-mixed" and "bf16-mixed" rows (and Fabric's "16-mixed" row, and the ``-clip`` and ``-fused`` rows' own
references: Lightning's rows with the same clip or the same fused AdamW) of the same run.

    python benchmarks/step.py [--device cpu|cuda] [--model gpt|resnet|all] [--steps 20] [--warmup 5] [--out PATH]

float16 matmuls are very slow on most CPUs (no native fp16 arithmetic): the fp16 rows on CPU say nothing about
speed on a GPU, and ``--cpu-fp16-steps`` runs them with fewer steps.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import _harness  # benchmarks/ is on sys.path when a script runs

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


SPECS: dict[tuple[str, str], ModelSpec] = {
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


# -- the child: one variant, one model ---------------------------------------------------------------------------------
def run_child(variant: str, kind: str, spec: ModelSpec, steps: int, warmup: int, device: str,
              threads: int, compile_backend: str = "inductor") -> dict[str, Any]:
    """Train ``variant`` for ``warmup + steps`` steps in this process; returns its step times and peak memory.

    ``compile_backend``: the ``torch.compile`` backend of the ``-compiled`` variants (the tests use ``aot_eager``,
    which traces the same graph without inductor's minute of CPU code generation)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cuda = device == "cuda"
    dev = torch.device(device)
    total = warmup + steps
    batches = make_batches(kind, spec, min(total, 8), dev)
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    net = build_model(kind, spec)
    extra: dict[str, Any] = {}
    if variant in LIGHTNING_VARIANTS:
        times, extra = _lightning_steps(variant, net, batches, total, device, sync, compile_backend)
    elif variant in FABRIC_VARIANTS:
        times, extra = _fabric_steps(variant, net, batches, total, device, sync)
    else:
        times, extra = _loop_steps(variant, net, batches, total, dev, sync)
    return _record(variant, kind, spec.batch, times[warmup:], cuda,
                   "cuda_max_memory_allocated" if cuda else "peak_rss", extra)


def _record(variant: str, kind: str, batch: int, timed: list[float], cuda: bool, peak_kind: str,
            extra: dict[str, Any]) -> dict[str, Any]:
    """A run's row: its timed steps (seconds) summarised, and the peak memory so far (CUDA's allocated, or RSS)."""
    import torch

    median = statistics.median(timed)
    peak = (
        torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "variant": variant,
        "model": kind,
        "steps_timed": len(timed),
        "step_ms_median": median * 1e3,
        "step_ms_iqr": _harness.iqr_width(timed) * 1e3,
        "step_ms_min": min(timed) * 1e3,  # the least disturbed step: a floor under a shared machine's load
        "samples_per_second": batch / median,
        "peak_memory_bytes": int(peak),
        "peak_memory_kind": peak_kind,
        **extra,
    }


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


def run_in_process(variant: str, kind: str, spec: ModelSpec, steps: int, warmup: int, device: str,
                   threads: int) -> dict[str, Any]:
    """:func:`run_child` in this process, then the run's objects collected (and CUDA's cached blocks released), so
    that the next run's peak memory is its own."""
    import gc

    import torch

    try:
        return run_child(variant, kind, spec, steps, warmup, device, threads)
    finally:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


class Persistent:
    """One variant built once (model, Trainer or loop), warmed up, and trained on for more steps at each
    :meth:`advance` (``--persistent``): a Lightning variant continues with :func:`fit_more`, a loop calls its step
    again. Its rounds then differ only by what happens while they run, not by how a run was built."""

    def __init__(self, variant: str, kind: str, spec: ModelSpec, warmup: int, device: str) -> None:
        import torch

        if variant in FABRIC_VARIANTS or variant.endswith("-compiled"):
            raise ValueError(f"variant={variant!r} cannot run --persistent (Fabric and compiled rows run afresh); "
                             "valid choices: the Trainer rows and the loops")  # fmt: skip
        torch.manual_seed(0)
        self.variant, self.kind, self.batch = variant, kind, spec.batch
        self.cuda = device == "cuda"
        self.sync: Callable[[], None] = torch.cuda.synchronize if self.cuda else (lambda: None)
        batches = make_batches(kind, spec, 8, torch.device(device))
        net = build_model(kind, spec)
        self.amp: Any = None
        self.trainer: Any = None
        if variant in LIGHTNING_VARIANTS:
            self.timer = _step_timer(self.sync)
            self.trainer, self.module, self.loader = fit_parts(
                net, batches, max(warmup, 1), device, [self.timer], **_trainer_precision(variant, device))
            self.trainer.fit(self.module, self.loader)
        else:
            self.one, self.amp = loop_of(variant, net, torch.device(device))
            self.batches = batches
            time_steps(self.one, batches, warmup, self.sync)

    def advance(self, steps: int) -> dict[str, Any]:
        """``steps`` more steps; a record of them as :func:`run_child` returns (the peak memory is the process's,
        shared by every persistent variant)."""
        if self.trainer is not None:
            self.timer.times.clear()
            fit_more(self.trainer, self.module, self.loader, steps)
            times = list(self.timer.times)
            extra = _trainer_extra(self.variant, self.trainer)
        else:
            times = time_steps(self.one, self.batches, steps, self.sync)
            extra = _loop_extra(self.amp)
        return _record(self.variant, self.kind, self.batch, times, self.cuda, _harness.SHARED_PEAK, extra)


# -- the parent --------------------------------------------------------------------------------------------------------
def _spawn(variant: str, kind: str, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    cmd = [
        sys.executable, os.path.abspath(__file__), "--_child", variant, "--model", kind, "--size", args.size,
        "--steps", str(steps), "--warmup", str(args.warmup), "--device", args.device, "--threads", str(args.threads),
    ]  # fmt: skip
    return _harness.run_child(cmd, f"variant {variant} on {kind}", args.child_timeout)


def combine(samples: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """One row from the repeats of one variant: medians of the step-time medians, max of the peaks."""
    row = dict(samples[0])
    row["step_ms_median"] = statistics.median(s["step_ms_median"] for s in samples)
    row["step_ms_runs"] = [s["step_ms_median"] for s in samples]
    row["step_ms_min"] = min(s["step_ms_min"] for s in samples)
    row["samples_per_second"] = batch / (row["step_ms_median"] / 1e3)
    row["peak_memory_bytes"] = max(s["peak_memory_bytes"] for s in samples)
    row["repeats"] = len(samples)
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Throughput and peak-memory ratios against Lightning's AMP rows of the same model (when measured)."""
    for kind in {r["model"] for r in rows}:
        group = [r for r in rows if r["model"] == kind]
        refs = {r["variant"]: r for r in group if r["variant"] in REFERENCES}
        fp32 = next((r for r in group if r["variant"] == "fp32"), None)
        for r in group:
            for name, ref in refs.items():
                key = name.removeprefix("lightning-").replace("-", "_")
                r[f"throughput_vs_{key}"] = r["samples_per_second"] / ref["samples_per_second"]
                r[f"step_time_vs_{key}"] = r["step_ms_median"] / ref["step_ms_median"]
                # Paired: each repeat's ratio from two runs close in time, then the median over the repeats. Less
                # sensitive to a load that changes between the start and the end of the run.
                paired = [a / b for a, b in zip(r.get("step_ms_runs", []), ref.get("step_ms_runs", []))]
                if paired:
                    r[f"step_time_vs_{key}_paired"] = statistics.median(paired)
                    r[f"step_time_vs_{key}_paired_range"] = [min(paired), max(paired)]
            if fp32 is not None and _harness.own_peak(r) and _harness.own_peak(fp32):
                r["peak_memory_vs_fp32"] = r["peak_memory_bytes"] / fp32["peak_memory_bytes"]


#: Issue 25's O1 speed goals on a GPU: (row, its reference), each at >= 0.97x the reference's throughput.
O1_SPEED_PAIRS = (
    ("core-O1-fp16", "torch-autocast-fp16"),
    ("core-O1-bf16", "torch-autocast-bf16"),
    ("mpx-O1-bf16", "lightning-bf16-mixed"),
    ("core-O1-fp16-aligned", "torch-autocast-fp16"),
    ("core-O1-bf16-aligned", "torch-autocast-bf16"),
    ("mpx-O1-fp16-aligned", "lightning-16-mixed"),
    ("mpx-O1-bf16-aligned", "lightning-bf16-mixed"),
)
#: The fused AdamW goals on a GPU, where Lightning's "16-mixed" skips on the device and "bf16-mixed" checks nothing:
#: (row with ``skip_on_device=True``, its reference with the same fused AdamW, the least throughput ratio).
DEVICE_SKIP_PAIRS = (
    ("mpx-O1-fp16-fused", "lightning-16-mixed-fused", 0.97),
    ("mpx-O2-fp16-fused", "lightning-16-mixed-fused", 1.05),
    ("mpx-O1-bf16-fused", "lightning-bf16-mixed-fused", 0.97),
    ("core-O1-devskip-fp16", "torch-autocast-fused-fp16", 0.97),
    ("core-O1-devskip-bf16", "torch-autocast-fused-bf16", 0.97),
)


def check_targets(rows: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """The issue's targets that this run can judge (GPU targets on CUDA, the CPU target on CPU)."""

    def row(kind: str, variant: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["model"] == kind and r["variant"] == variant), None)

    checks = []
    for kind in sorted({r["model"] for r in rows}):
        if device == "cpu":
            for dtype in ("bf16",):
                o1, ref = row(kind, f"mpx-O1-{dtype}"), row(kind, "lightning-bf16-mixed")
                if o1 and ref:
                    value = o1.get("step_time_vs_bf16_mixed_paired", o1["step_ms_median"] / ref["step_ms_median"])
                    checks.append({"model": kind, "target": "mpx-O1-bf16 step time <= 1.3x lightning-bf16-mixed",
                                   "value": value, "met": value <= 1.3})
        else:
            ref, fp32 = row(kind, "lightning-16-mixed"), row(kind, "fp32")
            o1, o2 = row(kind, "mpx-O1-fp16"), row(kind, "mpx-O2-fp16")
            if o2 and ref:
                value = o2["samples_per_second"] / ref["samples_per_second"]
                checks.append({"model": kind, "target": "mpx-O2-fp16 throughput >= 1.05x lightning-16-mixed",
                               "value": value, "met": value >= 1.05})
            if o1 and ref:
                value = o1["samples_per_second"] / ref["samples_per_second"]
                checks.append({"model": kind, "target": "mpx-O1-fp16 throughput within 3% of lightning-16-mixed",
                               "value": value, "met": value >= 0.97})
            # Issue 25: O1 at torch.autocast's speed, plugin and core loop, both dtypes (and with the aligned table).
            for variant, reference in O1_SPEED_PAIRS:
                a, b = row(kind, variant), row(kind, reference)
                if a and b:
                    value = a["samples_per_second"] / b["samples_per_second"]
                    checks.append({"model": kind, "target": f"{variant} throughput >= 0.97x {reference}",
                                   "value": value, "met": value >= 0.97})
            # The fused AdamW rows: the plugin and the core loop skipping on the device, as torch's GradScaler does.
            for variant, reference, bar in DEVICE_SKIP_PAIRS:
                a, b = row(kind, variant), row(kind, reference)
                if a and b:
                    value = a["samples_per_second"] / b["samples_per_second"]
                    checks.append({"model": kind, "target": f"{variant} throughput >= {bar:.2f}x {reference}",
                                   "value": value, "met": value >= bar})
            # --persistent: the process's peak, not a row's
            if o2 and fp32 and _harness.own_peak(o2) and _harness.own_peak(fp32):
                value = o2["peak_memory_bytes"] / fp32["peak_memory_bytes"]
                checks.append({"model": kind, "target": "mpx-O2-fp16 peak memory below fp32",
                               "value": value, "met": value < 1.0})
    return checks


def table(rows: list[dict[str, Any]], pad: bool = False) -> str:
    """The rows as a markdown table: step time, throughput, memory, the ratios to Lightning's AMP rows."""

    def x(value: float | None) -> str | None:
        return None if value is None else f"{value:.2f}x"

    # The -clip and -fused rows' own references, each a column when it was measured.
    own = [(key, name) for key, name in (("throughput_vs_16_mixed_clip", "vs 16-mixed-clip"),
                                         ("throughput_vs_16_mixed_fused", "vs 16-mixed-fused"),
                                         ("throughput_vs_bf16_mixed_fused", "vs bf16-mixed-fused"))
           if any(key in r for r in rows)]  # fmt: skip
    columns = ["model", "variant", "steps", "step ms", "samples/s", "peak MiB", "vs 16-mixed", "vs bf16-mixed",
               *(name for _, name in own), "paired t/bf16", "skipped"]
    return _harness.markdown_table(columns, [
        [r["model"], r["variant"], r["steps_timed"], f"{r['step_ms_median']:.2f}", f"{r['samples_per_second']:.1f}",
         f"{r['peak_memory_bytes'] / 2**20:.0f}", x(r.get("throughput_vs_16_mixed")),
         x(r.get("throughput_vs_bf16_mixed")), *(x(r.get(key)) for key, _ in own),
         x(r.get("step_time_vs_bf16_mixed_paired")), r.get("skipped_steps")]
        for r in rows], align="ll" + "r" * (len(columns) - 2), pad=pad)  # fmt: skip


NOTE = ("vs: throughput of the row / throughput of Lightning's AMP row, same run; paired t/bf16: median over the "
        "repeats of the row's step time / lightning-bf16-mixed's step time in the same repeat.")
CPU_NOTE = ("On CPU Lightning runs precision='16-mixed' as bfloat16 autocast; the fp16 rows use float16, which has no "
            "fast CPU kernels: they are correctness rows, not speed configurations.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--model", choices=(*MODELS, "all"), default="all")
    parser.add_argument("--size", choices=("small", "real"), default=None, help="default: small on CPU, real on CUDA")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant, after the warm-up")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cpu-fp16-steps", type=int, default=None,
                        help="timed steps for float16 rows on CPU (default: --steps)")
    parser.add_argument("--repeats", type=int, default=1, help="run the variant list this many times")
    parser.add_argument("--one-process", action="store_true",
                        help="run every variant in this process, the order rotated each of --repeats rounds (each "
                        "run builds its model, Trainer or loop afresh), instead of a child process per run: the "
                        "rows then do not carry the differences between processes")
    parser.add_argument("--persistent", action="store_true",
                        help="with --one-process: build every variant once (model, Trainer or loop), warm it up, "
                        "then train each on for --steps more steps per round, the order rotated (a Trainer continues "
                        "with fit() and a raised max_steps); peak memory is then not per variant")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), metavar="VARIANT",
                        help=f"subset of: {', '.join(VARIANTS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every child")
    parser.add_argument("--child-timeout", type=float, default=900.0, help="seconds per variant before giving up")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/step_<device>.json")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1, --warmup at least 0")
    if args.persistent and not args.one_process:
        parser.error("--persistent needs --one-process (the variants live in this process)")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.size is None:
        args.size = "real" if args.device == "cuda" else "small"
    kinds = MODELS if args.model == "all" else (args.model,)
    if args._child is not None:
        result = run_child(args._child, kinds[0], SPECS[(kinds[0], args.size)], args.steps, args.warmup,
                           args.device, args.threads)
        print(json.dumps(result))
        return None
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available")
    fp16_steps = args.cpu_fp16_steps if args.device == "cpu" and args.cpu_fp16_steps else args.steps
    loads = [_harness.load_average()]
    started = time.perf_counter()

    persistent: dict[str, Persistent] = {}
    if args.persistent:
        import torch

        torch.set_num_threads(args.threads)
        for kind in kinds:
            for variant in args.variants:
                persistent[f"{kind}/{variant}"] = Persistent(variant, kind, SPECS[(kind, args.size)], args.warmup,
                                                             args.device)  # fmt: skip

    def sample(kind: str, variant: str) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            steps = fp16_steps if is_fp16(variant) else args.steps
            if persistent:
                result = persistent[f"{kind}/{variant}"].advance(steps)
            elif args.one_process:
                result = run_in_process(variant, kind, SPECS[(kind, args.size)], steps, args.warmup, args.device,
                                        args.threads)  # fmt: skip
            else:
                result = _spawn(variant, kind, args, steps)
            loads.append(_harness.load_average())
            print(f"  {kind:<6} {variant:<21} {result['step_ms_median']:9.2f} ms", flush=True)
            return result

        return run

    # The variant list, --repeats times: in order, each run a fresh child process; or, with --one-process, in this
    # process with the order rotated every round.
    out = args.out or _harness.default_out(f"step_{args.device}")

    def result_of(samples: dict[str, list[dict[str, Any]]], rounds_done: int) -> dict[str, Any]:
        rows = [combine(group, SPECS[(key.split("/")[0], args.size)].batch) for key, group in samples.items()
                if group]  # fmt: skip
        add_ratios(rows)
        return {
            "benchmark": "step",
            "command": _harness.command(argv),
            **_harness.machine(args.device),
            "threads": args.threads,
            "size": args.size,
            "specs": {kind: vars(SPECS[(kind, args.size)]) for kind in kinds},
            "steps": args.steps,
            "fp16_steps": fp16_steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "rounds_done": rounds_done,
            "method": ("one process, each variant built once and trained on, rotated rounds" if args.persistent
                       else "one process, rotated rounds" if args.one_process else "a child process per run"),
            "loadavg": loads,
            "wall_seconds": time.perf_counter() - started,
            "rows": rows,
            "targets": check_targets(rows, args.device),
        }

    def after_round(index: int, samples: dict[str, list[dict[str, Any]]]) -> None:
        if args.one_process and index + 1 < args.repeats:  # a run cut short keeps the rounds it finished
            _harness.write_json(out, result_of(samples, index + 1), default=str)

    samples = _harness.interleave({f"{kind}/{variant}": sample(kind, variant) for kind in kinds
                                   for variant in args.variants}, args.repeats, rotate=args.one_process,
                                  after_round=after_round)  # fmt: skip
    result = result_of(samples, args.repeats)
    rows = result["rows"]
    print(table(rows, pad=True))
    print(NOTE + ("\n" + CPU_NOTE if args.device == "cpu" else ""))
    for check in result["targets"]:
        print(f"target [{check['model']}] {check['target']}: {check['value']:.3f} -> "
              f"{'MET' if check['met'] else 'NOT MET'}")
    _harness.save(out, result, {"": table(rows) + "\n\n" + NOTE}, default=str)
    return result


if __name__ == "__main__":
    main()
