"""``skip_on_device``'s default (``None``, "auto"): each fused Adam/AdamW skips an overflowed step on the device, every
other optimizer reads the flag on the host, silently; ``False`` reads on the host for all of them.

Checked as a user who sets nothing: the path each optimizer takes (seen by the optimizer: the flag handed to its step),
decided once per optimizer; a float16 overflow against ``torch.amp.GradScaler`` with the same fused AdamW; and every
front door with a fused AdamW beside an SGD (clip, overflows in each, a checkpoint saved right after an overflow step
and resumed, the LR scheduler, gradient accumulation, the logged metrics), each the same as its run with
``skip_on_device=False``: the read moved, nothing else.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_mpx.engine.optimizer_step as optimizer_step
from lightning_mpx import Amp, MixedPrecisionSettings, StepOutcome
from tests import test_lifecycle_doors as doors
from tests.lightning_helpers import assert_same


def _handed(optimizer: torch.optim.Optimizer, seen: list[bool]) -> torch.optim.Optimizer:
    """Append to ``seen``, at each call of ``optimizer.step``, whether the overflow flag was handed to it (the device
    path calls every step with ``found_inf``; the host path calls only the steps it takes, without)."""
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(hasattr(opt, "found_inf")))
    return optimizer


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _backward(amp: Amp, model: nn.Module, index: int, inf: bool = False) -> None:
    g = torch.Generator().manual_seed(index)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
    with amp.forward_context():
        loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
    amp.backward(loss * float("inf") if inf else loss)


# -- the setting ------------------------------------------------------------------------------------------------------
def test_the_default_is_auto_in_every_front_door():
    from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
    from lightning_mpx.accelerate import MixedPrecisionKwargs

    assert MixedPrecisionSettings().skip_on_device is None
    assert Amp("O1").settings.skip_on_device is None
    assert MixedPrecisionPlugin("O1").settings.skip_on_device is None
    assert FabricMixedPrecisionPlugin("O1").amp.settings.skip_on_device is None
    assert MixedPrecisionKwargs().skip_on_device is None and "skip_on_device" not in MixedPrecisionKwargs().to_kwargs()
    assert inspect.signature(Amp).parameters["skip_on_device"].default is None  # what help(Amp) shows


@pytest.mark.parametrize("value", [1, "auto", "True"])
def test_a_value_other_than_none_true_or_false_is_refused_naming_the_choices(value):
    from lightning_mpx.accelerate import MixedPrecisionKwargs

    message = rf"skip_on_device={value!r} must be True, False or None \(None: on the device for the optimizers"
    with pytest.raises(TypeError, match=message):
        Amp("O1", skip_on_device=value)
    with pytest.raises(TypeError, match=message):
        MixedPrecisionKwargs(skip_on_device=value)


# -- which optimizers take the device path ---------------------------------------------------------------------------
def _groups(params: list[torch.Tensor]) -> list[dict[str, Any]]:
    return [{"params": params[:2], "fused": True}, {"params": params[2:]}]


OPTIMIZERS: dict[str, tuple[Callable[[list[torch.Tensor]], torch.optim.Optimizer], bool]] = {
    "AdamW(fused=True)": (lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True), True),
    "Adam(fused=True)": (lambda p: torch.optim.Adam(p, lr=1e-2, fused=True), True),
    "AdamW()": (lambda p: torch.optim.AdamW(p, lr=1e-2), False),
    "Adam(foreach=True)": (lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True), False),
    "Adam, one group unfused": (lambda p: torch.optim.Adam(_groups(p), lr=1e-2), False),
    "SGD(fused=True)": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True), False),
    "SGD": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), False),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_auto_skips_on_the_device_for_fused_adam_and_adamw_only_and_says_nothing(name, level):
    make, on_device = OPTIMIZERS[name]
    amp = Amp(level, half_dtype="float16", init_scale=2.0**10)
    model = amp.prepare_model(_net())
    seen: list[bool] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for an optimizer left on the host, nor for one on the device
        opt = _handed(amp.prepare_optimizer(make(list(model.parameters()))), seen)
        _backward(amp, model, 0)
        first = amp.step(opt)
        amp.update()
        opt.zero_grad()
        _backward(amp, model, 1, inf=True)
        second = amp.step(opt)
        amp.update()
    if on_device:
        assert isinstance(second, StepOutcome) and not second.known  # nothing read at the step
        assert seen == [True, True]  # the overflowed step too: skipped by the optimizer itself
    else:
        assert type(first) is bool and type(second) is bool
        assert seen == [False]  # read on the host, the overflowed step never called
    assert bool(first) and not bool(second) and amp.skipped_steps == [1] and amp.scalers[0].get_scale() == 2.0**9


@pytest.mark.parametrize(
    "settings",
    [{"skip_on_device": False}, {"on_floor": "promote"}],
    ids=["skip_on_device=False", "on_floor=promote"],
)
def test_the_opt_out_and_promotion_read_a_fused_adamw_on_the_host_at_the_step(settings):
    amp = Amp("O1", half_dtype="float16", init_scale=2.0**10, **settings)
    model = amp.prepare_model(_net())
    seen: list[bool] = []
    opt = _handed(amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)), seen)
    _backward(amp, model, 0, inf=True)
    outcome = amp.step(opt)
    assert outcome is False and amp.skipped_steps == [1]  # read, counted and recorded at the step itself
    assert amp.last_overflow is not None and seen == []


def test_the_path_is_decided_once_per_optimizer_and_again_when_its_groups_change(monkeypatch):
    asked: list[str] = []
    original = optimizer_step.device_skip_refusal

    def counting(optimizer: torch.optim.Optimizer) -> str | None:
        asked.append(type(optimizer).__name__)
        return original(optimizer)

    monkeypatch.setattr(optimizer_step, "device_skip_refusal", counting)
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    first, last = list(model[0].parameters()), list(model[2].parameters())
    fused = amp.prepare_optimizer(torch.optim.AdamW(first, lr=1e-2, fused=True))
    plain = amp.prepare_optimizer(torch.optim.SGD([last[0]], lr=0.1))
    kinds = []
    for index in range(3):
        _backward(amp, model, index)
        kinds.append((type(amp.step(fused)).__name__, type(amp.step(plain)).__name__))
        amp.update()
        fused.zero_grad()
        plain.zero_grad()
    assert kinds == [("StepOutcome", "bool")] * 3 and asked == ["AdamW", "SGD"]  # at each one's first step only
    # A group that cannot skip on the device, added later: the optimizer reads on the host from its next step on
    # (skip_on_device=True raises there instead), and the group trains.
    fused.add_param_group({"params": [last[1]], "fused": False})
    before = last[1].detach().clone()
    _backward(amp, model, 3)
    assert amp.step(fused) is True and asked == ["AdamW", "SGD", "AdamW"]
    amp.update()
    assert not torch.equal(last[1], before)


# -- float16 against torch's GradScaler with the same fused AdamW ---------------------------------------------------
def test_a_float16_overflow_skips_exactly_that_step_as_grad_scaler_does_with_the_same_fused_adamw():
    """O1 float16, fused AdamW, nothing set: a loss made inf at one step skips that step (weights and optimizer state
    unchanged, bit for bit) and halves the scale, as ``torch.amp.GradScaler`` does with the same optimizer under
    ``torch.autocast``; the other steps train to the same weights (the cast lists differ in a few ops, not here)."""
    inf_at, steps = 2, 5

    def state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        out = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            out += [opt.state[p][k].detach().clone() for k in ("step", "exp_avg", "exp_avg_sq")] if opt.state else []
        return out

    def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        return torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)

    runs = []
    for ours in (False, True):
        if ours:
            amp = Amp("O1", half_dtype="float16", init_scale=2.0**10)
            model = amp.prepare_model(_net())
            opt = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
        else:
            model = _net()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        scales, unchanged = [], []
        for index in range(steps):
            x, y = batch(index)
            before = state(model, opt)
            if ours:
                with amp.forward_context():
                    loss = F.cross_entropy(model(x).float(), y)
                amp.backward(loss * float("inf") if index == inf_at else loss)
                amp.step(opt)
                amp.update()
                scales.append(amp.scalers[0].get_scale())
            else:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(model(x).float(), y)
                scaler.scale(loss * float("inf") if index == inf_at else loss).backward()
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            after = state(model, opt)
            unchanged.append(len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)))
            opt.zero_grad()
        runs.append((scales, unchanged, state(model, opt)))
        if ours:
            assert amp.skipped_steps == [1]
    (ref_scales, ref_unchanged, ref_state), (scales, unchanged, got) = runs
    assert unchanged == ref_unchanged == [i == inf_at for i in range(steps)]
    assert scales == ref_scales == [2.0**10] * inf_at + [2.0**9] * (steps - inf_at)
    assert len(got) == len(ref_state)
    for a, b in zip(got, ref_state):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)  # float16 rounding of the forward over four steps
    steps_taken = [t for t in got if t.dim() == 0]
    assert all(t.item() == steps - 1 for t in steps_taken)  # the skipped step did not count in AdamW's state


# -- every front door, with the lifecycle of tests/test_lifecycle_doors.py --------------------------------------------
@dataclasses.dataclass(frozen=True)
class SkipCase(doors.Case):
    """A lifecycle case with an overflow in every dtype (bfloat16's is at its static floor: ``on_floor="continue"``)
    and ``skip_on_device`` unset (``"unset"``) or given."""

    skip: bool | str = "unset"

    @property
    def dynamic(self) -> bool:
        return True  # the Record makes the planned steps overflow

    @property
    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"half_dtype": self.half}
        out.update({"init_scale": doors.INIT_SCALE} if self.half == "float16" else {"on_floor": "continue"})
        return out if self.skip == "unset" else {**out, "skip_on_device": self.skip}


def _mixed_optimizers(seen: list[bool]) -> Callable[[doors.Net], tuple[torch.optim.Optimizer, torch.optim.Optimizer]]:
    """The lifecycle's optimizers as a fused AdamW (the body, whose gradients overflow) and an SGD (the head)."""

    def make(net: doors.Net) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        body = _handed(torch.optim.AdamW(net.body.parameters(), lr=1e-2, fused=True), seen)
        return body, torch.optim.SGD(net.head.parameters(), lr=0.1, momentum=0.9)

    return make


@pytest.fixture(scope="module")
def door_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[doors.Record, list[bool]]]:
    """``door_runs(door, level, half, skip)``: that door's lifecycle run with the mixed optimizers, and what the fused
    AdamW's steps were handed; made once per module."""
    made: dict[tuple[str, SkipCase, tuple[str, ...]], tuple[doors.Record, list[bool]]] = {}

    def get(door: str, case: SkipCase, inf_into: tuple[str, ...]) -> tuple[doors.Record, list[bool]]:
        key = (door, case, inf_into)
        if key not in made:
            seen: list[bool] = []
            run = doors.run_core if door == "core" else doors.DOORS[door]
            path: Path = tmp_path_factory.mktemp(f"{door}-{case.level}-{case.half}-{case.skip}")
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(doors, "optimizers", _mixed_optimizers(seen))
                made[key] = (run(case, path, inf_into), seen)
        return made[key]

    return get


