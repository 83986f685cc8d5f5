"""LossScaler: the state machine against a plain-Python twin, against torch's GradScaler, checkpoints, no host
sync in update(), scale(), the floor policy and input validation."""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mpx.scaling.scaler import LossScaleFloorError, LossScaler

FAST = settings(max_examples=60, deadline=None)

# found_inf as the unscale step or a summing all-reduce writes it: 0 means finite, anything above 0 an overflow.
FOUND = st.sampled_from([0.0, 0.0, 0.0, 1.0, 2.0])


@st.composite
def dynamic_settings(draw: st.DrawFn) -> dict:
    """Settings whose bounds lie a few steps from the initial scale, so that sequences reach them.

    Every value and factor is exact in FP32; the bounds need not be reachable by whole factors (0.75, 1.25), so the
    clamp itself is exercised.
    """
    init = draw(st.sampled_from([1.0, 3.0, 2.0**10, 2.0**16]))
    return {
        "init_scale": init,
        "growth_factor": draw(st.sampled_from([2.0, 4.0, 1.5])),
        "backoff_factor": draw(st.sampled_from([0.5, 0.25])),
        "growth_interval": draw(st.integers(1, 5)),
        "hysteresis": draw(st.integers(1, 4)),
        "consecutive_hysteresis": draw(st.booleans()),
        "min_loss_scale": init * draw(st.sampled_from([1.0, 0.75])) * 2.0 ** -draw(st.integers(0, 4)),
        "max_loss_scale": init * draw(st.sampled_from([1.0, 1.25])) * 2.0 ** draw(st.integers(0, 4)),
    }


@dataclass
class ScalerModel:
    """The documented state machine in plain Python, with the scale in FP32 arithmetic."""

    scale: np.float32
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_loss_scale: float
    max_loss_scale: float
    growth_tracker: int = 0
    hysteresis_tracker: int = 0
    overflows: int = 0

    @classmethod
    def from_settings(cls, init_scale: float, **kwargs) -> ScalerModel:
        return cls(scale=np.float32(init_scale), hysteresis_tracker=kwargs["hysteresis"], **kwargs)

    def update(self, found_inf: float) -> None:
        if found_inf > 0:
            self.overflows += 1
            self.growth_tracker = 0
            if self.hysteresis_tracker == 1:  # exhausted: every overflow backs off until a growth
                self.scale = max(self.scale * np.float32(self.backoff_factor), np.float32(self.min_loss_scale))
            else:
                self.hysteresis_tracker -= 1
            return
        if self.consecutive_hysteresis:
            self.hysteresis_tracker = self.hysteresis
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = self.scale * np.float32(self.growth_factor)
            if np.isfinite(grown):
                self.scale = min(grown, np.float32(self.max_loss_scale))
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis

    def state_dict(self) -> dict:
        return {
            "scale": float(self.scale),
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
            "overflows": self.overflows,
            "dynamic": True,
        }


def _update(scaler: LossScaler, found_inf: float) -> None:
    scaler.update(torch.tensor(found_inf))


# -- the state machine ---------------------------------------------------------------------------------------------
@FAST
@given(config=dynamic_settings(), found_infs=st.lists(FOUND, max_size=80), data=st.data())
def test_dynamic_scaler_follows_the_state_machine(config, found_infs, data):
    scaler = LossScaler(**config)
    told = LossScaler(**config)  # also given the host's read of each flag (Amp.step reads it), when drawn
    model = ScalerModel.from_settings(**config)
    assert scaler.state_dict() == model.state_dict()
    for step, found_inf in enumerate(found_infs):
        _update(scaler, found_inf)
        read = data.draw(st.sampled_from([None, found_inf > 0]))
        told.update(torch.tensor(found_inf), overflowed=read)
        model.update(found_inf)
        assert scaler.state_dict() == model.state_dict(), f"after update {step} (found_inf={found_inf})"
        assert told.state_dict() == model.state_dict(), f"after update {step} (found_inf={found_inf}, read={read})"
        assert scaler.get_scale() == float(model.scale)
        assert int(scaler.overflow_count) == model.overflows
        assert model.min_loss_scale <= scaler.get_scale() <= model.max_loss_scale


