"""Stop 66 (savecopy66): the Trainer plugin's O2 checkpoint entry copies no master that the checkpoint's
``state_dict`` holds, and spectral norm at O2.

1. Lightning's ``dump_checkpoint`` (``trainer.save_checkpoint``, ``ModelCheckpoint``) asks the precision plugin for its
   ``state_dict()`` and calls its ``on_save_checkpoint`` next, which drops from the entry the masters the checkpoint's
   ``state_dict`` holds (the model's state-dict hook gives them there). The entry copied every master first: a model's
   worth of FP32 memory at every save (tests/test_core_save_memory.py's strict xfail). It now lends them for that one
   call (``lightning_checkpoints.LentMasters``); what is written, what callbacks and the checkpoint IO see, is
   unchanged: compared here with the same run under a subclass of the plugin that overrides ``on_save_checkpoint`` (the
   entry then copies, as before), file by file, bit for bit: ``ModelCheckpoint`` every step (full and weights only)
   written by ``AsyncCheckpointIO`` on its thread (it clones every tensor on the caller's thread first: the live masters
   in the checkpoint are copied there, which is right for a file written while training goes on), and
   ``trainer.save_checkpoint`` before the first step, inside validation and after the fit.
2. ``spectral_norm`` at O2: its power-iteration vectors are buffers, cast to half with the model as ``"bf16-true"``
   casts them (batch norm's statistics are kept FP32 because batch norm takes a half input with FP32 statistics;
   ``torch.mv`` of the half weight with an FP32 vector is refused, so those vectors cannot stay FP32 alone). The
   documented recipe, ``fp32_modules=[the layer]``, runs the layer FP32 whole, as ``"bf16-mixed"`` computes the
   normalized weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.test_core_save_memory import LAYERS, MASTER, LiveTemporaries, _batch, _net

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402


class Copying(MixedPrecisionPlugin):
    """The plugin with an ``on_save_checkpoint`` of its own: its entry copies the masters (the behaviour before)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, index: int) -> None:
        self.log("val", F.cross_entropy(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _live_storages(trainer: Any) -> set[int]:
    amp = trainer.precision_plugin.amp
    return {amp.master_of(p, refresh=False).untyped_storage().data_ptr() for p in trainer.lightning_module.parameters()}


class Saves(pl.Callback):
    """``trainer.save_checkpoint`` before the first step and inside validation, each watched; and, at every save, what
    a callback's ``on_save_checkpoint`` sees in the plugin's entry (whether it holds a live master), then an edit of
    the checkpoint (a key of the user's in the plugin's entry and in the ``state_dict``'s neighbourhood)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.peaks: dict[str, int] = {}
        self.live_in_entry: list[int] = []

    def _save(self, trainer: Any, name: str) -> None:
        with LiveTemporaries() as watch:
            trainer.save_checkpoint(self.folder / f"{name}.ckpt")
        self.peaks[name] = watch.peak

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self._save(trainer, "start")

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._save(trainer, "validation")

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        entry = checkpoint[type(trainer.precision_plugin).__qualname__]
        live = _live_storages(trainer)
        held = [t for masters in entry["master_weights"] for t in masters.values()]
        self.live_in_entry.append(sum(t.untyped_storage().data_ptr() in live for t in held))
        entry["users_note"] = len(held)  # an edit of the plugin's entry, and of the checkpoint
        checkpoint["users_sum"] = sum(float(v.float().sum()) for v in checkpoint["state_dict"].values())


def _fit(plugin: MixedPrecisionPlugin, folder: Path, io: list[Any]) -> dict[str, Any]:
    folder.mkdir()
    saves = Saves(folder)
    every = ModelCheckpoint(dirpath=folder, filename="step{step}", every_n_train_steps=1, save_top_k=-1)
    weights = ModelCheckpoint(dirpath=folder, filename="weights{step}", every_n_train_steps=3, save_top_k=-1,
                              save_weights_only=True)  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, val_check_interval=2, limit_val_batches=1,
                         num_sanity_val_steps=0, callbacks=[saves, every, weights], plugins=[plugin, *io])  # fmt: skip
    x, y = _batch()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.repeat(4, 1), y.repeat(4)), batch_size=4)
    trainer.fit(Module(), data, data)
    saves._save(trainer, "after_fit")
    return {"trainer": trainer, "saves": saves, "folder": folder}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("savecopy66")
    lent = _fit(MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16), root / "lent", [])
    lent_async = _fit(MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16), root / "async", [AsyncCheckpointIO()])
    copying = _fit(Copying("O2", half_dtype=torch.bfloat16), root / "copying", [])
    return {"lent": lent, "async": lent_async, "copying": copying}


def _same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, set(got) ^ set(want))
        for key in want:
            _same(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.mark.parametrize("io", ["lent", "async"])
def test_every_checkpoint_is_written_as_the_copying_entry_wrote_it(runs: dict[str, dict[str, Any]], io: str) -> None:
    """ModelCheckpoint every step, weights only, and ``trainer.save_checkpoint`` before the first step, inside
    validation and after the fit, written by the default checkpoint IO or by ``AsyncCheckpointIO`` on its thread
    while training goes on: the same files, bit for bit, as the entry that copies its masters (the plugin's key
    renamed) writes by the default IO; the masters are in the files' ``state_dict``, FP32."""
    lent, copying = runs[io]["folder"], runs["copying"]["folder"]
    names = sorted(p.name for p in copying.glob("*.ckpt"))
    assert names == sorted(p.name for p in lent.glob("*.ckpt"))
    assert {"start.ckpt", "validation.ckpt", "after_fit.ckpt", "stepstep=1.ckpt", "weightsstep=3.ckpt"} <= set(names)
    for name in names:
        got = torch.load(lent / name, weights_only=False)
        want = torch.load(copying / name, weights_only=False)
        got.pop("callbacks", None), want.pop("callbacks", None)  # ModelCheckpoint's dirpath differs
        if "Copying" in want:
            want["MixedPrecisionPlugin"] = want.pop("Copying")
            assert want["MixedPrecisionPlugin"]["master_weights"] == [{}]  # every master in the state_dict
        assert all(v.dtype == torch.float32 for v in got["state_dict"].values()), name
        _same(got, want, name)


def test_callbacks_see_an_entry_without_live_masters(runs: dict[str, dict[str, Any]]) -> None:
    """A callback's ``on_save_checkpoint`` (after the plugin's) finds no live master in the plugin's entry, at every
    save of the run (ModelCheckpoint's and the user's)."""
    for io in ("lent", "async"):
        seen = runs[io]["saves"].live_in_entry
        assert len(seen) == len(runs["copying"]["saves"].live_in_entry) == 6  # 3 steps, 3 of the user's
        assert seen == [0] * len(seen), io


def test_trainer_saves_copy_no_master(runs: dict[str, dict[str, Any]]) -> None:
    """``trainer.save_checkpoint`` before the first step, inside validation and after the fit: the temporaries alive
    at once stay under one master's bytes (after the fit, whose end moves the model, the model's state-dict hook and
    the entry's refresh compare each weight with its master's rounding, one at a time: they kept a boolean mask each,
    1.5 masters' bytes here, 24 MiB for 96 MiB of masters); the copying entry held every master at once (the watch
    sees them)."""
    lent, copying = runs["lent"]["saves"].peaks, runs["copying"]["saves"].peaks
    assert set(lent) == set(copying) == {"start", "validation", "after_fit"}
    for name in lent:
        assert copying[name] >= LAYERS * MASTER, (name, copying[name] / MASTER)
        assert lent[name] < MASTER, (name, lent[name] / MASTER)


def test_a_master_left_out_of_the_state_dict_stays_in_the_entry_as_a_copy(tmp_path: Path) -> None:
    """A LightningModule whose ``state_dict()`` leaves a trained layer out: the entry keeps that layer's master, a
    copy (training goes on without changing it), and a resume without strict loading restores it exactly."""

    class LeavesOut(Module):
        def state_dict(self, *args: Any, **kwargs: Any) -> Any:
            state = super().state_dict(*args, **kwargs)
            state.pop("net.0.weight", None)
            return state

    def trainer(steps: int) -> Any:
        return pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          plugins=[MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16)])  # fmt: skip

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_batch()), batch_size=4)
    first = trainer(1)
    module = LeavesOut()
    first.fit(module, data)
    checkpoint = first._checkpoint_connector.dump_checkpoint()
    saved = checkpoint["MixedPrecisionPlugin"]["master_weights"][0]
    assert set(saved) == {"net.0.weight"}
    live = first.precision_plugin.amp.master_of(module.net[0].weight)
    assert saved["net.0.weight"].untyped_storage().data_ptr() != live.untyped_storage().data_ptr()
    assert torch.equal(saved["net.0.weight"], live)
    first.save_checkpoint(tmp_path / "left_out.ckpt")
    resumed = LeavesOut()
    resumed.strict_loading = False
    second = trainer(1)
    second.fit(resumed, data, ckpt_path=tmp_path / "left_out.ckpt")
    assert torch.equal(second.precision_plugin.amp.master_of(resumed.net[0].weight), live)


