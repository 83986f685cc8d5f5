"""O2 checkpoints from a Trainer user's habits: each FP32 master written once whatever the CheckpointIO
(``AsyncCheckpointIO`` clones every tensor), weights-only checkpoints (``ModelCheckpoint(save_weights_only=True)``,
``trainer.save_checkpoint(path, weights_only=True)``) holding the FP32 masters, not their half rounding, and
checkpoints of the earlier format (the plugin's entry holding the masters) still resuming exactly."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin
from lightning_mpx.integrations.lightning_conversion import masters_from_checkpoint
from tests.lightning_helpers import classification_data, loader, make_trainer


class _Net(pl.LightningModule):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 4))
        self.seen: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_epoch_end(self) -> None:  # a user's habit: self.state_dict() in a hook during the fit
        self.seen = {k: v.detach().clone() for k, v in self.state_dict().items()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)


def _data() -> torch.utils.data.DataLoader:
    return loader(classification_data(n=16, seed=1), batch_size=8)


def _o2(half: torch.dtype = torch.bfloat16, **kwargs: Any) -> pl.Trainer:
    return make_trainer(MixedPrecisionPlugin("O2", half_dtype=half), **kwargs)


def _masters(trainer: pl.Trainer, model: nn.Module) -> dict[str, torch.Tensor]:
    return trainer.precision_plugin.amp.fp32_state_dict(model)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in got.items():
        assert value.dtype == torch.float32 and torch.equal(value, want[name]), name


def test_an_o2_checkpoint_holds_each_master_once_under_async_checkpoint_io(tmp_path: Any) -> None:
    """4 bytes a parameter as ``"bf16-mixed"``'s (not 8: the entry holds no copy to clone), O3's half of it; the
    asynchronous checkpoint resumes as an uninterrupted run."""
    sizes = {}
    for name, kwargs in {
        "bf16-mixed": dict(precision="bf16-mixed"),
        "O2": dict(plugins=[MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16), AsyncCheckpointIO()]),
        "O3": dict(plugins=[MixedPrecisionPlugin("O3", half_dtype=torch.bfloat16)]),
    }.items():
        model = _Net(width=1024)  # 21k parameters: the weights dominate the file
        trainer = make_trainer(max_steps=1, **kwargs)
        trainer.fit(model, _data())
        trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
        trainer.strategy.checkpoint_io.teardown()  # waits for the asynchronous write
        sizes[name] = (tmp_path / f"{name}.ckpt").stat().st_size
    assert sizes["O2"] <= sizes["bf16-mixed"] * 1.05, sizes
    assert sizes["O3"] <= sizes["bf16-mixed"] * 0.6, sizes

    whole = _Net()
    trainer = _o2(max_epochs=2)  # cut at an epoch's end: a resume continues exactly where it ended
    trainer.fit(whole, _data())
    first = _Net()
    cut = _o2(plugins=[AsyncCheckpointIO()])
    cut.fit(first, _data())
    cut.save_checkpoint(tmp_path / "cut.ckpt")
    cut.strategy.checkpoint_io.teardown()
    resumed = _Net()
    again = _o2(max_epochs=2)
    again.fit(resumed, _data(), ckpt_path=str(tmp_path / "cut.ckpt"))
    _assert_equal(_masters(again, resumed), _masters(trainer, whole))


def test_a_weights_only_o2_checkpoint_holds_the_fp32_masters_during_and_after_the_fit(tmp_path: Any) -> None:
    """``ModelCheckpoint(save_weights_only=True)`` (float16, whose rounding is coarser than the steps) and a
    weights-only ``trainer.save_checkpoint`` after the fit: ``load_from_checkpoint`` gets the masters, as a full
    checkpoint's ``state_dict`` gives; ``self.state_dict()`` in the fit too, while
    ``state_dict(keep_vars=True)`` is the half parameters and a deep copy keeps its own values."""
    model = _Net()
    callback = ModelCheckpoint(dirpath=tmp_path, save_weights_only=True, filename="cb")
    trainer = _o2(torch.float16, max_epochs=1, enable_checkpointing=True, callbacks=[callback])
    trainer.fit(model, _data())
    masters = _masters(trainer, model)
    assert any(not torch.equal(v, v.half().float()) for v in masters.values())  # finer than half: the test can fail
    _assert_equal(_Net.load_from_checkpoint(tmp_path / "cb.ckpt").state_dict(), masters)
    _assert_equal(model.seen, masters)
    trainer.save_checkpoint(tmp_path / "after.ckpt", weights_only=True)
    _assert_equal(_Net.load_from_checkpoint(tmp_path / "after.ckpt").state_dict(), masters)
    for name, value in model.state_dict(keep_vars=True).items():
        assert value.dtype == torch.float16 and torch.equal(value, masters[name].half()), name
    assert all(v.dtype == torch.float16 for v in copy.deepcopy(model).state_dict().values())

    # A model loaded from it resumes at O2 from the masters (its rounding in the half model).
    resumed = _Net.load_from_checkpoint(tmp_path / "after.ckpt")
    again = _o2(torch.float16, max_steps=0)
    again.fit(resumed, _data())
    _assert_equal(_masters(again, resumed), masters)


def _old_format(path: Any, out: Any, *, half_state: bool) -> None:
    """The checkpoint at ``path`` as earlier releases wrote it: the plugin's entry holds the masters, and the
    ``state_dict`` the masters too (stop 51 on) or the half values (``half_state``: before)."""
    saved = torch.load(path, weights_only=True)
    entry = saved["MixedPrecisionPlugin"]
    for masters, names in zip(entry["master_weights"], entry.pop("masters_in_state_dict")):
        for name in names:
            masters[name] = saved["state_dict"][name].clone()
            if half_state:
                saved["state_dict"][name] = saved["state_dict"][name].bfloat16()
    torch.save(saved, out)


def test_a_checkpoint_of_the_earlier_format_resumes_exactly(tmp_path: Any) -> None:
    whole = _Net()
    trainer = _o2(max_epochs=2)
    trainer.fit(whole, _data())
    first = _Net()
    cut = _o2()
    cut.fit(first, _data())
    cut.save_checkpoint(tmp_path / "new.ckpt")
    for half_state in (False, True):
        _old_format(tmp_path / "new.ckpt", tmp_path / "old.ckpt", half_state=half_state)
        resumed = _Net()
        again = _o2(max_epochs=2)
        again.fit(resumed, _data(), ckpt_path=str(tmp_path / "old.ckpt"))
        _assert_equal(_masters(again, resumed), _masters(trainer, whole))


@pytest.mark.parametrize("model_first", [True, False])
def test_the_entry_loaded_by_a_plain_engine_takes_the_masters_from_the_model_state_dict(
    tmp_path: Any, model_first: bool
) -> None:
    """A Trainer checkpoint resumed in a plain loop (``Amp.load_state_dict(ckpt["MixedPrecisionPlugin"])`` and
    ``model.load_state_dict(ckpt["state_dict"])``, in either order): the masters are the checkpoint's exactly, though
    the entry no longer holds them; a ``state_dict`` that lacks one is refused when the entry is made whole again."""
    model = _Net()
    trainer = _o2(max_steps=2)
    trainer.fit(model, _data())
    trainer.save_checkpoint(tmp_path / "o2.ckpt")
    masters = _masters(trainer, model)
    saved = torch.load(tmp_path / "o2.ckpt", weights_only=True)
    amp = Amp("O2", half_dtype=torch.bfloat16)
    plain = amp.prepare_model(_Net(width=16))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.5))
    loads = [
        lambda: plain.load_state_dict(saved["state_dict"]), lambda: amp.load_state_dict(saved["MixedPrecisionPlugin"])
    ]
    for load in loads if model_first else loads[::-1]:
        load()
    optimizer.load_state_dict(saved["optimizer_states"][0])
    _assert_equal(amp.fp32_state_dict(plain), masters)
    broken = {**saved, "state_dict": {k: v for k, v in saved["state_dict"].items() if k != "net.0.weight"}}
    with pytest.raises(KeyError, match=r"'net\.0\.weight'.*nothing was loaded"):
        masters_from_checkpoint(broken, "MixedPrecisionPlugin")
