"""The CUDA checks of ``gpu_suite.py``'s tests part, run in a child process: ``gpu_suite.py _checks --out FILE``.

The fused kernels against the reference backend on CUDA tensors (unscale in place and into FP32 masters, with norm and
clipping, the overflow flag, the master-to-model copy), the loss scaler's backoff and growth on the device,
``MasterWeights`` and ``Amp`` O2 steps with the fused backend against the foreach one, a Lightning
``MixedPrecisionPlugin`` fit, and the host syncs of a normal step (``torch.cuda.set_sync_debug_mode("warn")``).
Under ``--check`` the same code on CPU tensors, the kernels in triton's interpreter.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

from _harness import write_json

ROOT = Path(__file__).resolve().parents[1]
#: The backend the checks hold to the reference; explicit, since "auto" takes foreach for CPU tensors (--check).
FUSED = "triton"


def run_checks(out: Path, check: bool) -> int:
    """The CUDA checks (child process of the ``tests`` part); on CPU under ``--check`` the same code on CPU
    tensors with the kernels in triton's interpreter, and no sync counting (there is no CUDA to sync with)."""
    import torch

    device = torch.device("cpu" if check else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("the tests part needs a CUDA device (none found); use --check to run it on CPU", file=sys.stderr)
        return 2
    checks: list[dict[str, Any]] = []
    syncs: dict[str, Any] = {}

    def add(name: str, fn: Callable[[], str | None]) -> None:
        try:
            detail = fn() or ""
            checks.append({"name": name, "passed": True, "detail": detail})
        except Exception as error:  # one failing check must not hide the others
            tail = traceback.format_exc().strip().splitlines()[-3:]
            checks.append({"name": name, "passed": False, "detail": f"{type(error).__name__}: {error}"[:500],
                           "traceback": tail})  # fmt: skip
        print(f"  {'pass' if checks[-1]['passed'] else 'FAIL'}  {name}  {checks[-1]['detail']}", flush=True)

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        add(f"fused unscale parity, {_dt(dtype)}", lambda d=dtype: _unscale_parity(device, d, check))
    add("fused master copy parity (cast_copy_, MasterWeights)", lambda: _copy_parity(device, check))
    add("loss scaler backoff and growth on the device", lambda: _scaler(device))
    # --check: 2 steps where a GPU run takes 4 (each fused step costs a second in the interpreter)
    steps = 2 if check else 4
    add("Amp O2 float16 steps: fused backend = foreach backend", lambda: _amp_parity(device, steps))
    add("Amp overflow step skipped, scale halved", lambda: _amp_overflow(device))
    add("Lightning MixedPrecisionPlugin O2 fit", lambda: _plugin(device, steps))
    for name, loop in (("Amp O1 float16", "O1"), ("Amp O2 float16", "O2"), ("Amp O2 bfloat16", "O2-bf16"),
                       ("torch autocast + GradScaler float16", "gradscaler")):  # fmt: skip
        try:
            # --check counts nothing: one warm-up step runs the loop's code (three cost seconds in the interpreter).
            syncs[name] = _count_syncs(device, loop, warmup=1 if check else 3)
        except Exception as error:
            syncs[name] = {"per_step": None, "locations": [], "note": f"{type(error).__name__}: {error}"[:300]}
            checks.append({"name": f"sync count, {name}", "passed": False, "detail": syncs[name]["note"]})
        print(f"  syncs  {name}: {syncs[name]}", flush=True)
    write_json(out, {"device": str(device), "checks": checks, "syncs": syncs})
    return 0 if all(c["passed"] for c in checks) else 1


def _dt(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _workspace(check: bool) -> Any:
    from lightning_mpx.scaling.unscale import UnscaleWorkspace

    # Small chunks in the interpreter: the same code paths (several chunks per tensor) at a size it runs quickly.
    return UnscaleWorkspace(chunk_size=64, block_size=16, num_warps=1) if check else UnscaleWorkspace()


def _shapes(check: bool) -> list[tuple[int, ...]]:
    return [(3, 5), (7,), (130,), (1,)] if check else [(1000, 33), (4097,), (7,), (64, 3, 3, 3), (1,)]


def _unscale_parity(device: Any, dtype: Any, check: bool) -> str:
    """The fused backend against the reference: in place, with the norm, with clipping, into FP32 masters, and
    the overflow flag."""
    import torch

    from lightning_mpx.scaling.unscale import unscale_grads_

    ws = _workspace(check)
    grads = [torch.randn(s, device=device).mul_(512.0).to(dtype) for s in _shapes(check)]
    inv = torch.full((), 1 / 512.0, device=device)
    notes = []

    def both(**kw: Any) -> tuple[list[Any], list[Any], Any, Any, Any, Any]:
        fused, twin = [g.clone() for g in grads], [g.clone() for g in grads]
        out_f = [torch.empty(g.shape, device=device) for g in grads] if kw.pop("masters", False) else None
        out_t = [torch.empty(g.shape, device=device) for g in grads] if out_f is not None else None
        f_found, t_found = torch.zeros((), device=device), torch.zeros((), device=device)
        f_norm = unscale_grads_(fused, inv, f_found, out=out_f, backend="triton", workspace=ws, **kw)
        t_norm = unscale_grads_(twin, inv, t_found, out=out_t, backend="reference", **kw)
        return out_f or fused, out_t or twin, f_found, t_found, f_norm, t_norm

    fused, twin, f_found, t_found, f_norm, t_norm = both(compute_norm=True)
    assert all(torch.equal(a, b) for a, b in zip(fused, twin)), "in-place unscale differs from the reference"
    assert f_found.item() == t_found.item() == 0.0, "overflow flag set on finite gradients"
    torch.testing.assert_close(f_norm, t_norm, rtol=1e-5, atol=0)
    notes.append(f"norm {f_norm.item():.4g} vs {t_norm.item():.4g}")
    fused, twin, *_, f_norm, t_norm = both(max_norm=0.5)
    for a, b in zip(fused, twin):  # one rounding against two: may differ by a unit in the last place
        torch.testing.assert_close(a, b)
    notes.append("clip close")
    if dtype != torch.float32:
        fused, twin, *_ = both(masters=True, max_norm=0.5)
        for a, b in zip(fused, twin):
            torch.testing.assert_close(a, b)
        notes.append("into FP32 masters close")
    grads[1].view(-1)[0] = float("inf")
    *_, f_found, t_found, _, _ = both()
    assert f_found.item() == t_found.item() == 1.0, f"overflow flag {f_found.item()} / {t_found.item()}, want 1"
    notes.append("inf flagged")
    return "; ".join(notes)


def _copy_parity(device: Any, check: bool) -> str:
    import torch
    from torch import nn

    from lightning_mpx import MasterWeights, convert_module
    from lightning_mpx.scaling.unscale import cast_copy_

    src = [torch.randn(s, device=device) for s in _shapes(check)]
    for dtype in (torch.float16, torch.bfloat16):
        fused = [torch.empty(s.shape, dtype=dtype, device=device) for s in src]
        cast_copy_(fused, src, backend="triton", workspace=_workspace(check))
        assert all(torch.equal(f, s.to(dtype)) for f, s in zip(fused, src)), f"cast_copy_ {_dt(dtype)} differs"
    model = convert_module(nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 8)).to(device),
                           torch.float16)  # fmt: skip
    masters = MasterWeights(model.named_parameters(), copy_backend="triton")
    masters.workspace = _workspace(check)
    with torch.no_grad():
        for _, master in masters.half_pairs:
            master.add_(torch.randn_like(master) * 1e-2)
    masters.copy_to_model()
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in masters.half_pairs), "copy_to_model differs from .to()"
    kept = [p for p in model.parameters() if p.dtype == torch.float32]
    assert len(kept) == 2 and all(masters.master_of(p) is p for p in kept), "batch norm not kept FP32 as its own master"
    return f"{len(masters.half_pairs)} half parameters, {len(kept)} FP32 (batch norm)"


