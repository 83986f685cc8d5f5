"""The memory an O2 save takes: the lean entries (Fabric's plugin, the Accelerate adapter, the Apex layer) make no
FP32 copy of every master at once, and neither does an O3 resume's check of them (benchmarks/save_memory.py measures
the resident memory).

At stop 64 the lean entry's checksums of the masters' roundings (``masters_in_state_dict_half_sums``) made every
rounding before summing any (two FP32 copies of every master at once), and the engine's state dict it is made from
copied every master only for the lean entry to drop them (one more): a save of 96 MiB of masters peaked 321 MiB over
its start, 145 MiB once the roundings were summed in turn. What a save makes is watched here by
:class:`LiveTemporaries`, a dispatch mode entered only inside the test, which counts the bytes of every tensor an op
creates while it is alive: on a model of equal layers, one master at a time and all of them at once differ by the
number of layers."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

LAYERS, WIDTH = 6, 32
#: A save may hold this many of its largest master's bytes in temporaries at once (one master rounded to bfloat16
#: and back to FP32 takes 1.5); every master at once takes at least LAYERS.
FACTOR = 3


class LiveTemporaries(TorchDispatchMode):
    """Inside ``with``: the bytes of the tensors the ops create (a view of a tensor made before, or an op's result
    written into an input, counts nothing) that are alive at once, at their peak (:attr:`peak`). A storage counts
    until the last tensor made on it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data pointer -> [bytes, tensors alive on it]

    def _freed(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is not None:
            entry[1] -= 1
            if not entry[1]:
                del self._storages[key]
                self.live -= entry[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if not key or (key in inputs and key not in self._storages):
                continue
            if key in self._storages:
                self._storages[key][1] += 1
            else:
                self._storages[key] = [storage.nbytes(), 1]
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._freed, key)
        return out


def _peak(call: Callable[[], Any]) -> int:
    with LiveTemporaries() as watch:
        call()
    return watch.peak


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


#: The bytes of one layer's FP32 master: the largest (every master is one).
MASTER = WIDTH * WIDTH * 4


def _within(peak: int) -> None:
    """At least one master's FP32 rounding was watched (the watch sees the save's work), and at most ``FACTOR``
    masters' bytes were alive at once (all of them: ``LAYERS``)."""
    assert MASTER <= peak < FACTOR * MASTER, f"{peak / MASTER:.2f} masters' bytes alive at once (of {LAYERS})"


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, WIDTH, generator=g), torch.randint(0, WIDTH, (4,), generator=g)


def _fabric(level: str, seed: int = 0) -> tuple[Any, Any, Any]:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    mpx = FabricMixedPrecisionPlugin(level, half_dtype=torch.bfloat16)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    torch.manual_seed(seed)
    return (
        fabric,
        fabric.setup_module(nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])),
        mpx,
    )


@pytest.fixture(scope="module")
def fabric_o2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Fabric O2 run after one AdamW step, and its peak during the documented save (in a file, for the O3 tests)."""
    fabric, model, mpx = _fabric("O2")
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = _batch()
    fabric.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
    path = tmp_path_factory.mktemp("o2") / "run.ckpt"
    peak = _peak(lambda: fabric.save(path, {"model": model, "optimizer": optimizer, "mpx": mpx}))
    return {"path": path, "peak": peak, "mpx": mpx, "model": model}


def test_a_fabric_o2_save_copies_one_master_at_a_time(fabric_o2: dict[str, Any]) -> None:
    """``fabric.save(path, {"model", "optimizer", "mpx"})`` at O2: the plugin's entry (the masters named, their
    checksums and those of their roundings) holds a master's worth of temporaries at a time, not a model's."""
    _within(fabric_o2["peak"])


def test_an_accelerate_o2_save_state_copies_one_master_at_a_time(fresh_accelerate_state: None, tmp_path: Path) -> None:
    """``accelerator.save_state(folder)`` at O2 (the adapter's lean entry beside the model file)."""
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(mixed_precision="O2", cpu=True,
                              kwargs_handlers=[MixedPrecisionKwargs(half_dtype=torch.bfloat16)])  # fmt: skip
    net = _net()
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-2))
    x, y = _batch()
    accelerator.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    _within(_peak(lambda: accelerator.save_state(str(tmp_path / "state"))))
    from lightning_mpx.integrations.accelerate_checkpoint import AMP_STATE_NAME

    assert torch.load(tmp_path / "state" / AMP_STATE_NAME)["master_weights"] == [{}]  # the lean entry was saved


