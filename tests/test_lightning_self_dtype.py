"""Hostile habits against the Trainer and Fabric plugins' behaviours new in stop 50 (lightning_conversion.py,
lightning_model_hooks.py): ``self.dtype`` in half at O2/O3, lazy layers refused at O2, the warning for another
engine's masters and the note on an FP32 input below the boundary, each with the habit that broke it."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.environments.lightning import find_free_network_port  # noqa: E402
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin  # noqa: E402
from lightning_mpx.integrations.fsdp import shard_model  # noqa: E402
from tests.lightning_helpers import Classifier, assert_same, classification_data, loader, make_trainer  # noqa: E402

HALF = "bfloat16"


def _o2() -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("O2", half_dtype=HALF)


def _foreign(caught: list[warnings.WarningMessage]) -> list[str]:
    """Warnings about FP32 master weights (there were some for another engine's masters, before they were taken
    over)."""
    return [str(w.message) for w in caught if "master weights" in str(w.message)]


# -- self.dtype targets in a loss ---------------------------------------------------------------------------------
class _SelfDtypeTargets(Classifier):
    """A step whose soft targets are made in ``self.dtype`` (half at O2/O3), used by ``loss``."""

    def __init__(self, losses: tuple[str, ...]) -> None:
        super().__init__()
        self.loss_names = losses
        self.loss_dtypes: dict[str, torch.dtype] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        target = F.one_hot(y, 4).to(self.dtype) * 0.9 + 0.025
        losses = {
            "mse": lambda: F.mse_loss(out, target),
            "bce_with_logits": lambda: F.binary_cross_entropy_with_logits(out, target),
            "soft_cross_entropy": lambda: F.cross_entropy(out, target),
            "kl_div": lambda: F.kl_div(F.log_softmax(out, -1), target, reduction="batchmean"),
            "huber": lambda: F.huber_loss(out, target),
            "bce": lambda: F.binary_cross_entropy(torch.sigmoid(out), target),
        }
        total = out.new_zeros(())
        for name in self.loss_names:
            loss = losses[name]()
            self.loss_dtypes[name] = loss.dtype
            total = total + loss
        return total


def test_o2_losses_on_targets_made_in_self_dtype_stay_fp32() -> None:
    """``self.dtype`` is the half dtype at O2 now, so targets made with it are half while the boundary hands FP32
    outputs: O2's promise (losses in FP32, Apex's) holds for the usual losses on such a pair, as it did when
    ``self.dtype`` said float32."""
    names = ("mse", "bce_with_logits", "soft_cross_entropy", "kl_div", "huber", "bce")
    model = _SelfDtypeTargets(names)
    make_trainer(_o2(), max_steps=1).fit(model, loader(classification_data(n=16)))
    assert model.loss_dtypes == dict.fromkeys(names, torch.float32)


def test_o3_losses_on_targets_made_in_self_dtype_train_as_under_bf16_true() -> None:
    """At O3 the boundary hands FP32 outputs (Apex's ``cast_model_outputs``) while ``self.dtype`` is half:
    ``huber_loss`` and ``binary_cross_entropy`` refused the pair ("Found dtype BFloat16 but expected Float"), which
    Lightning's "bf16-true" (half outputs) trains. O3's policy runs such a mixed call in the widest dtype, FP32, as
    torch does for ``mse_loss`` and ``kl_div`` on the same pair (their dtypes unchanged)."""
    names = ("mse", "bce_with_logits", "soft_cross_entropy", "kl_div", "huber", "bce")
    reference = _SelfDtypeTargets(names)
    make_trainer(precision="bf16-true", max_steps=1).fit(reference, loader(classification_data(n=16)))
    assert reference.loss_dtypes == dict.fromkeys(names, torch.bfloat16)  # the habit trains there, in half
    model = _SelfDtypeTargets(names)
    make_trainer(MixedPrecisionPlugin("O3", half_dtype=HALF), max_steps=1).fit(model, loader(classification_data(n=16)))
    assert model.loss_dtypes == dict.fromkeys(names, torch.float32)
    assert model.net[0].weight.dtype == torch.bfloat16  # still O3: a half model, no masters


def test_fabric_o3_losses_on_targets_made_in_the_modules_dtype_train_in_its_autocast() -> None:
    """Fabric's habit: the loss in ``fabric.autocast()`` on the set-up model's FP32 output and a target made in the
    LightningModule's ``dtype`` (half at O3 since stop 50), refused by ``huber_loss`` and ``binary_cross_entropy``
    before; they run in FP32 now, as at O2."""
    torch.manual_seed(0)
    lightning_module = Classifier()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O3", half_dtype=HALF)])
    module, optimizer = fabric.setup(lightning_module, torch.optim.SGD(lightning_module.parameters(), lr=0.1))
    assert lightning_module.dtype == torch.bfloat16
    before = [p.detach().clone() for p in module.parameters()]
    for x, y in loader(classification_data(n=16)):
        with fabric.autocast():
            out = module(x)
            target = F.one_hot(y, 4).to(lightning_module.dtype) * 0.9 + 0.025
            losses = (F.huber_loss(out, target), F.binary_cross_entropy(torch.sigmoid(out), target))
        assert [loss.dtype for loss in losses] == [torch.float32] * 2
        fabric.backward(sum(losses))
        optimizer.step()
        optimizer.zero_grad()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(module.parameters(), before))


# -- the note on an uncast input ------------------------------------------------------------------------------------
class _Smooth(nn.Module):
    """A layer that blends its output with an FP32 tensor it makes itself (its own bug, not its input's dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.lerp(x * self.weight, torch.zeros(x.shape), 0.1)


class _Steps(Classifier):
    """Steps that fail on dtypes: ``"lerp"`` mixes the FP32 output with a ``self.dtype`` target in the training
    step (no module involved); ``"inner"`` calls a direct child (its input cast to half) that fails on a tensor of
    its own; ``"deep conv"`` validates through a grandchild convolution on the FP32 batch."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.smooth = _Smooth()
        self.body = nn.Module()
        self.body.conv = nn.Conv1d(1, 2, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.how == "inner":
            return self.smooth(x).sum()
        out = self(x)
        return torch.lerp(out, F.one_hot(y, 4).to(self.dtype), 0.1).sum()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.body.conv(batch[0].unsqueeze(1))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) are Python 3.11's")
def test_the_boundary_note_goes_to_a_half_module_given_fp32_only() -> None:
    """The note says a module below the boundary got the FP32 batch and to call it through ``self(...)`` or cast
    with ``x.to(self.dtype)``. It was added to any error whose message names Float, BFloat16 and "expected":
    ``torch.lerp(output, target)`` on an FP32 output and a ``self.dtype`` target got it, and its advice (cast to
    ``self.dtype``) is the cause there; so did a half layer given its input in half that failed on an FP32 tensor of its
    own. A grandchild convolution given the FP32 batch in ``trainer.validate``, the
    case it is for, gets it once."""
    data = loader(classification_data(n=16))
    for how in ("lerp", "inner"):
        with pytest.raises(RuntimeError, match="expected dtype") as raised:
            make_trainer(_o2(), max_steps=1).fit(_Steps(how), data)
        assert getattr(raised.value, "__notes__", []) == [], how

    with pytest.raises(RuntimeError, match="should be the same") as raised:
        make_trainer(_o2()).validate(_Steps("deep conv"), data)
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == 1 and "direct children" in notes[0]


# -- another engine's masters ---------------------------------------------------------------------------------------
class _MastersAtStart(pl.Callback):
    def on_train_start(self, trainer: Any, module: Any) -> None:
        amp = trainer.precision_plugin.amp
        self.seen = [amp.master_of(p, refresh=False).detach().clone() for p in module.parameters()]


def test_one_trainer_plugin_for_two_models_in_turn_goes_on_from_the_first_ones_fp32_masters() -> None:
    """One plugin for model A, then B, then A again (the plugin reused across Trainers): it keeps one model's engine,
    so A's masters were gone at the third fit, which started them rounded (with a warning). A's masters live with A
    now (its parameters link to them), and the third fit's engine takes them over: it starts from them exactly."""
    data = loader(classification_data(n=16))
    plugin, first, second = _o2(), Classifier(), Classifier()
    make_trainer(plugin, max_steps=1).fit(first, data)
    trained = [plugin.amp.master_of(p, refresh=False).detach().clone() for p in first.parameters()]
    assert any(not torch.equal(m, p.float()) for m, p in zip(trained, first.parameters()))  # more than the half
    make_trainer(plugin, max_steps=1).fit(second, data)
    probe = _MastersAtStart()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(plugin, max_steps=1, callbacks=[probe]).fit(first, data)
    assert _foreign(caught) == []
    assert_same(probe.seen, trained)


def _fabric_fit(mpx: FabricMixedPrecisionPlugin, model: nn.Module, data: Any) -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    module, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in data:
        fabric.backward(F.cross_entropy(module(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return fabric, module, optimizer


def test_fabric_a_new_plugin_for_a_model_trained_at_o2_starts_from_its_fp32_masters(tmp_path: Any) -> None:
    """A second stage with Fabric: a new ``FabricMixedPrecisionPlugin("O2")`` for a model trained at O2 started its
    masters from the half weights (silently, then with a warning). It takes them over now, exactly, as loading the
    first run's checkpoint gives them; the plugin setting up a part of a model it set up itself keeps its own."""
    data = loader(classification_data(n=32))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    first = FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
    fabric, module, optimizer = _fabric_fit(first, model, data)
    trained = [m.detach().clone() for m in first.master_params(optimizer)]
    fabric.save(tmp_path / "stage1.ckpt", {"model": module, "optimizer": optimizer, "mpx": first})
    fabric.setup_module(model[0])  # the same plugin: its own masters
    assert_same(first.master_params(optimizer), trained)

    second = FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[second])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert _foreign(caught) == []
    assert_same(second.master_params(optimizer), trained)
    second.setup_optimizers(optimizer)
    fabric.load(tmp_path / "stage1.ckpt", {"model": module, "optimizer": optimizer, "mpx": second})
    assert_same(second.master_params(optimizer), trained)


# -- lazy layers built in configure_model ---------------------------------------------------------------------------
class _BuiltInConfigureModel(Classifier):
    """:class:`Classifier` whose layers are built in ``configure_model`` (``nn.LazyLinear`` first), materialized
    there by a forward when ``materialize``."""

    def __init__(self, materialize: bool) -> None:
        super().__init__()
        self.net = None  # type: ignore[assignment]
        self.materialize = materialize

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 4))
            if self.materialize:
                self(torch.zeros(1, 16))


def test_a_lazy_layer_built_in_configure_model_is_refused_with_a_remedy_that_applies_there() -> None:
    """Layers built in ``configure_model`` do not exist before ``trainer.fit``, so the refusal's remedy ("run one
    forward before trainer.fit") cannot be followed. It says to run the forward in ``configure_model`` after
    building them, which trains."""
    data = loader(classification_data(n=16))
    with pytest.raises(ValueError, match=r"before trainer\.fit.*, in configure_model after building them"):
        make_trainer(_o2(), max_steps=1).fit(_BuiltInConfigureModel(materialize=False), data)
    model = _BuiltInConfigureModel(materialize=True)
    make_trainer(_o2(), max_steps=1).fit(model, data)
    assert model.net[0].weight.dtype == torch.bfloat16 and model.dtype == torch.bfloat16


# -- self.dtype under FSDP2 -----------------------------------------------------------------------------------------
class _Sharded(Classifier):
    """:class:`Classifier` sharded by ``shard_model`` in ``configure_model``; records ``self.dtype`` in its step."""

    def configure_model(self) -> None:
        shard_model(self.net, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen = (self.dtype, self.net[0].weight.dtype)
        return super().training_step(batch, batch_idx)


class _Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.fixture
def group_of_one(monkeypatch: Any) -> Any:
    """The environment of a gloo group of one process, this one; the group and the environment undone after."""
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_network_port()), RANK="0", LOCAL_RANK="0")
    for name, value in dict(env, WORLD_SIZE="1", NODE_RANK="0").items():
        monkeypatch.setenv(name, value)  # restored (or removed) after the test, as Lightning sets some of them
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="ModelParallelStrategy needs torch.distributed")
def test_self_dtype_at_o3_under_model_parallel_strategy_is_the_shards_half_dtype(group_of_one: Any) -> None:
    """At O3 ``shard_model`` casts the model to half in ``configure_model``, and the plugin recorded ``self.dtype``
    only for unsharded models and FSDP1's: under ``ModelParallelStrategy`` a step read float32 beside bfloat16
    weights (so ``x.to(self.dtype)``, the note's remedy, fed FP32 to them). Fabric's plugin recorded it for the
    first model only: a second one set up after the engine took the first one sharded (a GAN's) said float32."""
    model = _Sharded()
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    make_trainer(MixedPrecisionPlugin("O3", half_dtype=HALF), max_steps=1, strategy=strategy).fit(
        model, loader(classification_data(n=16))
    )
    assert model.seen == (torch.bfloat16, torch.bfloat16)

    mpx = FabricMixedPrecisionPlugin("O3", half_dtype=HALF)
    strategy = FabricModelParallel(
        lambda module, mesh: shard_model(module, mpx, mesh=mesh["data_parallel"]), data_parallel_size=1,
        tensor_parallel_size=1,
    )  # fmt: skip
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, plugins=[mpx])
    fabric.launch()  # the group the Trainer started: no process started
    first = fabric.setup_module(_Linear())
    first(torch.randn(2, 4))  # the engine takes it sharded
    second = fabric.setup_module(_Linear()).module
    assert (first.module.dtype, second.dtype, second.lin.weight.dtype) == (torch.bfloat16,) * 3
