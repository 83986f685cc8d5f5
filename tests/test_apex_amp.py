"""lightning_mpx.apex.amp: Apex's front end over Amp, semantic by semantic, on CPU."""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_mpx
from lightning_mpx.apex import _amp_state, amp
from lightning_mpx.apex.amp import AmpOptimizer


@pytest.fixture(autouse=True)
def _reset_amp_state():
    yield
    _amp_state.reset()
    _amp_state.registrations.clear()


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y) * 0.01  # small enough that 2**16 times its gradients fit in float16


# -- initialize ---------------------------------------------------------------------------------------------------
def test_shapes_follow_the_arguments():
    m1, m2 = _mlp(), _mlp(1)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    model, opt = amp.initialize(m1, o1, opt_level="O0")
    assert model is m1 and isinstance(opt, AmpOptimizer) and opt.optimizer is o1
    models, opts = amp.initialize([m1, m2], [o1, o2], opt_level="O0")
    assert models == [m1, m2] and [o.optimizer for o in opts] == [o1, o2]
    assert amp.initialize(m1, opt_level="O0") is m1
    assert amp.initialize([m1], opt_level="O0") == [m1]


def test_overrides_are_validated_by_the_core():
    with pytest.raises(ValueError, match="letter O"):
        amp.initialize(_mlp(), opt_level="02")
    with pytest.raises(ValueError, match="loss_scale='big'"):
        amp.initialize(_mlp(), opt_level="O1", loss_scale="big")
    with pytest.raises(TypeError, match="models="):
        amp.initialize("not a model")
    model = amp.initialize(_mlp(), opt_level="O2", keep_batchnorm_fp32="False", loss_scale="128.0")
    assert _amp_state.amp.properties.keep_batchnorm_fp32 is False
    assert _amp_state.loss_scalers[0].loss_scale() == 128.0
    assert next(model.parameters()).dtype == torch.float16


def test_enabled_false_returns_the_objects_and_does_nothing():
    model, opt = _mlp(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m, o = amp.initialize(model, opt, enabled=False, opt_level="O2")
    assert m is model and o is opt and next(model.parameters()).dtype == torch.float32
    loss = torch.tensor(2.0)
    with amp.scale_loss(loss, o) as scaled:
        assert scaled is loss


def test_wrapper_is_an_optimizer_for_schedulers_and_delegates():
    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, inner, opt_level="O2")
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    x, y = _data()
    with amp.scale_loss(_loss(model, x, y), opt) as scaled:
        scaled.backward()
    opt.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    with pytest.raises(RuntimeError, match="step the optimizer amp.initialize"):
        inner.step()  # the raw optimizer refuses a direct step, naming the returned one
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(closure=lambda: 0.0)


# -- O1 casts -------------------------------------------------------------------------------------------------------
def test_o1_policy_is_active_from_initialize_on_this_thread_only():
    amp.initialize(_mlp(), opt_level="O1")
    a = torch.randn(2, 2)
    assert torch.mm(a, a).dtype == torch.float16
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.mm(a, a).dtype))
    thread.start()
    thread.join()
    assert seen == [torch.float32]  # scoped to the initializing thread (why DataParallel runs uncast)
    with amp.disable_casts():
        assert torch.mm(a, a).dtype == torch.float32
    _amp_state.reset()
    assert torch.mm(a, a).dtype == torch.float32


def test_o1_promotion_and_float_list():
    amp.initialize(_mlp(), opt_level="O1")
    a = torch.randn(3)
    assert torch.add(a.half(), a).dtype == torch.float32
    assert torch.softmax(a.half(), 0).dtype == torch.float32


def test_cast_cache_is_cleared_at_the_end_of_each_block():
    model = _mlp()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1")
    policy = _amp_state.amp.policy
    x, y = _data()
    loss = _loss(model, x, y) + _loss(model, x, y)  # the second forward reuses the cached half weights
    assert policy.cache_size > 0
    cached = policy.cache_size
    _loss(model, x, y)
    assert policy.cache_size == cached
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert policy.cache_size == 0


