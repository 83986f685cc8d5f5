"""Helper attack65a: a hostile Lightning user (``Trainer`` and Fabric) of stop 64's surfaces, against Lightning's own
precisions (``"bf16-mixed"``, a real ``"16-mixed"`` with a ``GradScaler``: on a CPU ``precision="16-mixed"`` is turned
into ``"bf16-mixed"`` by Lightning, so the reference is built as ``MixedPrecision("16-mixed", "cpu", scaler=...)``).

Found and fixed:

1. At O2, weights of another floating dtype loaded into a set-up model (``model.load_state_dict`` of a float16
   checkpoint into a bfloat16 model, ``fabric.load_raw``, a state dict built from NumPy's float64 arrays, a callback's
   load mid-fit) reached the FP32 masters as their half rounding: only FP32 values went to the masters exactly. The run
   trained on silently from the rounded weights (bfloat16's rounding of float16 weights, 9.8e-4 off after the load),
   where ``"bf16-mixed"``'s FP32 model holds them exactly; now the masters take them as an FP32 model does.
2. ``fabric.load`` of a checkpoint whose model entry had a weight replaced by hand, with the state ordered as
   docs/fabric.md writes it (``{"model": ..., "optimizer": ..., "mpx": ...}``), was refused at the next forward:
   "the model's weights were not loaded from it" (they were, before the plugin's entry); only ``"mpx"`` first passed.
3. ``fabric.load`` of an O2 checkpoint before ``fabric.setup`` got ``ValueError: ... 0 model(s) were prepared with
   master weights``, naming no call.
4. A Trainer fit at O2 resumed from a checkpoint saved after (or inside) ``trainer.validate``/``test`` before any fit
   failed with ``ValueError: the checkpoint has master weights for 0 model(s) but 1 model(s)...``, blaming a
   take-over; one saved inside the stage held the half model's weights.

Held (no change): ``fabric.backward`` refused before any set-up and every set-up pattern (``setup_module`` then
``setup_optimizers``, ``setup(model)`` then optimizers, a GAN set up one by one, inside ``fabric.launch``) trains as
``"16-mixed"``/``"bf16-mixed"``; ``fabric.clip_gradients`` limits (by norm, by value, ``norm_type=inf``, from a
``Fabric`` subclass, ``functools.partial``, inside ``fabric.launch``) and the Trainer's clipping against
``"16-mixed"``; the Trainer's O2 resumes; rank-0-only reads under the Trainer's DDP
(``tests/lightning_rank_zero_reads_script.py``).

Tiny models on CPU, bfloat16 unless the scale is the point.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.launch import rank_results, run_script
from tests.lightning_helpers import make_trainer


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def _fabric(precision: str, cls: type[Fabric] = Fabric, **scaling: Any) -> Fabric:
    """``"O1"``/``"O2"`` with ``:float16`` for float16 (else bfloat16), or Lightning's own precision; ``"16-mixed"`` is
    a real float16 autocast with a ``GradScaler`` (``precision="16-mixed"`` would be bfloat16 on a CPU)."""
    if precision.startswith("O"):
        level, _, dtype = precision.partition(":")
        plugin = FabricMixedPrecisionPlugin(level, half_dtype=dtype or "bfloat16", **scaling)
        return cls(accelerator="cpu", devices=1, plugins=[plugin])
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", **scaling)
        return cls(accelerator="cpu", devices=1, plugins=[FabricMixedPrecision("16-mixed", "cpu", scaler=scaler)])
    return cls(accelerator="cpu", devices=1, precision=precision)


def _flat(module: nn.Module) -> torch.Tensor:
    """The model's state dict as one FP32 vector (at O2 the FP32 masters: a set-up model's ``state_dict()`` gives
    them)."""
    return torch.cat([v.detach().float().flatten() for v in module.state_dict().values()])


# -- 1. weights of another dtype loaded after set-up ------------------------------------------------------------------
def _loaded_run(precision: str, values: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step, then ``values`` loaded into the set-up model (``model.load_state_dict``), then two steps: the weights
    right after the load and at the end."""
    fabric = _fabric(precision)
    net = _net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for step in range(3):
        if step == 1:
            model.load_state_dict(values)
            loaded = _flat(model)
        x, y = _batch(step)
        fabric.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    return loaded, _flat(model)