def test_defaults():
    scaler = LossScaler()
    assert (scaler.init_scale, scaler.growth_factor, scaler.backoff_factor) == (2.0**16, 2.0, 0.5)
    assert (scaler.growth_interval, scaler.hysteresis) == (2000, 1)
    assert (scaler.min_loss_scale, scaler.max_loss_scale) == (1.0, 2.0**24)
    assert scaler.get_scale() == 2.0**16


def test_hysteresis_tolerates_overflows_before_backing_off():
    scaler = LossScaler(init_scale=32.0, hysteresis=3, growth_interval=2, min_loss_scale=2.0)
    trajectory = []
    for found_inf in [1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1]:
        _update(scaler, found_inf)
        state = scaler.state_dict()
        trajectory.append((state["scale"], state["hysteresis_tracker"], state["growth_tracker"]))
    assert trajectory == [
        (32.0, 2, 0),
        (32.0, 1, 0),
        (16.0, 1, 0),  # third overflow: back off; the tracker stays exhausted...
        (8.0, 1, 0),  # ...so the next overflow backs off too (Megatron-LM, DeepSpeed)
        (8.0, 1, 1),  # a success alone does not restore the tracker...
        (16.0, 3, 0),  # ...a growth does
        (16.0, 2, 0),
        (16.0, 1, 0),
        (8.0, 1, 0),
        (4.0, 1, 0),
        (2.0, 1, 0),
        (2.0, 1, 0),  # clamped at min_loss_scale=2.0
    ]
    assert int(scaler.overflow_count) == 10


@pytest.mark.parametrize("hysteresis", [1, 3])
def test_growth_never_reaches_inf_without_a_ceiling(hysteresis):
    scaler = LossScaler(init_scale=2.0**125, growth_interval=1, hysteresis=hysteresis, max_loss_scale=math.inf)
    for _ in range(5):
        _update(scaler, 0.0)
    assert scaler.get_scale() == 2.0**127  # the largest power of two in FP32; one more growth would be inf


@FAST
@given(found_infs=st.lists(FOUND, max_size=30), read=st.booleans())
def test_static_scale_never_changes(found_infs, read):
    scaler = LossScaler(128.0, growth_interval=1)
    for found_inf in found_infs:
        scaler.update(torch.tensor(found_inf), overflowed=(found_inf > 0) if read else None)
    assert scaler.state_dict() == {
        "scale": 128.0,
        "growth_tracker": 0,
        "hysteresis_tracker": 1,
        "overflows": sum(f > 0 for f in found_infs),
        "dynamic": False,
    }


# -- parity with torch.amp.GradScaler ------------------------------------------------------------------------------
@FAST
@given(
    init_scale=st.sampled_from([1.0, 3.0, 2.0**16]),
    growth_factor=st.sampled_from([2.0, 4.0, 1.1]),  # 1.1 and 0.3 are inexact in FP32: rounding must agree too
    backoff_factor=st.sampled_from([0.5, 0.25, 0.3]),
    growth_interval=st.integers(1, 4),
    overflows=st.lists(st.booleans(), max_size=40),
)
def test_trajectory_matches_grad_scaler(init_scale, growth_factor, backoff_factor, growth_interval, overflows):
    factors = {"growth_factor": growth_factor, "backoff_factor": backoff_factor, "growth_interval": growth_interval}
    reference = torch.amp.GradScaler("cpu", init_scale=init_scale, **factors)
    # Bounds far enough away never to be reached in 40 steps (2**-80 <= scale <= 2**96).
    ours = LossScaler(init_scale=init_scale, min_loss_scale=2.0**-100, max_loss_scale=math.inf, **factors)
    weight_ref = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight_ref], lr=0.1)
    weight_ours = torch.nn.Parameter(torch.ones(3))
    for step, overflow in enumerate(overflows):
        inputs = torch.tensor([1.0, math.inf if overflow else 2.0, 3.0])

        optimizer.zero_grad()
        reference.scale((weight_ref * inputs).sum()).backward()
        reference.unscale_(optimizer)
        reference.step(optimizer)
        reference.update()

        weight_ours.grad = None
        ours.scale((weight_ours * inputs).sum()).backward()
        ours.update(~torch.isfinite(weight_ours.grad).all())

        assert ours.get_scale() == reference.get_scale(), f"after step {step} (overflow={overflow})"


