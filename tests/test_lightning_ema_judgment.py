"""A hostile review of stop 60's O2 EMA judgment at the step (engine/frozen_writes.py ``HeldWrites``) and of the kept
frozen FP32 values under a ``BaseFinetuning`` callback, each against ``"bf16-mixed"`` on the same code.

Found: an EMA child inside ``torch.optim.Adagrad(self.parameters())`` was never warned about: Adagrad makes its state
(``sum``, ``step`` 0) for every parameter at construction, which the judgment took for "stepped with a gradient".
Held (no false warning, and the run ends where ``"bf16-mixed"`` does): tied weights normalised by hand, a BatchNorm in
an FP32 unit with ``swa_utils.update_bn``, ``parametrize`` weight_norm (assigned mid-run too), ``reset_parameters()``
mid-run, a frozen-then-unfrozen layer normalised by hand, a WGAN ``.data`` clamp under plain SGD with ``n_critic=5``,
a ``load_state_dict`` mid-run; warned (once): an EMA updated by ``torch._foreach_lerp_`` or by ``copy_`` of a blend.
``BackboneFinetuning`` with ``trainer.validate()`` before ``fit``, a ``BaseFinetuning`` that freezes nothing, and an
``fp32_modules`` unit in the backbone: as ``"bf16-mixed"``, no warning. The Trainer's DDP (one 2-rank launch,
tests/lightning_ema_judgment_script.py): the Adagrad EMA child warned once on rank zero only; ``BackboneFinetuning`` as
``"bf16-mixed"`` under DDP. bfloat16, tiny."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin
from tests.lightning_helpers import classification_data, loader, make_trainer

HALF = torch.bfloat16
EMA = "that the optimizer holds got no gradient"


def _caught(run: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "lightning_mpx:" in str(w.message)]


def _loop(model: nn.Module, o2: bool, after: Callable[[nn.Module, int], None], *, optimizer: Any = None,
          steps: int = 6, **amp_kwargs: Any) -> tuple[list[str], dict[str, torch.Tensor]]:
    """``steps`` steps of the core loop at O2, or under ``torch.autocast`` on the FP32 model ("bf16-mixed"), with
    ``after(model, i)`` after each; the warnings and the model's FP32 values at the end."""
    make = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1))

    def run() -> None:
        nonlocal model
        amp = Amp("O2", half_dtype=HALF, **amp_kwargs) if o2 else None
        model = amp.prepare_model(model) if amp else model
        opt = amp.prepare_optimizer(make(model.parameters())) if amp else make(model.parameters())
        g = torch.Generator().manual_seed(1)
        for i in range(steps):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            if amp:
                with amp.forward_context():
                    loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
                amp.backward(loss)
                amp.step(opt)
                amp.update()
            else:
                with torch.autocast("cpu", dtype=HALF):
                    loss = F.cross_entropy(model(x).float(), y)
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
            after(model, i)

    messages = _caught(run)
    return messages, {k: v.float().clone() for k, v in model.state_dict().items()}


