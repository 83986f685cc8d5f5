"""review69c: a hostile user and reviewer of stop 69's report fixes (the doctor's loss, the underflow tags without a
wrapper's ``module``) and of the Apex layer's ``num_losses=2`` charges, checked against the run's own facts and
``torch.amp.GradScaler``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from lightning_mpx import MixedPrecisionPlugin, doctor  # noqa: E402
from lightning_mpx.apex import _amp_state  # noqa: E402
from lightning_mpx.health.events import read_run  # noqa: E402
from tests.test_core_doctor_floor_and_tags import _doctor  # noqa: E402  (the doctor's exit status and report, JSON and text)


@pytest.fixture(autouse=True)
def _reset_apex():
    """The Apex layer's process state (``_amp_state``, its documented exception) reset around each test: an
    ``amp.initialize`` left in place would cast the next tests' models in the same worker."""
    _amp_state.reset()
    yield
    _amp_state.reset()


# -- the doctor's loss: an epoch's mean ------------------------------------------------------------------------------
class _EpochLogged(pl.LightningModule):
    """Two linear layers; the batch at each global step in ``bad`` holds an inf (one bad sample, met once an epoch).
    The loss is logged as users do: ``loss`` an epoch's mean only, ``train_loss`` at each step and an epoch's mean."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.bad = nn.Linear(8, 8), nn.Linear(8, 1), bad

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch[0] * float("inf") if self.trainer.global_step in self.bad else batch[0]
        loss = self.b(torch.relu(self.a(x))).float().square().mean()
        self.log("loss", loss, on_step=False, on_epoch=True)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def test_a_bad_sample_met_once_an_epoch_is_no_broken_run_when_the_loss_is_logged_as_an_epochs_mean(tmp_path, capsys):
    # 3 epochs of 10 float16 steps; the bad sample at steps 4, 14, 24 is skipped each time (27 updates applied). The
    # epoch means "loss" and "train_loss_epoch" are NaN at every epoch's end. The doctor read "loss" (before
    # "train_loss_step") and said "PROBLEM: non-finite loss ... at every logged step 9-29 ... the steps were not
    # skipped" (exit 1); read alone, the epoch means gave the same verdict.
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=2.0**10, growth_interval=1000)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=3, logger=TensorBoardLogger(str(tmp_path), name="", version=0),
        log_every_n_steps=1, plugins=[plugin], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(20, 8)), batch_size=2)
    trainer.fit(_EpochLogged({4, 14, 24}), loader)
    series = read_run(tmp_path).series
    assert [s for s, v in series["loss"] if v != v] == [9, 19, 29] == [s for s, v in series["train_loss_epoch"]]
    assert [s for s, v in series["train_loss_step"] if v != v] == [4, 14, 24]
    assert series["mpx/skipped_steps"][-1] == (29, 3.0)
    status, report, text_status, text = _doctor(tmp_path, capsys)
    assert status == text_status == 0 and report["healthy"], text
    assert "3 overflow steps in 30 (10.0%), 3 skipped in all" in report["findings"][0]["evidence"][0]
    assert "diagnosis: healthy" in text
    # the scale grown too high overflows the last two steps, their loss finite (no bad batch): a scale backing off,
    # healthy. Read from the epoch's NaN mean (the last bad sample's), it was a broken forward: persistent overflow.
    grown = dict(series, **{tag: [*series[tag][:-2], (28, 1.0), (29, 1.0)] for tag in ("mpx/overflows",)})
    grown["mpx/loss_scale"] = [*series["mpx/loss_scale"][:-2], (28, 2.0**16), (29, 2.0**15)]
    assert all(v == v for _, v in grown["train_loss_step"][-2:])
    assert doctor.diagnose_scalars(grown).exit_status == 0
    # the epoch means alone (no train_loss_step): each NaN epoch holds its skipped step, healthy too
    alone = {tag: points for tag, points in series.items() if not tag.startswith("train_loss")}
    assert doctor.diagnose_scalars(alone).exit_status == 0
    # ... but an epoch's NaN mean without an overflow in that epoch is still a broken run
    alone["mpx/overflows"] = [(s, v if s < 10 else 0.0) for s, v in alone["mpx/overflows"]]
    (finding,) = [f for f in doctor.diagnose_scalars(alone).findings if f.problem]
    assert finding.kind == "non_finite_loss" and finding.since_step == 9, finding


# -- Apex num_losses >= 2: each loss's own overflow backs its scale off once, as one GradScaler per loss ---------------
def _apex_losses(infs: set[tuple[int, int]], named: tuple[str, ...], *, apex: bool, opt_level: str = "O1",
                 order: tuple[int, ...] | None = None, delays: tuple[int, ...] = ()) -> tuple[list, list]:  # fmt: skip
    """Four iterations of ``len(named)`` losses of a trunk and a head (each with its own SGD), loss ``k``'s block
    naming ``named[k]``'s optimizer (``"both"``: the two), in ``order``, ``delay_unscale`` on the losses in ``delays``;
    ``(iteration, loss)`` in ``infs`` inf. The scales after each iteration and the FP32 weights (``apex=False``: FP32
    with one ``torch.amp.GradScaler`` per loss, a step taken by an optimizer whose summed gradients are finite)."""
    import math

    import torch.nn.functional as F

    from lightning_mpx.apex import _amp_state, amp
    from tests.test_apex_delayed_chain_fixes import _batches, _Net

    count = len(named)
    torch.manual_seed(0)
    model = _Net()
    trunk = torch.optim.SGD(model.trunk.parameters(), lr=0.1)
    head = torch.optim.SGD(model.head.parameters(), lr=0.1)
    if apex:
        model, (trunk, head) = amp.initialize(model, [trunk, head], opt_level=opt_level, loss_scale="dynamic",
                                              verbosity=0, num_losses=count)  # fmt: skip
    else:
        scalers = [torch.amp.GradScaler("cpu", init_scale=65536.0) for _ in range(count)]
        each = torch.optim.SGD(model.parameters(), lr=0.0)  # for the scalers' unscale_ of one loss's gradients
    scales = []
    for i, (x, y) in enumerate(_batches(4)):
        trunk.zero_grad()
        head.zero_grad()
        total = [torch.zeros_like(p) for p in model.parameters()]
        for k in order or range(count):
            out = model(x.to(next(model.parameters()).dtype)).float()
            loss = F.cross_entropy(out, y) * (math.inf if (i, k) in infs else 1.0 + 0.1 * k)
            if apex:
                optimizer = {"trunk": trunk, "head": head, "both": [trunk, head]}[named[k]]
                with amp.scale_loss(loss, optimizer, loss_id=k, delay_unscale=k in delays) as scaled:
                    scaled.backward()
            else:
                each.zero_grad()
                scalers[k].scale(loss).backward()
                scalers[k].unscale_(each)
                total = [t + p.grad for t, p in zip(total, model.parameters())]
                scalers[k].update()
        if not apex:
            for p, t in zip(model.parameters(), total):
                p.grad = t
        for optimizer in (trunk, head):
            if apex or all(p.grad.isfinite().all() for p in optimizer.param_groups[0]["params"]):
                optimizer.step()
        scales.append(
            [_amp_state.loss_scalers[k].loss_scale() if apex else scalers[k].get_scale() for k in range(count)]
        )
    opts = (trunk, head)
    weights = [p for o in opts for p in (amp.master_params(o) if apex else o.param_groups[0]["params"])]
    return scales, [p.detach().float().clone() for p in weights]


@pytest.mark.parametrize(
    ("opt_level", "infs", "named", "order"),
    [
        ("O1", {(2, 0), (2, 1)}, ("trunk", "head"), None),  # both overflow at once, loss 1 into loss 0's inf: each once
        ("O2", {(2, 0), (2, 1)}, ("head", "trunk"), None),
        ("O1", {(1, 1)}, ("trunk", "trunk", "head"), None),  # three, the middle
        ("O2", {(1, 1), (2, 0), (2, 1)}, ("head", "trunk"), (1, 0)),  # out of order
    ],
    ids=["O1-both", "O2-both-named-head-first", "O1-three-middle", "O2-out-of-order"],
)
def test_apex_each_losss_own_overflow_backs_it_off_once_as_one_grad_scaler_per_loss(opt_level, infs, named, order):
    scales, weights = _apex_losses(infs, named, apex=True, opt_level=opt_level, order=order)
    want, reference = _apex_losses(infs, named, apex=False, order=order)
    assert scales == want
    assert max((w - r).abs().max().item() for w, r in zip(weights, reference)) < 1e-3


def test_apex_an_inf_left_by_a_delay_unscale_block_backs_off_only_its_own_loss():
    """Was: loss 1's scale backed off too (its block's check took the inf the core brought to its scale at the
    block's start, charged to loss 0, as its own); now only loss 0's, the steps skipped."""
    infs, named = {(2, 0)}, ("trunk", "head")
    scales, _ = _apex_losses(infs, named, apex=True, delays=(0,))
    assert scales == _apex_losses(infs, named, apex=False)[0]


def test_apex_three_losses_an_overflow_charged_to_the_head_skips_its_step_when_a_later_block_names_both():
    """num_losses=3, O1: loss 0's block (naming the trunk's SGD) overflows into the head's gradients, loss 1's block
    names the head's SGD, loss 2's names both. With xfails69's counting fix (cc604ef) loss 2's block kept the head's
    inf aside from its check and the head stepped it: its weights NaN, every later iteration backing off every loss
    (review69c). Reverted: the head's step is skipped, the weights finite and near FP32's."""
    infs, named = {(1, 0), (2, 2)}, ("trunk", "head", "both")
    _, weights = _apex_losses(infs, named, apex=True)
    _, reference = _apex_losses(infs, named, apex=False)
    assert all(w.isfinite().all() for w in weights)
    assert max((w - r).abs().max().item() for w, r in zip(weights, reference)) < 1e-3


def test_apex_three_losses_charged_head_backs_off_each_loss_once():
    infs, named = {(1, 0), (2, 2)}, ("trunk", "head", "both")
    assert _apex_losses(infs, named, apex=True)[0] == _apex_losses(infs, named, apex=False)[0]