def _scaler(device: Any) -> str:
    import torch

    from lightning_mpx import LossScaler

    scaler = LossScaler(init_scale=2.0**16, growth_interval=2)
    scaled = scaler.scale(torch.ones((), device=device))
    assert scaled.device.type == device.type and scaler.device.type == device.type
    scaler.update(torch.ones((), device=device))  # overflow: back off
    after_overflow = scaler.get_scale()
    for _ in range(2):
        scaler.update(torch.zeros((), device=device))  # two clean iterations: grow
    grown = scaler.get_scale()
    assert (after_overflow, grown) == (2.0**15, 2.0**16), (after_overflow, grown)
    assert int(scaler.overflow_count.item()) == 1
    return f"2**16 -> {after_overflow:g} -> {grown:g}"


def _model(device: Any) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 16)).to(device)


def _batch(device: Any, step: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 32, generator=g).to(device), torch.randint(0, 16, (8,), generator=g).to(device)


def _amp_run(device: Any, level: str, half: str, backend: str, steps: int) -> tuple[Any, Any, Any]:
    """``steps`` ordinary Amp steps of the small model; returns (amp, model, optimizer)."""
    import torch

    from lightning_mpx import Amp

    amp = Amp(level, half_dtype=half, unscale_backend=backend, on_floor="continue")
    model = amp.prepare_model(_model(device))
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(steps):
        _amp_step(amp, model, optimizer, *_batch(device, step))
    return amp, model, optimizer