def test_register_functions_and_decorators():
    @amp.half_function
    def identity(t):
        return t

    @amp.float_function
    def identity_float(t):
        return t

    amp.register_promote_function(torch, "mm")  # registration after initialize takes effect as well
    amp.initialize(_mlp(), opt_level="O1")
    a = torch.randn(2, 2)
    assert identity(a).dtype == torch.float16
    assert identity_float(a.half()).dtype == torch.float32
    assert torch.mm(a, a).dtype == torch.float32  # now promoted, no longer half
    amp.register_half_function(torch, "mm")
    assert torch.mm(a, a).dtype == torch.float16
    _amp_state.reset()
    assert identity(a).dtype == torch.float32  # outside amp the decorated function is itself


def test_register_refuses_a_plain_python_function_with_the_decorator_advice():
    import types

    module = types.SimpleNamespace(f=lambda t: t, __name__="mine")
    with pytest.raises(TypeError, match="half_function"):
        amp.register_half_function(module, "f")
    with pytest.raises(ValueError, match="name='g'"):
        amp.register_float_function(module, "g")


def test_tensor_cpu_returns_fp32_as_in_apex():
    amp.initialize(_mlp(), opt_level="O1")
    assert torch.randn(2).half().cpu().dtype == torch.float32
    assert lightning_mpx.CastTable.default().category_of(torch.Tensor.cpu) is None  # the core's default is unchanged


def test_inplace_float_op_on_half_is_refused_as_in_apex():
    amp.initialize(_mlp(), opt_level="O1")
    with pytest.raises(NotImplementedError, match=r"Tensor.exp_ on a torch.float16 tensor.*out-of-place exp\(\)"):
        torch.randn(2).half().exp_()
    x = torch.randn(2)
    x.exp_()  # an FP32 tensor: allowed, as in Apex
    assert torch.randn(2).half().add_(1).dtype == torch.float16  # not a float-list op: allowed


def test_banned_op_gives_the_bce_with_logits_advice():
    amp.initialize(_mlp(), opt_level="O1")
    # Apex raised NotImplementedError; the core's BannedOpError is one, with the same advice.
    assert issubclass(lightning_mpx.BannedOpError, NotImplementedError)
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
        F.binary_cross_entropy(torch.rand(3), torch.rand(3))


# -- scale_loss -----------------------------------------------------------------------------------------------------
def _reference_grads(model: nn.Module, losses) -> list[torch.Tensor]:
    model.zero_grad()
    for fn in losses:
        fn(model).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_two_blocks_accumulate_into_unscaled_master_grads(opt_level):
    reference = _mlp()
    model = copy.deepcopy(reference)
    x, y = _data()
    x2, y2 = _data(2)
    expected = _reference_grads(reference, [lambda m: _loss(m, x, y), lambda m: _loss(m, x2, y2)])
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level)
    for xb, yb in ((x, y), (x2, y2)):
        with amp.scale_loss(_loss(model, xb, yb), opt) as scaled:
            scaled.backward()
        # unscaled at the end of each block, as Apex
        grads = [p.grad for p in amp.master_params(opt)]
        assert all(g.dtype == torch.float32 for g in grads)
    got = [p.grad for p in amp.master_params(opt)]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=2e-3, rtol=2e-2)


