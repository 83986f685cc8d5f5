"""lightning_mpx.apex attacked with Apex-era scripts' settings (round 51): ``min_loss_scale``/``max_loss_scale`` as
Apex's ``LossScaler`` used them, the checkpoint order Apex documents (and the wrong one), resumes at O0/O1 through
``torch.save``/``torch.load``, and Megatron-era ``apex.fp16_utils`` (``delayed_shift``, ``clip_master_grads`` with
another norm, ``FP16Model``/``convert_network``). Each case against Apex's documented rule or torch's own function."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx.apex import _amp_state, amp
from lightning_mpx.apex import fp16_utils as apex_fp16_utils
from lightning_mpx.apex.fp16_utils import FP16_Optimizer, FP16Model, convert_network, network_to_half


@pytest.fixture(autouse=True)
def _reset_amp_state():
    _amp_state.reset()
    yield
    _amp_state.reset()


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _setup(seed: int = 0, **kwargs):
    model = _mlp(seed)
    return amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0, **kwargs)


def _batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(n)]


def _apex_step(model, optimizer, x, y, *, poison: bool = False) -> None:
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x).float(), y)
    if poison:
        loss = loss * float("inf")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()


# -- Apex's LossScaler bounds ----------------------------------------------------------------------------------------
def test_min_loss_scale_floor_keeps_skipping_and_training_as_apex():
    """Apex's ``update_scale``: ``max(min_loss_scale, scale / 2)`` on overflow, the step skipped, training goes on.
    Was: ``LossScaleFloorError`` at the first overflow at the floor (the script died)."""
    model, optimizer = _setup(opt_level="O1", loss_scale="dynamic", min_loss_scale=64.0)
    _amp_state.loss_scalers[0]._loss_scale = 128.0
    x, y = _batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    scales = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the core's note that the floor was reached
        for _ in range(3):
            _apex_step(model, optimizer, x, y, poison=True)
            scales.append(_amp_state.loss_scalers[0].loss_scale())
    assert scales == [64.0, 64.0, 64.0]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # every step skipped
    _apex_step(model, optimizer, x, y)  # a clean step trains at the floor's scale
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize(("bounds", "first"), [
    ({"max_loss_scale": 2.0**3}, 2.0**3),  # Apex: min(max_loss_scale, 2**16); was a ValueError naming init_scale
    ({"min_loss_scale": 2.0**20}, 2.0**20),  # a floor above 2**16: the floor
    ({}, 2.0**16),
])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # 2**20 overflows float16 at once: the floor is reached
def test_the_first_dynamic_scale_is_apex_min_of_max_loss_scale_and_2_to_16(bounds, first):
    model, optimizer = _setup(opt_level="O1", loss_scale="dynamic", **bounds)
    assert _amp_state.loss_scalers[0].loss_scale() == first
    x, y = _batches(1)[0]
    _apex_step(model, optimizer, x, y)
    assert _amp_state.loss_scalers[0].loss_scale() == first  # and trains from there


# -- the model given to initialize ------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_a_model_made_half_before_initialize_is_refused_as_apex(opt_level):
    """Apex's ``check_params_fp32``: ``model.half()`` before ``initialize`` is refused, naming the parameter (was: O1
    trained the half weights without masters, silently; O0 failed in the first matmul). Apex's switch lets it in."""
    model = _mlp().to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"'0.weight' with dtype torch.bfloat16.*do not need to call .half\(\)"):
        amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    assert _amp_state.amp is None and not _amp_state.hooks  # nothing was set up
    _amp_state.allow_incoming_model_not_fp32 = True
    try:
        amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    finally:
        _amp_state.allow_incoming_model_not_fp32 = False


