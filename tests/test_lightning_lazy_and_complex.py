"""Hostile Lightning habits of stop 50, not tested before: modules whose parameters are not ordinary FP32 tensors
(lazy layers, complex parameters) through the Trainer and Fabric plugins, each against Lightning's own precision."""

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

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import Classifier, assert_same, classification_data, loader, make_trainer  # noqa: E402

HALF = "bfloat16"


# -- lazy modules ----------------------------------------------------------------------------------------------------
class _LazyClassifier(Classifier):
    """:class:`Classifier` with an ``nn.LazyLinear`` first layer, materialized by a forward when asked."""

    def __init__(self, materialize: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 4))
        if materialize:
            self(torch.zeros(1, 16))


def test_a_lazy_layer_at_o2_is_refused_at_fit_naming_it_and_the_remedy_which_then_trains_exactly() -> None:
    """``nn.LazyLinear`` trains under Lightning's "32-true", "bf16-mixed" and "bf16-true" and the plugin's O1/O3; at
    O2 ``trainer.fit`` failed inside the engine with torch's "Can't access the shape of an uninitialized parameter"
    (nothing about O2's masters or what to do). Now a ValueError names the parameters and the remedy; the remedy (one
    forward before the fit) trains as the same weights in an eager model, bit for bit."""
    data = loader(classification_data(n=32))
    with pytest.raises(ValueError, match=r"net\.0\.weight, net\.0\.bias of _LazyClassifier are not initialized.*"
                       r"O2 makes the FP32 master weights at trainer\.fit.*Run one forward"):  # fmt: skip
        make_trainer(MixedPrecisionPlugin("O2", half_dtype=HALF), max_steps=1).fit(_LazyClassifier(), data)

    lazy = _LazyClassifier(materialize=True)
    eager = Classifier()
    eager.net.load_state_dict(lazy.net.state_dict())
    for model in (lazy, eager):
        make_trainer(MixedPrecisionPlugin("O2", half_dtype=HALF), max_steps=2).fit(model, data)
    assert_same(lazy.state_dict(), eager.state_dict())
    assert lazy.net[0].weight.dtype == torch.bfloat16


def test_fabric_refuses_a_lazy_layer_at_o2_at_setup_and_takes_it_at_o1() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype=HALF)])
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"0\.weight, 0\.bias of Sequential are not initialized.*before fabric\.setup"):
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O1", half_dtype=HALF)])
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 2))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(4, 16)).sum())
    optimizer.step()
    assert model.module[0].weight.shape == (8, 16)


# -- a module deeper than the boundary, called from the step ------------------------------------------------------
class _DeepCall(Classifier):
    """:class:`Classifier` whose training step calls a grandchild (``self.body.net[0]``) on the batch itself."""

    def __init__(self, fail: str = "", cast: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Module()
        self.body.net = self.net
        self.fail = fail
        self.cast = cast
        self.step_dtype: torch.dtype | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail:
            raise RuntimeError(self.fail)
        x, y = batch
        self.step_dtype = self.dtype
        if self.cast:
            x = x.to(self.dtype)  # the usual remedy: what the weights hold
        return F.cross_entropy(self.body.net[2](F.relu(self.body.net[0](x))), y)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) are Python 3.11's")
def test_an_fp32_batch_into_a_grandchild_at_o2_fails_with_a_note_on_the_boundary_that_bf16_true_does_not_have() -> None:
    """Lightning's "bf16-true" casts the whole batch, so ``self.body.net[0](x)`` from the step trains there; the
    plugin casts at the LightningModule and its direct children only (Apex's boundary, FP32 targets kept), and the run
    ended on torch's bare "mat1 and mat2 must have the same dtype, but got Float and BFloat16". The error now carries
    a note saying where the casts stop and what to do; an unrelated error gets none."""
    data = loader(classification_data(n=32))
    make_trainer(precision="bf16-true", max_steps=1).fit(_DeepCall(), data)  # Lightning's own: no error
    with pytest.raises(RuntimeError, match="same dtype") as raised:
        make_trainer(MixedPrecisionPlugin("O2", half_dtype=HALF), max_steps=1).fit(_DeepCall(), data)
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == 1 and "direct children" in notes[0] and "x.to(self.dtype)" in notes[0]

    with pytest.raises(RuntimeError, match="the loss is not finite") as raised:
        make_trainer(MixedPrecisionPlugin("O2", half_dtype=HALF), max_steps=1).fit(
            _DeepCall(fail="the loss is not finite"), data
        )
    assert not getattr(raised.value, "__notes__", [])


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_the_lightning_modules_dtype_is_the_weights_dtype_as_under_lightnings_own_precision(level: str) -> None:
    """``LightningModule.dtype`` (what ``x.to(self.dtype)`` and ``torch.zeros(..., dtype=self.dtype)`` in a step
    use) said float32 at O2/O3 while the weights were bfloat16, where Lightning's "bf16-true" says bfloat16: the cast
    the note above recommends then fed FP32 to the half layer again. It is the weights' dtype now, as under
    Lightning's own precision of the same weights ("bf16-mixed" at O1), in the step, after the fit and in Fabric."""
    data = loader(classification_data(n=16))
    reference = "bf16-mixed" if level == "O1" else "bf16-true"
    want = _DeepCall(cast=True)
    make_trainer(precision=reference, max_steps=1).fit(want, data)
    got = _DeepCall(cast=True)
    make_trainer(MixedPrecisionPlugin(level, half_dtype=HALF), max_steps=1).fit(got, data)
    assert got.step_dtype == want.step_dtype == got.net[0].weight.dtype
    assert got.dtype == want.dtype

    # Fabric, with a Lightning submodule kept in FP32 whole: it says so.
    mpx = FabricMixedPrecisionPlugin(level, half_dtype=HALF, fp32_modules=["head"])
    module = Fabric(accelerator="cpu", devices=1, plugins=[mpx]).setup_module(_WithHead()).module
    assert module.dtype == module.body.weight.dtype == want.dtype
    assert module.head.dtype == module.head.net.weight.dtype == torch.float32