def test_delay_unscale_defers_to_the_last_block():
    reference = _mlp()
    model = copy.deepcopy(reference)
    x, y = _data()
    x2, y2 = _data(2)
    expected = _reference_grads(reference, [lambda m: _loss(m, x, y), lambda m: _loss(m, x2, y2)])
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1")
    scale = _amp_state.loss_scalers[0].loss_scale()
    with amp.scale_loss(_loss(model, x, y), opt, delay_unscale=True) as scaled:
        scaled.backward()
    first = next(model.parameters()).grad.clone()
    assert _amp_state.amp.is_unscaled(opt.optimizer) is False  # still scaled
    with amp.scale_loss(_loss(model, x2, y2), opt) as scaled:
        scaled.backward()
    second_only = _reference_grads(copy.deepcopy(reference), [lambda m: _loss(m, x2, y2)])
    torch.testing.assert_close(first / scale, expected[0] - second_only[0], atol=2e-3, rtol=2e-2)
    for g, e in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(g, e, atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_overflow_skips_the_step_backs_off_and_logs_apex_message(opt_level, caplog):
    model = _mlp()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _data()
    with caplog.at_level(logging.INFO, logger="lightning_mpx.apex"):
        with amp.scale_loss(_loss(model, x, y) * float("inf"), opt) as scaled:
            scaled.backward()
    assert "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0" in caplog.text
    opt.step()
    opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert _amp_state.loss_scalers[0].loss_scale() == 32768.0
    with amp.scale_loss(_loss(model, x, y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_verbosity_zero_silences_the_message(caplog):
    model = _mlp()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    x, y = _data()
    with caplog.at_level(logging.INFO, logger="lightning_mpx.apex"):
        with amp.scale_loss(_loss(model, x, y) * float("inf"), opt) as scaled:
            scaled.backward()
    assert "Gradient overflow" not in caplog.text


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_two_models_two_losses_two_optimizers_with_injected_overflow(opt_level):
    m0, m1 = _mlp(0), _mlp(1)
    o0 = torch.optim.SGD(m0.parameters(), lr=0.1)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    (m0, m1), (o0, o1) = amp.initialize([m0, m1], [o0, o1], opt_level=opt_level, num_losses=2)
    x, y = _data()
    p0 = [p.detach().clone() for p in m0.parameters()]
    p1 = [p.detach().clone() for p in m1.parameters()]
    # loss 0 trains model 0 only and is fine; loss 1 reaches both models and overflows: both optimizers it names skip
    with amp.scale_loss(_loss(m0, x, y), o0, loss_id=0) as scaled:
        scaled.backward()
    bad = _loss(m1, x, y) * float("inf") + _loss(m0, x, y) * 0
    with amp.scale_loss(bad, [o0, o1], loss_id=1) as scaled:
        scaled.backward()
    o0.step()
    o1.step()
    assert all(torch.equal(a, b) for a, b in zip(p0, m0.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(p1, m1.parameters()))
    assert _amp_state.loss_scalers[0].loss_scale() == 65536.0
    assert _amp_state.loss_scalers[1].loss_scale() == 32768.0
    # the next iteration steps both
    o0.zero_grad()
    o1.zero_grad()
    with amp.scale_loss(_loss(m0, x, y), o0, loss_id=0) as scaled:
        scaled.backward()
    with amp.scale_loss(_loss(m1, x, y), o1, loss_id=1) as scaled:
        scaled.backward()
    o0.step()
    o1.step()
    assert not torch.equal(p0[0], next(m0.parameters()))
    assert not torch.equal(p1[0], next(m1.parameters()))


def test_three_models_two_losses_one_optimizer_overflow_in_the_second_loss():
    models = [_mlp(i) for i in range(3)]
    params = [p for m in models for p in m.parameters()]
    models, opt = amp.initialize(models, torch.optim.SGD(params, lr=0.1), opt_level="O2", num_losses=2)
    x, y = _data()
    before = [p.detach().clone() for m in models for p in m.parameters()]
    with amp.scale_loss(_loss(models[0], x, y) + _loss(models[1], x, y), opt, loss_id=0) as scaled:
        scaled.backward()
    with amp.scale_loss(_loss(models[2], x, y) * float("inf"), opt, loss_id=1) as scaled:
        scaled.backward()
    opt.step()
    after = [p for m in models for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [65536.0, 32768.0]


# -- masters, add_param_group, checkpoints --------------------------------------------------------------------------
def test_o2_model_state_dict_is_fp32_and_the_masters_exact():
    model = _mlp()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2")
    x, y = _data()
    with amp.scale_loss(_loss(model, x, y), opt) as scaled:
        scaled.backward()
    opt.step()
    state = model.state_dict()
    assert all(v.dtype == torch.float32 for v in state.values())
    masters = list(amp.master_params(opt))
    assert all(torch.equal(state[k], m) for k, m in zip(state, masters))
    assert all(p.dtype == torch.float16 for p in model.parameters())


def test_add_param_group_after_initialize_gets_masters():
    model = _mlp()
    model, opt = amp.initialize(model, torch.optim.SGD(model[0].parameters(), lr=0.1), opt_level="O2")
    opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.1})
    masters = list(amp.master_params(opt))
    assert len(masters) == 4 and all(m.dtype == torch.float32 for m in masters)
    before = model[2].weight.detach().clone()
    x, y = _data()
    with amp.scale_loss(_loss(model, x, y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(before, model[2].weight)


def test_amp_state_dict_is_apex_format_and_loads_an_apex_checkpoint():
    model = _mlp()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", num_losses=2)
    state = amp.state_dict()
    assert state["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 0}
    assert set(state) == {"loss_scaler0", "loss_scaler1", "lightning_mpx"}
    apex_ckpt = {
        "loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7},
        "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0},
    }
    amp.load_state_dict(apex_ckpt)
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [1024.0, 8.0]
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1024.0, "unskipped": 7}
    with pytest.raises(ValueError, match="num_losses=2"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})
    with pytest.raises(ValueError, match="unexpected keys"):
        amp.load_state_dict({**apex_ckpt, "junk": 1})


def _train(model, opt, steps, seed):
    for i in range(steps):
        x, y = _data(seed + i)
        with amp.scale_loss(_loss(model, x, y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()


def _apex_o2_run():
    model = _mlp()
    model, opt = amp.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2), opt_level="O2")
    return model, opt


def test_o2_checkpoint_resumes_bit_exactly():
    model, opt = _apex_o2_run()
    _train(model, opt, 3, 10)
    ckpt = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()})
    _train(model, opt, 3, 20)
    expected = [m.detach().clone() for m in amp.master_params(opt)]
    saved = copy.deepcopy(ckpt)

    model, opt = _apex_o2_run()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    _train(model, opt, 3, 20)
    assert all(torch.equal(a, b) for a, b in zip(expected, amp.master_params(opt)))

    # the model's FP32 state dict alone (without the amp entry) restores the masters exactly too
    ckpt = copy.deepcopy(saved)  # the optimizer loads the checkpoint's tensors without copying them
    model, opt = _apex_o2_run()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict({k: v for k, v in ckpt["amp"].items() if k != "lightning_mpx"})
    _train(model, opt, 3, 20)
    assert all(torch.equal(a, b) for a, b in zip(expected, amp.master_params(opt)))


def _core_train(core, model, opt, steps, seed):
    for i in range(steps):
        x, y = _data(seed + i)
        with core.forward_context():
            loss = F.mse_loss(core.cast_outputs(model(core.cast_inputs(x))), y) * 0.01
        core.backward(loss)
        core.step(opt)
        core.update()
        opt.zero_grad()


def _core_run():
    core = lightning_mpx.Amp("O2", half_dtype="float16")  # Apex's dtype: its checkpoints are float16
    model = core.prepare_model(_mlp())
    opt = core.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    return core, model, opt


def test_apex_checkpoint_resumes_through_the_core_and_the_reverse():
    # Apex layer -> core
    model, opt = _apex_o2_run()
    _train(model, opt, 3, 10)
    ckpt = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()})
    _train(model, opt, 3, 20)
    expected = [m.detach().clone() for m in amp.master_params(opt)]
    _amp_state.reset()
    core, cmodel, copt = _core_run()
    cmodel.load_state_dict(ckpt["model"])
    copt.load_state_dict(ckpt["optimizer"])
    core.load_state_dict(ckpt["amp"]["lightning_mpx"])
    _core_train(core, cmodel, copt, 3, 20)
    assert all(torch.equal(a, b) for a, b in zip(expected, core.master_params(copt)))

    # core -> Apex layer
    core, cmodel, copt = _core_run()
    _core_train(core, cmodel, copt, 3, 10)
    ckpt = copy.deepcopy({"model": cmodel.state_dict(), "optimizer": copt.state_dict(), "amp": core.state_dict()})
    _core_train(core, cmodel, copt, 3, 20)
    expected = [m.detach().clone() for m in core.master_params(copt)]
    model, opt = _apex_o2_run()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    _train(model, opt, 3, 20)
    assert all(torch.equal(a, b) for a, b in zip(expected, amp.master_params(opt)))