# -- checkpoint order ------------------------------------------------------------------------------------------------
def test_amp_load_state_dict_before_initialize_is_refused_naming_the_order():
    """Apex documents initialize, then model/optimizer/amp ``load_state_dict``. Before any initialize the load is
    refused; before a second initialize (a notebook's second run) the scales loaded would silently go to the old
    engine, so that initialize is refused (once), and the documented order then restores them."""
    checkpoint = {"loss_scaler0": {"loss_scale": 8.0, "unskipped": 5}}
    with pytest.raises(RuntimeError, match=r"before amp.initialize\(\).*documented order"):
        amp.load_state_dict(checkpoint)
    _setup(opt_level="O1")
    model = _mlp(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.load_state_dict(checkpoint)
    with pytest.raises(RuntimeError, match=r"after amp.load_state_dict\(\).*documented order"):
        amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    amp.load_state_dict(checkpoint)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 8.0, "unskipped": 5}
    x, y = _batches(1)[0]
    _apex_step(model, optimizer, x, y)
    _setup(2, opt_level="O1")  # what was loaded is in use: a later initialize is fine


@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_torch_save_resume_at_o0_o1_is_bit_for_bit(opt_level):
    """The README's checkpoint (model, optimizer, amp, a scheduler) through torch.save and torch.load (weights only,
    torch's default), restored after initialize into new objects: the same values as the run never interrupted."""
    batches = _batches(6)

    def setup():
        model = _mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, loss_scale="dynamic", verbosity=0)
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)

    def train(model, optimizer, scheduler, part):
        for x, y in part:
            _apex_step(model, optimizer, x, y)
            scheduler.step()

    model, optimizer, scheduler = setup()
    train(model, optimizer, scheduler, batches)
    straight = copy.deepcopy(model.state_dict())
    _amp_state.reset()
    model, optimizer, scheduler = setup()
    train(model, optimizer, scheduler, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict(),
                "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    _amp_state.reset()
    checkpoint = torch.load(buffer)
    model, optimizer, scheduler = setup()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    train(model, optimizer, scheduler, batches[3:])
    assert all(torch.equal(straight[k], v) for k, v in model.state_dict().items())


# -- apex.fp16_utils as Megatron-era scripts used it ------------------------------------------------------------------
def test_fp16_optimizer_delayed_shift_tolerates_overflows_as_megatron():
    """Megatron's ``dynamic_loss_args={'delayed_shift': 2}``: the first overflow is tolerated, the second backs off,
    and so does every further one until the scale grows (was: accepted and ignored, backing off every time)."""
    model = network_to_half(_mlp())
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                               dynamic_loss_args={"init_scale": 2.0**10, "delayed_shift": 2}, verbose=False)
    x, y = _batches(1)[0]
    scales = []
    for _ in range(3):
        optimizer.zero_grad()
        optimizer.backward(F.cross_entropy(model(x).float(), y) * float("inf"))
        optimizer.step()
        scales.append(optimizer.loss_scale)
    assert scales == [2.0**10, 2.0**9, 2.0**8]


@pytest.mark.parametrize("norm_type", [float("inf"), 1.0])
def test_fp16_optimizer_clip_master_grads_any_norm_as_torch(norm_type):
    """Apex's ``clip_master_grads(max_norm, norm_type)`` was torch's clip over the FP32 masters, any norm (was: a
    ValueError for anything but 2); ``-1`` on overflow."""
    model = network_to_half(_mlp())
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0, verbose=False)
    x, y = _batches(1)[0]
    optimizer.zero_grad()
    optimizer.backward(F.cross_entropy(model(x).float(), y))
    masters = list(optimizer.amp.master_params(optimizer.optimizer))
    reference = [m.grad.clone() for m in masters]
    twins = [torch.zeros_like(g, requires_grad=True) for g in reference]
    for twin, g in zip(twins, reference):
        twin.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(twins, 1e-3, norm_type=norm_type)
    got = optimizer.clip_master_grads(1e-3, norm_type=norm_type)
    assert got == float(want)
    assert all(torch.equal(m.grad, twin.grad) for m, twin in zip(masters, twins))
    optimizer.zero_grad()
    optimizer.backward(F.cross_entropy(model(x).float(), y) * float("inf"))
    assert optimizer.clip_master_grads(1e-3, norm_type=norm_type) == -1.0