def test_ddp_save_copies_no_master_and_writes_the_same_file(tmp_path: Path) -> None:
    """``strategy="ddp"`` (one process here: the module wrapped by DDP, rank 0 writes): a ``trainer.save_checkpoint``
    in ``on_train_batch_end`` copies no master and writes what the copying entry writes. The process group and the
    environment Lightning sets for it are taken down after."""
    import os

    import torch.distributed as dist

    environ = dict(os.environ)

    class Watched(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            with LiveTemporaries() as watch:
                trainer.save_checkpoint(tmp_path / f"{type(trainer.precision_plugin).__name__}.ckpt")
            peaks[type(trainer.precision_plugin).__name__] = watch.peak
            assert type(trainer.strategy.model).__name__ == "DistributedDataParallel"

    peaks: dict[str, int] = {}
    try:
        for plugin in (MixedPrecisionPlugin, Copying):
            trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=1, max_steps=1, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 callbacks=[Watched()], plugins=[plugin("O2", half_dtype=torch.bfloat16)])  # fmt: skip
            trainer.fit(Module(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_batch()), batch_size=4))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    assert peaks["Copying"] >= LAYERS * MASTER and peaks["MixedPrecisionPlugin"] < MASTER, peaks
    got = torch.load(tmp_path / "MixedPrecisionPlugin.ckpt", weights_only=False)
    want = torch.load(tmp_path / "Copying.ckpt", weights_only=False)
    want["MixedPrecisionPlugin"] = want.pop("Copying")
    _same(got, want, "ddp")


