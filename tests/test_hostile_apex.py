"""lightning_mpx.apex attacked as Apex users wrote their scripts (imagenet's and DCGAN's ``main_amp.py``, the misuse
they commit), each case against a reference: the same loop in FP32, ``torch.amp.GradScaler``, or Apex's documented
dynamic scaler. The two-process cases run in one launch of ``tests/hostile_apex_ddp_script.py``."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx.apex import _amp_state, amp
from tests.launch import rank_results, run_script


@pytest.fixture(autouse=True)
def _reset_amp_state():
    yield
    _amp_state.reset()
    _amp_state.registrations.clear()


# -- imagenet's main_amp.py ---------------------------------------------------------------------------------------
def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 4),
    )


def _images(n: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 3, 6, 6, generator=g).contiguous(memory_format=torch.channels_last),
         torch.randint(0, 4, (4,), generator=g))
        for _ in range(n)
    ]


def _imagenet_setup(opt_level: str | None, **kwargs):
    model = _cnn().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    if opt_level is not None:
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    return model, optimizer, scheduler


def _imagenet_iteration(model, optimizer, scheduler, x, y, *, apex: bool = True) -> None:
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    if apex:
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()


def _checkpoint(model, optimizer, scheduler) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict(),
                "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize(("opt_level", "kwargs", "tol"), [
    ("O2", {"cast_model_type": torch.bfloat16, "keep_batchnorm_fp32": True}, 3e-2),
    ("O3", {"cast_model_type": torch.bfloat16, "keep_batchnorm_fp32": True}, 6e-2),
    ("O2", {"loss_scale": 128.0}, 5e-3),
])
def test_imagenet_loop_follows_fp32_and_resumes_bit_for_bit(opt_level, kwargs, tol):
    """Finding (fixed): ``cast_model_type=torch.bfloat16`` raised a ValueError naming a ``half_dtype`` that
    ``initialize`` does not take; Apex cast the model to the dtype given. Then: the loop follows FP32, and checkpoints
    saved before the first step and mid-run resume bit for bit."""
    data = _images()
    reference = _imagenet_setup(None)
    for x, y in data:
        _imagenet_iteration(*reference, x, y, apex=False)
    ref_state = reference[0].state_dict()

    _amp_state.reset()
    model, optimizer, scheduler = _imagenet_setup(opt_level, **kwargs)
    half = kwargs.get("cast_model_type", torch.float16)
    assert model[0].weight.dtype == half
    assert model[1].weight.dtype == torch.float32  # keep_batchnorm_fp32
    assert _amp_state.opt_properties.cast_model_type == half
    saved = {}
    for i, (x, y) in enumerate(data):
        if i in (0, 3):
            saved[i] = _checkpoint(model, optimizer, scheduler)
        _imagenet_iteration(model, optimizer, scheduler, x, y)
    final = {k: v.clone() for k, v in model.state_dict().items()}
    final_opt = copy.deepcopy(optimizer.state_dict())
    for key, value in ref_state.items():
        if value.is_floating_point():
            torch.testing.assert_close(final[key].float(), value, atol=tol, rtol=tol, msg=key)

    for cut, buffer in saved.items():
        _amp_state.reset()
        model, optimizer, scheduler = _imagenet_setup(opt_level, **kwargs)
        checkpoint = torch.load(buffer)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        for x, y in data[cut:]:
            _imagenet_iteration(model, optimizer, scheduler, x, y)
        for key, value in model.state_dict().items():
            assert torch.equal(value, final[key]), (cut, key)
        resumed = optimizer.state_dict()
        for index, entry in final_opt["state"].items():
            assert torch.equal(resumed["state"][index]["momentum_buffer"], entry["momentum_buffer"]), (cut, index)
        assert resumed["param_groups"][0]["lr"] == final_opt["param_groups"][0]["lr"]


# -- DCGAN's main_amp.py ------------------------------------------------------------------------------------------
def _gan():
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return discriminator, generator


def _dcgan(opt_level: str | None, inf_at: tuple[int, int] | None, steps: int = 5):
    """DCGAN's loop: three losses, the generator's backpropagated through the discriminator, ``netG.zero_grad()``
    right before the generator's loss (after the discriminator's step). ``opt_level=None``: FP32, the step of an
    infinite loss left out by hand. Returns the nets, the optimizers and the scales after each iteration."""
    netD, netG = _gan()
    optD = torch.optim.Adam(netD.parameters(), lr=1e-3, betas=(0.5, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=1e-3, betas=(0.5, 0.999))
    if opt_level is not None:
        (netD, netG), (optD, optG) = amp.initialize(
            [netD, netG], [optD, optG], opt_level=opt_level, num_losses=3, verbosity=0
        )
    criterion = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(1)
    scales = []

    def backward(loss, optimizer, loss_id):
        if opt_level is None:
            loss.backward()
            return
        with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
            scaled.backward()

    for i in range(steps):
        real, noise = torch.randn(8, 8, generator=g) * 0.1, torch.randn(8, 4, generator=g)
        poison = [float("inf") if inf_at == (i, k) else 1.0 for k in range(3)]
        netD.zero_grad()
        out = netD(real)
        backward(criterion(out, torch.ones_like(out)) * poison[0], optD, 0)
        fake = netG(noise)
        out = netD(fake.detach())
        backward(criterion(out, torch.zeros_like(out)) * poison[1], optD, 1)
        if opt_level is not None or poison[:2] == [1.0, 1.0]:
            optD.step()
        netG.zero_grad()
        out = netD(fake)
        backward(criterion(out, torch.ones_like(out)) * poison[2], optG, 2)
        if opt_level is not None or poison[2] == 1.0:
            optG.step()
        if opt_level is not None:
            scales.append([s.loss_scale() for s in _amp_state.loss_scalers])
    return (netD, netG), (optD, optG), scales


@pytest.mark.parametrize(("opt_level", "loss_id"), [("O1", 2), ("O2", 2), ("O2", 0)])
def test_dcgan_overflow_skips_that_step_only(opt_level, loss_id):
    """Finding (fixed): an overflow in the generator's loss (loss 2) skipped the generator's step as it should, and
    then its next step too, with loss 0's scale backed off: the next iteration's discriminator blocks (run before
    ``netG.zero_grad()``) brought the generator's leftover inf gradients to their scale and charged them. Apex never
    looked at an optimizer a block does not name. Reference: FP32 with that one step left out by hand."""
    steps = 5
    (refD, refG), _, _ = _dcgan(None, (2, loss_id), steps)
    (netD, netG), (optD, optG), scales = _dcgan(opt_level, (2, loss_id), steps)
    expected = [65536.0] * 3
    for i in range(steps):
        if i == 2:
            expected[loss_id] = 32768.0
        assert scales[i] == expected, (i, scales)
    skipped = {"D": 1 if loss_id < 2 else 0, "G": 1 if loss_id == 2 else 0}
    for name, optimizer in (("D", optD), ("G", optG)):
        for state in optimizer.state.values():
            assert int(state["step"]) == steps - skipped[name], name  # steps taken: exactly one left out
    for net, ref in ((netD, refD), (netG, refG)):
        for (key, value), ref_value in zip(net.state_dict().items(), ref.state_dict().values()):
            if value.is_floating_point():
                torch.testing.assert_close(value.float(), ref_value, atol=2e-2, rtol=2e-2, msg=key)


def test_one_block_naming_two_optimizers_skips_both_and_backs_off_once():
    """``amp.scale_loss(loss, [opt1, opt2])`` with an inf loss: both steps skipped, one back-off (held)."""
    torch.manual_seed(0)
    m1, m2 = nn.Linear(4, 2), nn.Linear(4, 2)
    before = [copy.deepcopy(m.state_dict()) for m in (m1, m2)]
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    [m1, m2], [o1, o2] = amp.initialize([m1, m2], [o1, o2], opt_level="O2", verbosity=0)
    x = torch.randn(4, 4) * 0.1
    with amp.scale_loss((m1(x).sum() + m2(x).sum()) * float("inf"), [o1, o2]) as scaled:
        scaled.backward()
    o1.step()
    o2.step()
    assert _amp_state.loss_scalers[0].loss_scale() == 32768.0
    for model, state in zip((m1, m2), before):
        for key, value in model.state_dict().items():
            assert torch.equal(value, state[key]), key


# -- the dynamic scaler -------------------------------------------------------------------------------------------
def test_dynamic_scale_and_skips_follow_grad_scaler():
    """Apex's documented scaler (2**16, halve on overflow, double after 2000 clean steps), NaN losses on some steps:
    the scale after each step and the weights match ``torch.amp.GradScaler`` with the same schedule (held)."""
    bad = {3, 14, 15}
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 1990}})
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2000)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler._growth_tracker.fill_(1990)
    x = torch.randn(4, 4) * 0.1
    for i in range(24):
        poison = float("nan") if i in bad else 1.0
        optimizer.zero_grad()
        with amp.scale_loss(model(x).float().mean() * poison, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        ref_opt.zero_grad()
        with amp.disable_casts():  # the reference in FP32: O1's casts are on for this thread since initialize
            ref_loss = reference(x).mean() * poison
        assert ref_loss.dtype == torch.float32
        scaler.scale(ref_loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        assert _amp_state.loss_scalers[0].loss_scale() == scaler.get_scale(), i
    torch.testing.assert_close(model.weight, reference.weight, atol=2e-3, rtol=2e-3)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": scaler.get_scale(), "unskipped": 8}


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor on the host (each one a device sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("item", "tolist", "__bool__", "__float__", "__int__"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_one_host_read_per_iteration_as_apex():
    """Finding (fixed): Apex read the overflow flag once per iteration (at the end of the block); the block read it
    and the step read the same flag again (``StepMachine._read_flags``): two syncs. The step now takes the block's
    read (``Amp.overflowed``) when no check made a new flag since."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                      verbosity=0)
    x = torch.randn(8, 4) * 0.1
    for _ in range(2):
        reads = _HostReads()
        with reads:
            optimizer.zero_grad()
            with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
    assert reads.count == 1