def _other_weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights of another model in ``dtype``: values a float16 checkpoint holds (so that FP32 keeps them exactly);
    in bfloat16 a bias of small values too, which float16 holds as subnormals (rounded)."""
    values = {k: (v * 1.37).to(torch.float16).to(dtype) for k, v in _net(1).state_dict().items()}
    if dtype == torch.bfloat16:
        values["0.bias"] = values["0.bias"] * 1e-5
    return values


@pytest.mark.parametrize(
    ("precision", "reference", "dtype"),
    [
        ("O2", "bf16-mixed", torch.float16),  # a float16 checkpoint into a bfloat16 model
        ("O2", "bf16-mixed", torch.float64),  # a state dict made from NumPy's float64 arrays
        ("O2:float16", "16-mixed", torch.bfloat16),  # a bfloat16 checkpoint into a float16 model (small values)
    ],
    ids=["float16-into-bf16", "float64-into-bf16", "bfloat16-into-fp16"],
)
def test_weights_of_another_dtype_loaded_after_setup_reach_the_masters(
    precision: str, reference: str, dtype: torch.dtype
) -> None:
    """Weights of another floating dtype loaded into an O2 model after ``fabric.setup`` go to its FP32 masters as
    Lightning's FP32 model takes them: the weights right after the load, and after two steps, are ``reference``'s bit
    for bit. Before, only FP32 values reached the masters exactly: these took the model's half rounding (9.8e-4 off
    for float16 values in a bfloat16 model) and training went on from it, silently."""
    values = _other_weights(dtype)
    loaded, final = _loaded_run(precision, values)
    want_loaded, want_final = _loaded_run(reference, values)
    assert torch.equal(want_loaded, torch.cat([v.float().flatten() for v in values.values()]))  # FP32's: exact
    assert torch.equal(loaded, want_loaded)
    assert torch.equal(final, want_final)


class _LoadAtEpoch(pl.Callback):
    """Loads ``values`` into the LightningModule's ``net`` when epoch 1 starts (a warm restart from other weights)."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self.values = values

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            pl_module.net.load_state_dict(self.values)


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

    test_step = validation_step

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_load_mid_fit_of_float16_weights_reaches_the_masters() -> None:
    """A callback loading float16 weights into the LightningModule mid-fit (epoch 1) at O2 bfloat16: the fit ends
    with ``"bf16-mixed"``'s weights bit for bit (before: 1.0e-3 off, trained on from their bfloat16 rounding)."""
    data = torch.utils.data.TensorDataset(*_batch(0))
    values = _other_weights(torch.float16)
    finals = []
    for plugin in (dict(precision="bf16-mixed"), dict(plugins=[MixedPrecisionPlugin("O2", half_dtype="bfloat16")])):
        model = _Net()
        trainer = make_trainer(max_epochs=2, callbacks=[_LoadAtEpoch(values)], **plugin)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
        finals.append(_flat(model))
    assert torch.equal(finals[0], finals[1])


# -- 2. a checkpoint edited by hand, loaded with the model first -------------------------------------------------------
def _resumed(precision: str, path: Any, keys: tuple[str, ...]) -> torch.Tensor:
    """``path`` loaded with ``fabric.load`` of the state's ``keys`` in that order, then two steps: the weights."""
    fabric = _fabric(precision)
    net = _net()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": opt, "mpx": fabric.strategy.precision}
    fabric.load(path, {key: state[key] for key in keys})
    for step in range(2):
        x, y = _batch(step)
        fabric.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    return _flat(model)