# -- 2. spectral norm (and weight norm) at O2 -------------------------------------------------------------------------

NORMS = {
    "spectral_norm": nn.utils.spectral_norm,  # the hook: weight_orig, buffers weight_u/weight_v
    "parametrizations.spectral_norm": nn.utils.parametrizations.spectral_norm,  # buffers _u/_v
    "parametrizations.weight_norm": nn.utils.parametrizations.weight_norm,  # no buffer: g and v are parameters
}


def _normed(norm: str) -> nn.Module:
    torch.manual_seed(0)  # the power iteration's starting vectors too
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    NORMS[norm](net[2])
    return net


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _first_forward(norm: str, **fabric: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training-mode forward through Fabric: its output and layer 2's floating tensors after it."""
    from lightning.fabric import Fabric

    net = _normed(norm)
    model = Fabric(accelerator="cpu", devices=1, **fabric).setup_module(net)
    out = model(_data()[0]).float()
    return out, dict(net[2].named_buffers())


@pytest.mark.parametrize("norm", list(NORMS))
def test_o2_computes_the_normalized_weight_in_half_as_bf16_true(norm: str) -> None:
    """Pinned (docs/master_weights.md, "What the cast leaves FP32"): at O2 spectral norm's power-iteration vectors are
    cast to half with the model and the normalized weight is computed from the half weight each forward, exactly as
    under Fabric's ``"bf16-true"`` (the FP32 masters are kept apart); weight norm's too (no buffers)."""
    from lightning_mpx import FabricMixedPrecisionPlugin

    got, got_buffers = _first_forward(norm, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype=torch.bfloat16)])
    want, want_buffers = _first_forward(norm, precision="bf16-true")
    assert torch.equal(got, want)
    assert got_buffers.keys() == want_buffers.keys() == ({"weight_u", "weight_v"} if norm == "spectral_norm"
                                                         else {"parametrizations.weight.0._u",
                                                               "parametrizations.weight.0._v"} if "spectral" in norm
                                                         else set())  # fmt: skip
    for name, value in got_buffers.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, want_buffers[name]), name


