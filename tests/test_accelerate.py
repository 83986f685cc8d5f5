"""The Accelerate adapter with a real ``Accelerator`` on CPU: every opt level in float16 and bfloat16, masters,
clipping, accumulation, skipped steps, several optimizers and losses, metrics in TensorBoard, exact resume and two
processes."""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("accelerate")

from accelerate.utils import GradScalerKwargs  # noqa: E402

from lightning_mpx import Amp  # noqa: E402
from lightning_mpx.integrations.accelerate import AMP_STATE_NAME, Accelerator, MixedPrecisionKwargs  # noqa: E402
from tests.accelerate_helpers import prepared_gan, reset_accelerate_state  # noqa: E402
from tests.launch import accelerate_launch  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's singleton state: none at each start

ROOT = Path(__file__).resolve().parents[1]
HALVES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _batch(seed=0, n=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _accelerator(level="O2", **settings):
    settings.setdefault("half_dtype", "float16")  # these tests are about float16's loss scaling (a CPU's default: bf16)
    handlers = [MixedPrecisionKwargs(**settings)]
    return Accelerator(mixed_precision=level, kwargs_handlers=handlers)


def _setup(level="O2", *, lr=1e-2, optimizer=torch.optim.AdamW, seed=0, **settings):
    accelerator = _accelerator(level, **settings)
    model = _net(seed)
    opt = optimizer(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    return accelerator, model, opt, sched


def _step(accelerator, model, opt, sched, x, y, *, clip=None, inject=None):
    loss = F.cross_entropy(model(x), y)
    accelerator.backward(loss)
    if inject is not None:
        inject(model)
    if clip is not None:
        accelerator.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss.detach()


def _inf_into_first_grad(model):
    with torch.no_grad():
        model[0].weight.grad[0, 0] = float("inf")


def _masters(opt):
    return opt.amp.master_params(opt.optimizer)


def _snapshot(model, opt, sched):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [p.detach().clone() for p in _masters(opt)],
        copy.deepcopy(opt.optimizer.state_dict()),
        (sched.scheduler.last_epoch, sched.get_last_lr()),
    )


def _assert_same_tensors(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same_tensors(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_tensors(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    else:
        assert a == b


# -- construction and bad input -----------------------------------------------------------------------------------
def test_unknown_mixed_precision_lists_native_and_opt_level_choices():
    with pytest.raises(ValueError) as error:
        Accelerator(mixed_precision="O4")
    message = str(error.value)
    assert "mixed_precision='O4'" in message
    for choice in ("'no'", "'fp16'", "'bf16'", "'fp8'", "'O0'", "'O1'", "'O2'", "'O3'"):
        assert choice in message


@pytest.mark.parametrize("value, hint", [("01", "digit zero"), ("o2", "lower-case o")])
def test_digit_zero_and_lower_case_prefix_get_a_hint(value, hint):
    with pytest.raises(ValueError, match=f"{hint}: did you mean 'O{value[1]}'"):
        Accelerator(mixed_precision=value)


def test_settings_are_refused_where_they_cannot_apply():
    with pytest.raises(ValueError, match="MixedPrecisionKwargs configures an opt level.*mixed_precision='fp16'"):
        Accelerator(mixed_precision="fp16", kwargs_handlers=[MixedPrecisionKwargs()])
    with pytest.raises(ValueError, match="GradScalerKwargs.*MixedPrecisionKwargs instead"):
        Accelerator(mixed_precision="O2", kwargs_handlers=[GradScalerKwargs(init_scale=8.0)])
    with pytest.raises(ValueError, match="keep_batchnorm_fp32=True only applies when the model is cast"):
        _accelerator("O1", keep_batchnorm_fp32=True)
    with pytest.raises(ValueError, match="at most one"):
        Accelerator(mixed_precision="O1", kwargs_handlers=[MixedPrecisionKwargs(), MixedPrecisionKwargs()])


@pytest.mark.parametrize(
    "field, value, error, match",
    [
        ("half_dtype", "float8", ValueError, r"half_dtype='float8'.*valid choices"),
        ("growth_factor", 0.5, ValueError, r"growth_factor=0.5"),
        ("keep_batchnorm_fp32", "yes", TypeError, r"keep_batchnorm_fp32='yes'"),
        ("num_losses", 0, ValueError, r"num_losses=0"),
        ("unscale_backend", "cuda", ValueError, r"unscale_backend='cuda'.*valid choices"),
        ("loss_scale", -1.0, ValueError, r"loss_scale=-1.0"),
        ("on_floor", "ignore", ValueError, r"on_floor='ignore'.*valid choices"),
    ],
)
def test_mixed_precision_kwargs_validates_each_field(field, value, error, match):
    with pytest.raises(error, match=match):
        MixedPrecisionKwargs(**{field: value})


def test_mixed_precision_kwargs_defaults_mirror_amp():
    amp_defaults = {
        name: p.default for name, p in inspect.signature(Amp.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    amp_defaults.pop("opt_level")
    handler = MixedPrecisionKwargs()
    assert handler.half_dtype is None  # the device's: float16, bfloat16 on a CPU (picked by the adapter itself)
    for name, default in amp_defaults.items():
        assert getattr(handler, name) == (None if name == "half_dtype" else default), name
    assert handler.amp_kwargs() == handler.amp_kwargs("cuda") == {"half_dtype": "float16"}
    assert handler.amp_kwargs("cpu") == {"half_dtype": "bfloat16"}
    assert MixedPrecisionKwargs(half_dtype="float16").amp_kwargs("cpu") == {"half_dtype": "float16"}
    changed = MixedPrecisionKwargs(
        half_dtype="bfloat16", growth_interval=7, keep_batchnorm_fp32=False, log_metrics=False
    )
    assert changed.amp_kwargs() == {"half_dtype": "bfloat16", "growth_interval": 7, "keep_batchnorm_fp32": False}


def test_native_values_keep_native_behaviour():
    accelerator = Accelerator(mixed_precision="bf16")
    assert accelerator.amp is None and accelerator.opt_level is None
    assert accelerator.mixed_precision == "bf16" and accelerator.native_amp
    model = accelerator.prepare(nn.Sequential(nn.Linear(4, 4)))
    inner = []
    model[0].register_forward_hook(lambda m, i, o: inner.append(o.dtype))
    assert model(torch.randn(2, 4)).dtype == torch.float32
    assert inner == [torch.bfloat16]  # Accelerate's own autocast, not an opt level
    assert model[0].weight.dtype == torch.float32
    with pytest.raises(ValueError, match="loss_id=1 needs an opt level"):
        accelerator.backward(model(torch.randn(2, 4)).sum(), loss_id=1)


def test_opt_level_from_the_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "O1")
    accelerator = Accelerator()
    assert accelerator.opt_level == "O1" and accelerator.mixed_precision == "O1"
    assert accelerator.state.mixed_precision == "no"  # Accelerate itself runs without its own mixed precision


def test_missing_accelerate_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.delitem(sys.modules, "lightning_mpx.integrations.accelerate")
    with pytest.raises(ImportError, match=r"pip install 'lightning-mpx\[accelerate\]'"):
        importlib.import_module("lightning_mpx.integrations.accelerate")


# -- each opt level, float16 and bfloat16 ----------------------------------------------------------------------------
@pytest.mark.parametrize("half_name", HALVES)
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_each_opt_level_prepares_and_trains(level, half_name):
    half = HALVES[half_name]
    # SGD: Adam's epsilon underflows in a pure-half (O3 float16) optimizer.
    accelerator, model, opt, sched = _setup(level, optimizer=torch.optim.SGD, lr=0.1, half_dtype=half_name)
    expected_weight = {"O0": torch.float32, "O1": torch.float32, "O2": half, "O3": half}[level]
    expected_bn = torch.float32 if level != "O3" else half  # O2 keeps batch norm FP32, O3 casts everything
    assert model[0].weight.dtype == expected_weight and model[1].weight.dtype == expected_bn
    inner = []
    model[0].register_forward_hook(lambda m, i, o: inner.append(o.dtype))
    x, y = _batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = [_step(accelerator, model, opt, sched, x, y).item() for _ in range(3)]
    # The matmul ran in half at O1-O3 (policy or half model) and in FP32 at O0; the output reaches the loss in FP32.
    assert inner[0] == (torch.float32 if level == "O0" else half)
    assert model(x).dtype == torch.float32
    assert losses[-1] < losses[0]
    assert not torch.equal(before["0.weight"], model.state_dict()["0.weight"])
    scale = accelerator.mpx_metrics()["mpx/loss_scale"]
    assert scale == (2.0**16 if level in ("O1", "O2") and half is torch.float16 else 1.0)


def test_o1_policy_is_scoped_to_the_prepared_instance_and_autocast():
    accelerator, model, _, _ = _setup("O1")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    assert torch.mm(a, b).dtype == torch.float32  # nothing patched process-wide
    with accelerator.autocast():
        assert torch.mm(a, b).dtype == torch.float16
        assert torch.softmax(a, -1).dtype == torch.float32
    other = _net()  # same class, not prepared: its forward is untouched
    inner = []
    other[0].register_forward_hook(lambda m, i, o: inner.append(o.dtype))
    other(torch.randn(2, 8))
    assert inner == [torch.float32]
    # The wrapper is an attribute of the prepared instance; the class keeps torch's own forward.
    assert "forward" in vars(model) and "forward" not in vars(other)
    assert nn.Sequential.__dict__["forward"].__module__ == "torch.nn.modules.container"


def test_unwrap_model_without_fp32_wrapper_restores_the_plain_forward():
    accelerator, model, _, _ = _setup("O2")
    assert model(torch.randn(2, 8)).dtype == torch.float32
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert plain(torch.randn(2, 8, dtype=torch.float16)).dtype == torch.float16


def test_o2_optimizer_holds_fp32_masters_and_prepare_order_does_not_matter():
    accelerator = _accelerator("O2")
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt, model = accelerator.prepare(opt, model, device_placement=[True, True])  # models are prepared first anyway
    assert isinstance(model, nn.Sequential) and len(accelerator._models) == 1
    single = accelerator.prepare(_net(seed=1))  # one object in, one object out, as in Accelerate
    assert isinstance(single, nn.Sequential) and single[0].weight.dtype == torch.float16
    held = _masters(opt)
    assert all(p.dtype == torch.float32 for p in held)
    assert not any(p is model[0].weight for p in held)
    # The optimizer itself keeps the model's parameters (what code that walks param_groups expects).
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]
    x, y = _batch()
    _step(accelerator, model, opt, torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda _: 1.0), x, y)
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    for param, master in accelerator.amp.master_weights[0].half_pairs:
        assert torch.equal(param, master.half())
    # The half model gradients and the masters' were consumed by the step.
    assert all(p.grad is None for p in model.parameters()) and all(p.grad is None for p in held)


def test_o2_model_prepared_in_evaluation_mode_has_no_masters():
    accelerator = _accelerator("O2", half_dtype="bfloat16")
    model = accelerator.prepare_model(_net(), evaluation_mode=True)
    assert accelerator.amp.master_weights == []
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    model.eval()
    with torch.no_grad():
        assert model(_batch()[0]).dtype == torch.float32  # inputs cast to half, outputs back to FP32

    # Prepared again for training (Accelerate itself returns the model as it is): the masters are made then, once.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    assert len(accelerator.amp.master_weights) == 1
    assert {p.dtype for p in _masters(opt)} == {torch.float32}
    model.train()
    before = model[0].weight.detach().clone()
    x, y = _batch()
    accelerator.backward(F.cross_entropy(model(x), y))
    opt.step()
    assert not opt.step_was_skipped and not torch.equal(before, model[0].weight)


def test_o2_optimizer_prepared_before_any_model_is_refused_naming_the_calls():
    """An optimizer prepared alone at O2 (no model yet) is refused with what happened and the calls that work; after
    a model prepared only for evaluation, the message says that instead. Then the named calls prepare it."""
    accelerator = _accelerator("O2", half_dtype="bfloat16")
    model = _net()
    with pytest.raises(RuntimeError, match=r"no model has been prepared.*accelerator\.prepare\(model, optimizer\)"):
        accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    model = accelerator.prepare_model(model, evaluation_mode=True)
    with pytest.raises(RuntimeError, match=r"prepared for evaluation.*evaluation_mode=True.*accelerator\.prepare"):
        accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert {p.dtype for p in _masters(opt)} == {torch.float32}


def test_zero_grad_without_step_clears_the_half_model_gradients():
    accelerator, model, opt, _ = _setup("O2")
    x, y = _batch()
    accelerator.backward(F.cross_entropy(model(x), y))
    assert model[0].weight.grad is not None
    opt.zero_grad()
    assert model[0].weight.grad is None


# -- clipping --------------------------------------------------------------------------------------------------------
def _reference_grads(x, y):
    model = _net()
    F.cross_entropy(model(x), y).backward()
    return model


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clip_grad_norm_works_on_unscaled_gradients(level):
    accelerator, model, opt, _ = _setup(level)
    x, y = _batch()
    reference = _reference_grads(x, y)
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    accelerator.backward(F.cross_entropy(model(x), y))
    norm = accelerator.clip_grad_norm_(model.parameters(), 0.1)
    assert accelerator.amp.scalers[0].get_scale() == 2.0**16  # the gradients were scaled ...
    torch.testing.assert_close(norm, expected, rtol=2e-2, atol=0)  # ... and the norm is of the true ones
    clipped = torch.nn.utils.get_total_norm([p.grad for p in _masters(opt)])
    assert clipped.item() == pytest.approx(0.1, rel=1e-3)
    assert accelerator.mpx_metrics()["mpx/grad_norm"] == pytest.approx(norm.item())
    opt.step()
    assert not opt.step_was_skipped


def test_clip_on_part_of_the_model_and_other_norms_unscales_once():
    accelerator, model, opt, _ = _setup("O2")
    x, y = _batch()
    reference = _reference_grads(x, y)
    accelerator.backward(F.cross_entropy(model(x), y))
    accelerator.unscale_gradients(opt)
    first = accelerator.clip_grad_norm_(model[0].parameters(), 1e6, norm_type=float("inf"))
    expected = max(p.grad.abs().max() for p in reference[0].parameters())
    torch.testing.assert_close(first, expected, rtol=2e-2, atol=0)
    again = accelerator.clip_grad_norm_(model.parameters(), 1e6)  # still unscaled exactly once
    expected_all = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    torch.testing.assert_close(again, expected_all, rtol=2e-2, atol=0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_clip_of_the_trainable_parameters_leaves_out_one_frozen_after_its_gradient(level):
    """The optimizer holds every parameter; the first layer is frozen after a backward gave it a gradient (which the
    step still applies, as torch's optimizers do): ``clip_grad_norm_`` of the trainable parameters is the norm of
    theirs alone, as torch's clip of that list under Accelerate's own precision, not the fused norm of all that the
    optimizer holds (which takes only frozen parameters without a gradient as left out)."""
    accelerator, model, opt, _ = _setup(level)
    x, y = _batch()
    reference = _reference_grads(x, y)
    accelerator.backward(F.cross_entropy(model(x), y))
    model[0].requires_grad_(False)
    norm = accelerator.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1e6)
    rest = [p.grad for name, p in reference.named_parameters() if not name.startswith("0.")]
    everything = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    expected = torch.nn.utils.get_total_norm(rest)
    assert everything > expected * 1.1  # the frozen layer's gradient would show in the norm
    torch.testing.assert_close(norm, expected, rtol=2e-2, atol=0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clip_grad_value_clamps_unscaled_gradients(level):
    accelerator, model, opt, _ = _setup(level)
    x, y = _batch()
    reference = _reference_grads(x, y)
    accelerator.backward(F.cross_entropy(model(x), y))
    accelerator.clip_grad_value_(model.parameters(), 0.05)
    for got, ref in zip(_masters(opt), reference.parameters()):
        torch.testing.assert_close(got.grad, ref.grad.clamp(-0.05, 0.05), rtol=2e-2, atol=1e-3)


def test_clipping_refuses_foreign_parameters_and_non_synchronising_steps():
    accelerator, model, opt, _ = _setup("O2")
    stranger = nn.Parameter(torch.ones(2))
    stranger.grad = torch.ones(2)
    x, y = _batch()
    accelerator.backward(F.cross_entropy(model(x), y))
    with pytest.raises(ValueError, match="no optimizer prepared by this Accelerator"):
        accelerator.clip_grad_norm_([stranger, *model.parameters()], 1.0)
    accelerator.gradient_state._set_sync_gradients(False)
    with pytest.raises(RuntimeError, match="sync_gradients is False"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0)


# -- skipped steps ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("accumulation", [1, 2])
def test_injected_overflow_leaves_parameters_optimizer_and_scheduler_unchanged(accumulation):
    accelerator = Accelerator(
        mixed_precision="O2", gradient_accumulation_steps=accumulation,
        kwargs_handlers=[MixedPrecisionKwargs(half_dtype="float16")],
    )
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    history = []
    for index in range(4 * accumulation):
        real_step = index // accumulation
        last_micro = (index + 1) % accumulation == 0
        with accelerator.accumulate(model):
            x, y = _batch(index)
            accelerator.backward(F.cross_entropy(model(x), y))
            if real_step == 2 and last_micro:
                _inf_into_first_grad(model)
                before = _snapshot(model, opt, sched)
                scale = accelerator.amp.scalers[0].get_scale()
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if real_step == 2 and last_micro:
                assert opt.step_was_skipped and accelerator.optimizer_step_was_skipped
                _assert_same_tensors(_snapshot(model, opt, sched), before)
                assert accelerator.amp.scalers[0].get_scale() == scale / 2
            opt.zero_grad()
        if last_micro:
            history.append((opt.step_was_skipped, sched.scheduler.last_epoch))
    assert history == [(False, 1), (False, 2), (True, 2), (False, 3)]
    assert accelerator.mpx_metrics()["mpx/skipped_steps"] == 1.0


def test_accumulation_divides_the_loss_and_updates_the_scale_once_per_real_step():
    accelerator = Accelerator(
        mixed_precision="O2",
        gradient_accumulation_steps=2,
        kwargs_handlers=[MixedPrecisionKwargs(half_dtype="float16", growth_interval=1, init_scale=16.0)],
    )
    model = _net()
    model.eval()  # batch statistics would make two half batches differ from one full batch
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = accelerator.prepare(model, opt)
    x, y = _batch(n=32)
    reference = _net().eval()
    F.cross_entropy(reference(x), y).backward()
    seen_grads = []
    for step in range(2):
        for half in (slice(0, 16), slice(16, 32)):
            with accelerator.accumulate(model):
                accelerator.backward(F.cross_entropy(model(x[half]), y[half]))
                if accelerator.sync_gradients:
                    accelerator.unscale_gradients()
                    seen_grads.append([p.grad.clone() for p in _masters(opt)])
                opt.step()
                opt.zero_grad()
    # Two real steps: the scale grew twice (growth_interval=1), not once per micro-batch.
    assert accelerator.amp.scalers[0].get_scale() == 16.0 * 4
    # The accumulated gradient is the mean over the micro-batches, as with FP32 on the whole batch.
    for got, ref in zip(seen_grads[0], reference.parameters()):
        torch.testing.assert_close(got, ref.grad, rtol=2e-2, atol=2e-4)


# -- several optimizers and losses -----------------------------------------------------------------------------------
def test_gan_two_optimizers_two_losses_skip_and_update_independently(tmp_path):
    accelerator = _accelerator("O2", num_losses=2, growth_interval=1, init_scale=16.0)
    gen, disc, opt_g, opt_d = prepared_gan(accelerator)
    bce = F.binary_cross_entropy_with_logits
    skipped = []
    for it in range(4):
        z, real = torch.randn(16, 4), torch.randn(16, 8)
        # discriminator: loss 0
        fake = gen(z).detach()
        d_loss = bce(disc(real), torch.ones(16, 1)) + bce(disc(fake), torch.zeros(16, 1))
        accelerator.backward(d_loss, loss_id=0)
        if it == 2:
            with torch.no_grad():
                disc[0].weight.grad[0, 0] = float("nan")
            d_before = [p.clone() for p in _masters(opt_d)]
        opt_d.step()
        opt_d.zero_grad()
        # generator: loss 1 (its backward also reaches the discriminator, whose gradients zero_grad drops)
        g_loss = bce(disc(gen(z)), torch.ones(16, 1))
        accelerator.backward(g_loss, loss_id=1)
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        skipped.append((opt_d.step_was_skipped, opt_g.step_was_skipped))
        if it == 2:
            _assert_same_tensors([p.clone() for p in _masters(opt_d)], d_before)
    assert skipped == [(False, False), (False, False), (True, False), (False, False)]
    metrics = accelerator.mpx_metrics()
    # Loss 1's last update is pending until the next backward; save_state applies it so the checkpoint holds it.
    assert accelerator.amp.scalers[1].get_scale() == 16.0 * 2**3
    accelerator.save_state(str(tmp_path))
    saved = torch.load(tmp_path / AMP_STATE_NAME, weights_only=True)
    scales = [s.get_scale() for s in accelerator.amp.scalers]
    # Once per iteration each: loss 0 grew 3 times and halved once, loss 1 grew 4 times.
    assert scales == [16.0 * 2**3 / 2, 16.0 * 2**4] == [s["scale"] for s in saved["scalers"]]
    assert metrics["mpx/skipped_steps/loss0"] == 1.0 and metrics["mpx/skipped_steps/loss1"] == 0.0
    assert {"mpx/loss_scale/loss0", "mpx/loss_scale/loss1", "mpx/overflows/loss0"} <= metrics.keys()


def test_one_loss_two_optimizers_updates_the_scale_once_per_iteration():
    accelerator = _accelerator("O2", growth_interval=1, init_scale=16.0)
    torch.manual_seed(0)
    encoder, decoder = nn.Linear(8, 8), nn.Linear(8, 3)
    opt_e = torch.optim.SGD(encoder.parameters(), lr=1e-2)
    opt_d = torch.optim.SGD(decoder.parameters(), lr=1e-2)
    encoder, decoder, opt_e, opt_d = accelerator.prepare(encoder, decoder, opt_e, opt_d)
    for it in range(3):
        x, y = _batch(it)
        accelerator.backward(F.cross_entropy(decoder(encoder(x)), y))
        if it == 1:
            with torch.no_grad():
                encoder.weight.grad[0, 0] = float("inf")
        opt_e.step()
        opt_d.step()
        opt_e.zero_grad()
        opt_d.zero_grad()
        if it == 1:  # each optimizer skips on its own overflow
            assert opt_e.step_was_skipped and not opt_d.step_was_skipped
    # grew, halved, grew: once per iteration, not once per optimizer step
    assert accelerator.amp.scalers[0].get_scale() == 16.0 * 2 / 2 * 2


# -- metrics ---------------------------------------------------------------------------------------------------------
def test_log_sends_the_metrics_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = Accelerator(
        mixed_precision="O2",
        log_with="tensorboard",
        project_dir=str(tmp_path),
        kwargs_handlers=[MixedPrecisionKwargs(half_dtype="float16")],
    )
    accelerator.init_trackers("run")
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    calls = []
    original = accelerator.amp.metrics
    accelerator.amp.metrics = lambda *args: calls.append(1) or original(*args)
    for step in range(4):
        x, y = _batch(step)
        loss = _step(accelerator, model, opt, sched, x, y, clip=1.0, inject=_inf_into_first_grad if step == 1 else None)
        if step % 2 == 1:
            accelerator.log({"loss": loss.item()}, step=step)
    assert len(calls) == 2  # the device is read only where the user logs
    accelerator.end_training()
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "mpx/loss_scale", "mpx/overflows", "mpx/skipped_steps", "mpx/grad_norm"} <= tags
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags}
    assert scalars["mpx/loss_scale"] == [(1, 2.0**15), (3, 2.0**15)]
    assert scalars["mpx/overflows"] == [(1, 1.0), (3, 0.0)]
    assert scalars["mpx/skipped_steps"] == [(1, 1.0), (3, 1.0)]


def test_log_metrics_can_be_turned_off():
    accelerator = _accelerator("O2", log_metrics=False)
    logged = []
    accelerator.trackers = [
        type("T", (), {"name": "fake", "log": lambda self, values, step, **kw: logged.append(values)})()
    ]
    accelerator.log({"loss": 1.0})
    assert logged == [{"loss": 1.0}]


# -- checkpoints -----------------------------------------------------------------------------------------------------
def _run_with_state(tmp_path, accelerator, model, opt, steps, one_step, *, save_at=None, load=False):
    """Steps ``[0, steps)`` of ``one_step(step)``, saving the state after step ``save_at - 1``; or, with ``load``,
    the state loaded first and steps ``[save_at, steps)``. Returns the model's state, the masters and the
    optimizer's state."""
    if load:
        accelerator.load_state(str(tmp_path))
    for step in range(save_at if load else 0, steps):
        one_step(step)
        if save_at is not None and not load and step + 1 == save_at:
            accelerator.save_state(str(tmp_path))
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [p.detach().clone() for p in _masters(opt)],
        opt.optimizer.state_dict()["state"],
    )


def _resume_run(tmp_path, steps, *, save_at=None, load=False, seed=0):
    accelerator, model, opt, sched = _setup("O2", seed=seed, growth_interval=2)

    def one_step(step):
        x, y = _batch(step)
        _step(accelerator, model, opt, sched, x, y, clip=1.0, inject=_inf_into_first_grad if step == 1 else None)

    state = _run_with_state(tmp_path, accelerator, model, opt, steps, one_step, save_at=save_at, load=load)
    state = (*state, sched.scheduler.last_epoch, accelerator.amp.state_dict())
    reset_accelerate_state()
    return state


def test_save_state_load_state_resumes_exactly(tmp_path):
    straight = _resume_run(tmp_path / "unused", 7)
    _resume_run(tmp_path, 4, save_at=4)
    assert (tmp_path / AMP_STATE_NAME).is_file()
    resumed = _resume_run(tmp_path, 7, save_at=4, load=True, seed=123)  # other initial weights: all come from disk
    # parameters, masters, optimizer state, scheduler, and the Amp state: scale, trackers, counters, masters
    _assert_same_tensors(resumed, straight)
    assert straight[4]["scalers"][0]["overflows"] == 1


def _frozen_again_run(tmp_path, steps, *, save_at=None, load=False):
    """O2 with the first layer frozen at step 2 and unfrozen at step 6 (AdamW over every parameter, as users write
    it); a resumed run builds its model with that layer frozen, as the code that saved at a frozen step would."""
    accelerator = _accelerator("O2")
    model = _net(123 if load else 0)
    if load:
        model[0].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    model, opt, sched = accelerator.prepare(model, opt, sched)

    def one_step(step):
        if step in (2, 6):
            model[0].requires_grad_(step == 6)
        x, y = _batch(step)
        _step(accelerator, model, opt, sched, x, y)

    state = _run_with_state(tmp_path, accelerator, model, opt, steps, one_step, save_at=save_at, load=load)
    reset_accelerate_state()
    return state


def test_load_state_with_a_trained_layer_frozen_again_goes_on_as_the_straight_run(tmp_path):
    """The first layer trains, is frozen, the state is saved while it is frozen, and a new run loads it into a model
    built with that layer frozen, then unfreezes it: parameters, masters and Adam moments equal the uninterrupted
    run's, bit for bit (the layer's moments load into an FP32 master, not into its half parameter)."""
    straight = _frozen_again_run(tmp_path / "unused", 9)
    _frozen_again_run(tmp_path, 4, save_at=4)
    resumed = _frozen_again_run(tmp_path, 9, save_at=4, load=True)
    _assert_same_tensors(resumed, straight)


def test_load_state_without_amp_state_says_why(tmp_path):
    accelerator, *_ = _setup("O2")
    accelerator.save_state(str(tmp_path))
    (tmp_path / AMP_STATE_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="not saved by lightning_mpx's Accelerator") as error:
        accelerator.load_state(str(tmp_path))
    assert "load them into the model before accelerator.prepare" in str(error.value)  # and says what to do


def test_load_state_into_an_evaluation_only_o2_model(tmp_path):
    accelerator, model, opt, sched = _setup("O2", growth_interval=1)
    for step in range(3):
        _step(accelerator, model, opt, sched, *_batch(step))
    accelerator.save_state(str(tmp_path))
    # The half values the model holds (its state_dict() gives the FP32 masters): what an evaluation-only model loads.
    trained = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    scale = accelerator.amp.scalers[0].get_scale()
    assert scale == 2.0**19  # 2**16 grown on each of 3 steps
    reset_accelerate_state()

    evaluator = _accelerator("O2", growth_interval=1)
    fresh = evaluator.prepare_model(_net(seed=5), evaluation_mode=True)
    evaluator.load_state(str(tmp_path))  # the checkpoint's masters are not needed without an optimizer
    assert evaluator.amp.master_weights == [] and evaluator.amp.scalers[0].get_scale() == scale
    _assert_same_tensors(fresh.state_dict(), trained)


# -- two processes ---------------------------------------------------------------------------------------------------

def test_two_processes_skip_together_and_stay_identical(tmp_path):
    accelerate_launch("accelerate_two_process.py", tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world_size"] == ranks[1]["world_size"] == 2
    # The overflow was injected on rank 0 only; both ranks skipped that step, and only that one.
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == [False, False, True, False, False]
    assert ranks[0]["scale"] == ranks[1]["scale"] == 2.0**15
    params = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    _assert_same_tensors(params[0], params[1])
    assert params[0]["masters"][0].dtype == torch.float32 and params[0]["model"]["0.weight"].dtype == torch.float16
    saved = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert AMP_STATE_NAME in saved and "model.safetensors" in saved
    assert "model_1.safetensors" not in saved  # the DDP-wrapped model is registered once
    # Saved under DDP with each master once (the model file holds them): a new single process resumes them exactly.
    masters = params[0]["masters"]
    engine = torch.load(tmp_path / "checkpoint" / AMP_STATE_NAME, weights_only=True)
    assert engine["master_weights"] == [{}] and len(engine["masters_in_state_dict"][0]) == 4  # BN: FP32
    reset_accelerate_state()
    kwargs = [MixedPrecisionKwargs(half_dtype="float16")]
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=kwargs)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    accelerator.load_state(str(tmp_path / "checkpoint"))
    _assert_same_tensors(list(accelerator.amp.master_params(opt.optimizer)), masters)