def test_an_apex_o2_amp_state_dict_copies_one_master_at_a_time() -> None:
    """``amp.state_dict()`` at O2 (Apex's checkpoint saves it beside ``model.state_dict()``, which holds the
    masters)."""
    from lightning_mpx.apex import amp
    from lightning_mpx.apex._state import _amp_state

    net = _net()
    try:
        model, optimizer = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=1e-2), opt_level="O2",
                                          cast_model_type=torch.bfloat16, verbosity=0)  # fmt: skip
        x, y = _batch()
        with amp.scale_loss(F.cross_entropy(model(x.bfloat16()).float(), y), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        state: dict[str, Any] = {}
        _within(_peak(lambda: state.update(amp.state_dict())))
        assert state["lightning_mpx"]["master_weights"] == [{}]
    finally:
        _amp_state.reset()


def test_a_trainer_o2_save_checkpoint_copies_one_master_at_a_time(tmp_path: Path) -> None:
    """``trainer.save_checkpoint(path)`` at O2 through ``MixedPrecisionPlugin``: the plugin's entry lends the masters
    the checkpoint's ``state_dict`` holds for the one call from its ``state_dict()`` to its ``on_save_checkpoint``
    (copying each, it held every master at once; tests/test_lightning_checkpoint_copies.py)."""
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         plugins=[MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16)])  # fmt: skip
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_batch()), batch_size=4))
    # The save's work here (the fit's end moved the model: each weight is compared with its master's bfloat16
    # rounding, half a master's bytes, one at a time) is watched, and under one master's bytes are alive at once.
    peak = _peak(lambda: trainer.save_checkpoint(tmp_path / "last.ckpt"))
    assert MASTER // 2 <= peak < MASTER, f"{peak / MASTER:.2f} masters' bytes alive at once (of {LAYERS})"


@pytest.mark.parametrize("entries", ["model_first", "plugin_alone"])
def test_an_o3_resume_checks_one_rounding_at_a_time(fabric_o2: dict[str, Any], entries: str) -> None:
    """The O2 checkpoint resumed at O3: ``fabric.load`` (the model's entry first, or the plugin's alone, which the
    next forward refuses) and the forward, whose checks round each master in turn."""
    fabric, model, mpx = _fabric("O3", seed=1)
    x = _batch()[0].bfloat16()

    def resume() -> None:
        if entries == "model_first":
            fabric.load(fabric_o2["path"], {"model": model, "mpx": mpx})
            model(x)
            return
        fabric.load(fabric_o2["path"], {"mpx": mpx}, strict=False)
        with pytest.raises(RuntimeError, match="the model's weights were not loaded"):
            model(x)

    _within(_peak(resume))


def test_the_state_dicts_handed_out_hold_copies_of_the_masters(fabric_o2: dict[str, Any]) -> None:
    """What the engine's state dict hands out keeps its values while training goes on: the core's
    ``Amp.state_dict()`` holds copies of the masters, and the plugin's lean entry (the masters not copied, then
    dropped) none of the live masters."""
    mpx, model = fabric_o2["mpx"], fabric_o2["model"]
    live = {mpx.amp.master_of(p).data_ptr() for p in model.parameters()}
    core = [t for t in tree_flatten(mpx.amp.state_dict())[0] if isinstance(t, torch.Tensor)]
    lean = [t for t in tree_flatten(mpx.state_dict())[0] if isinstance(t, torch.Tensor)]
    assert sum(t.numel() == WIDTH * WIDTH for t in core) == LAYERS  # the masters are there
    assert not {t.data_ptr() for t in core + lean} & live


def test_the_checksums_round_and_sum_a_large_tensor_a_chunk_at_a_time() -> None:
    """One tensor of three chunks and a bit (``held_masters._CHUNK`` elements each): its checksums (and those of its
    bfloat16 rounding) are the sums of all its bits, made with temporaries of under two chunks' FP32 bytes (the
    whole tensor's rounding is three)."""
    from lightning_mpx.engine.held_masters import _CHUNK, checksums

    value = torch.randn(3 * _CHUNK + 5, generator=torch.Generator().manual_seed(0))
    sums: dict[str, dict[str, int]] = {}
    peak = _peak(lambda: sums.update(fp32=checksums({"w": value}), half=checksums({"w": value}, torch.bfloat16)))
    assert peak < 2 * 4 * _CHUNK, f"{peak / (4 * _CHUNK):.2f} chunks' FP32 bytes alive at once"
    bits = value.view(torch.int32).to(torch.int64).sum().item()
    rounded = value.to(torch.bfloat16).float().view(torch.int32).to(torch.int64).sum().item()
    assert sums == {"fp32": {"w": bits}, "half": {"w": rounded}}


def test_save_memory_check_runs_every_door(fresh_accelerate_state: None, tmp_path: Path) -> None:
    """``benchmarks/save_memory.py --check``: every row's save runs in this process on a tiny model and the result
    holds the fields the docs quote (its figures mean nothing)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import save_memory

    out = tmp_path / "save_memory.json"
    result = save_memory.main(["--check", "--out", str(out)])
    assert result["check"] and out.exists() and out.with_suffix(".md").exists()
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == [v[0] for v in save_memory.VARIANTS]
    for row in rows.values():
        assert row["fp32_weight_bytes"] == 2 * (32 * 32 + 32) * 4 and row["checkpoint_bytes"] > 0
        assert row["peak_over_start_bytes"] >= 0 and row["peak_method"] in ("VmHWM", "statm every 0.5 ms")
        assert row["peak_over_weights"] == row["peak_over_start_bytes"] / row["fp32_weight_bytes"]
