"""A hostile user against stop 55's changes (bfloat16 O2): model surgery after set-up met by a checkpoint. A head
added after ``fabric.setup`` (or between two ``trainer.fit`` calls with one plugin) is prepared again when its
optimizer is registered; the checkpoint saved after it must resume into the model built whole with the head (a fresh
process's habit), as the run that saved it continues."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin, MixedPrecisionPlugin, MixedPrecisionSettings
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

HALF = "bfloat16"


class _Net(nn.Module):
    def __init__(self, head: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.head: nn.Module = nn.Identity()
        if head:
            _add_head(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(torch.tanh(self.fc1(x))))


def _add_head(model: nn.Module) -> None:
    torch.manual_seed(1)
    model.head = nn.Linear(4, 4)


def _fabric() -> tuple[Fabric, FabricMixedPrecisionPlugin]:
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype=HALF, loss_scale="dynamic", init_scale=2.0**8)
    return Fabric(accelerator="cpu", devices=1, plugins=[mpx]), mpx


def _train(fabric: Fabric, model: Any, optimizer: Any, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        fabric.backward(F.cross_entropy(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()


def test_a_fabric_checkpoint_saved_after_a_head_added_post_setup_resumes_into_the_model_built_whole(
    tmp_path: Path,
) -> None:
    """Fabric O2: train, add a head, register a new optimizer (the model is prepared again), train, ``fabric.save``;
    a fresh process builds the model with the head, sets it up and ``fabric.load``s: it was refused ("the checkpoint
    has master weights for 2 model(s) but 1 model(s) were prepared": the head's masters were a second model's, named
    ``model1.head.weight``). It now resumes exactly as the saving run continues."""
    fabric, mpx = _fabric()
    net = _Net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    mpx.setup_optimizers(optimizer)
    _train(fabric, model, optimizer, range(2))
    _add_head(net)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(net.parameters(), lr=1e-2))
    mpx.setup_optimizers(optimizer)
    _train(fabric, model, optimizer, range(2, 4))
    path = tmp_path / "head.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "mpx": mpx})
    saved = torch.load(path, weights_only=False)["mpx"]["masters_in_state_dict"]
    assert saved == [list(net.state_dict())], "one model's masters, named as its state dict"
    _train(fabric, model, optimizer, range(4, 6))
    uninterrupted = mpx.fp32_state_dict(model)

    fabric, mpx = _fabric()
    whole = _Net(head=True)
    model, optimizer = fabric.setup(whole, torch.optim.AdamW(whole.parameters(), lr=1e-2))
    mpx.setup_optimizers(optimizer)
    fabric.load(path, {"model": model, "optimizer": optimizer, "mpx": mpx})
    _train(fabric, model, optimizer, range(4, 6))
    resumed = mpx.fp32_state_dict(model)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


class _Headed(Classifier):
    def __init__(self, head: bool = False) -> None:
        super().__init__()
        self.head: nn.Module = nn.Identity()
        if head:
            _add_head(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return loader(classification_data(n=32))


def test_a_trainer_checkpoint_after_a_head_added_between_two_fits_resumes_with_a_new_plugin(tmp_path: Path) -> None:
    """One plugin, two ``trainer.fit`` calls, a head added between them (a second stage); the checkpoint of the second
    fit resumed by a new process (a new plugin, the model built with the head) was refused the same way; it now
    trains as the plugin that saved it resuming the same checkpoint."""
    plugin = MixedPrecisionPlugin("O2", half_dtype=HALF)
    model = _Headed()
    make_trainer(plugin, max_steps=2).fit(model)
    _add_head(model)
    trainer = make_trainer(plugin, max_steps=2)
    trainer.fit(model)
    path = os.path.join(tmp_path, "stage2.ckpt")
    trainer.save_checkpoint(path)
    make_trainer(plugin, max_steps=4).fit(model, ckpt_path=path)
    fresh = MixedPrecisionPlugin("O2", half_dtype=HALF)
    whole = _Headed(head=True)
    make_trainer(fresh, max_steps=4).fit(whole, ckpt_path=path)
    want, got = plugin.amp.fp32_state_dict(model), fresh.amp.fp32_state_dict(whole)
    assert got.keys() == want.keys() and any(k.startswith("head.") for k in want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_after_the_fit_a_model_made_fp32_loads_with_assign_true_as_in_fp32() -> None:
    """After an O2 fit, ``model.float()`` (the documented way back to an FP32 model: it takes its masters and lets them
    go), then ``load_state_dict(sd, assign=True)`` (a Hugging Face or meta-init habit) was refused as if the model
    still held half parameters with masters. The model is FP32's now: the load assigns, and a fit with a new plugin
    trains it as one from a model built and loaded in FP32."""
    plugin = MixedPrecisionPlugin("O2", half_dtype=HALF)
    model = _Headed()
    make_trainer(plugin, max_steps=2).fit(model)
    model.float()
    torch.manual_seed(5)
    loaded = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(loaded, assign=True)
    state = model.state_dict()
    assert all(state[k].data_ptr() == v.data_ptr() for k, v in loaded.items()), "assigned, as in FP32"
    fresh = _Headed()
    fresh.load_state_dict(loaded)
    runs = {}
    for name, net in (("reused", model), ("fresh", fresh)):
        second = MixedPrecisionPlugin("O2", half_dtype=HALF)
        make_trainer(second, max_steps=2).fit(net)
        runs[name] = second.amp.fp32_state_dict(net)
    assert all(torch.equal(runs["reused"][k], runs["fresh"][k]) for k in runs["fresh"])


def test_one_settings_object_given_to_every_door_warns_once_about_a_setting_its_level_ignores() -> None:
    """docs/core.md, "One settings object": the warning about a setting the level never reads comes once per
    settings object; the documented habit hands that object to each front door."""
    settings = MixedPrecisionSettings.from_kwargs("O1", half_dtype=HALF, model_writes="values")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Amp.from_settings(settings)
        MixedPrecisionPlugin.from_settings(settings)
        FabricMixedPrecisionPlugin.from_settings(settings)
    assert len([w for w in caught if "model_writes='values' is ignored" in str(w.message)]) == 1