def test_fp16_utils_has_apex_fp16model_convert_network_and_clip_grad_norm():
    """``from apex.fp16_utils import FP16Model, convert_network, clip_grad_norm`` (was: ImportError)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    converted = convert_network(copy.deepcopy(net), torch.bfloat16)
    assert converted[0].weight.dtype == torch.bfloat16 and converted[2].bias.dtype == torch.bfloat16
    assert converted[1].weight.dtype == torch.float32 and converted[1].running_mean.dtype == torch.float32
    model = FP16Model(nn.Sequential(nn.Linear(4, 2)))
    out = model(torch.randn(3, 4))
    assert out.dtype == torch.float16 and model.network[0].weight.dtype == torch.float16
    assert apex_fp16_utils.clip_grad_norm is torch.nn.utils.clip_grad_norm_


# -- opt-level overrides -----------------------------------------------------------------------------------------
class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        y = self.linear(x)
        return {"logits": y, "extra": (y, y.argmax(-1))}


@pytest.mark.parametrize(("opt_level", "cast", "want"), [
    ("O2", None, torch.float32),  # Apex's default output caster at O2/O3: FP32
    ("O2", torch.float16, torch.float16),
    ("O1", torch.float32, torch.float32),  # Apex patched the forward at O1 too when cast_model_outputs was given
    ("O3", torch.bfloat16, torch.bfloat16),
])
def test_cast_model_outputs_casts_every_floating_output_as_apex_applier(opt_level, cast, want):
    model = _TwoHeads()
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level,
                              cast_model_outputs=cast, verbosity=0)
    out = model(torch.randn(3, 4))
    assert out["logits"].dtype == want and out["extra"][0].dtype == want
    assert out["extra"][1].dtype == torch.int64  # integers untouched


def test_o2_master_weights_false_steps_the_half_model_as_plain_half_training():
    """``opt_level="O2", master_weights=False``: the half parameters are stepped themselves (no masters), the static
    scale divided out exactly: bit for bit the same half model trained by hand."""
    model = _mlp()
    reference = copy.deepcopy(model).to(torch.bfloat16)
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                                      opt_level="O2", cast_model_type=torch.bfloat16, master_weights=False,
                                      loss_scale=128.0, verbosity=0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    assert all(m is p for m, p in zip(amp.master_params(optimizer), model.parameters()))
    for x, y in _batches(3):
        _apex_step(model, optimizer, x, y)
        ref_opt.zero_grad()
        (F.cross_entropy(reference(x.to(torch.bfloat16)).float(), y) * 128.0).backward()
        for p in reference.parameters():
            p.grad.div_(128.0)
        ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize(("cast_model_type", "data_dtype"), [(None, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_o2_casts_inputs_of_the_other_half_dtype_as_apex_to_type(cast_model_type, data_dtype):
    """Apex's input caster cast every floating input to the model's dtype: bfloat16 data into the float16 model (was:
    torch's "mat1 and mat2 must have the same dtype" in the first layer)."""
    model = _mlp()
    reference = copy.deepcopy(model)
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                              cast_model_type=cast_model_type, verbosity=0)
    x = torch.randn(3, 4).to(data_dtype)
    half = model[0].weight.dtype
    want = reference.to(half)(x.to(half)).float()
    assert torch.equal(model(x), want)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_stepping_the_optimizer_passed_to_initialize_is_refused_naming_the_returned_one(opt_level):
    """Apex patched the optimizer in place, so scripts step the one they passed in. Here that one's step bypasses
    the skip and the scale's update (was, at O1: an overflowed step put inf into the weights and the scale never
    backed off; at O2 an error pointing at ``amp.step(optimizer)``). The returned one steps; after
    ``_amp_state.reset()`` the original is its own again."""
    model = _mlp()
    original = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, original, opt_level=opt_level, cast_model_type=None if opt_level == "O1"
                                      else torch.bfloat16, loss_scale="dynamic", verbosity=0)
    x, y = _batches(1)[0]
    with amp.scale_loss(F.cross_entropy(model(x).float(), y) * float("inf"), original) as scaled_loss:
        scaled_loss.backward()
    with pytest.raises(RuntimeError, match=r"step\(\) of the SGD passed to amp.initialize\(\): step the optimizer"):
        original.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    optimizer.step()  # skipped, and the scale backs off
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**15
    _amp_state.reset()
    original.zero_grad()
    F.cross_entropy(model(x.to(model[0].weight.dtype)).float(), y).backward()  # the model stays as cast
    original.step()