def test_amp_state_loss_scalers_and_reset_undoes_hooks():
    model = _mlp()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2")
    assert amp._amp_state is _amp_state
    assert _amp_state.loss_scalers[0].loss_scale() == 65536.0
    model2 = amp.initialize(_mlp(), opt_level="O0")
    assert model2(torch.randn(1, 4)).dtype == torch.float32
    assert model(torch.randn(1, 4)).dtype == torch.float32  # a later initialize leaves the first model's casts
    _amp_state.reset()
    with pytest.raises(RuntimeError, match="same dtype"):
        model(torch.randn(1, 4))  # reset() undoes every call's hooks


def test_reset_from_another_thread_or_under_another_mode_is_refused():
    amp.initialize(_mlp(), opt_level="O1")
    errors = []

    def other():
        try:
            _amp_state.reset()
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert errors and "another thread" in errors[0]

    class PassThrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with PassThrough():
        with pytest.raises(RuntimeError, match="innermost"):
            amp.initialize(_mlp(), opt_level="O1")
    _amp_state.reset()
    assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_delayed_block_after_an_unscaled_one_then_step(opt_level):
    reference = _mlp()
    model = copy.deepcopy(reference)
    before = [p.detach().clone() for p in reference.parameters()]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = _data()
    x2, y2 = _data(2)
    _reference_grads(reference, [lambda m: _loss(m, x, y), lambda m: _loss(m, x2, y2)])
    ref_opt.step()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level)
    start = [m.detach().clone() for m in amp.master_params(opt)]  # at O2 the half weights' values
    with amp.scale_loss(_loss(model, x, y), opt) as scaled:
        scaled.backward()
    with amp.scale_loss(_loss(model, x2, y2), opt, delay_unscale=True) as scaled:
        scaled.backward()
    opt.step()  # unscales the delayed block and adds the first block's gradients
    for p, s, r, b in zip(amp.master_params(opt), start, reference.parameters(), before):
        torch.testing.assert_close(p - s, r.detach() - b, atol=2e-5, rtol=3e-2)  # the update, not the weights


