"""The Trainer plugin under manual optimization (``self.automatic_optimization = False``), attacked the way GAN code
uses it: two optimizers stepped by hand, an overflow in one optimizer's gradients only, a critic stepped several
times per batch, ``opt.step(closure=...)``, accumulation by hand, ``self.clip_gradients``, schedulers stepped by hand,
reads inside the step, checkpoints and resume, and DDP with an overflow on one rank only
(tests/hostile_manual_ddp_script.py, one launch). Each run is held to a reference: Lightning's ``"32-true"`` with the
overflowed steps left out by hand, or the plugin's own host-read path for steps skipped on the device."""

from __future__ import annotations

import glob
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_mpx import MixedPrecisionPlugin
from tests.hostile_manual_ddp_script import DDP_OVERFLOWS, ManualGAN, gan_data
from tests.launch import rank_results, run_script
from tests.lightning_helpers import classification_data, make_trainer

#: batch index -> the optimizer whose gradient gets an inf (on the only process)
OVERFLOWS: dict[int, tuple[str, None]] = {1: ("d", None), 4: ("g", None)}


def _plugin(opt_level: str = "O2", half_dtype: str = "float16", **settings: Any) -> MixedPrecisionPlugin:
    settings = dict(dict(loss_scale="dynamic", init_scale=256.0, growth_interval=3), **settings)
    return MixedPrecisionPlugin(opt_level, half_dtype=half_dtype, **settings)


def _fit(plugin: Any, epochs: int = 1, ckpt_path: str | None = None, trainer_kwargs: Any = None, **model: Any) -> Any:
    gan = ManualGAN(reference=plugin is None, **model)
    kwargs = dict(trainer_kwargs or {})
    if plugin is None:
        kwargs["precision"] = "32-true"
    trainer = make_trainer(plugin, max_epochs=epochs, **kwargs)
    trainer.fit(gan, gan_data(), ckpt_path=ckpt_path)
    return gan, trainer


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


# -- runs against FP32 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opt_level, half_dtype, model, tol",
    [
        ("O1", "bfloat16", dict(), 2e-3),
        ("O2", "float16", dict(), 5e-4),
        ("O2", "float16", dict(closure=True), 5e-4),  # the discriminator stepped with opt.step(closure=...)
        ("O2", "float16", dict(n_critic=3), 5e-4),  # WGAN's critic loop: three steps of one optimizer per batch
        ("O2", "float16", dict(accumulate=2), 5e-4),  # a step every two batches, gradients added up by hand
        ("O1", "float16", dict(clip_val=0.05), 5e-4),  # self.clip_gradients, small enough to clip every step
    ],
    ids=["O1-bf16", "O2-fp16", "O2-closure", "O2-n_critic", "O2-accumulate", "O1-clip"],
)
def test_gan_matches_fp32_with_an_overflow_in_one_optimizer(opt_level, half_dtype, model, tol):
    stepping = model.get("accumulate", 1)
    # the overflows on batches that step (with accumulation, an inf earlier in the window skips the window's step)
    overflows = {batch + stepping - 1 - batch % stepping: what for batch, what in OVERFLOWS.items()}
    reference, _ = _fit(None, overflows=overflows, **model)
    plugin = _plugin(opt_level, half_dtype)
    gan, _ = _fit(plugin, overflows=overflows, **model)
    assert gan.skipped == [(which, batch) for batch, (which, _) in overflows.items()]  # step_was_skipped, per optimizer
    assert plugin.amp.skipped_steps == [2]
    assert _max_diff(gan, reference) < tol
    # one scale update per iteration that stepped (never one per optimizer), each overflow halving the scale:
    # 256, halved at the first overflow, halved again at the second, then growth after three clean iterations
    assert plugin.amp.iteration.index == 8 // stepping
    assert plugin.amp.scalers[0].get_scale() == (128.0 if stepping == 1 else 64.0)


def test_clip_gradients_in_a_manual_step_clips():
    # The clip test above is a test only if the clip changes the run.
    unclipped, _ = _fit(None)
    clipped, _ = _fit(None, clip_val=0.05)
    assert _max_diff(clipped, unclipped) > 1e-2


def test_each_loss_keeps_its_own_scale():
    plugin = _plugin("O2", num_losses=2)
    gan, _ = _fit(plugin, overflows={1: ("d", None)})
    assert gan.skipped == [("d", 1)]
    # loss 0 (generator) grew at batches 2 and 5; loss 1 (discriminator) overflowed at batch 1, then grew at 4 and 7
    assert [s.get_scale() for s in plugin.amp.scalers] == [1024.0, 512.0]
    assert plugin.amp.skipped_steps == [0, 1]