# -- checkpoints ---------------------------------------------------------------------------------------------------
def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@FAST
@given(config=dynamic_settings(), found_infs=st.lists(FOUND, max_size=40), data=st.data())
def test_resume_is_exact(config, found_infs, data):
    split = data.draw(st.integers(0, len(found_infs)), label="split")
    original = LossScaler(**config)
    for found_inf in found_infs[:split]:
        _update(original, found_inf)
    state = _round_trip(original.state_dict())
    assert {"scale", "growth_tracker", "hysteresis_tracker", "overflows"} <= set(state)

    loaded_lazily = LossScaler(**config)  # no state tensors yet: the state waits for them
    loaded_lazily.load_state_dict(state)
    assert loaded_lazily.state_dict() == original.state_dict()
    loaded_eagerly = LossScaler(**config)
    loaded_eagerly.scale(torch.ones(()))  # state tensors exist at their initial values
    loaded_eagerly.load_state_dict(state)

    scalers = [original, loaded_lazily, loaded_eagerly]
    for found_inf in found_infs[split:]:
        for scaler in scalers:
            _update(scaler, found_inf)
        assert original.state_dict() == loaded_lazily.state_dict() == loaded_eagerly.state_dict()
    assert original.get_scale() == loaded_lazily.get_scale() == loaded_eagerly.get_scale()


def test_state_dict_contents():
    scaler = LossScaler(init_scale=4.0, hysteresis=2, growth_interval=3)
    for found_inf in [0, 1, 1, 0]:
        _update(scaler, found_inf)
    assert scaler.state_dict() == {
        "scale": 2.0,
        "growth_tracker": 1,
        "hysteresis_tracker": 1,  # exhausted by the backoff; only a growth restores it
        "overflows": 2,
        "dynamic": True,
    }


@pytest.mark.parametrize("hysteresis", [1, 2])
@pytest.mark.parametrize("lazily", [True, False], ids=["before-state", "after-state"])
def test_resume_with_a_shorter_growth_interval_still_grows(hysteresis, lazily):
    saved = LossScaler(init_scale=4.0, growth_interval=20, hysteresis=hysteresis)
    for _ in range(10):
        _update(saved, 0.0)
    resumed = LossScaler(init_scale=4.0, growth_interval=3, hysteresis=hysteresis)
    if not lazily:
        resumed.to("cpu")
    resumed.load_state_dict(saved.state_dict())
    _update(resumed, 0.0)  # ten successes are already past the new interval: grow now
    assert resumed.get_scale() == 8.0
    for _ in range(3):
        _update(resumed, 0.0)
    assert resumed.get_scale() == 16.0


def test_load_state_dict_names_missing_keys():
    with pytest.raises(KeyError, match="overflows"):
        LossScaler().load_state_dict({"scale": 2.0, "growth_tracker": 0, "hysteresis_tracker": 1})