class _MixedModel(nn.Module):
    """The user made the first layer half and kept the second FP32 (what cast_model_type=False is for)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 8).half()
        self.second = nn.Linear(8, 2)

    def forward(self, x):
        return self.second(torch.relu(self.first(x.half())).float())


def test_o2_with_cast_model_type_false_keeps_the_model_and_masters_its_half_parameters():
    model = _MixedModel()
    model, opt = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", cast_model_type=False
    )
    assert [p.dtype for p in model.parameters()] == [torch.float16] * 2 + [torch.float32] * 2
    params, masters = list(model.parameters()), list(amp.master_params(opt))
    assert all(m.dtype == torch.float32 for m in masters)
    assert masters[0] is not params[0] and masters[2] is params[2]
    x, y = _data()
    assert model(x).dtype == torch.float32  # no boundary hooks: the model's own forward decides
    before = [p.detach().clone() for p in params]
    with amp.scale_loss(_loss(model, x, y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    # O1 (no masters) with cast_model_type=False: the model is left alone too
    model = amp.initialize(_MixedModel(), opt_level="O1", cast_model_type=False)
    assert next(model.parameters()).dtype == torch.float16


def test_apex_scaler_entries_round_trip():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    model = _mlp()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1")

    @settings(max_examples=30, deadline=None)
    @given(exponent=st.integers(0, 24), unskipped=st.integers(0, 1999))
    def round_trip(exponent, unskipped):
        entry = {"loss_scale": float(2.0**exponent), "unskipped": unskipped}
        amp.load_state_dict({"loss_scaler0": entry})
        assert amp.state_dict()["loss_scaler0"] == entry
        assert _amp_state.loss_scalers[0].loss_scale() == entry["loss_scale"]

    round_trip()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_master_params_costs_no_python_call_per_parameter(opt_level: str) -> None:
    """``clip_grad_norm_(amp.master_params(opt), c)`` after each block is Apex's clip habit: the list of what the
    optimizer updates is made by C-level maps (a generator cost a Python call per parameter, two at O1), the same
    tensors as the groups' (O1) or their FP32 masters (O2); a bad argument is refused at the call."""
    import sys

    counts = []
    for width in (2, 8):
        _amp_state.reset()
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(width)])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
        with amp.scale_loss(model(torch.randn(2, 4, dtype=next(model.parameters()).dtype)).float().sum(), opt) as s:
            s.backward()
        calls = [0]

        def profile(frame, event, arg, calls=calls):
            calls[0] += event == "call"

        sys.setprofile(profile)
        try:
            params = list(amp.master_params(opt))
        finally:
            sys.setprofile(None)
        counts.append(calls[0])
        assert len(params) == 2 * width and all(p.grad is not None and p.dtype == torch.float32 for p in params)
        if opt_level == "O1":
            assert all(p is q for p, q in zip(params, model.parameters()))
        opt.step()
    assert counts[0] == counts[1], counts
    with pytest.raises(TypeError, match="optimizer="):
        amp.master_params(model)