@pytest.mark.parametrize("precision", ["O2", "O1"])
def test_a_checkpoint_with_a_weight_replaced_by_hand_loads_with_the_model_first(precision: str, tmp_path: Any) -> None:
    """An O2 checkpoint whose model entry had a weight replaced by hand (a head re-initialised for a new task),
    loaded as docs/fabric.md writes the state (``{"model": ..., "optimizer": ..., "mpx": ...}``, the model first),
    trains on as ``"bf16-mixed"`` loading the same file: at O2 and resumed at O1. Before, the plugin refused at the
    next forward, saying the model's weights were not loaded from the checkpoint (they were, before its entry: only
    the order ``{"mpx": ..., "model": ...}`` passed). The entry loaded without the model is still refused."""
    fabric = _fabric("O2")
    net = _net()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for step in range(2):
        x, y = _batch(step)
        fabric.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    fabric.save(tmp_path / "saved.ckpt", {"model": model, "optimizer": opt, "mpx": fabric.strategy.precision})
    checkpoint = torch.load(tmp_path / "saved.ckpt", weights_only=False)
    checkpoint["model"]["2.weight"] = torch.full_like(checkpoint["model"]["2.weight"], 0.01)
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    want = _resumed("bf16-mixed", tmp_path / "edited.ckpt", ("model", "optimizer"))
    for keys in (("model", "optimizer", "mpx"), ("mpx", "optimizer", "model")):
        assert torch.equal(_resumed(precision, tmp_path / "edited.ckpt", keys), want), keys
    with pytest.raises(RuntimeError, match="the model's weights were not loaded from it"):
        _resumed(precision, tmp_path / "edited.ckpt", ("optimizer", "mpx"))


# -- 3. rank-0-only reads under DDP: one launch --------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("attack65a")
    run_script("lightning_rank_zero_reads_script.py", out, timeout=150)
    ranks = rank_results(out)
    for case in ranks[0]:
        for rank in ranks:
            assert "error" not in rank[case], (case, rank[case].get("error"))
    assert [rank["after"]["sum"] for rank in ranks] == [2.0, 2.0]  # the process group works after every case
    return ranks


@pytest.mark.parametrize("case", ["trainer_auto/O1", "trainer_gan/O2", "fabric_gan/O1"])
def test_rank_zero_reads_never_part_the_ranks(launched: list[dict[str, Any]], case: str) -> None:
    """Rank 0 alone reads the scale (``scaler.get_scale()``, ``metrics()``, ``state_dict()``: in
    ``on_before_optimizer_step`` and ``on_train_batch_end`` callbacks, between a GAN's two steps), with accumulation,
    ``LearningRateMonitor``, ``ModelCheckpoint(every_n_train_steps=1)``, ``toggle_optimizer``, a generator set up in
    pieces inside ``fabric.launch``, fused AdamW (skipped on the device) and float16 overflows on rank 1 only: no hang,
    the same scale at every batch and the same weights on both ranks, the scale backed off at the overflows; the three
    reads agree."""
    zero, one = launched[0][case], launched[1][case]
    assert zero["live"] == one["live"] and zero["final"] == one["final"]
    live = zero["live"]
    assert any(b < a for a, b in zip(live, live[1:])) and len(set(live)) > 2  # backed off, and moved otherwise
    assert zero["seen"] and all(len(set(read[1:])) == 1 for read in zero["seen"])
    assert one["seen"] == []


@pytest.mark.parametrize("front", ["trainer_auto", "fabric_gan"])
def test_rank_zero_reads_show_what_16_mixed_shows(launched: list[dict[str, Any]], front: str) -> None:
    """The same runs under Lightning's ``"16-mixed"`` (a ``GradScaler``, read with ``get_scale()`` at the same points
    on rank 0): the same scale at every batch, the same reads, bit-equal weights (O1 float16; a constant learning
    rate, which ``"16-mixed"`` would step on a skipped step too)."""
    ours, native = launched[0][f"{front}/O1"], launched[0][f"{front}/16-mixed"]
    assert ours["live"] == native["live"]
    assert ours["seen"] == native["seen"]
    assert ours["final"] == native["final"]


