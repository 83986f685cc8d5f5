"""Lightning's hook contract, with the plugin in place of Lightning's own precision plugins (real Trainer, CPU).

What Lightning's own tests hold for its precision plugins (tests_pytorch/models/test_hooks.py's hook order,
plugins/test_amp_plugins.py's ``test_amp_gradient_unscale``, trainer/test_trainer.py's clipping overrides,
core/test_lightning_module.py's ``configure_gradient_clipping``, the scheduler hooks, ``ddp_spawn``), checked here
against the same run with Lightning's "16-mixed", "bf16-mixed" or "32-true" wherever one exists:

* the LightningModule's ``backward`` hook is called with the scaled loss, also when a wrapper stands in for it;
* ``lr_scheduler_step`` receives the user's own scheduler; a skipped step holds the schedule;
* the plugin pickles (``strategy="ddp_spawn"``);
* hooks that read gradients (``configure_gradient_clipping``, ``on_before_optimizer_step``) see them unscaled, and the
  model's own gradients are clipped (at O2 too), in automatic and manual optimization.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import pickle
from typing import Any, Callable
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn

from lightning_mpx import CastTable, MixedPrecisionPlugin
from tests.launch import rank_results, run_script
from tests.lightning_helpers import (
    Classifier,
    RecordingClassifier,
    RecordingLogger,
    classification_data,
    loader,
    make_trainer,
    true_gradients,
)

#: Plugin settings per half dtype. bfloat16 gets a dynamic scale (its default is a static 1.0, under which a scaled
#: gradient cannot be told from a true one).
HALVES: dict[str, dict[str, Any]] = {
    "fp16": dict(half_dtype="float16"),
    "bf16": dict(half_dtype="bfloat16", loss_scale="dynamic"),
}
CASES = [pytest.param(level, half, id=f"{level}-{half}") for level in ("O1", "O2") for half in ("fp16", "bf16")]
SCALE = 1024.0


def _plugin(level: str, half: str, **kwargs: Any) -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin(level, init_scale=SCALE, **{**HALVES[half], **kwargs})


def _lightning_own(half: str) -> str | Precision:
    """Lightning's own mixed precision for ``half``. On CPU, ``precision="16-mixed"`` falls back to "bf16-mixed"
    (with a warning): the plugin built by hand runs float16 autocast with a GradScaler."""
    return MixedPrecision("16-mixed", "cpu") if half == "fp16" else "bf16-mixed"


def _trainer(run: str | Precision, **kwargs: Any) -> pl.Trainer:
    """A Trainer with a precision plugin (the plugin, or one of Lightning's), or Lightning's precision named ``run``."""
    return make_trainer(precision=run, **kwargs) if isinstance(run, str) else make_trainer(run, **kwargs)


def _norm(tensors: Any) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])).item()


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() for p in module.parameters()]


# -- 1. the backward hook ------------------------------------------------------------------------------------------
class _RecordsBackward(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.backward_losses: list[float] = []

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.backward_losses.append(loss.item())
        super().backward(loss, *args, **kwargs)


@pytest.mark.parametrize("level,half", CASES)
def test_backward_override_gets_the_scaled_loss_every_step(level, half):
    model = _RecordsBackward()
    make_trainer(_plugin(level, half), max_steps=3).fit(model, loader(classification_data(n=48)))
    # The loss the training step returned, times the scale (a power of two: exact), as with "16-mixed".
    assert model.backward_losses == [loss * SCALE for loss in model.losses]


@pytest.mark.parametrize("level,half", CASES)
def test_a_wrapped_default_backward_is_called(level, half):
    def calls(run: str | Precision) -> int:
        model = Classifier()
        # A wrapper over the default hook: Lightning's is_overridden() sees through it.
        with mock.patch.object(model, "backward", wraps=model.backward) as backward:
            _trainer(run, max_steps=2).fit(model, loader(classification_data(n=32)))
        return backward.call_count

    assert calls(_plugin(level, half)) == calls(_lightning_own(half)) == calls("32-true") == 2


def _hook_names() -> list[str]:
    """The public hooks of LightningModule (as Lightning's own hook-order test picks them)."""
    module_only = {name for name, _ in inspect.getmembers(nn.Module, inspect.isfunction)} - {"forward", "zero_grad"}
    names = {name for name, _ in inspect.getmembers(pl.LightningModule, inspect.isfunction) if not name.startswith("_")}
    return sorted(names - module_only - {"optimizers", "log", "log_dict"})


def _record_into(obj: Any, names: list[str], calls: list[str], prefix: str = "") -> None:
    """Replace each hook on the instance by a wrapper that records its name (``functools.wraps``: Lightning's
    ``is_overridden`` sees the default hook through it)."""
    for name in names:
        hook = getattr(obj, name)

        def wrapper(*args: Any, __hook: Callable[..., Any] = hook, __name: str = prefix + name, **kwargs: Any) -> Any:
            calls.append(__name)
            return __hook(*args, **kwargs)

        setattr(obj, name, functools.wraps(hook)(wrapper))


class _HookOrder(Classifier):
    def __init__(self, calls: list[str], automatic: bool) -> None:
        super().__init__(scheduler=True)
        self.automatic_optimization = automatic
        _record_into(self, _hook_names(), calls)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()
        return {"loss": loss}


def _hook_order(run: str | Precision, automatic: bool) -> list[str]:
    calls: list[str] = []
    callback = pl.Callback()
    callback_hooks = [n for n, _ in inspect.getmembers(pl.Callback, inspect.isfunction) if n.startswith("on_")]
    _record_into(callback, callback_hooks, calls, prefix="Callback.")
    model = _HookOrder(calls, automatic)
    _trainer(run, max_steps=2, callbacks=[callback]).fit(model, loader(classification_data(n=32)))
    return calls


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
@pytest.mark.parametrize("level,half", CASES)
def test_hook_order_is_lightnings_own(level, half, automatic):
    plugin_order = _hook_order(_plugin(level, half), automatic)
    assert plugin_order.count("backward") == 2
    assert plugin_order == _hook_order(_lightning_own(half), automatic)


# -- 2. learning-rate schedulers -------------------------------------------------------------------------------------
class _SchedulerHook(Classifier):
    """A per-step schedule with an ``lr_scheduler_step`` override: ``isinstance`` dispatch, or timm's call."""

    def __init__(self, kind: str, inject_inf_at: tuple[int, ...] = ()) -> None:
        super().__init__(inject_inf_at=inject_inf_at, lr=1.0)
        self.kind = kind
        self.received: list[Any] = []

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.kind == "isinstance":
            self.scheduler: Any = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        else:
            self.scheduler = _EpochScheduler(optimizer, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler, "interval": "step"}}

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        self.received.append(scheduler)
        if isinstance(scheduler, torch.optim.lr_scheduler.StepLR):
            scheduler.step()
        elif isinstance(scheduler, _EpochScheduler):
            scheduler.step(epoch=len(self.received))  # timm: step(epoch) sets the rate of that epoch


class _EpochScheduler:
    """A scheduler as timm writes them: not a torch LRScheduler, and ``step(epoch, metric=None)`` sets the rate of
    that epoch (Lightning needs an ``lr_scheduler_step`` override for it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, gamma: float) -> None:
        self.optimizer = optimizer
        self.gamma = gamma
        self.base = [group["lr"] for group in optimizer.param_groups]

    def step(self, epoch: int, metric: Any = None) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base):
            group["lr"] = base * self.gamma**epoch

    def state_dict(self) -> dict[str, Any]:
        return {"gamma": self.gamma, "base": list(self.base)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gamma, self.base = state["gamma"], list(state["base"])


def _final_lr(run: str | Precision, kind: str, steps: int, inject_inf_at: tuple[int, ...] = ()) -> tuple:
    model = _SchedulerHook(kind, inject_inf_at)
    trainer = _trainer(run, max_steps=steps)
    trainer.fit(model, loader(classification_data(n=64)))
    assert all(s is model.scheduler for s in model.received)  # the user's own object, never a wrapper
    return trainer.optimizers[0].param_groups[0]["lr"], len(model.received)


@pytest.mark.parametrize("kind", ["isinstance", "step_epoch"])
@pytest.mark.parametrize("level,half", CASES)
def test_scheduler_override_gets_the_users_scheduler_and_steps_it(level, half, kind):
    lr, calls = _final_lr(_plugin(level, half), kind, steps=4)
    assert (lr, calls) == _final_lr("32-true", kind, steps=4) == (0.0625, 4)


@pytest.mark.parametrize("kind", ["isinstance", "step_epoch"])
@pytest.mark.parametrize("level,half", CASES)
def test_a_skipped_step_holds_the_schedule(level, half, kind):
    plugin = _plugin(level, half)
    lr, calls = _final_lr(plugin, kind, steps=4, inject_inf_at=(1,))
    assert plugin.amp.skipped_steps == [1]
    # The hook is not called for the skipped step: three real steps, the rate of three steps of the FP32 run.
    # (Lightning's "16-mixed" steps the schedule on a step GradScaler skipped: 0.0625 here.)
    assert (lr, calls) == _final_lr("32-true", kind, steps=3) == (0.125, 3)


class _SeesConfigs(pl.Callback):
    """Records, at each batch start, whether the Trainer's scheduler config is the one Lightning built, as it was."""

    def __init__(self) -> None:
        self.original: Any = None
        self.seen: list[bool] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.original = trainer.lr_scheduler_configs[0]

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        config = trainer.lr_scheduler_configs[0]
        self.seen.append(config is self.original and config.interval == "step")


def test_the_schedule_is_held_for_one_batch_only_and_logged_at_every_step():
    plugin = _plugin("O1", "fp16")
    logger = RecordingLogger()
    configs = _SeesConfigs()
    monitor = pl.callbacks.LearningRateMonitor(logging_interval="step")
    model = Classifier(inject_inf_at=(1,), lr=1.0, scheduler=True)
    trainer = make_trainer(plugin, max_steps=4, logger=logger, log_every_n_steps=1, callbacks=[configs, monitor])
    trainer.fit(model, loader(classification_data(n=64)))
    assert plugin.amp.skipped_steps == [1]
    # Callbacks find Lightning's own config at every batch start, the one after the skipped step included.
    assert configs.seen == [True] * 4
    assert [metrics["lr-SGD"] for _, metrics in logger.logged if "lr-SGD" in metrics] == [1.0, 0.5, 0.5, 0.25]
    assert trainer.lr_scheduler_configs[0] is configs.original


# -- 3. pickling, ddp_spawn ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_the_plugin_pickles_with_its_settings_and_trains_as_the_original(level):
    kwargs: dict[str, Any] = dict(half_dtype="bfloat16", loss_scale="dynamic", init_scale=256.0, growth_interval=3)
    if level == "O1":
        table = CastTable.default()  # holds F.max_pool2d (a local function of torch) and Tensor methods
        table.register(torch.outer, "half")
        table.register(torch.ops.aten.mm.default, "half")
        kwargs["cast_table"] = table
    original = MixedPrecisionPlugin(level, **kwargs)
    copied = pickle.loads(pickle.dumps(original))
    assert type(copied) is MixedPrecisionPlugin and copied.opt_level == level
    if level == "O1":
        assert [(e.qualified_name, e.category) for e in copied.amp.policy.table] == [
            (e.qualified_name, e.category) for e in table
        ]
        assert torch.ops.aten.mm.default in copied.amp.policy.table

    finals = []
    for plugin in (original, copied):
        model = Classifier(optimizer="adamw", lr=0.01)
        make_trainer(plugin, max_steps=4).fit(model, loader(classification_data(n=64)))
        finals.append([p.detach().clone() for p in model.parameters()])
        assert plugin.amp.scalers[0].get_scale() == 256.0 * 2  # grew once, after 3 steps: its own scaler
    for a, b in zip(*finals):
        assert torch.equal(a, b)


class _Tagged(MixedPrecisionPlugin):
    """A user's subclass with an attribute of its own."""

    def __init__(self, tag: str, **kwargs: Any) -> None:
        super().__init__("O2", **kwargs)
        self.tag = tag


def test_a_pickled_plugin_starts_afresh_and_keeps_a_subclass_attributes():
    plugin = _Tagged("mine", init_scale=SCALE, half_dtype="float16")
    model = Classifier(inject_inf_at=(1,))
    make_trainer(plugin, max_steps=2).fit(model, loader(classification_data(n=32)))
    assert plugin.amp.scalers[0].get_scale() == SCALE / 2
    copied = copy.deepcopy(plugin)  # through __getstate__ too
    for clone in (copied, pickle.loads(pickle.dumps(plugin))):
        assert type(clone) is _Tagged and clone.tag == "mine"
        # The settings, not the run: the state of a run is in its checkpoints.
        assert clone.amp is not plugin.amp and clone.amp.master_weights == []
        assert clone.amp.scalers[0].get_scale() == SCALE


def test_ddp_spawn_two_processes_train_as_one_process_on_the_global_batches(tmp_path):
    # The script and the two processes Lightning spawns into which it pickles the Trainer are processes of their own,
    # from the warm interpreter of tests/warm_python.py (each paid the imports before stop 64). TMPDIR: Lightning's
    # ddp_spawn saves rank 0's weights for the main process in a tempfile.mkdtemp() folder and removes the file only:
    # the folder goes under tmp_path, not /tmp.
    run_script("ddp_spawn_script.py", tmp_path, timeout=240, ranks=None, MPX_LEVELS="O1", TMPDIR=str(tmp_path))
    ranks = rank_results(tmp_path, prefix="O1_")
    main = json.loads((tmp_path / "O1_main.json").read_text())
    for rank in ranks:
        assert rank["plugin"] == "MixedPrecisionPlugin" and rank["world_size"] == 2
        assert rank["table_has_outer"]  # the user's cast table reached the process
        assert rank["skipped_steps"] == [1] and rank["scale"] == SCALE / 2  # rank 0's overflow, skipped by both
        assert rank["lrs"] == [0.25, 0.125, 0.125, 0.0625]  # the schedule held on the skipped step
    assert ranks[0]["params"] == ranks[1]["params"]
    assert main["main"] == ranks[0]["params"]  # what Lightning brought back to the main process
    for trained, reference in zip(main["main"], main["reference"]):
        torch.testing.assert_close(torch.tensor(trained), torch.tensor(reference), rtol=0, atol=1e-3)


# -- 4. gradients the hooks read: unscaled, and clipped on the model ---------------------------------------------------
class _ClipHook(Classifier):
    """Records the model's gradient norm before and after Lightning's clip, inside ``configure_gradient_clipping``."""

    def __init__(self) -> None:
        super().__init__()
        self.before: list[float] = []
        self.after: list[float] = []

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        self.before.append(_norm(p.grad for p in self.parameters()))
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.after.append(_norm(p.grad for p in self.parameters()))


@pytest.mark.parametrize("level,half", CASES)
def test_clipping_override_sees_unscaled_gradients_and_clips_the_models(level, half):
    def run(which: str | Precision) -> _ClipHook:
        model = _ClipHook()
        _trainer(which, max_steps=1, gradient_clip_val=0.05).fit(model, loader(classification_data(n=16)))
        return model

    plugin, own, fp32 = run(_plugin(level, half)), run(_lightning_own(half)), run("32-true")
    assert fp32.before[0] > 0.05  # the clip is active
    assert plugin.before[0] == pytest.approx(own.before[0], rel=2e-2)  # not times the scale (1024)
    assert plugin.before[0] == pytest.approx(fp32.before[0], rel=2e-2)
    assert plugin.after[0] == pytest.approx(0.05, rel=1e-2) and own.after[0] == pytest.approx(0.05, rel=1e-2)


class _ClippingSGD(torch.optim.SGD):
    def step(self, closure: Any = None, pl_module: Any = None) -> Any:
        pl_module.check_clipped()
        return super().step(closure)


class _UnscaleCheck(Classifier):
    """Lightning's test_amp_gradient_unscale, for the plugin: the hooks and the optimizer see the module's gradients
    unscaled, then clipped by value."""

    def on_after_backward(self) -> None:
        scale = self.trainer.precision_plugin.amp.scalers[0].get_scale()
        assert scale == SCALE
        self.expected = [p.grad.detach().float() / scale for p in self.parameters()]  # accumulated so far

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        for grad, expected in zip(_grads(self), self.expected):
            torch.testing.assert_close(grad, expected, rtol=1e-2, atol=1e-5)
        self.clipped = [g.clamp(-1e-3, 1e-3) for g in _grads(self)]

    def configure_gradient_clipping(self, *args: Any, **kwargs: Any) -> None:
        super().configure_gradient_clipping(*args, **kwargs)
        self.check_clipped()

    def check_clipped(self) -> None:
        for grad, expected in zip(_grads(self), self.clipped):
            torch.testing.assert_close(grad, expected, rtol=1e-2, atol=1e-6)
        self.checks = getattr(self, "checks", 0) + 1

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, closure: Any = None, **kwargs: Any) -> None:
        optimizer.step(closure, pl_module=self)

    def configure_optimizers(self) -> Any:
        return _ClippingSGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("level,half", CASES)