def _cast_mode_calls(run) -> int:
    """How many torch calls made by ``run()`` went through a cast policy's torch-function mode (its
    ``__torch_function__``: two Python calls each, with the table's lookup)."""
    import sys

    from lightning_mpx.casting.mode import _CastMode

    code = _CastMode.__torch_function__.__code__
    calls = [0]

    def profile(frame, event, arg):
        calls[0] += event == "call" and frame.f_code is code

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls[0]


def test_o1_unscale_step_and_zero_grad_pay_no_cast_mode_call_per_torch_call() -> None:
    """Apex's O1 is one cast scope for the whole run, so the layer's own unscale at a block's end, the optimizer's
    step (with casts off) and its zero_grad met the O1 mode at every torch call (115 times in this loop's first step
    without the zero_grad; the core O1 loop, whose scope is the forward alone: 0), two Python calls each and more: the
    census's GPT step made 921 Python calls, now 494 (core O1: 403). They now run with the mode set aside, as the core
    loop's do, and train exactly as before (float16 Adam, an overflowing step skipped, bit for bit the core O1 loop's
    weights)."""
    results = {}
    for front in ("core", "apex"):
        _amp_state.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if front == "apex":
            model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
        else:
            core = lightning_mpx.Amp("O1", half_dtype=torch.float16)
            model, opt = core.prepare_model(model), core.prepare_optimizer(opt)
        modes = []
        for i in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) * (1e6 if i == 2 else 1.0)
            if front == "apex":
                block = amp.scale_loss(F.cross_entropy(model(x), torch.tensor([0, 1, 0, 1])), opt)
                block.__enter__().backward()
                modes.append(_cast_mode_calls(lambda: (block.__exit__(None, None, None), opt.step(), opt.zero_grad())))
            else:
                with core.forward_context():
                    loss = F.cross_entropy(model(x), torch.tensor([0, 1, 0, 1]))
                core.backward(loss)
                modes.append(_cast_mode_calls(lambda: (core.step(opt), core.update(), opt.zero_grad())))
        results[front] = modes, [p.detach().clone() for p in model.parameters()]
    _amp_state.reset()
    assert results["apex"][0] == results["core"][0] == [0, 0, 0, 0]
    for got, ref in zip(results["apex"][1], results["core"][1]):
        assert torch.equal(got, ref)
