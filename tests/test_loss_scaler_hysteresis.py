"""LossScaler's hysteresis against plain-Python twins of Megatron-LM's ``DynamicGradScaler``, DeepSpeed's
``DynamicLossScaler`` (with and without ``consecutive_hysteresis``) and Apex's ``amp_C.update_scale_hysteresis``
kernel (``growth_factor=1.0`` included), and a static scale restored from a checkpoint."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mpx.scaling.scaler import LossScaler

FAST = settings(max_examples=80, deadline=None)


class MegatronDynamicGradScaler:
    """megatron/core/optimizer/grad_scaler.py ``DynamicGradScaler.update`` in plain Python (FP32 scale)."""

    def __init__(self, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        self.scale = np.float32(initial_scale)
        self.min_scale = np.float32(min_scale)
        self.growth_factor = np.float32(growth_factor)
        self.backoff_factor = np.float32(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:  # not reset here: every further overflow backs off
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor


class DeepSpeedDynamicLossScaler:
    """deepspeed/runtime/fp16/loss_scaler.py ``DynamicLossScaler.update_scale`` in plain Python."""

    def __init__(self, init_scale, scale_factor, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale = np.float32(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = np.float32(scale_factor)
        self.scale_window = scale_window
        self.min_scale = np.float32(min_scale)
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class ApexUpdateScaleHysteresis:
    """Apex's ``csrc/update_scale_hysteresis.cu`` (``amp_C.update_scale_hysteresis``) in plain Python: FP32 scale,
    products in double as in the kernel."""

    def __init__(self, scale, growth_factor, backoff_factor, growth_interval, hysteresis):
        self.scale = np.float32(scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker > 0:  # tolerated: only the growth tracker restarts
                self.growth_tracker = 0
                return
            self.scale = np.float32(float(self.scale) * self.backoff_factor)
            self.growth_tracker = 0
        else:
            successful = self.growth_tracker + 1
            if successful == self.growth_interval:
                grown = np.float32(float(self.scale) * self.growth_factor)
                if np.isfinite(grown):
                    self.scale = grown
                self.growth_tracker = 0
            else:
                self.growth_tracker = successful
            self.hysteresis_tracker = self.hysteresis  # every clean step restores it


SETTINGS = dict(
    init=st.sampled_from([2.0**10, 2.0**16]),
    min_scale=st.sampled_from([1.0, 2.0**8, 2.0**12]),
    interval=st.integers(1, 5),
    hysteresis=st.integers(1, 4),
    overflows=st.lists(st.booleans(), max_size=60),
)


def _ours(init, min_scale, interval, hysteresis, consecutive=False, factor=2.0):
    return LossScaler(
        init_scale=max(init, min_scale),
        growth_factor=factor,
        backoff_factor=1.0 / factor,
        growth_interval=interval,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_loss_scale=min_scale,
        max_loss_scale=math.inf,  # neither reference has a ceiling
    )


@FAST
@given(**SETTINGS, factor=st.sampled_from([2.0, 4.0]))
def test_hysteresis_follows_megatron(init, min_scale, interval, hysteresis, overflows, factor):
    ours = _ours(init, min_scale, interval, hysteresis, factor=factor)
    megatron = MegatronDynamicGradScaler(max(init, min_scale), min_scale, factor, 1.0 / factor, interval, hysteresis)
    for step, overflow in enumerate(overflows):
        ours.update(torch.tensor(float(overflow)))
        megatron.update(overflow)
        state = ours.state_dict()
        assert state["scale"] == float(megatron.scale), f"after update {step}"
        assert state["growth_tracker"] == megatron.growth_tracker
        # Megatron's tracker keeps counting below zero; every value <= 0 means "exhausted", which is 1 here.
        assert state["hysteresis_tracker"] == max(megatron.hysteresis_tracker, 1)


@FAST
@given(**SETTINGS, consecutive=st.booleans())
def test_hysteresis_follows_deepspeed(init, min_scale, interval, hysteresis, overflows, consecutive):
    ours = _ours(init, min_scale, interval, hysteresis, consecutive)
    deepspeed = DeepSpeedDynamicLossScaler(max(init, min_scale), 2.0, interval, min_scale, hysteresis, consecutive)
    for step, overflow in enumerate(overflows):
        ours.update(torch.tensor(float(overflow)))
        deepspeed.update_scale(overflow)
        state = ours.state_dict()
        assert state["scale"] == float(deepspeed.cur_scale), f"after update {step}"
        assert state["hysteresis_tracker"] == deepspeed.cur_hysteresis


@FAST
@given(
    init=st.sampled_from([1.0, 2.0**10, 2.0**16]),
    growth_factor=st.sampled_from([1.0, 2.0, 4.0]),
    backoff_factor=st.sampled_from([0.5, 0.25]),
    interval=st.integers(1, 5),
    hysteresis=st.integers(1, 4),
    overflows=st.lists(st.booleans(), max_size=60),
)
def test_consecutive_hysteresis_follows_apex_kernel(init, growth_factor, backoff_factor, interval, hysteresis,
                                                    overflows):
    # Apex's kernel has no floor or ceiling: 60 backoffs of 0.25 from 1.0 stay above FP32's smallest normal.
    ours = LossScaler(init_scale=init, growth_factor=growth_factor, backoff_factor=backoff_factor,
                      growth_interval=interval, hysteresis=hysteresis, consecutive_hysteresis=True,
                      min_loss_scale=float(torch.finfo(torch.float32).tiny), max_loss_scale=math.inf)
    apex = ApexUpdateScaleHysteresis(init, growth_factor, backoff_factor, interval, hysteresis)
    for step, overflow in enumerate(overflows):
        ours.update(torch.tensor(float(overflow)))
        apex.update(overflow)
        state = ours.state_dict()
        assert state["scale"] == float(apex.scale), f"after update {step}"
        assert state["growth_tracker"] == apex.growth_tracker
        assert state["hysteresis_tracker"] == max(apex.hysteresis_tracker, 1)  # <= 0 in the kernel: exhausted


@pytest.mark.parametrize("hysteresis", [1, 3])
def test_growth_factor_one_backs_off_and_never_grows(hysteresis):
    scaler = LossScaler(init_scale=1024.0, growth_factor=1.0, growth_interval=2, hysteresis=hysteresis)
    for overflow in [1] * hysteresis + [0] * 10:
        scaler.update(torch.tensor(float(overflow)))
    assert scaler.get_scale() == 512.0


@pytest.mark.parametrize("consecutive", [False, True])
def test_persistent_overflow_backs_off_every_step_once_the_tracker_is_exhausted(consecutive):
    # Before the fix the tracker restarted after each backoff: the scale fell 3x slower than Megatron's/DeepSpeed's.
    scaler = LossScaler(init_scale=2.0**16, hysteresis=3, consecutive_hysteresis=consecutive)
    scales = []
    for _ in range(8):
        scaler.update(torch.tensor(1.0))
        scales.append(scaler.get_scale())
    assert scales == [2.0**16, 2.0**16, 2.0**15, 2.0**14, 2.0**13, 2.0**12, 2.0**11, 2.0**10]


def test_consecutive_hysteresis_restores_the_tracker_after_a_clean_step():
    plain = LossScaler(init_scale=64.0, hysteresis=2)
    consecutive = LossScaler(init_scale=64.0, hysteresis=2, consecutive_hysteresis=True)
    for overflow in [1, 0, 1, 0, 1]:  # never two overflows in a row
        plain.update(torch.tensor(float(overflow)))
        consecutive.update(torch.tensor(float(overflow)))
    assert plain.get_scale() == 16.0  # the tracker, exhausted by the first overflow, stays so: 2 backoffs
    assert consecutive.get_scale() == 64.0  # each clean step restored it: no backoff at all


def test_consecutive_hysteresis_is_validated_and_shown():
    with pytest.raises(TypeError, match=r"consecutive_hysteresis=1 must be True or False"):
        LossScaler(consecutive_hysteresis=1)
    assert "consecutive_hysteresis=True" in repr(LossScaler(hysteresis=2, consecutive_hysteresis=True))


# -- a static scale from a checkpoint ---------------------------------------------------------------------------------
@pytest.mark.parametrize("lazily", [True, False], ids=["before-state", "after-state"])
@pytest.mark.parametrize("configured, saved", [(1.0, 128.0), (128.0, 1.0), (4.0, 128.0)])
def test_a_static_scale_from_a_checkpoint_scales_and_unscales_alike(lazily, configured, saved):
    # Before the fix a static 1.0 scaler that loaded 128 returned the loss unscaled but unscaled by 1/128.
    scaler = LossScaler(configured)
    if not lazily:
        scaler.to("cpu")
    scaler.load_state_dict(LossScaler(saved).state_dict())
    loss = torch.tensor(3.0, requires_grad=True)
    scaled = scaler.scale(loss)
    assert scaled.item() == 3.0 * saved
    assert scaler.inv_scale().item() == 1.0 / saved
    assert (scaled is loss) == (saved == 1.0)  # a scale of 1.0 still hands back the loss itself