class WithEma(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        self.ema = copy.deepcopy(self.net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _foreach_lerp(model: nn.Module, i: int) -> None:
    with torch.no_grad():
        torch._foreach_lerp_(list(model.ema.parameters()), list(model.net.parameters()), 0.001)


def _copy_blend(model: nn.Module, i: int) -> None:
    with torch.no_grad():
        for e, s in zip(model.ema.parameters(), model.net.parameters()):
            e.copy_(e * 0.999 + s * 0.001)


def _adagrad(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(params, lr=0.05)


@pytest.mark.parametrize(
    ("update", "optimizer"),
    [(_foreach_lerp, None), (_copy_blend, None), (_foreach_lerp, _adagrad)],
    ids=["foreach_lerp", "copy_blend", "adagrad"],
)
def test_an_ema_child_inside_the_optimizer_is_warned_once(update: Any, optimizer: Any) -> None:
    """``_foreach_lerp_`` and ``copy_`` of a blend are writes the step takes. Under Adagrad, whose state (``step`` 0)
    exists for every parameter from construction, the child was taken for stepped: no warning (was: none), while its
    EMA ended as far from ``"bf16-mixed"``'s as under SGD."""
    messages, ours = _loop(WithEma(), True, update, optimizer=optimizer, steps=12)
    assert len(messages) == 1 and EMA in messages[0] and "('ema')" in messages[0], messages
    _, mixed = _loop(WithEma(), False, update, optimizer=optimizer, steps=12)
    start = WithEma().state_dict()
    moved = max((mixed[k] - start[k]).abs().max().item() for k in mixed if k.startswith("ema."))
    gap = max((ours[k] - mixed[k]).abs().max().item() for k in mixed if k.startswith("ema."))
    assert gap > 0.3 * moved, (gap, moved)  # what the warning is for


def test_adagrad_part_stepped_before_and_normalised_without_gradient_is_not_warned() -> None:
    """The counterpart under Adagrad: an MoE expert no token reached at a step, normalised by hand after it, was
    stepped with a gradient before (its Adagrad ``step`` > 0): no EMA child."""
    from tests.test_lightning_o2_write_warnings import MoE, _normalise

    messages, _ = _loop(MoE(), True, lambda m, i: _normalise(list(m.experts)), optimizer=_adagrad, steps=9)
    assert messages == [], messages


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.out = nn.Linear(16, 4), nn.Linear(16, 4, bias=False), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.a(x)) + self.b(x)


class Normed(nn.Module):
    def __init__(self, parametrized: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.b = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)
        if parametrized:
            torch.nn.utils.parametrizations.weight_norm(self.a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


def _norm_rows(weight: torch.Tensor) -> None:
    with torch.no_grad():
        weight.div_(weight.norm(dim=1, keepdim=True))


def _update_bn(model: nn.Module, i: int) -> None:
    if i == 3:
        dtype = next(model.parameters()).dtype
        torch.optim.swa_utils.update_bn([torch.randn(8, 16).to(dtype) for _ in range(2)], model)


def _assign_weight_norm(model: nn.Module, i: int) -> None:
    if i == 2:
        with torch.no_grad():
            model.a.weight = model.a.weight * 1.5  # right_inverse writes original0/original1


def _reset(model: nn.Module, i: int) -> None:
    if i == 2:
        torch.manual_seed(5)
        model.a.reset_parameters()


def _toggle(model: nn.Module, i: int) -> None:
    model.a.requires_grad_(not 1 <= i < 3)
    _norm_rows(model.a.weight)


CASES = {
    "tied_normalised": (Tied, lambda m, i: _norm_rows(m.a.weight), {}),
    "bn_fp32_unit_update_bn": (Normed, _update_bn, {"fp32_modules": ["bn"]}),
    "weight_norm_assigned": (lambda: Normed(parametrized=True), _assign_weight_norm, {}),
    "reset_parameters": (Normed, _reset, {}),
    "frozen_then_unfrozen_normalised": (Normed, _toggle, {}),
}


_OLD_RNG = pytest.mark.skipif(torch.__version__ < (2, 13), reason="torch < 2.13's uniform_ draws other values into "
                              "bfloat16 (O2's weights) than float32 (bf16-mixed's) from one seed: reset_parameters"
                              " differs")


@pytest.mark.parametrize("case", [pytest.param(c, marks=_OLD_RNG) if c == "reset_parameters" else c for c in CASES])
def test_writes_that_are_no_ema_are_not_warned_and_end_as_bf16_mixed(case: str) -> None:
    make, after, kwargs = CASES[case]
    messages, ours = _loop(make(), True, after, **kwargs)
    assert messages == [], messages
    _, mixed = _loop(make(), False, after)
    gap = max((ours[k] - mixed[k]).abs().max().item() for k in mixed if mixed[k].is_floating_point())
    assert gap < 5e-2, gap


class WGAN(pl.LightningModule):
    """A critic clamped through ``.data`` after each of its steps under plain SGD (no state), the generator stepped
    every ``n_critic=5`` batches; and a ``load_state_dict`` of a layer that never trains at global step 3."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.G = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.D = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
        self.spare = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()
        x, z = batch[0], torch.randn(len(batch[0]), 8)
        fake = self.G(z).detach()
        d_loss = self.D(fake).float().mean() - self.D(x.to(fake.dtype)).float().mean()
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        for p in self.D.parameters():
            p.data.clamp_(-0.01, 0.01)
        if batch_idx % 5 == 4:
            g_loss = -self.D(self.G(z)).float().mean()
            g_opt.zero_grad()
            self.manual_backward(g_loss)
            g_opt.step()
        if batch_idx == 3:
            torch.manual_seed(3)
            self.spare.load_state_dict(nn.Linear(16, 1).state_dict())

    def configure_optimizers(self) -> Any:
        return (torch.optim.SGD(self.G.parameters(), lr=1e-3),
                torch.optim.SGD(list(self.D.parameters()) + list(self.spare.parameters()), lr=1e-3))


def test_trainer_wgan_data_clamp_n_critic_5_and_a_load_mid_run_are_not_warned() -> None:
    trainer = make_trainer(MixedPrecisionPlugin("O2", half_dtype=HALF), max_epochs=1)
    messages = _caught(lambda: trainer.fit(WGAN(), loader(classification_data(n=80), batch_size=8)))
    assert messages == [], messages


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


class Finetuned(pl.LightningModule):
    def __init__(self, everything: bool = False) -> None:
        super().__init__()
        self.backbone, self.head, self.everything = _mlp(), nn.Linear(4, 4), everything

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]).float(), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD((self if self.everything else self.head).parameters(), lr=0.1)


class FreezesNothing(pl.callbacks.BaseFinetuning):
    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        pass

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Any) -> None:
        pass


def _fit(case: str, precision: str) -> tuple[list[str], dict[str, torch.Tensor]]:
    from lightning.pytorch.callbacks import BackboneFinetuning

    kwargs = {"fp32_modules": ["backbone.0"]} if case == "fp32_modules" and precision == "O2" else {}
    plugin = MixedPrecisionPlugin("O2", half_dtype=HALF, **kwargs) if precision == "O2" else None
    callback = FreezesNothing() if case == "freezes_nothing" else BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    settings: dict[str, Any] = {} if plugin else {"precision": precision}
    trainer = make_trainer(plugin, max_epochs=2, callbacks=[callback], **settings)
    model = Finetuned(everything=case == "freezes_nothing")
    data = loader(classification_data(n=32))

    def run() -> None:
        if case == "validate_first":
            trainer.validate(model, data)
        trainer.fit(model, data)

    messages = _caught(run)
    return messages, {k: v.float().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", ["validate_first", "freezes_nothing", "fp32_modules"])
def test_base_finetuning_variants_end_as_bf16_mixed_without_a_warning(case: str) -> None:
    messages, ours = _fit(case, "O2")
    assert messages == [], messages
    _, mixed = _fit(case, "bf16-mixed")
    start = {f"backbone.{k}": v for k, v in _mlp().state_dict().items()}
    assert max((mixed[k] - start[k]).abs().max().item() for k in start) > 2e-4  # the backbone moved
    assert max((ours[k] - mixed[k]).abs().max().item() for k in start) <= 5e-5


def test_trainer_ddp_adagrad_ema_child_and_backbone_finetuning(tmp_path: Path) -> None:
    """The Trainer's DDP, two ranks (tests/lightning_ema_judgment_script.py): the Adagrad EMA child (``_foreach_lerp_``)
    warned once on rank zero, never on rank one; BackboneFinetuning's backbone at O2 as under ``"bf16-mixed"`` on
    both ranks, no warning."""
    from tests.launch import rank_results, run_script

    run_script("lightning_ema_judgment_script.py", tmp_path, timeout=240)
    got = rank_results(tmp_path)
    for rank, want in ((0, 1), (1, 0)):
        ema, backbone = got[rank]["ema"], got[rank]["backbone"]
        assert "error" not in ema and "error" not in backbone, (ema.get("error"), backbone.get("error"))
        assert ema["warned"] == want and ema["other"] == 0, (rank, ema)
        assert backbone["warned"] == 0 and backbone["moved"] > 2e-4 and backbone["gap"] <= 5e-5, (rank, backbone)
