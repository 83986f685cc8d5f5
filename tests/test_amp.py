"""The Amp engine end to end on CPU: conversion, masters, skipping, clipping, several losses, resume."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, LossScaleFloorError


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _batch(seed=0, n=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _train_step(amp, model, opt, x, y, *, clip=None, loss_id=0):
    with amp.forward_context():
        out = amp.cast_outputs(model(amp.cast_inputs(x)))
        loss = F.cross_entropy(out, y)
    amp.backward(loss, loss_id=loss_id)
    if clip is not None:
        amp.clip_grad_norm_(opt, clip)
    stepped = amp.step(opt)
    amp.update()
    opt.zero_grad()
    return loss.detach(), stepped


def _setup(level, **kw):
    amp = Amp(level, **{"half_dtype": "float16", **kw})
    model = amp.prepare_model(_net())
    opt = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return amp, model, opt


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=str)
def test_o2_keeps_batchnorm_fp32_and_optimizer_holds_fp32_masters(half):
    amp, model, opt = _setup("O2", half_dtype=half)
    assert model[0].weight.dtype == half and model[3].bias.dtype == half
    assert model[1].weight.dtype == torch.float32 and model[1].running_mean.dtype == torch.float32
    held = [p for g in opt.param_groups for p in g["params"]]
    assert [id(p) for p in held] == [id(p) for p in model.parameters()]  # the optimizer keeps the model's params
    stepped_on = amp.master_params(opt)  # ... and steps FP32 masters in their place
    assert all(p.dtype == torch.float32 for p in stepped_on)
    assert all(m is not p for m, p in zip(stepped_on, held) if p.dtype == half)
    _train_step(amp, model, opt, *_batch())
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    # after a real step the half model equals its masters rounded to half
    masters = amp.master_weights[0]
    for param, master in masters.half_pairs:
        assert torch.equal(param, master.to(half))


def test_o2_without_keep_batchnorm_casts_everything():
    amp, model, _ = _setup("O2", keep_batchnorm_fp32=False, half_dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_o3_has_no_masters_and_trains_half_params_directly():
    amp, model, opt = _setup("O3", half_dtype="bfloat16")
    assert amp.master_weights == []
    assert all(p.dtype == torch.bfloat16 for g in opt.param_groups for p in g["params"] if p.dim() > 1)


def test_o2_model_prepared_for_evaluation_only_gets_no_masters_until_trained():
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net(), train=False)
    assert amp.master_weights == [] and model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32  # batch norm still kept FP32
    out = amp.cast_outputs(model(amp.cast_inputs(_batch()[0])))
    assert out.dtype == torch.float32
    with pytest.raises(RuntimeError, match="train=True"):
        amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    amp.prepare_model(model)  # now trained: masters are made, once however often it is prepared
    amp.prepare_model(model)
    assert len(amp.master_weights) == 1
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(p.dtype == torch.float32 for p in amp.master_params(opt))
    before = model[0].weight.detach().clone()
    _, stepped = _train_step(amp, model, opt, *_batch())
    assert stepped and not torch.equal(before, model[0].weight)
    with pytest.raises(TypeError, match="train='no' must be True or False"):
        amp.prepare_model(_net(), train="no")


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_master_weights_and_scaler_round_trip_bit_exactly(level):
    amp, model, opt = _setup(level)
    for i in range(5):
        _train_step(amp, model, opt, *_batch(i))
    state = copy.deepcopy(amp.state_dict())
    fresh = Amp(level, half_dtype="float16")
    fresh_model = fresh.prepare_model(_net())
    fresh_model.load_state_dict(model.state_dict())
    fresh.load_state_dict(state)
    for a, b in zip(amp.master_weights, fresh.master_weights):
        for (_, ma), (_, mb) in zip(a.half_pairs, b.half_pairs):
            assert torch.equal(ma, mb)
    assert fresh.scalers[0].state_dict() == amp.scalers[0].state_dict()


def _inject_inf(model, name="0.weight"):
    dict(model.named_parameters())[name].grad.view(-1)[-1] = float("inf")


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_skips_step_with_parameters_and_optimizer_state_bit_identical(level):
    amp, model, opt = _setup(level)
    for i in range(3):
        _train_step(amp, model, opt, *_batch(i))
    params_before = copy.deepcopy(model.state_dict())
    opt_before = copy.deepcopy(opt.state_dict())
    masters_before = copy.deepcopy(amp.state_dict()["master_weights"])
    scale_before = amp.scalers[0].get_scale()

    x, y = _batch(9)
    with amp.forward_context():
        loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))), y)
    amp.backward(loss)
    _inject_inf(model)
    assert amp.step(opt) is False
    amp.update()
    opt.zero_grad()

    for k, v in model.state_dict().items():
        if "running" in k or "num_batches" in k:
            continue  # batch-norm statistics move in every forward pass, skipped or not
        assert torch.equal(v, params_before[k]), k
    after = opt.state_dict()
    for idx, st in opt_before["state"].items():
        for key, value in st.items():
            assert torch.equal(after["state"][idx][key], value), (idx, key)
    for a, b in zip(amp.state_dict()["master_weights"], masters_before):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert amp.scalers[0].get_scale() == scale_before / 2
    assert amp.skipped_steps == [1]
    assert amp.last_overflow_parameters == ["0.weight"]
    metrics = amp.metrics()
    assert metrics["mpx/overflows"].item() == 1 and metrics["mpx/skipped_steps"] == 1
    assert amp.metrics()["mpx/overflows"].item() == 0  # counted since the last read


def test_static_scale_overflow_raises_at_floor_after_skipping():
    amp, model, opt = _setup("O0")
    before = copy.deepcopy(model.state_dict())
    x, y = _batch()
    amp.backward(F.cross_entropy(model(x), y))
    _inject_inf(model, "3.bias")
    with pytest.raises(LossScaleFloorError, match=r"3\.bias"):
        amp.step(opt)
    assert all(
        torch.equal(v, before[k]) for k, v in model.state_dict().items() if "running" not in k and "num_b" not in k
    )


def test_clip_grad_norm_sees_unscaled_gradients():
    amp, model, opt = _setup("O1")
    ref = copy.deepcopy(model)
    x, y = _batch()
    F.cross_entropy(ref(x), y).backward()
    true_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    with amp.forward_context():
        loss = F.cross_entropy(model(x), y)
    amp.backward(loss)
    norm = amp.clip_grad_norm_(opt, 0.1)
    torch.testing.assert_close(norm, true_norm, rtol=2e-2, atol=0)  # O1 runs the matmuls in float16
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(clipped, torch.tensor(0.1), rtol=1e-4, atol=0)
    assert amp.metrics()["mpx/grad_norm"] is norm


def test_unscale_twice_is_an_error_naming_the_call():
    amp, model, opt = _setup("O1", half_dtype="bfloat16")
    x, y = _batch()
    amp.backward(F.cross_entropy(model(x), y))
    amp.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer"):
        amp.unscale_(opt)


def test_accumulation_unscales_once_and_keeps_the_scale():
    # FP32 model with a dynamic power-of-two scale: scaling is exact, so accumulation must match exactly.
    amp, model, opt = _setup("O0", loss_scale="dynamic", growth_interval=1)
    scale = amp.scalers[0].get_scale()
    ref = copy.deepcopy(model)
    for i in range(4):
        x, y = _batch(i)
        with amp.forward_context():
            loss = F.cross_entropy(model(x), y) / 4
        amp.backward(loss)
        assert amp.scalers[0].get_scale() == scale  # no update mid-accumulation
        F.cross_entropy(ref(x), y).div(4).backward()
    amp.unscale_(opt)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-9)
    assert amp.step(opt)
    amp.update()
    assert amp.scalers[0].get_scale() == scale * 2  # one real step, one growth (interval 1)


def test_two_losses_two_optimizers_skip_independently_and_update_once_per_iteration():
    amp = Amp("O1", num_losses=2, growth_interval=1, init_scale=2.0**8, half_dtype="float16")
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    amp.prepare_model(gen), amp.prepare_model(disc)
    opt_g = amp.prepare_optimizer(torch.optim.SGD(gen.parameters(), lr=0.1))
    opt_d = amp.prepare_optimizer(torch.optim.SGD(disc.parameters(), lr=0.1))
    z = torch.randn(8, 4)
    # discriminator step with an overflow
    with amp.forward_context():
        loss_d = disc(gen(z).detach()).mean()
    amp.backward(loss_d, loss_id=1)
    disc.weight.grad[0, 0] = float("nan")
    d_before = disc.weight.detach().clone()
    assert amp.step(opt_d) is False
    opt_d.zero_grad()
    # generator step, fine
    with amp.forward_context():
        loss_g = -disc(gen(z)).mean()
    amp.backward(loss_g, loss_id=0)
    g_before = gen.weight.detach().clone()
    assert amp.step(opt_g) is True
    opt_g.zero_grad()
    amp.update()
    assert torch.equal(disc.weight, d_before) and not torch.equal(gen.weight, g_before)
    assert amp.scalers[1].get_scale() == 2.0**7  # backed off once
    assert amp.scalers[0].get_scale() == 2.0**9  # grew once (interval 1), not once per optimizer call
    m = amp.metrics()
    assert {"mpx/loss_scale/loss0", "mpx/loss_scale/loss1", "mpx/skipped_steps/loss1"} <= set(m)
    assert m["mpx/skipped_steps/loss1"] == 1 and m["mpx/skipped_steps/loss0"] == 0


def test_two_losses_into_one_optimizer_are_rescaled_not_mixed():
    amp = Amp("O1", num_losses=2, init_scale=2.0**10, half_dtype="float16")
    amp.scalers[1].to("cpu").load_state_dict(
        {"scale": 2.0**4, "growth_tracker": 0, "hysteresis_tracker": 1, "overflows": 0}
    )
    model = amp.prepare_model(nn.Linear(3, 1, bias=False))
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    x = torch.ones(2, 3)
    amp.backward(model(x).sum(), loss_id=0)
    amp.backward(2 * model(x).sum(), loss_id=1)
    amp.unscale_(opt)
    torch.testing.assert_close(model.weight.grad, torch.full((1, 3), 6.0))  # 2 + 4, each unscaled correctly


def _fresh_run(level, steps, state=None):
    amp, model, opt = _setup(level)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        amp.load_state_dict(state["amp"])
    return amp, model, opt


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_resume_is_bit_identical(level):
    amp, model, opt = _fresh_run(level, 0)
    for i in range(6):
        _train_step(amp, model, opt, *_batch(i), clip=1.0)
    straight = copy.deepcopy(model.state_dict())

    amp, model, opt = _fresh_run(level, 0)
    for i in range(3):
        _train_step(amp, model, opt, *_batch(i), clip=1.0)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
    amp, model, opt = _fresh_run(level, 0, saved)
    for i in range(3, 6):
        _train_step(amp, model, opt, *_batch(i), clip=1.0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, straight[k]), k


def test_fused_adamw_with_clipping():
    amp = Amp("O2", half_dtype="float16")
    model = amp.prepare_model(_net())
    opt = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    losses = [_train_step(amp, model, opt, *_batch(0), clip=0.5)[0].item() for _ in range(20)]
    assert losses[-1] < losses[0]


def _task(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    return x, (x @ w + 0.3 * torch.randn(1024, 4, generator=g)).argmax(-1)


def _loop(level, half):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
    )
    x, y = _task()
    if level is None:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else:
        amp = Amp(level, half_dtype=half)
        model = amp.prepare_model(model)
        opt = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
    g = torch.Generator().manual_seed(2)
    for _ in range(100):  # the loss falls from ~1.4 to ~0.1; each mixed run lands within 0.3% of FP32
        idx = torch.randint(0, 1024, (64,), generator=g)
        if level is None:
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        else:
            _train_step(amp, model, opt, x[idx], y[idx])
        opt.zero_grad()
    with torch.no_grad():
        out = model(x) if level is None else amp.cast_outputs(model(amp.cast_inputs(x)))
        return F.cross_entropy(out.float(), y).item()


@pytest.fixture(scope="module")
def fp32_loss():
    return _loop(None, None)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_training_loop_reaches_fp32_loss_within_2_percent(level, half, fp32_loss):
    fp32 = fp32_loss
    mixed = _loop(level, half)
    assert abs(mixed - fp32) / fp32 < 0.02, (fp32, mixed)


def test_bad_input_messages():
    with pytest.raises(ValueError, match=r"num_losses=0 must be a positive integer"):
        Amp("O1", num_losses=0, half_dtype="bfloat16")
    with pytest.raises(
        ValueError, match=r"unscale_backend='cuda' is not valid; valid choices: auto, foreach, reference"
    ):
        Amp("O1", unscale_backend="cuda", half_dtype="bfloat16")
    from lightning_mpx import CastTable

    with pytest.raises(ValueError, match=r"cast_table is only used by the cast-table policy.*opt_level='O2'"):
        Amp("O2", cast_table=CastTable.default(), half_dtype="bfloat16")
    amp, model, opt = _setup("O1", half_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"loss_id=1 is out of range; valid choices: 0 to 0"):
        amp.backward(model(_batch()[0]).sum(), loss_id=1)
    with pytest.raises(ValueError, match=r"optimizer=LBFGS"):
        amp.prepare_optimizer(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(RuntimeError, match=r"was not registered; call prepare_optimizer"):
        amp.step(torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.raises(ValueError, match=r"module=ReLU has no floating-point parameters"):
        Amp("O2", half_dtype="bfloat16").prepare_model(nn.ReLU())
    with pytest.raises(RuntimeError, match=r"prepare_model\(\) must run before prepare_optimizer\(\)"):
        Amp("O2", half_dtype="bfloat16").prepare_optimizer(torch.optim.SGD(_net().parameters(), lr=1.0))


def test_update_clears_the_cast_cache_at_the_iteration_boundary():
    amp, model, opt = _setup("O1", half_dtype="bfloat16")
    amp.policy.engine = "mode"  # the Python policy's cache (torch.autocast's lives for one forward scope)
    x, y = _batch()
    with amp.forward_context():
        loss = F.cross_entropy(model(x), y)
    assert amp.policy.cache_size > 0  # the half copies of the weights are cached during the iteration
    amp.backward(loss)
    amp.step(opt)
    amp.update()
    assert amp.policy.cache_size == 0


def test_overflow_messages_are_rate_limited_and_name_parameters(caplog):
    amp, model, opt = _setup("O1", overflow_log_interval=3600.0)
    caplog.set_level("INFO", logger="lightning_mpx")
    for _ in range(3):
        x, y = _batch()
        amp.backward(F.cross_entropy(model(x), y))
        _inject_inf(model)
        assert not amp.step(opt)
        amp.update()
        opt.zero_grad()
    messages = [r.getMessage() for r in caplog.records if r.name == "lightning_mpx"]
    assert len(messages) == 1 and "0.weight" in messages[0] and "skipped" in messages[0]
    assert amp.skipped_steps == [3]
    amp.log_overflows = False  # what adapters set on ranks other than zero
    amp.overflow_log_interval = 0.0
    amp.backward(F.cross_entropy(model(_batch()[0]), _batch()[1]))
    _inject_inf(model)
    amp.step(opt)
    assert len([r for r in caplog.records if r.name == "lightning_mpx"]) == 1


def test_parameter_pairs_follow_a_param_group_added_after_steps():
    # The engine caches (optimizer parameter, model parameter) pairs per optimizer; a group added later must be
    # unscaled and stepped too, its master gradient coming from its own half parameter.
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    amp = Amp("O2", half_dtype="bfloat16", loss_scale=8.0)
    amp.prepare_model(first)
    amp.prepare_model(second)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(first.parameters(), lr=0.1))
    x = torch.randn(2, 4, dtype=torch.bfloat16)

    def step() -> None:
        amp.backward((first(x).float().sum() + second(x).float().sum()))
        assert amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()

    step()
    second.zero_grad()  # its half gradients of the first step were never the optimizer's
    optimizer.add_param_group({"params": list(second.parameters())})  # the model's own half parameters
    masters = [amp.master_of(p) for p in second.parameters()]
    assert all(m.dtype == torch.float32 for m in masters)
    before = [m.detach().clone() for m in masters]
    step()
    assert torch.allclose(masters[0], before[0] - 0.1 * x.float().sum(0).expand(4, 4), atol=1e-2)
    assert torch.allclose(masters[1], before[1] - 0.1 * 2.0)  # d(sum)/d(bias) = batch size
    assert all(p.grad is None for p in second.parameters())  # half gradients dropped once unscaled


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_sparse_gradients_are_refused_with_the_parameters_name(level):
    amp = Amp(level, half_dtype="bfloat16")
    model = amp.prepare_model(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)))
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    with amp.forward_context():
        loss = amp.cast_outputs(model(torch.tensor([1, 2, 3]))).float().sum()
    amp.backward(loss)
    with pytest.raises(ValueError, match=r"parameter 0\.weight has a sparse gradient.*sparse=False"):
        amp.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing was changed