LIFECYCLE_CASES = [("O1", "bfloat16"), ("O2", "bfloat16"), ("O1", "float16"), ("O2", "float16")]


@pytest.mark.parametrize("inf_into", [("body",), ("body", "head")], ids=["inf-in-adamw", "inf-in-both"])
@pytest.mark.parametrize("level, half", LIFECYCLE_CASES, ids=[f"{lv}-{h}" for lv, h in LIFECYCLE_CASES])
@pytest.mark.parametrize("door", ["core", "lightning", "fabric", "accelerate", "apex"])
def test_every_door_with_a_fused_adamw_and_nothing_set_trains_as_its_host_path(door, level, half, inf_into, door_runs):
    """A fused AdamW (the body) and an SGD (the head) through each door, a clip, the planned overflows, a checkpoint
    saved right after the first overflow step and resumed into a fresh run: with nothing set, the same steps
    skipped, scales, resumed state (scalers, weights, optimizer state), counts, last overflow and final weights as
    with ``skip_on_device=False``, bit for bit; the AdamW was handed the flag at every step (the SGD never can be).
    The Apex door stays on the host path (Apex reports an overflow at the step)."""
    if door == "apex" and half != "float16":
        pytest.skip("the Apex layer is float16 only (Apex's initialize() has no bfloat16)")
    auto, auto_seen = door_runs(door, SkipCase(level, half), inf_into)
    host, host_seen = door_runs(door, SkipCase(level, half, skip=False), inf_into)
    assert auto.stepped == host.stepped
    if door != "apex":  # (the Apex door skips every optimizer a scale_loss block names: tests/test_lifecycle_doors)
        assert auto.stepped == [(s not in doors.INF_AT, "head" not in inf_into or s not in doors.INF_AT)
                                for s in range(doors.STEPS)]  # fmt: skip
    assert auto.scales == host.scales and auto.clip_norm == host.clip_norm
    assert auto.resumed["scalers"] == host.resumed["scalers"]
    overflowed = 2 if door == "apex" else len(inf_into)  # optimizer steps skipped at each planned step
    assert auto.resumed["skipped_steps"] == host.resumed["skipped_steps"] == [overflowed]
    assert_same(auto.resumed["weights"], host.resumed["weights"])
    assert_same(auto.resumed["optimizers"], host.resumed["optimizers"])
    assert_same(auto.final, host.final)
    assert auto.skipped_steps == host.skipped_steps == [2 * overflowed]
    assert auto.last_overflow == host.last_overflow
    assert host_seen == [False] * (doors.STEPS - 2)  # the steps it took, none of the two skipped on the host
    if door == "apex":
        assert auto_seen == host_seen
    else:
        assert auto_seen == [True] * doors.STEPS  # every step of the AdamW, the two it skipped on the device included