def _amp_step(amp: Any, model: Any, optimizer: Any, x: Any, y: Any, loss_factor: float = 1.0) -> bool:
    import torch.nn.functional as F

    with amp.forward_context():
        loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y) * loss_factor
    amp.backward(loss)
    stepped = amp.step(optimizer)
    amp.update()
    optimizer.zero_grad(set_to_none=True)
    return stepped


def _amp_parity(device: Any, steps: int) -> str:
    import torch

    _, fused_model, _ = _amp_run(device, "O2", "float16", FUSED, steps)
    _, twin_model, _ = _amp_run(device, "O2", "float16", "foreach", steps)
    worst = 0.0
    for a, b in zip(fused_model.parameters(), twin_model.parameters()):
        torch.testing.assert_close(a, b)
        worst = max(worst, (a.float() - b.float()).abs().max().item())
    return f"{steps} steps, largest parameter difference {worst:.3g}"


def _amp_overflow(device: Any) -> str:
    amp, model, optimizer = _amp_run(device, "O2", "float16", FUSED, 2)
    before = [p.detach().clone() for p in model.parameters()]
    scale = amp.scalers[0].get_scale()
    stepped = _amp_step(amp, model, optimizer, *_batch(device, 99), loss_factor=float("inf"))
    assert not stepped and amp.skipped_steps == [1], (stepped, amp.skipped_steps)
    assert all(a.equal(b) for a, b in zip(before, model.parameters())), "a skipped step changed the parameters"
    assert amp.scalers[0].get_scale() == scale / 2, (amp.scalers[0].get_scale(), scale)
    return f"skipped, scale {scale:g} -> {scale / 2:g}, parameters unchanged"


def _plugin(device: Any, steps: int) -> str:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    from lightning_mpx import MixedPrecisionPlugin

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model("cpu")

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return F.cross_entropy(self.net(x).float(), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = [_batch("cpu", i) for i in range(steps)]
    module = Module()
    start = [p.detach().float().clone() for p in module.parameters()]
    plugin = MixedPrecisionPlugin("O2", half_dtype="float16", unscale_backend=FUSED)
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_steps=steps,
                         plugins=[plugin], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    params = list(module.parameters())  # back on the CPU: Lightning's teardown moves the model there
    assert trainer.global_step == steps, trainer.global_step
    assert trainer.strategy.root_device.type == device.type, trainer.strategy.root_device
    assert params[0].dtype == torch.float16, params[0].dtype
    assert all(torch.isfinite(p).all() for p in params), "non-finite parameters after fit"
    moved = sum(not torch.equal(p.float().cpu(), s) for p, s in zip(params, start))
    assert moved, "no parameter changed"
    return f"{steps} steps, {moved}/{len(params)} parameters moved, skipped {sum(plugin.amp.skipped_steps)}"


@contextlib.contextmanager
def _sync_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Record the warnings that ``torch.cuda.set_sync_debug_mode("warn")`` raises, one per host sync."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _count_syncs(device: Any, loop: str, warmup: int = 3, steps: int = 5) -> dict[str, Any]:
    """Host syncs in each of ``steps`` normal steps that follow ``warmup`` steps (kernel compilation, first
    allocations). ``loop``: ``"O1"``, ``"O2"``, ``"O2-bf16"`` (``Amp``, default backend) or ``"gradscaler"``."""
    import torch
    import torch.nn.functional as F

    if loop == "gradscaler":
        model = _model(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler(device.type)

        def one(x: Any, y: Any) -> None:
            with torch.autocast(device.type, dtype=torch.float16):
                loss = F.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    else:
        level, _, half = loop.partition("-")
        backend = "auto" if device.type == "cuda" else FUSED
        amp, model, optimizer = _amp_run(device, level, "bfloat16" if half == "bf16" else "float16", backend, 0)

        def one(x: Any, y: Any) -> None:
            _amp_step(amp, model, optimizer, x, y)

    for step in range(warmup):
        one(*_batch(device, step))
    if device.type != "cuda":  # --check: the loop ran; there is no device to sync with
        return {"per_step": None, "locations": [], "note": "no CUDA device (--check): syncs not counted"}
    per_step, locations = [], []
    for step in range(warmup, warmup + steps):
        batch = _batch(device, step)  # copying the batch to the device is the data loader's sync, not the step's
        torch.cuda.synchronize()
        with _sync_warnings() as caught:
            one(*batch)
        found = [w for w in caught if "synchroniz" in str(w.message)]
        per_step.append(len(found))
        locations += [_where(w.filename, w.lineno) for w in found]
    return {"per_step": per_step, "locations": sorted(set(locations)), "warmup": warmup}


def _where(filename: str, lineno: int) -> str:
    return f"{os.path.relpath(filename, ROOT) if filename.startswith(str(ROOT)) else filename}:{lineno}"
