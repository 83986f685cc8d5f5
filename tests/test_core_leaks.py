"""What the engine keeps alive: optimizers re-created mid-run, models dropped while the engine lives, a plugin kept
after its fit (a notebook), and the engine's containers over many steps."""

from __future__ import annotations

import gc
import weakref

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin
from tests.lightning_helpers import classification_data, loader, make_trainer


def _steps(amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer, n: int, inf_every: int = 0) -> None:
    for i in range(n):
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(torch.randn(4, 8)))).sum()
        if inf_every and i % inf_every == 0:
            loss = loss * float("inf")
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def test_recreated_optimizers_are_collected() -> None:
    """A fine-tuning loop that makes a new Adam per stage: each old one and its state go once the user drops it."""
    for level in ("O1", "O2"):
        amp = Amp(level, half_dtype=torch.bfloat16)
        model = amp.prepare_model(_mlp())
        refs = []
        for _ in range(3):
            optimizer = amp.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
            _steps(amp, model, optimizer, 2)
            refs += [weakref.ref(optimizer), weakref.ref(next(iter(optimizer.state.values()))["exp_avg"])]
            del optimizer
        gc.collect()
        assert [r() for r in refs] == [None] * len(refs), level


def test_dropped_model_takes_its_masters() -> None:
    """O2: a model the user drops while its engine lives (a notebook's engine, a later stage's) frees its FP32 masters
    at once; before, the engine's entries kept them until it prepared another model."""
    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(_mlp())
    optimizer = amp.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    _steps(amp, model, optimizer, 2)
    masters = [weakref.ref(amp.master_of(p)) for p in model.parameters()]
    assert all(m() is not None and m().dtype == torch.float32 for m in masters)
    del model, optimizer
    gc.collect()
    assert [m() for m in masters] == [None] * len(masters)


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_plugin_kept_after_fit_holds_no_run() -> None:
    """A notebook keeps its plugin and drops the Trainer and model after ``fit``: the model, the Trainer, the Adam and
    the FP32 masters go, as with Lightning's own "bf16-mixed" (the plugin held the model, and through it all of them).
    The kept plugin fitting a new model after that starts a fresh engine, as for any other model."""
    plugin = MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16)
    module = _Module()
    trainer = make_trainer(plugin)
    trainer.fit(module, loader(classification_data()))
    refs = [weakref.ref(module), weakref.ref(trainer), weakref.ref(trainer.optimizers[0])]
    refs += [weakref.ref(plugin.amp.master_of(p)) for p in module.parameters()]
    first_amp = plugin.amp
    module.state_dict()  # a weights-only save after the fit: the FP32 values it handed out go with the model too
    del module, trainer
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    again = _Module()
    make_trainer(plugin).fit(again, loader(classification_data()))
    assert plugin.amp is not first_amp
    assert all(plugin.amp.master_of(p).dtype == torch.float32 for p in again.parameters())


def _sizes(obj: object, seen: set[int], path: str, out: dict[str, int], depth: int = 0) -> None:
    """The length of every container reachable from ``obj`` through lightning_mpx objects, by path."""
    if depth > 6 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (dict, list, set, tuple)):
        out[path] = len(obj)
        items = list(obj.items()) if isinstance(obj, dict) else list(enumerate(obj))
        for key, value in items[:20]:
            _sizes(value, seen, f"{path}[{str(key)[:20]}]", out, depth + 1)
    elif type(obj).__module__.startswith("lightning_mpx"):
        fields = vars(obj) if hasattr(obj, "__dict__") else {}
        for name, value in fields.items():
            _sizes(value, seen, f"{path}.{name}", out, depth + 1)


def test_engine_containers_do_not_grow_per_step() -> None:
    """80 float16 steps with overflows, telemetry, metrics and the forensics' watch: no container of the engine
    (records, outcomes, telemetry, readers) grows between step 40 and step 80 (a probe of 200 steps found none)."""
    amp = Amp("O2", half_dtype=torch.float16, on_floor="continue", diagnose_overflows=True)
    model = amp.prepare_model(_mlp())
    optimizer = amp.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    snapshots = []
    for _ in range(2):
        for _ in range(4):
            amp.request_telemetry()
            _steps(amp, model, optimizer, 10, inf_every=7)
            amp.metrics()
        out: dict[str, int] = {}
        _sizes(amp, set(), "amp", out)
        snapshots.append(out)
    grew = {k: (snapshots[0].get(k), v) for k, v in snapshots[1].items() if v > max(snapshots[0].get(k) or 0, 2)}
    assert grew == {}