# -- the frameworks' own loops: schedules, accumulation, logged metrics ---------------------------------------------
def _given(skip: bool | str) -> dict[str, Any]:
    return {} if skip == "unset" else {"skip_on_device": skip}


def test_trainer_with_a_fused_adamw_accumulation_and_a_schedule_logs_and_trains_as_the_host_path():
    """Lightning's automatic loop, ``accumulate_grad_batches=2``, a per-step StepLR, every step logged, an inf in both
    micro-batches of the third step: the logged metrics, the held schedule, the halved scale, the count and the
    weights are the host path's."""
    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import Classifier, RecordingLogger, classification_data, loader, make_trainer

    class Probed(Classifier):
        def __init__(self, seen: list[bool], **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.seen = seen

        def configure_optimizers(self) -> Any:
            out = super().configure_optimizers()
            _handed(out["optimizer"], self.seen)
            return out

    runs = []
    for skip in ("unset", False):
        seen: list[bool] = []
        model = Probed(seen, inject_inf_at=(2,), optimizer="adamw_fused", lr=0.01, scheduler=True)
        plugin = MixedPrecisionPlugin("O2", half_dtype="float16", init_scale=2.0**10, **_given(skip))
        logger = RecordingLogger()
        trainer = make_trainer(plugin, max_steps=4, accumulate_grad_batches=2, logger=logger, log_every_n_steps=1)
        trainer.fit(model, loader(classification_data(n=128)))
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        weights = [p.detach().clone() for p in model.parameters()]
        runs.append((logger.logged, plugin.amp.skipped_steps, plugin.amp.scalers[0].get_scale(), lr, weights, seen))
    (logged, skipped, scale, lr, weights, seen), (h_logged, h_skipped, h_scale, h_lr, h_weights, h_seen) = runs
    assert seen == [True] * 4 and h_seen == [False] * 3  # the device path for the fused AdamW, by default
    assert [m["mpx/skipped_steps"] for _, m in logged] == [0.0, 0.0, 1.0, 1.0]
    assert logged == h_logged and skipped == h_skipped == [1] and scale == h_scale == 2.0**9
    assert lr == h_lr == 0.01 * 0.5**3  # the schedule held on the skipped step
    assert_same(weights, h_weights)


def test_accelerator_with_accumulation_and_a_schedule_reads_step_was_skipped_as_the_host_path(fresh_accelerate_state):
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    runs = []
    for skip in ("unset", False):
        reset_accelerate_state()
        kwargs = MixedPrecisionKwargs(half_dtype="float16", init_scale=2.0**10, **_given(skip))
        accelerator = Accelerator(mixed_precision="O1", gradient_accumulation_steps=2, kwargs_handlers=[kwargs])
        seen: list[bool] = []
        model = _net()
        opt = _handed(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), seen)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        model, opt, sched = accelerator.prepare(model, opt, sched)
        skipped = []
        for index in range(8):
            g = torch.Generator().manual_seed(index)
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss * float("inf") if index == 4 else loss)
                opt.step()
                sched.step()
                if accelerator.sync_gradients:
                    skipped.append((opt.step_was_skipped, sched.scheduler.last_epoch))
                opt.zero_grad()
        weights = [p.detach().clone() for p in model.parameters()]
        runs.append((skipped, accelerator.amp.skipped_steps, accelerator.amp.scalers[0].get_scale(), weights, seen))
    (skipped, count, scale, weights, seen), (h_skipped, h_count, h_scale, h_weights, h_seen) = runs
    assert seen == [True] * 4 and h_seen == [False] * 3
    assert skipped == h_skipped == [(False, 1), (False, 2), (True, 2), (False, 3)]
    assert count == h_count == [1] and scale == h_scale == 2.0**9
    assert_same(weights, h_weights)