@pytest.mark.parametrize("norm", ["spectral_norm", "parametrizations.spectral_norm"])
def test_o2_with_the_normed_layer_in_fp32_modules_iterates_as_bf16_mixed(norm: str) -> None:
    """The recipe (docs/master_weights.md): ``fp32_modules=[the layer]`` keeps the layer FP32 whole, its
    power-iteration vectors FP32 and computed from the FP32 weight, bit for bit as under ``"bf16-mixed"`` (which
    computes them in FP32 from its FP32 weights); without it they are half."""
    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = FabricMixedPrecisionPlugin("O2", half_dtype=torch.bfloat16, fp32_modules=["2"])
    _, got = _first_forward(norm, plugins=[plugin])
    _, want = _first_forward(norm, precision="bf16-mixed")
    _, plain = _first_forward(norm, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype=torch.bfloat16)])
    for name, value in want.items():
        assert value.dtype == got[name].dtype == torch.float32 and torch.equal(got[name], value), name
        assert not torch.equal(plain[name].float(), value), name


def _fit_normed(norm: str, **trainer: Any) -> torch.Tensor:
    """Six SGD steps of the Trainer on the normed model; the trained model's FP32 output (eval mode)."""

    class Normed(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _normed(norm)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    module = Normed()
    x, y = _data()
    pl.Trainer(accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, **trainer).fit(
        module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.repeat(6, 1), y.repeat(6)), batch_size=8)
    )  # fmt: skip
    fresh = _normed(norm)
    fresh.load_state_dict({k: v.float() for k, v in module.net.state_dict().items()})  # the masters, FP32 buffers
    with torch.no_grad():
        return fresh.eval()(x)


@pytest.mark.parametrize("norm", ["spectral_norm", "parametrizations.spectral_norm"])
def test_trainer_o2_recipe_trains_as_bf16_mixed(norm: str) -> None:
    """Six SGD steps of the Trainer at O2 with the recipe against Lightning's ``"bf16-mixed"``: within twice the
    distance of the FP32 run from ``"bf16-mixed"`` (the recipe computes the layer's product in FP32, bf16-mixed in
    bfloat16: it sits between the two), and its buffers FP32 in the checkpoint's state dict."""
    from lightning_mpx import MixedPrecisionPlugin

    want = _fit_normed(norm, precision="bf16-mixed")
    fp32 = _fit_normed(norm, precision="32-true")
    got = _fit_normed(norm, plugins=[MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16, fp32_modules=["net.2"])])
    assert (got - want).abs().max() <= 2 * (fp32 - want).abs().max()
    assert (fp32 - want).abs().max() < 1e-2  # the runs are close: the comparison is of noise-level differences


def test_a_model_made_fp32_after_an_o2_fit_with_fp32_modules_runs_in_fp32() -> None:
    from lightning_mpx import MixedPrecisionPlugin

    class Small(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _normed("parametrizations.weight_norm")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Small()
    pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False,
               plugins=[MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16, fp32_modules=["net.2"])]).fit(
        module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=8)
    )  # fmt: skip
    module.float()
    assert module(_data()[0]).dtype == torch.float32