def test_gradients_unscaled_for_the_hooks_and_clipped_on_the_module(level, half, accumulate):
    model = _UnscaleCheck()
    trainer = make_trainer(
        _plugin(level, half, growth_interval=1000),
        max_steps=2,
        gradient_clip_val=1e-3,
        gradient_clip_algorithm="value",
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(model, loader(classification_data(n=64)))
    assert model.checks == 4  # after the clip and in the optimizer, at each of the two steps


@pytest.mark.parametrize("owner", ["module", "callback"])
@pytest.mark.parametrize("level,half", CASES)
def test_a_wrapper_over_the_default_gradient_hook_sees_unscaled_gradients(level, half, owner):
    # A profiler or a hook recorder that wraps on_before_optimizer_step on the instance and reads the gradients in its
    # wrapper: Lightning's is_overridden() sees the default hook through it.
    model, callback = Classifier(), pl.Callback()
    seen: list[float] = []
    target = model if owner == "module" else callback
    hook = target.on_before_optimizer_step

    @functools.wraps(hook)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        seen.append(_norm(p.grad for p in model.parameters()))
        return hook(*args, **kwargs)

    target.on_before_optimizer_step = wrapper
    data = classification_data(n=16)
    make_trainer(_plugin(level, half), max_steps=1, callbacks=[callback]).fit(model, loader(data))
    assert seen == [pytest.approx(_norm(true_gradients(data[:16])), rel=2e-2)]


@pytest.mark.parametrize("level,half", CASES)
def test_clipping_override_of_its_own_acts_on_unscaled_gradients(level, half):
    # Lightning's test_lightning_module_configure_gradient_clipping: the override clamps the optimizer's gradients.
    class Clamps(RecordingClassifier):
        def configure_gradient_clipping(
            self, optimizer: Any, gradient_clip_val: Any, gradient_clip_algorithm: Any
        ) -> None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad.clamp_(min=0, max=1e-2)

    data = classification_data(n=16)
    trainer = make_trainer(_plugin(level, half), max_steps=1, gradient_clip_val=1e-4)
    trainer.fit(Clamps(), loader(data))
    # Scaled gradients would read 1e-2 wherever they are positive. (bfloat16's gradients are a coarser rounding.)
    atol = 2e-4 if half == "fp16" else 1e-3
    for seen, true in zip(trainer.optimizers[0].seen[0], true_gradients(data[:16])):
        torch.testing.assert_close(seen.float(), true.clamp(0, 1e-2), rtol=2e-2, atol=atol)


@pytest.mark.parametrize("level,half", CASES)
def test_the_trainers_clip_follows_a_hooks_write_to_the_models_gradients(level, half):
    class Halves(RecordingClassifier):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.net[0].weight.grad.mul_(0.5)  # the user's own edit of the true gradients, before Lightning's clip

    data = classification_data(n=16)
    trainer = make_trainer(_plugin(level, half), max_steps=1, gradient_clip_val=1e-3, gradient_clip_algorithm="value")
    trainer.fit(Halves(), loader(data))
    true = true_gradients(data[:16])
    true[0] = true[0] * 0.5
    atol = 1e-4 if half == "fp16" else 5e-4  # below the clip value, 1e-3 (bfloat16: a coarser rounding)
    for seen, expected in zip(trainer.optimizers[0].seen[0], true):
        torch.testing.assert_close(seen.float(), expected.clamp(-1e-3, 1e-3), rtol=2e-2, atol=atol)


class _ManualClip(Classifier):
    """Manual optimization: ``manual_backward``, ``clip_gradients``, the step."""

    def __init__(self) -> None:
        super().__init__(lr=0.5)
        self.automatic_optimization = False
        self.clipped_norms: list[float] = []
        self.backward_calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        self.clipped_norms.append(_norm(p.grad for p in self.parameters()))
        optimizer.step()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.backward_calls += 1
        super().backward(loss, *args, **kwargs)


@pytest.mark.parametrize("level,half", CASES)
def test_manual_optimization_clips_unscaled_gradients(level, half):
    def run(which: str | Precision) -> _ManualClip:
        model = _ManualClip()
        _trainer(which, max_steps=3).fit(model, loader(classification_data(n=48)))
        return model

    plugin, fp32 = run(_plugin(level, half)), run("32-true")
    assert plugin.backward_calls == 3
    assert plugin.clipped_norms == pytest.approx([0.05] * 3, rel=1e-2)
    # The training follows the FP32 run's (Lightning's "bf16-mixed" follows it as closely).
    ref = run("bf16-mixed") if half == "bf16" else fp32
    tolerance = 3 * max((a - b).abs().max().item() for a, b in zip(ref.parameters(), fp32.parameters())) + 2e-3
    for mine, theirs in zip(plugin.parameters(), fp32.parameters()):
        torch.testing.assert_close(mine.float(), theirs, rtol=0, atol=tolerance)