def test_fabric_loop_asking_step_was_skipped_before_zero_grad_records_as_the_host_path():
    """A Fabric loop with one fused AdamW that asks ``step_was_skipped`` after each step (to hold its schedule): the
    same answers, counts, scale, metrics and overflow record (the parameters named) as the host path. A loop that does
    not ask before ``zero_grad()`` gets the same count, step and scale, and a record that names no parameter (the
    gradients were gone when it was read: ``docs/loss_scaling.md``)."""
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    def run(skip: bool | str, ask: bool) -> tuple[Any, ...]:
        mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", init_scale=2.0**10, **_given(skip))
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
        model, opt = fabric.setup(model := _net(), torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
        answers = []
        for index in range(4):
            g = torch.Generator().manual_seed(index)
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss * float("inf") if index == 1 else loss)
            opt.step()
            if ask:
                answers.append(mpx.step_was_skipped(opt))
            opt.zero_grad()
        metrics = mpx.metrics()
        amp = mpx.amp
        weights = [p.detach().clone() for p in model.parameters()]
        return (answers, amp.skipped_steps, amp.last_overflow.step, amp.scalers[0].get_scale(),
                metrics["mpx/skipped_steps"], amp.last_overflow_parameters, weights)

    auto, host = run("unset", ask=True), run(False, ask=True)
    assert auto[0] == [False, True, False, False] and auto[1] == [1] and auto[3] == 2.0**9
    assert auto[:6] == host[:6] and auto[5] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert_same(auto[6], host[6])
    unasked = run("unset", ask=False)
    assert unasked[1:5] == host[1:5] and unasked[5] == []
    assert_same(unasked[6], host[6])