@pytest.mark.parametrize("ask_skipped", [True, False], ids=["asked", "never-asked"])
def test_fused_adamw_skipped_on_the_device_matches_the_host_read(ask_skipped):
    # skip_on_device=None: the fused AdamW skips on the device; skip_on_device=False reads the flag on the host.
    # Never asked, the outcomes are read by the plugin itself (next batch, teardown) and counted all the same.
    on_device = _plugin("O2")
    gan, _ = _fit(on_device, optimizer="adamw_fused", overflows=OVERFLOWS, ask_skipped=ask_skipped)
    host = _plugin("O2", skip_on_device=False)
    reference, _ = _fit(host, optimizer="adamw_fused", overflows=OVERFLOWS)
    assert reference.skipped == [("d", 1), ("g", 4)]
    assert gan.skipped == (reference.skipped if ask_skipped else [])
    assert on_device.amp.skipped_steps == host.amp.skipped_steps == [2]
    core = ("mpx/loss_scale", "mpx/overflows", "mpx/skipped_steps")
    on_device_metrics, host_metrics = on_device.metrics(), host.metrics()
    assert {k: on_device_metrics[k] for k in core} == {k: host_metrics[k] for k in core}
    # (mpx/overflow/<module> names only the gradients still there when the outcome is read: never asked, it is read
    # after the step's opt.zero_grad(), as documented for skip_on_device, and names none)
    assert _max_diff(gan, reference) == 0.0


def test_hand_stepped_schedulers_follow_the_user():
    # In manual optimization the plugin holds no schedule: the user steps it (here on every batch, skipped or not),
    # and its learning rate is Lightning's 32-true run's.
    plugin = _plugin("O2")
    gan, _ = _fit(plugin, overflows=OVERFLOWS, schedulers=True)
    reference, _ = _fit(None, overflows=OVERFLOWS, schedulers=True)
    assert gan.lrs == reference.lrs and len(gan.lrs) == 8
    assert _max_diff(gan, reference) < 5e-4


# -- reads inside the step -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("read", ["metrics", "save_checkpoint"])
def test_a_read_inside_the_step_does_not_end_the_iteration(tmp_path, read):
    # plugin.metrics() or trainer.save_checkpoint() between the discriminator's step and the generator's backward used
    # to close the iteration there: two scale updates per batch, so the scale grew twice as fast as the straight run's
    # (and under DDP, with the read on rank 0 only, the ranks' scales parted: see the DDP test).
    def mid_step(trainer: Any) -> None:
        if read == "metrics":
            trainer.precision_plugin.metrics()
        elif trainer.global_step == 3:  # batch 1, after the discriminator's step
            trainer.save_checkpoint(os.path.join(tmp_path, "mid.ckpt"))

    straight = _plugin("O1", "bfloat16", growth_interval=1)
    _fit(straight, overflows=OVERFLOWS)
    plugin = _plugin("O1", "bfloat16", growth_interval=1)
    _fit(plugin, overflows=OVERFLOWS, mid_step=mid_step)
    assert plugin.amp.iteration.index == straight.amp.iteration.index == 8
    assert plugin.amp.scalers[0].get_scale() == straight.amp.scalers[0].get_scale()
    assert plugin.metrics()["mpx/skipped_steps"] == straight.metrics()["mpx/skipped_steps"] == 2


# -- checkpoints -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])
def test_checkpoint_resumes_bit_for_bit(tmp_path, optimizer):
    every_epoch = ModelCheckpoint(dirpath=str(tmp_path), save_top_k=-1, save_on_train_epoch_end=True)
    straight_plugin = _plugin("O2")
    straight, straight_trainer = _fit(
        straight_plugin, epochs=2, optimizer=optimizer, overflows=OVERFLOWS, schedulers=True,
        trainer_kwargs=dict(enable_checkpointing=True, callbacks=[every_epoch]),
    )
    (first_epoch,) = glob.glob(os.path.join(tmp_path, "epoch=0-*.ckpt"))
    plugin = _plugin("O2")
    resumed, trainer = _fit(
        plugin, epochs=2, ckpt_path=first_epoch, optimizer=optimizer, overflows=OVERFLOWS, schedulers=True
    )
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    for opt_a, opt_b in zip(straight_trainer.optimizers, trainer.optimizers):
        for masters_a, masters_b in zip(straight_plugin.main_params(opt_a), plugin.main_params(opt_b)):
            assert torch.equal(masters_a, masters_b)
        for state_a, state_b in zip(opt_a.state.values(), opt_b.state.values()):
            for key in state_a:
                assert torch.equal(torch.as_tensor(state_a[key]), torch.as_tensor(state_b[key])), key
        assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
    assert straight_plugin.amp.state_dict()["scalers"] == plugin.amp.state_dict()["scalers"]
    assert straight_plugin.amp.skipped_steps == plugin.amp.skipped_steps == [4]


