"""A hostile user of stop 61's surfaces: ``optimizer.state[p]`` habits at O2 (a reset by assignment, a deep-copied or
pickled optimizer as a snapshot), ``plugin.scaler`` read between a Trainer GAN's two manual steps at O2 float16, and
a backbone unfrozen into the optimizer in the middle of an accumulation window; each against an FP32 run or
``torch.amp.GradScaler``.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin
from tests.lightning_helpers import make_trainer


def _core(level: str | None, n: int) -> tuple[Amp | None, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    amp = Amp(level, half_dtype=torch.bfloat16) if level else None
    model = amp.prepare_model(net) if amp else net
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    optimizer = amp.prepare_optimizer(optimizer) if amp else optimizer
    _steps(amp, model, optimizer, range(n))
    return amp, model, optimizer


def _steps(amp: Amp | None, model: nn.Module, optimizer: torch.optim.Optimizer, seeds: Any) -> None:
    for i in seeds:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        if amp is None:
            model(x).pow(2).mean().backward()
            optimizer.step()
        else:
            with amp.forward_context():
                loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().pow(2).mean()
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
        optimizer.zero_grad()


def test_resetting_a_parameters_moments_by_assignment_matches_fp32() -> None:
    """``optimizer.state[p] = {}`` or ``optimizer.state.update({p: {}})`` (a reset of ``p``'s moments) at O2 replaced
    nothing: the master's moments went on (step 3, not 1) and a stale ``{}`` under ``p`` shadowed them for every later
    read by ``p``."""
    runs = {}
    for level in (None, "O2"):
        amp, model, optimizer = _core(level, 2)
        first, last = model[0].weight, model[2].bias
        optimizer.state[first] = {}
        optimizer.state.update({last: {}})
        _steps(amp, model, optimizer, range(2, 3))
        runs[level] = (model, optimizer)
        assert int(optimizer.state[first]["step"]) == int(optimizer.state[last]["step"]) == 1  # restarted, as FP32's
        assert len(optimizer.state) == 4
        assert [int(s["step"]) for s in optimizer.state_dict()["state"].values()] == [1, 3, 3, 1]
    (ref_model, ref), (model, optimizer) = runs[None], runs["O2"]
    for p, r in zip(model.parameters(), ref_model.parameters()):
        assert optimizer.state[p]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(optimizer.state[p]["exp_avg"], ref.state[r]["exp_avg"], rtol=0.05, atol=1e-4)


def test_a_deep_copied_or_pickled_optimizer_is_a_snapshot_whose_state_dict_restores_the_run() -> None:
    """``best = copy.deepcopy(optimizer)`` at O2: the copy's state was keyed by copies of the FP32 masters, which are
    in none of its groups, so ``best.state_dict()`` raised ``KeyError``; a pickle too. Now the copy's state is keyed by
    its groups' parameters (FP32 moments) and its state dict restores the original as an FP32 run's does."""
    amp, model, optimizer = _core("O2", 2)
    want = optimizer.state_dict()
    for best in (copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer))):
        saved = best.state_dict()
        assert saved["param_groups"] == want["param_groups"]
        for index, entry in want["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(saved["state"][index][key], value, rtol=0, atol=0)
    _steps(amp, model, optimizer, range(2, 4))
    optimizer.load_state_dict(best.state_dict())  # back to the snapshot
    for p, master in zip(model.parameters(), amp.master_params(optimizer)):
        assert optimizer.state[p] is optimizer.state[master] and int(optimizer.state[p]["step"]) == 2
    assert optimizer.state[model[0].weight]["exp_avg"].dtype == torch.float32
    _steps(amp, model, optimizer, range(4, 5))  # trains on from there
    assert int(optimizer.state[model[0].weight]["step"]) == 3


_X = torch.randn(24, 3, generator=torch.Generator().manual_seed(0))
_INF = (1, 4)  # iterations whose discriminator loss overflows


def _gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(2, 3), nn.Linear(3, 1)


def _d_loss(g: nn.Module, d: nn.Module, x: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.randn(x.shape[0], 2, generator=torch.Generator().manual_seed(i))
    loss = d(x).float().pow(2).mean() + (d(g(z).detach()).float() - 1).pow(2).mean()
    return z, loss * float("inf") if i in _INF else loss


class _GAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.g, self.d = _gan()
        self.automatic_optimization = False
        self.seen: list[Any] = []

    def training_step(self, batch: Any, i: int) -> None:
        opt_g, opt_d = self.optimizers()
        z, d_loss = _d_loss(self.g, self.d, batch[0], i)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.seen.append(self.trainer.precision_plugin.scaler.get_scale())
        opt_g.zero_grad()
        self.manual_backward(self.d(self.g(z)).float().pow(2).mean())
        opt_g.step()
        self.seen.append(self.trainer.scaler.get_scale())

    def on_train_batch_end(self, *args: Any) -> None:
        self.seen.append(("end", self.trainer.scaler.state_dict()["scale"]))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.g.parameters(), lr=1e-2), torch.optim.Adam(self.d.parameters(), lr=1e-2)


def _grad_scaler_gan() -> tuple[list[Any], list[torch.Tensor]]:
    """The PyTorch GAN recipe: one ``GradScaler``, both steps, one ``update()`` per iteration."""
    g, d = _gan()
    opt_g, opt_d = torch.optim.Adam(g.parameters(), lr=1e-2), torch.optim.Adam(d.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    seen: list[Any] = []
    for i in range(len(_X) // 4):
        with torch.autocast("cpu", dtype=torch.float16):
            z, d_loss = _d_loss(g, d, _X[4 * i : 4 * i + 4], i)
        opt_d.zero_grad()
        scaler.scale(d_loss).backward()
        scaler.step(opt_d)
        seen.append(scaler.get_scale())
        with torch.autocast("cpu", dtype=torch.float16):
            g_loss = d(g(z)).float().pow(2).mean()
        opt_g.zero_grad()
        scaler.scale(g_loss).backward()
        scaler.step(opt_g)
        seen.append(scaler.get_scale())
        scaler.update()
        seen.append(("end", scaler.get_scale()))
    return seen, [p.detach() for p in [*g.parameters(), *d.parameters()]]


def test_a_trainer_gan_at_o2_float16_reads_and_steps_as_the_grad_scaler_recipe() -> None:
    """Manual optimization, two optimizers, D's loss overflowing twice, ``plugin.scaler`` read between the steps:
    the scale each read shows and the weights are the ``torch.amp.GradScaler`` recipe's (D skipped, G stepped)."""
    want_seen, want = _grad_scaler_gan()
    module = _GAN()
    plugin = MixedPrecisionPlugin("O2", half_dtype=torch.float16, init_scale=256.0, growth_interval=2)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_X), batch_size=4)
    make_trainer(plugin).fit(module, data)
    assert module.seen == want_seen
    assert len({s for s in want_seen if isinstance(s, float)}) > 1  # it moved
    for p, r in zip([*module.g.parameters(), *module.d.parameters()], want):
        torch.testing.assert_close(p.detach().float(), r, rtol=0, atol=2e-3)


class _Unfreeze(pl.callbacks.BaseFinetuning):
    """Adds the frozen backbone to the optimizer at batch 1 of the first epoch: inside the first accumulation
    window, after the head's first micro-batch."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Any) -> None:
        pass

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.current_epoch == 0 and i == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer=trainer.optimizers[0], lr=5e-3)


class _HeadFirst(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
        self.head = nn.Linear(6, 1)

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        return (self.head(self.backbone(batch[0])).float() - batch[1]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.head.parameters(), lr=1e-2)


def test_a_backbone_unfrozen_inside_an_accumulation_window_at_o2_trains_as_fp32() -> None:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=4)
    runs = []
    for plugin in (None, MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16)):
        module = _HeadFirst()
        trainer = make_trainer(plugin, max_epochs=2, accumulate_grad_batches=2, callbacks=[_Unfreeze()])
        trainer.fit(module, data)
        state = trainer.optimizers[0].state
        assert [int(state[p]["step"]) for p in module.parameters()] == [8, 8, 8, 8]
        runs.append(module)
    for p, r in zip(runs[1].parameters(), runs[0].parameters()):
        torch.testing.assert_close(p.detach().float(), r.detach(), rtol=0, atol=5e-3)