# -- no host sync in update() --------------------------------------------------------------------------------------
class _RecordOps(TorchDispatchMode):
    """Records the aten ops that run; ``aten._local_scalar_dense`` is the copy of a device value to the host
    behind ``.item()``, ``float()``, ``int()`` and ``bool()`` of a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @property
    def synced(self) -> bool:
        return any("_local_scalar_dense" in op for op in self.ops)


@pytest.mark.parametrize(
    "scaler_kwargs", [{"loss_scale": 128.0}, {"hysteresis": 1}, {"hysteresis": 3}], ids=["static", "hyst1", "hyst3"]
)
def test_update_reads_nothing_back_from_the_device(scaler_kwargs):
    scaler = LossScaler(**scaler_kwargs, growth_interval=1).to("cpu")
    state_tensors = [scaler.scale_tensor, scaler.overflow_count]
    found_infs = [torch.tensor(1.0), torch.tensor(0.0), torch.tensor([True]), torch.zeros(1)]
    with _RecordOps() as recorded:
        for found_inf in found_infs:
            scaler.update(found_inf)
    assert recorded.ops, "the recorder saw no ops at all"
    assert not recorded.synced, recorded.ops
    # Updated in place: tensors handed out earlier (metrics, CUDA graphs) stay live.
    assert scaler.scale_tensor is state_tensors[0] and scaler.overflow_count is state_tensors[1]
    assert int(scaler.overflow_count) == 2

    with _RecordOps() as recorded:  # the check itself can fail: a host read is seen
        scaler.get_scale()
    assert recorded.synced


@pytest.mark.parametrize("hysteresis", [1, 3])
def test_update_runs_on_the_meta_device(hysteresis):
    # Meta tensors have no values: any host read inside update() would raise.
    scaler = LossScaler(hysteresis=hysteresis).to("meta")
    scaler.update(torch.ones((), device="meta"))
    assert scaler.scale_tensor.device.type == "meta"


# -- scale() and inv_scale() ---------------------------------------------------------------------------------------
DEVICES = [
    "cpu",
    "meta",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


def test_scale_multiplies_by_the_scale():
    loss = torch.tensor([1.5, -2.0, 0.0])
    assert torch.equal(LossScaler().scale(loss), loss * 2.0**16)
    assert torch.equal(LossScaler(128.0).scale(loss), loss * 128.0)
    half = torch.tensor([3.0, 0.25], dtype=torch.float16)
    scaled = LossScaler(init_scale=256.0).scale(half)
    assert scaled.dtype == torch.float16 and torch.equal(scaled, torch.tensor([768.0, 64.0], dtype=torch.float16))


def test_scale_follows_updates():
    scaler = LossScaler(init_scale=4.0, growth_interval=1)
    _update(scaler, 0.0)
    assert scaler.scale(torch.tensor(3.0)).item() == 24.0


def test_static_scale_of_one_returns_the_loss_itself():
    loss = torch.tensor(2.5, requires_grad=True)
    assert LossScaler(1.0).scale(loss) is loss


@pytest.mark.parametrize("device", DEVICES)
def test_state_is_created_lazily_on_the_device_of_the_loss(device):
    scaler = LossScaler()
    assert scaler.device is None
    scaler.scale(torch.ones(2, device=device))
    assert scaler.device == torch.ones((), device=device).device
    assert scaler.scale_tensor.dtype == torch.float32 and scaler.scale_tensor.shape == ()
    assert scaler.overflow_count.device == scaler.device


@pytest.mark.parametrize("scale", [1.0, 3.0, 2.0**16, 12345.678, 1e-3])
def test_inv_scale_is_the_fp64_reciprocal(scale):
    scaler = LossScaler(loss_scale=scale)
    expected = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()
    inv = scaler.inv_scale()
    assert inv.dtype == torch.float32 and inv.shape == ()
    assert torch.equal(inv, expected)


@pytest.mark.parametrize("loss_scale", [1.0, 3.0, "dynamic"])
def test_unscale_factor_is_inv_scale_and_follows_a_loaded_scale(loss_scale):
    """What Amp unscales by: the FP64 reciprocal, as inv_scale(); a static 1.0 makes no kernels for it (one tensor,
    kept), and a checkpoint that loads another scale into the scaler changes it at once."""
    scaler = LossScaler(loss_scale=loss_scale)
    first, again = scaler.unscale_factor(), scaler.unscale_factor()
    assert torch.equal(first, scaler.inv_scale()) and first.dtype == torch.float32 and first.shape == ()
    assert (first is again) == (loss_scale == 1.0)
    state = scaler.state_dict()
    state["scale"] = 4.0 if loss_scale != 4.0 else 2.0
    scaler.load_state_dict(state)
    assert torch.equal(scaler.unscale_factor(), torch.tensor(0.25))
    state["scale"] = 1.0
    scaler.load_state_dict(state)
    assert torch.equal(scaler.unscale_factor(), torch.tensor(1.0)) and scaler.scale(torch.ones(())).item() == 1.0


@pytest.mark.parametrize("loss_scale", [1.0, "dynamic"])
def test_an_update_told_the_host_read_makes_fewer_operators(loss_scale):
    """``Amp.step`` reads the flag to decide the skip: told what it said, a static scale's update runs no operator
    on the device (none for a clean step; the count's add for an overflow), a dynamic one only its update kernel
    and the clamp to its bounds."""
    scaler = LossScaler(loss_scale).to("cpu")
    found, overflow = torch.zeros(()), torch.ones(())
    with _RecordOps() as counted:
        scaler.update(found)
    with _RecordOps() as told:
        scaler.update(found, overflowed=False)
    with _RecordOps() as told_overflow:
        scaler.update(overflow, overflowed=True)
    kernel = [] if loss_scale == 1.0 else ["aten._amp_update_scale_.default", "aten.clamp_.default"]
    assert counted.ops == ["aten.gt.Scalar", "aten.add_.Tensor", *kernel]  # the count's two (a 0-d flag: no view)
    assert told.ops == kernel and told_overflow.ops == ["aten.add_.Tensor", *kernel]
    assert int(scaler.overflow_count) == 1


def test_overflow_count_counts_updates_that_found_an_overflow():
    scaler = LossScaler(init_scale=8.0)
    for found in (0.0, 1.0, 0.0, 1.0, 1.0):
        scaler.update(torch.tensor(found))
    assert scaler.overflow_count.dtype == torch.int64 and scaler.overflow_count.item() == 3


# -- the floor policy ----------------------------------------------------------------------------------------------
NAMES = ["encoder.weight", "head.bias"]


def _at_floor(on_floor: str) -> LossScaler:
    return LossScaler(init_scale=1.0, min_loss_scale=1.0, on_floor=on_floor)


def test_raise_at_floor_names_the_parameters():
    with pytest.raises(LossScaleFloorError, match=r"encoder\.weight, head\.bias"):
        _at_floor("raise").handle_overflow(NAMES)


def test_raise_lists_at_most_ten_names():
    names = [f"layer{i}.weight" for i in range(12)]
    with pytest.raises(LossScaleFloorError) as raised:
        _at_floor("raise").handle_overflow(names)
    message = str(raised.value)
    assert "layer9.weight" in message and "layer10.weight" not in message and "2 more" in message


def test_floor_reached_by_backing_off():
    scaler = LossScaler(init_scale=4.0, min_loss_scale=1.0)
    scaler.handle_overflow(NAMES)  # 4.0: can still go lower
    _update(scaler, 1.0)
    scaler.handle_overflow(NAMES)  # 2.0
    _update(scaler, 1.0)
    with pytest.raises(LossScaleFloorError, match="encoder.weight"):
        scaler.handle_overflow(NAMES)  # 1.0


def test_warn_at_floor():
    with pytest.warns(RuntimeWarning, match=r"encoder\.weight, head\.bias"):
        _at_floor("warn").handle_overflow(NAMES)


@pytest.mark.parametrize(
    "scaler",
    [_at_floor("continue"), LossScaler(128.0, on_floor="continue"), LossScaler(init_scale=2.0, min_loss_scale=1.0)],
    ids=["continue-dynamic", "continue-static", "above-floor"],
)
def test_no_action(scaler):
    before = scaler.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.handle_overflow(NAMES)
    assert scaler.state_dict() == before


@pytest.mark.parametrize("scale", [1.0, 128.0, 2.0**16])
def test_static_scale_is_always_at_its_floor(scale):
    with pytest.raises(LossScaleFloorError, match="head.bias") as raised:
        LossScaler(scale).handle_overflow(NAMES)
    assert "pass on_floor='warn' or 'continue' to keep training" in str(raised.value)
    with pytest.warns(RuntimeWarning, match="head.bias") as warned:
        LossScaler(scale, on_floor="warn").handle_overflow(NAMES)
    # the warning of a run already set to warn does not tell it to pass on_floor='warn': it says what goes on
    message = str(warned[0].message)
    assert "pass on_floor='warn'" not in message and "training goes on (on_floor='warn'" in message


# -- bad input -----------------------------------------------------------------------------------------------------
BAD_ARGUMENTS = [
    ({"loss_scale": "dynamc"}, "loss_scale='dynamc'"),
    ({"loss_scale": 0.0}, "loss_scale=0.0"),
    ({"loss_scale": -128.0}, "loss_scale=-128.0"),
    ({"loss_scale": math.inf}, "loss_scale=inf"),
    ({"loss_scale": True}, "loss_scale=True"),
    ({"init_scale": 0.0}, "init_scale=0.0"),
    ({"init_scale": -1.0}, "init_scale=-1.0"),
    ({"min_loss_scale": 0.0}, "min_loss_scale=0.0"),
    ({"min_loss_scale": -1.0}, "min_loss_scale=-1.0"),
    ({"max_loss_scale": 0.0}, "max_loss_scale=0.0"),
    ({"max_loss_scale": -4.0}, "max_loss_scale=-4.0"),
    ({"loss_scale": 128.0, "max_loss_scale": math.nan}, "max_loss_scale=nan"),
    ({"growth_factor": 0.999}, "growth_factor=0.999"),
    ({"growth_factor": math.nan}, "growth_factor=nan"),
    ({"growth_factor": 0.5}, "growth_factor=0.5"),
    ({"growth_factor": math.inf}, "growth_factor=inf"),
    ({"growth_factor": "2"}, "growth_factor='2'"),
    ({"backoff_factor": 0.0}, "backoff_factor=0.0"),
    ({"backoff_factor": 1.0}, "backoff_factor=1.0"),
    ({"backoff_factor": 2.0}, "backoff_factor=2.0"),
    ({"backoff_factor": "0.5"}, "backoff_factor='0.5'"),
    ({"growth_interval": 0}, "growth_interval=0"),
    ({"growth_interval": 2.5}, "growth_interval=2.5"),
    ({"hysteresis": 0}, "hysteresis=0"),
    ({"hysteresis": -1}, "hysteresis=-1"),
    ({"min_loss_scale": 8.0, "max_loss_scale": 4.0, "init_scale": 4.0}, "min_loss_scale=8.0"),
    ({"init_scale": 0.5, "min_loss_scale": 1.0}, "init_scale=0.5"),
    ({"init_scale": 2.0**25}, "init_scale=33554432.0"),
]


@pytest.mark.parametrize(("kwargs", "shown"), BAD_ARGUMENTS, ids=[shown for _, shown in BAD_ARGUMENTS])
def test_bad_argument_is_named_with_its_value(kwargs, shown):
    with pytest.raises(ValueError) as raised:
        LossScaler(**kwargs)
    assert shown in str(raised.value)


def test_min_above_max_names_both():
    with pytest.raises(ValueError, match=r"min_loss_scale=8\.0.*max_loss_scale=4\.0"):
        LossScaler(128.0, min_loss_scale=8.0, max_loss_scale=4.0)


def test_bad_on_floor_lists_the_choices():
    with pytest.raises(ValueError, match=r"on_floor='explode'.*raise, warn, continue"):
        LossScaler(on_floor="explode")  # type: ignore[arg-type]


def test_static_checkpoint_does_not_load_into_a_dynamic_scaler():
    static = LossScaler(128.0)
    with pytest.raises(ValueError, match=r"checkpoint holds a static loss scale but this scaler is dynamic"):
        LossScaler("dynamic").load_state_dict(static.state_dict())


def test_init_scale_beyond_fp32_range_is_refused():
    with pytest.raises(ValueError, match=r"init_scale=1e\+39 must be a positive finite number"):
        LossScaler(init_scale=1e39, max_loss_scale=float("inf"))