class _WithHead(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = pl.LightningModule()
        self.head.net = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head.net(self.body(x))


# -- a second stage with a new Trainer ------------------------------------------------------------------------------
def _masters(plugin: MixedPrecisionPlugin, model: Classifier) -> list[torch.Tensor]:
    return [plugin.amp.master_of(p, refresh=False).detach().clone() for p in model.parameters()]


class _MastersAtStart(pl.Callback):
    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.seen = _masters(trainer.precision_plugin, module)


def _stage_two(tmp_path: Any, how: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    """An O2 fit, then a second one on the same model through a new Trainer (``how``: with a new plugin, the same
    plugin, or a new plugin resuming from the first fit's checkpoint); the masters after the first fit, those the
    second starts from, and the warnings of the second."""
    data = loader(classification_data(n=32))
    model = Classifier(optimizer="adamw", lr=1e-2)
    first = MixedPrecisionPlugin("O2", half_dtype=HALF)
    trainer = make_trainer(first, max_epochs=1)
    trainer.fit(model, data)
    trained = _masters(first, model)
    ckpt = tmp_path / "stage1.ckpt"
    trainer.save_checkpoint(ckpt)
    probe = _MastersAtStart()
    second = first if how == "same plugin" else MixedPrecisionPlugin("O2", half_dtype=HALF)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(second, max_epochs=2 if how == "checkpoint" else 1, callbacks=[probe]).fit(
            model, data, ckpt_path=str(ckpt) if how == "checkpoint" else None
        )
    return trained, probe.seen, [str(w.message) for w in caught if "another MixedPrecisionPlugin" in str(w.message)]


@pytest.mark.parametrize("how", ["new plugin", "same plugin", "checkpoint"])
def test_a_new_plugin_for_a_model_fitted_at_o2_before_starts_from_its_fp32_masters(tmp_path: Any, how: str) -> None:
    """Fine-tuning in stages, a new ``Trainer(plugins=[MixedPrecisionPlugin("O2")])`` per stage on the same model: the
    new plugin's masters started silently from the half weights, one bfloat16 rounding of what FP32 training carries
    on from exactly (the half parameters kept no link to the engine holding their masters). The new plugin takes the
    masters over now, as the same plugin or a resume from the first fit's checkpoint start from them, without a
    warning."""
    trained, start, warned = _stage_two(tmp_path, how)
    assert warned == []
    assert_same(start, trained)


# -- complex parameters ----------------------------------------------------------------------------------------------
class _PhaseClassifier(Classifier):
    """:class:`Classifier` with a complex parameter (a spectral layer's weights, as in Fourier neural operators)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = nn.Parameter(torch.polar(torch.ones(4), torch.linspace(0.0, 1.0, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out * self.phase.real.to(out.dtype)


def test_a_complex_parameter_trains_at_o1_as_lightnings_bf16_mixed() -> None:
    data = loader(classification_data(n=32))

    def fit(plugin: Any) -> _PhaseClassifier:
        model = _PhaseClassifier()
        extra = {} if plugin is not None else {"precision": "bf16-mixed"}
        make_trainer(plugin, max_steps=2, **extra).fit(model, data)
        return model

    want = fit(None)
    got = fit(MixedPrecisionPlugin("O1", half_dtype=HALF))
    assert_same(got.state_dict(), want.state_dict())