# -- misuse -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("opt_level", "kwargs", "convert"), [
    ("O2", {}, lambda m: m.float()),
    ("O3", {}, lambda m: m.to(torch.float32)),
    ("O2", {"cast_model_type": torch.bfloat16}, lambda m: m.half()),
])
def test_a_model_converted_after_initialize_says_so(opt_level, kwargs, convert):
    """Finding (fixed): converting the model after ``initialize`` failed in the first matmul with torch's "mat1 and
    mat2 must have the same dtype" (the input hook still casts to the half dtype); now the error says why."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = amp.initialize(model, opt_level=opt_level, verbosity=0, **kwargs)
    model(torch.randn(2, 4))  # fine before the conversion
    convert(model)
    with pytest.raises(RuntimeError, match=r"converted after amp.initialize\(\)"):
        model(torch.randn(2, 4))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_step_after_a_backward_outside_scale_loss_is_refused(opt_level):
    """Finding (fixed): ``loss.backward(); optimizer.step()`` without the block divided the gradients by 65536 (at O1
    Apex stepped them as they were): a silent 1/65536 learning rate. Now a clear error; a step with no gradients,
    and one at a static scale of 1, go on as before."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    optimizer.step()  # no gradients yet: nothing to refuse
    x = torch.randn(4, 4) * 0.1
    model(x).float().sum().backward()
    with pytest.raises(RuntimeError, match=r"no amp.scale_loss\(\) block ran"):
        optimizer.step()
    optimizer.zero_grad()
    with amp.scale_loss(model(x).float().sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()  # the block's way works

    _amp_state.reset()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, loss_scale=1.0, verbosity=0)
    model(x).float().sum().backward()
    optimizer.step()
    reference(x).sum().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    torch.testing.assert_close(model.weight.float(), reference.weight, atol=2e-3, rtol=0)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_initialize_twice_on_the_same_objects_keeps_training_where_it_was(opt_level):
    """Finding (fixed): a second ``amp.initialize`` of the same model and optimizer at O2 made new masters from the
    half weights and left Adam's moments and step count keyed by the old masters: the new ones started from zero
    (bias correction restarted). Reference: the uninterrupted run, bit for bit."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g) * 0.1, torch.randn(8, 2, generator=g)) for _ in range(6)]

    def run(again_at: int | None) -> list[torch.Tensor]:
        _amp_state.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        plain = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, optimizer = amp.initialize(model, plain, opt_level=opt_level, verbosity=0)
        for i, (x, y) in enumerate(data):
            if i == again_at:
                model, optimizer = amp.initialize(model, plain, opt_level=opt_level, verbosity=0)
            optimizer.zero_grad()
            with amp.scale_loss(F.mse_loss(model(x).float(), y), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
        assert all(int(state["step"]) == len(data) for state in plain.state.values())
        return [*model.state_dict().values(), *amp.master_params(optimizer)]

    for a, b in zip(run(None), run(3)):
        assert torch.equal(a, b)


def test_add_param_group_of_a_new_half_head_at_o2_gets_masters_and_follows_fp32():
    """Finding (fixed): a head made half after ``initialize`` and added with ``optimizer.add_param_group`` (Apex's
    patched ``add_param_group`` gave it FP32 masters) failed at the next step with a ValueError telling to call
    ``prepare_model()``, which an Apex script never calls. Reference: FP32, the head's initial weights rounded alike."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g) * 0.1, torch.randn(8, 2, generator=g)) for _ in range(5)]
    torch.manual_seed(0)
    body, head = nn.Linear(4, 8), nn.Linear(8, 2)
    ref_body, ref_head = copy.deepcopy(body), copy.deepcopy(head)
    optimizer = torch.optim.SGD(body.parameters(), lr=10.0, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_body.parameters(), lr=10.0, momentum=0.9)
    body, optimizer = amp.initialize(body, optimizer, opt_level="O2", verbosity=0)
    head.half()
    with torch.no_grad():
        for p, ref in zip(head.parameters(), ref_head.parameters()):
            ref.copy_(p)
    for i, (x, y) in enumerate(data):
        if i == 2:
            optimizer.add_param_group({"params": head.parameters(), "lr": 5.0})  # a generator, as people write
            ref_opt.add_param_group({"params": list(ref_head.parameters()), "lr": 5.0})
        out, ref_out = (head(body(x).half()).float(), ref_head(ref_body(x))) if i >= 2 else (body(x)[:, :2],
                                                                                              ref_body(x)[:, :2])
        optimizer.zero_grad()
        with amp.scale_loss(F.mse_loss(out, y) * 0.01, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        ref_opt.zero_grad()
        (F.mse_loss(ref_out, y) * 0.01).backward()
        ref_opt.step()
    masters = list(amp.master_params(optimizer))
    assert [m.dtype for m in masters] == [torch.float32] * 4
    assert head.weight.dtype == torch.float16
    for master, ref in zip(masters, [*ref_body.parameters(), *ref_head.parameters()]):
        torch.testing.assert_close(master, ref, atol=1e-3, rtol=1e-3)


def test_an_optimizer_built_after_initialize_gets_a_short_clear_error():
    """Finding (fixed): the error printed the optimizer's whole repr (every hyperparameter) and no remedy."""
    model = amp.initialize(nn.Linear(4, 2), opt_level="O2", verbosity=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"Build the optimizer before amp.initialize\(\)") as info:
        with amp.scale_loss(model(torch.randn(2, 4)).sum(), optimizer) as scaled:
            scaled.backward()
    assert "Parameter Group" not in str(info.value)


def test_delay_unscale_accumulation_follows_fp32_and_an_overflowed_micro_batch_skips_the_step():
    """Gradient accumulation over 3 micro-batches with ``delay_unscale=True`` but the last (held): the step matches
    FP32's accumulated step; an inf in the second micro-batch skips that step only and halves the scale once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        micro = [torch.randn(4, 4, generator=g) * 0.1 for _ in range(3)]
        overflow = step == 2
        for k, x in enumerate(micro):
            loss = model(x).float().pow(2).mean() / 3 * (float("inf") if overflow and k == 1 else 1.0)
            with amp.scale_loss(loss, optimizer, delay_unscale=k < 2) as scaled:
                scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
        if not overflow:
            for x in micro:
                (reference(x).pow(2).mean() / 3).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        assert _amp_state.loss_scalers[0].loss_scale() == (32768.0 if step >= 2 else 65536.0)
    for (key, value), ref_value in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, ref_value, atol=2e-3, rtol=2e-3, msg=key)


# -- two processes (one launch) -----------------------------------------------------------------------------------
def test_ddp_after_initialize_two_ranks(tmp_path):
    """DistributedDataParallel wrapped after ``initialize`` (gloo, two ranks seeded differently): an inf loss on rank
    0 only skips the step on both and backs off both scales; both ranks end equal and follow FP32 on the whole
    batch (the overflowed step left out)."""
    run_script("hostile_apex_ddp_script.py", tmp_path, timeout=240)
    results = rank_results(tmp_path)
    for case in results[0]:
        r0, r1 = results[0][case], results[1][case]
        assert r0["scales"] == r1["scales"] == r0["expected_scales"], case
        assert r0["weights"] == r1["weights"], case
        torch.testing.assert_close(torch.tensor(r0["weights"]), torch.tensor(r0["reference"]), atol=2e-2, rtol=2e-2)