# -- DDP -------------------------------------------------------------------------------------------------------------
def test_ddp_overflow_on_one_rank(tmp_path):
    # One launch, two gloo processes, every case of the script in turn.
    run_script("hostile_manual_ddp_script.py", tmp_path, timeout=300)
    ranks = rank_results(tmp_path)
    expected = [[which, batch] for batch, (which, _) in DDP_OVERFLOWS.items()]
    for case in ("o1_sgd", "o2_fused", "o2_host"):
        r0, r1 = ranks[0][case], ranks[1][case]
        # the ranks skip together (the inf was on one rank only) and end with the same weights and scale (o1_sgd: a
        # metrics() read on rank 0 inside the step used to update rank 0's scale there, so the ranks' scales parted
        # and DDP averaged gradients of two scales)
        assert r0["skipped"] == r1["skipped"] == expected, case
        assert r0["skipped_steps"] == r1["skipped_steps"] == [2], case
        assert r0["scales"] == r1["scales"], case
        assert r0["params"] == r1["params"], case
        # the batch reaches the step as it is, as on one device (at O2 the step, reached through DDP's forward, got it
        # cast to half, float targets included)
        assert r0["batch_dtypes"] == ["torch.float32"], case
    assert ranks[0]["reference"]["params"] == ranks[1]["reference"]["params"]

    def max_diff(case: str, reference: str) -> float:
        return max(
            abs(x - y)
            for a, b in zip(ranks[0][case]["params"], ranks[0][reference]["params"])
            for x, y in zip(a, b)
        )

    assert max_diff("o1_sgd", "reference") < 2e-3
    # O2 under DDP, where the step is reached through DDP's forward: the generator called on noise made in the step
    # trains (it raised a dtype error), and skipping on the device is the host read's run exactly
    assert ranks[0]["o2_fused"]["params"] == ranks[0]["o2_host"]["params"]


class _TwoLosses(pl.LightningModule):
    """Manual optimization with a loss per optimizer's turn (``num_losses=2``): batch 0's loss-0 backward overflows in
    the body (an inf put in its gradient), only the head steps; batch 1's loss-1 backward before the loop's
    ``zero_grad`` (``clear``: ``set_to_none``), another loss-1 backward, both steps. ``mpx``: our plugin (``loss_id``
    given); else Lightning's ``"bf16-mixed"`` (batch 0's inf left out, its head step taken on the same values)."""

    def __init__(self, clear: bool, mpx: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.automatic_optimization = False
        self.clear, self.mpx, self.stepped = clear, mpx, []

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.05), torch.optim.SGD(self.net[2].parameters(), lr=0.05)]

    def training_step(self, batch: Any, index: int) -> None:
        body, head = self.optimizers()
        x, y = batch

        def backward(inputs: torch.Tensor, loss_id: int) -> None:
            loss = F.cross_entropy(self.net(inputs).float(), y)
            self.manual_backward(loss, **({"loss_id": loss_id} if self.mpx else {}))

        if index == 0:
            backward(x, 0)
            if self.mpx:
                self.net[0].weight.grad[0, 0] = float("inf")
            head.step()
            return
        backward(x, 1)
        body.zero_grad(set_to_none=self.clear)
        head.zero_grad(set_to_none=self.clear)
        backward(x * 0.5, 1)
        before = self.net[0].weight.detach().float().clone()
        body.step()
        head.step()
        self.stepped.append(not torch.equal(self.net[0].weight.detach().float(), before))


@pytest.mark.parametrize("clear", [True, False])
def test_another_losses_backward_then_zero_grad_drops_the_bodys_overflow(clear: bool) -> None:
    """Before: the body's inf, found when the loss-1 backward brought its gradients to loss 1's scale, was charged
    there and outlived the ``zero_grad``: the body's step at batch 1, on finite gradients, was skipped and loss 0's
    scale halved (256 -> 128) where ``"bf16-mixed"`` (and one ``torch.amp.GradScaler`` per loss) steps it."""
    runs = {}
    for mpx in (True, False):
        module = _TwoLosses(clear, mpx)
        plugin = _plugin("O1", "bfloat16", num_losses=2) if mpx else None
        trainer = make_trainer(plugin, max_steps=2, limit_train_batches=2, precision=None if mpx else "bf16-mixed")
        trainer.fit(module, torch.utils.data.DataLoader(classification_data(), batch_size=16))
        runs[mpx] = module, plugin
    (ours, plugin), (ref, _) = runs[True], runs[False]
    assert ours.stepped == ref.stepped == [True]
    assert [scaler.get_scale() for scaler in plugin.amp.scalers] == [256.0, 256.0]
    for got, want in zip(ours.net.parameters(), ref.net.parameters(), strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=5e-3)  # bf16 autocast's rounding