def test_fabric_load_before_setup_names_the_calls(tmp_path: Any) -> None:
    """``fabric.load(path, {"model": net, "optimizer": opt, "mpx": mpx})`` before ``fabric.setup`` (a script that
    builds, loads, then sets up) with an O2 checkpoint: a ``RuntimeError`` naming ``fabric.setup`` before
    ``fabric.load``, as for an entry that holds its masters. Before, the lean entry (whose masters the model's entry
    holds) got ``ValueError: the checkpoint has master weights for 1 model(s) but 0 model(s) were prepared with master
    weights``, naming no call. Loaded after ``fabric.setup``, it resumes."""
    fabric = _fabric("O2")
    net = _net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fabric.save(tmp_path / "o2.ckpt", {"model": model, "optimizer": opt, "mpx": fabric.strategy.precision})
    fabric = _fabric("O2")
    net = _net(1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = {"model": net, "optimizer": opt, "mpx": fabric.strategy.precision}
    named = r"before prepare_model\(\).*fabric\.load\(path, state\) after fabric\.setup"
    with pytest.raises(RuntimeError, match=named):
        fabric.load(tmp_path / "o2.ckpt", state)
    model, opt = fabric.setup(net, opt)
    fabric.load(tmp_path / "o2.ckpt", {"model": model, "optimizer": opt, "mpx": fabric.strategy.precision})
    assert torch.equal(_flat(model), _flat(_net()))


class _SaveAtEnd(pl.Callback):
    """``trainer.save_checkpoint(path)`` in ``on_validation_end``/``on_test_end``: inside the evaluation stage."""

    def __init__(self, path: Any) -> None:
        self.path = path

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)

    on_test_end = on_validation_end


@pytest.mark.parametrize("where", ["after", "inside"])
@pytest.mark.parametrize("stage", ["validate", "test"])
def test_a_fit_resumes_from_a_checkpoint_saved_at_an_evaluation(stage: str, where: str, tmp_path: Any) -> None:
    """``trainer.validate(model)`` (or ``test``) before any fit, a checkpoint saved after it
    (``trainer.save_checkpoint``) or inside it (a callback's ``on_validation_end``), then another model's
    ``trainer.fit(model, ckpt_path=path)`` at O2: it trains from the checkpoint's weights as ``"bf16-mixed"`` does, bit
    for bit. Before, the fit failed with ``ValueError: the checkpoint has master weights for 0 model(s) but 1 model(s)
    were prepared with master weights``, blaming a take-over by a later engine (the evaluating engine made no masters;
    the checkpoint's FP32 ``state_dict`` gives them), and a checkpoint saved inside the stage held the half model's
    weights (``load_from_checkpoint`` gave their rounding)."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_batch(0)), batch_size=4)
    finals = []
    for name, plugin in (
        ("bf16-mixed", dict(precision="bf16-mixed")),
        ("O2", dict(plugins=[MixedPrecisionPlugin("O2", half_dtype="bfloat16")])),
    ):
        path = tmp_path / f"{name}.ckpt"
        trainer = make_trainer(max_epochs=2, callbacks=[_SaveAtEnd(path)] if where == "inside" else [], **plugin)
        getattr(trainer, stage)(_Net(), data, verbose=False)
        if where == "after":
            trainer.save_checkpoint(path)
        assert {v.dtype for v in torch.load(path, weights_only=False)["state_dict"].values()} == {torch.float32}
        model = _Net()
        model.net = _net(1)  # another model: the checkpoint's weights must reach it (and, at O2, its masters)
        trainer = make_trainer(max_epochs=2, **plugin)
        trainer.fit(model, data, ckpt_path=path)
        finals.append(_flat(model))
    assert torch.equal(finals[0], finals[1])
