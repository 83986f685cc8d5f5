"""What Apex's own tests (tests/L0/run_amp) hold ``lightning_mpx.apex`` to, tested here against FP32 references:
the older ``amp.init()`` handle API, ``_amp_state.handle`` and ``opt_properties``, several models, losses and
optimizers with an injected overflow, the O1 cast cache, ``add_param_group`` at O1, and a run restored beside the
one it was saved from."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_mpx
from lightning_mpx.apex import _amp_state, amp
from lightning_mpx.apex.amp import AmpHandle, NoOpHandle


@pytest.fixture(autouse=True)
def _reset_amp_state():
    yield
    _amp_state.reset()


class _Pair(nn.Module):
    """``sum(x * a * b)`` with an FP32 parameter ``a`` and a parameter ``b`` the user made float16. Small integers
    and power-of-two learning rates keep every gradient and SGD update exact in both dtypes, so a mixed-precision
    run can be held to its FP32 twin exactly."""

    def __init__(self, offset: float, half: bool = True) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor([1.0, 2.0]) + offset)
        self.b = nn.Parameter((torch.tensor([2.0, 3.0]) + offset).to(torch.float16 if half else torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.a * self.b.float()).sum()


_X = torch.ones(2)


def _params(*models: nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().clone() for m in models for p in m.parameters()]


def _zero(models: list[nn.Module], optimizers: list, how: str) -> None:
    if how == "grad=None":
        for model in models:
            for param in model.parameters():
                param.grad = None
    else:
        for optimizer in optimizers:
            optimizer.zero_grad()


def _set_scales(*scales: float) -> None:
    # Apex scripts (and Apex's tests) set the scale through the scaler's attribute.
    for view, scale in zip(_amp_state.loss_scalers, scales):
        view._loss_scale = scale


# -- amp.init() and its handle ---------------------------------------------------------------------------------------
def test_init_turns_o1_casts_on_for_this_thread_until_the_handle_is_deactivated():
    a = torch.randn(4, 4)
    handle = amp.init()
    assert isinstance(handle, AmpHandle) and _amp_state.handle is handle and handle.is_active()
    assert torch.mm(a, a).dtype == torch.float16  # whitelist: half
    assert torch.softmax(a.half(), 0).dtype == torch.float32  # blacklist: FP32
    assert torch.add(a.half(), a).dtype == torch.float32  # promote: widest
    with handle._disable_casts():
        assert torch.mm(a, a).dtype == torch.float32
    handle._deactivate()
    handle._deactivate()  # twice is harmless, as in Apex
    assert not handle.is_active() and torch.mm(a, a).dtype == torch.float32


def test_init_bans_binary_cross_entropy_on_half_unless_allowed():
    p = torch.rand(4, dtype=torch.float16)
    amp.init()
    with pytest.raises(NotImplementedError):
        F.binary_cross_entropy(p, torch.rand(4))
    _amp_state.handle._deactivate()
    amp.init(allow_banned=True)
    assert F.binary_cross_entropy(p, torch.rand(4)).dtype == torch.float32


def test_init_disabled_returns_a_handle_that_changes_nothing():
    model = _Pair(0.0, half=False)
    handle = amp.init(enabled=False)
    assert isinstance(handle, NoOpHandle) and not handle.is_active()
    assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32
    opt = handle.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.25))
    loss = model(_X)
    with opt.scale_loss(loss) as scaled:
        assert scaled is loss
        scaled.backward()
    opt.step()
    assert torch.equal(model.a.detach(), torch.tensor([1.0, 2.0]) - 0.25 * torch.tensor([2.0, 3.0]))


def test_wrap_optimizer_trains_like_fp32_and_skips_an_overflowed_step():
    """The first API: handle.wrap_optimizer() and optimizer.scale_loss(loss), through the same engine."""
    reference = _Pair(0.0, half=False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.25, momentum=0.5)
    model = _Pair(0.0, half=False)
    handle = amp.init()
    opt = handle.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5))
    assert _amp_state.amp.master_params(opt.optimizer) == list(model.parameters())  # registered with the engine
    for step in range(4):
        opt.zero_grad()
        with opt.scale_loss(model(_X)) as scaled:
            scaled.backward()
            if step == 1:
                model.a.grad[0] = float("inf")
        opt.step()
        if step != 1:  # the reference skips that batch
            ref_opt.zero_grad()
            reference(_X).backward()
            ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(reference)))
    assert _amp_state.loss_scalers[0].loss_scale() == 32768.0
    # handle.scale_loss needs the wrapped optimizer: nothing patches a plain optimizer's step to skip
    with pytest.raises(TypeError, match="wrap_optimizer"):
        with handle.scale_loss(model(_X), opt.optimizer):
            pass
    with handle.scale_loss(model(_X), opt) as scaled:
        assert torch.equal(scaled, model(_X) * 32768.0)
    amp.init()  # a later init replaces the handle
    with pytest.raises(RuntimeError, match="earlier amp.init"):
        handle.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.25))


def test_amp_state_handle_of_initialize_at_o1_and_training_after_deactivate():
    model = _Pair(0.0, half=False)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.25), opt_level="O1", verbosity=0)
    handle = _amp_state.handle
    assert isinstance(handle, AmpHandle) and handle.is_active()
    handle._deactivate()
    assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32
    with amp.scale_loss(model(_X), opt) as scaled:  # the engine and its scaler stay
        assert torch.equal(scaled, model(_X) * 65536.0)
        scaled.backward()
    opt.step()
    assert torch.equal(model.a.detach(), torch.tensor([0.5, 1.25]))
    amp.initialize(_Pair(0.0, half=False), opt_level="O2", cast_model_type=False)
    assert _amp_state.handle is None  # no O1 scope, no handle (Apex made one at O1 only)


@pytest.mark.parametrize(
    ("opt_level", "loss_scale", "master_weights", "cast_model_type"),
    [("O0", 1.0, False, torch.float32), ("O1", "dynamic", False, None), ("O2", "dynamic", True, torch.float16),
     ("O3", 1.0, False, torch.float16)],
)
def test_opt_properties_reads_what_initialize_resolved(opt_level, loss_scale, master_weights, cast_model_type):
    with pytest.raises(AttributeError, match="initialize"):
        _amp_state.opt_properties  # noqa: B018 - before initialize, as in Apex
    amp.initialize(nn.Linear(2, 2), opt_level=opt_level)
    props = _amp_state.opt_properties
    assert props.enabled and props.opt_level == opt_level
    assert (props.loss_scale, props.master_weights, props.cast_model_type) == (loss_scale, master_weights,
                                                                               cast_model_type)
    amp.initialize(nn.Linear(2, 2), opt_level=opt_level, loss_scale=128.0)
    assert _amp_state.opt_properties.loss_scale == 128.0
    amp.initialize(nn.Linear(2, 2), enabled=False)
    assert _amp_state.opt_properties.enabled is False


def test_loss_scale_attribute_sets_the_scale_used():
    model = _Pair(0.0, half=False)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.25), opt_level="O1", num_losses=2)
    _set_scales(4.0, 16.0)
    assert [v.loss_scale() for v in _amp_state.loss_scalers] == [4.0, 16.0]
    assert _amp_state.loss_scalers[1]._loss_scale == 16.0
    loss = model(_X)
    with amp.scale_loss(loss, opt, loss_id=1) as scaled:
        assert torch.equal(scaled, loss * 16.0)
    for bad in (0.0, -4.0, float("inf"), "4"):
        with pytest.raises(ValueError, match=r"_loss_scale=.* must be a positive finite number"):
            _amp_state.loss_scalers[0]._loss_scale = bad


# -- several models, losses and optimizers, an injected overflow -------------------------------------------------------
def _reference_two_models(skip_iteration: int | None, skip: tuple[int, ...] = (0, 1)) -> tuple[list, list]:
    """FP32 twins of two _Pair models, one SGD per model, two iterations that step (the skipped one does not step the
    optimizers in ``skip``). Returns the gradients each stepping iteration saw and the final parameters."""
    m0, m1 = _Pair(1.0, half=False), _Pair(2.0, half=False)
    opts = [torch.optim.SGD(m0.parameters(), lr=0.25, momentum=0.125),
            torch.optim.SGD(m1.parameters(), lr=0.5, momentum=0.25)]
    grads = []
    for i in range(3 if skip_iteration is not None else 2):
        for o in opts:
            o.zero_grad()
        m0(_X).backward()
        m1(_X).backward()
        if i == skip_iteration:
            for k, o in enumerate(opts):
                if k not in skip:
                    o.step()
            continue
        grads.append([p.grad.clone() for m in (m0, m1) for p in m.parameters()])
        for o in opts:
            o.step()
    return grads, _params(m0, m1)


@pytest.mark.parametrize("how", ["grad=None", "zero_grad"])
@pytest.mark.parametrize("where", ["half", "fp32"])
@pytest.mark.parametrize("num_losses", [1, 2])
def test_o2_two_losses_one_optimizer_overflow_then_zeroing_leaves_no_inf(how, where, num_losses):
    """The overflow skips iteration 0; the next iterations zero (``p.grad = None`` as Apex's tests do) and must see
    their own gradients only, as the FP32 twin that skipped iteration 0. Before, the master gradients of the first
    block came back after the zeroing, with their inf."""
    m0, m1 = _Pair(1.0), _Pair(2.0)
    opt = torch.optim.SGD([{"params": m0.parameters(), "lr": 0.25}, {"params": m1.parameters(), "lr": 0.5}],
                          momentum=0.125)
    (m0, m1), opt = amp.initialize([m0, m1], opt, opt_level="O2", cast_model_type=False, num_losses=num_losses,
                                   verbosity=0)
    _set_scales(4.0, 16.0)
    twin = [_Pair(1.0, half=False), _Pair(2.0, half=False)]
    twin_opt = torch.optim.SGD([{"params": twin[0].parameters(), "lr": 0.25},
                                {"params": twin[1].parameters(), "lr": 0.5}], momentum=0.125)
    for i in range(3):
        _zero([m0, m1], [opt], how)
        for k, model in enumerate((m0, m1)):
            with amp.scale_loss(model(_X), opt, loss_id=k % num_losses) as scaled:
                scaled.backward()
                if i == 0 and k == 0:
                    (m0.b if where == "half" else m0.a).grad[0] = float("inf")
        if i > 0:
            twin_opt.zero_grad()
            (twin[0](_X) + twin[1](_X)).backward()
            grads = [p.grad for p in amp.master_params(opt)]
            assert all(torch.equal(g, p.grad) for g, p in zip(grads, [*twin[0].parameters(), *twin[1].parameters()]))
            twin_opt.step()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(_params(m0, m1), _params(*twin)))
    assert all(torch.equal(m, p.float()) for m, p in zip(amp.master_params(opt), [*m0.parameters(), *m1.parameters()]))


@pytest.mark.parametrize("front_door", ["core", "apex"])
def test_grad_none_after_a_skipped_overflow_leaves_no_inf_in_the_masters(front_door):
    """Whatever the front door: an overflow skips the step, ``p.grad = None`` zeroes, and the next steps use their
    own iteration's gradients only (FP32 twin), at O2 with two losses."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    data = [torch.randn(5, 3) for _ in range(3)]
    if front_door == "core":
        core = lightning_mpx.Amp("O2", num_losses=2, init_scale=8.0, half_dtype="float16")
        model = core.prepare_model(model)
        opt = core.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    else:
        model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), opt_level="O2",
                                    num_losses=2, verbosity=0)
        _set_scales(8.0, 8.0)
    for i, x in enumerate(data):
        for param in model.parameters():
            param.grad = None
        for loss_id, part in enumerate((slice(0, 1), slice(1, 2))):
            if front_door == "core":
                core.backward(core.cast_outputs(model(core.cast_inputs(x)))[:, part].sum(), loss_id=loss_id)
                if i == 0 and loss_id == 0:
                    model[0].weight.grad[0, 0] = float("inf")
            else:
                with amp.scale_loss(model(x)[:, part].sum(), opt, loss_id=loss_id) as scaled:
                    scaled.backward()
                    if i == 0 and loss_id == 0:
                        model[0].weight.grad[0, 0] = float("inf")
        if front_door == "core":
            assert core.step(opt) is (i > 0)
            core.update()
        else:
            opt.step()
        if i > 0:
            ref_opt.zero_grad()
            reference(x).sum().backward()
            ref_opt.step()
    masters = [core.master_of(p) for p in model.parameters()] if front_door == "core" else list(
        amp.master_params(opt))
    assert all(torch.isfinite(m).all() for m in masters)
    torch.testing.assert_close(masters, list(reference.parameters()), rtol=0, atol=1e-2)


def test_o1_an_optimizer_not_named_in_a_block_keeps_its_unscaled_gradients():
    """Block 0 names optimizer 0, block 1 optimizer 1: after both, each optimizer's gradients are the true ones (the
    second block's backward must not leave optimizer 0's scaled by its own scale)."""
    ref_grads, ref_final = _reference_two_models(None)
    m0, m1 = _Pair(1.0), _Pair(2.0)
    opts = [torch.optim.SGD(m0.parameters(), lr=0.25, momentum=0.125),
            torch.optim.SGD(m1.parameters(), lr=0.5, momentum=0.25)]
    (m0, m1), opts = amp.initialize([m0, m1], opts, opt_level="O1", cast_model_type=False, num_losses=2, verbosity=0)
    _set_scales(4.0, 16.0)
    for i in range(2):
        _zero([m0, m1], opts, "grad=None")
        for k, model in enumerate((m0, m1)):
            with amp.scale_loss(model(_X), opts[k], loss_id=k) as scaled:
                scaled.backward()
        grads = [p.grad.float() for o in opts for p in amp.master_params(o)]
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads[i])), grads
        for o in opts:
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(_params(m0, m1), ref_final))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_one_scaler_two_blocks_only_the_overflowing_block_skips_what_it_names(opt_level):
    """One loss scaler; block 0 names optimizer 0 and overflows, block 1 names both and does not: optimizer 0 skips,
    optimizer 1 steps (as the FP32 twin that skips only optimizer 0's step)."""
    _, ref_final = _reference_two_models(0, skip=(0,))
    m0, m1 = _Pair(1.0), _Pair(2.0)
    opts = [torch.optim.SGD(m0.parameters(), lr=0.25, momentum=0.125),
            torch.optim.SGD(m1.parameters(), lr=0.5, momentum=0.25)]
    (m0, m1), opts = amp.initialize([m0, m1], opts, opt_level=opt_level, cast_model_type=False, verbosity=0)
    _set_scales(4.0)
    for i in range(3):
        _zero([m0, m1], opts, "grad=None")
        with amp.scale_loss(m0(_X), opts[0]) as scaled:
            scaled.backward()
            if i == 0:
                m0.b.grad[0] = float("inf")
        with amp.scale_loss(m1(_X), opts) as scaled:
            scaled.backward()
        for o in opts:
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(_params(m0, m1), ref_final))
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0  # one backoff, for the one overflow


# -- O1: the cast cache, add_param_group -------------------------------------------------------------------------------
class _Chain(nn.Module):
    """``sum((x @ w) @ w)``: one weight, used twice in a forward, whose half cast O1 caches."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(16.0).view(4, 4).div(8).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x @ self.w) @ self.w).sum()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_o1_cast_cache_gives_the_fp32_gradient_across_train_eval_train(dtype):
    x = torch.ones(2, 4)
    model = _Chain(dtype)
    _amp_state.allow_incoming_model_not_fp32 = True  # as Apex's test_cache: a half model on purpose
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), opt_level="O1", verbosity=0)
    _amp_state.allow_incoming_model_not_fp32 = False
    _set_scales(4.0)  # the half gradients (up to ~80) times Apex's 65536 would overflow float16
    for phase in range(2):
        model.w.grad = None
        with amp.scale_loss(model(x), opt) as scaled:
            scaled.backward()
        w32 = model.w.detach().float().requires_grad_()
        ((x @ w32) @ w32).sum().backward()  # FP32 reference, outside the cache
        assert model.w.grad.dtype == dtype
        assert torch.equal(model.w.grad.float(), w32.grad)
        with torch.no_grad():
            model.w.data -= 1.0  # a write the next forward's cast must see
            model(x)  # an evaluation forward in between, as in a validation loop


@pytest.mark.parametrize("zero_before_add", [True, False])
@pytest.mark.parametrize("how", ["grad=None", "zero_grad"])
def test_o1_add_param_group_trains_the_new_group_like_fp32(zero_before_add, how):
    ref0, ref1 = _Pair(1.0, half=False), _Pair(2.0, half=False)
    m0, m1 = _Pair(1.0), _Pair(2.0)
    ref_opt = torch.optim.SGD([{"params": ref0.parameters(), "lr": 0.25}], momentum=0.125)
    opt = torch.optim.SGD([{"params": m0.parameters(), "lr": 0.25}], momentum=0.125)
    (m0, m1), opt = amp.initialize([m0, m1], opt, opt_level="O1", cast_model_type=False, verbosity=0)
    _set_scales(4.0)
    for models, optimizer, mixed in (([ref0, ref1], ref_opt, False), ([m0, m1], opt, True)):
        def backward(loss: torch.Tensor) -> None:
            if mixed:
                with amp.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
            else:
                loss.backward()

        _zero(models, [optimizer], how)
        backward(models[0](_X))
        optimizer.step()
        if zero_before_add:
            _zero(models, [optimizer], how)
        optimizer.add_param_group({"params": models[1].parameters(), "lr": 0.5})
        if not zero_before_add:
            _zero(models, [optimizer], how)
        for _ in range(2):
            backward(models[0](_X) + models[1](_X))
            optimizer.step()
            _zero(models, [optimizer], how)
    assert all(torch.equal(a, b) for a, b in zip(_params(m0, m1), _params(ref0, ref1)))


# -- a second initialize: a run restored beside the one it came from ---------------------------------------------------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def _step(model: nn.Module, opt, x: torch.Tensor, y: torch.Tensor, loss_id: int = 0) -> None:
    opt.zero_grad()
    loss = F.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
    opt.step()


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("initialize_first", [True, False])
def test_restored_run_trains_beside_the_original_bit_exactly(opt_level, initialize_first):
    """Apex's resume recipe in one process: the original run goes on after a second ``initialize`` (for the restored
    run, before or after loading the checkpoint); both then train in lockstep, bit for bit."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(6)]
    model = _Net()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                opt_level=opt_level, num_losses=2, verbosity=0)
    for x, y in batches[:3]:
        _step(model, opt, x, y, loss_id=0)
    ckpt = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    assert all(v.dtype == torch.float32 for k, v in ckpt["model"].items() if "num_batches" not in k)
    restored = _Net()
    restored_opt = torch.optim.SGD(restored.parameters(), lr=0.05, momentum=0.9)
    if initialize_first:
        restored, restored_opt = amp.initialize(restored, restored_opt, opt_level=opt_level, num_losses=2,
                                                verbosity=0)
    restored.load_state_dict(ckpt["model"])
    restored_opt.load_state_dict(ckpt["optimizer"])
    if not initialize_first:
        restored, restored_opt = amp.initialize(restored, restored_opt, opt_level=opt_level, num_losses=2,
                                                verbosity=0)
    for x, y in batches[3:]:
        _step(model, opt, x, y, loss_id=0)
        _step(restored, restored_opt, x, y, loss_id=1)
        a, b = model.state_dict(), restored.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(m, r) for m, r in zip(amp.master_params(opt), amp.master_params(restored_opt)))


def test_a_second_initialize_gives_the_earlier_optimizers_fresh_scalers_as_apex():
    """Apex's loss scalers were global: a second initialize replaced them for every optimizer."""
    model = _Pair(0.0, half=False)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.25), opt_level="O1", verbosity=0)
    with amp.scale_loss(model(_X) * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()
    with amp.scale_loss(model(_X), opt) as scaled:
        assert torch.equal(scaled, model(_X) * 32768.0)
    opt.step()
    other = _Pair(0.0, half=False)
    amp.initialize(other, torch.optim.SGD(other.parameters(), lr=0.25), opt_level="O1", verbosity=0)
    opt.zero_grad()
    with amp.scale_loss(model(_X), opt) as scaled:
        assert torch.equal(scaled, model(_X) * 65536.0)
    opt.step()


def test_a_second_initialize_keeps_the_first_models_hooks_and_drops_them_for_a_model_given_again():
    model = nn.Linear(4, 2)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    amp.initialize(nn.Linear(4, 2), opt_level="O0")
    out = model(torch.randn(3, 4))  # still casts its FP32 input to half, and its output back
    assert out.dtype == torch.float32 and model.weight.dtype == torch.float16
    with amp.scale_loss(out.sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    hooks = len(model._forward_pre_hooks)
    model, opt2 = amp.initialize(model, opt.optimizer, opt_level="O2", verbosity=0)
    assert len(model._forward_pre_hooks) == hooks  # the first call's hooks went before the new ones came
    with pytest.raises(RuntimeError, match="later amp.initialize"):
        opt.step()  # the first wrapper of the optimizer given again
    with pytest.raises(ValueError, match="later amp.initialize"):
        with amp.scale_loss(model(torch.randn(3, 4)).sum(), opt):
            pass


def test_an_earlier_run_keeps_scaling_after_a_disabled_initialize():
    reference = _Pair(0.0, half=False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.25)
    model = _Pair(0.0)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.25), opt_level="O2",
                                cast_model_type=False, verbosity=0)
    _set_scales(4.0)
    other = _Pair(0.0, half=False)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.25)
    amp.initialize(other, other_opt, enabled=False)
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(model(_X), opt) as scaled:  # the first run's scale, unscaled at its step
            assert torch.equal(scaled, model(_X) * 4.0)
            scaled.backward()
        opt.step()
        ref_opt.zero_grad()
        reference(_X).backward()
        ref_opt.step()
        with amp.scale_loss(other(_X), other_opt) as scaled:  # the disabled call's: unscaled
            assert torch.equal(scaled, other(_X))
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(reference)))


def test_an_earlier_run_the_script_dropped_is_not_kept_alive():
    model = nn.Linear(4, 2)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    alive = [weakref.ref(model), weakref.ref(model.weight), weakref.ref(list(amp.master_params(opt))[0])]
    amp.initialize(nn.Linear(4, 2), torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1), opt_level="O2")
    del model, opt
    gc.collect()
    assert [ref() for ref in alive] == [None, None, None]  # the module, its weight and the weight's FP32 master


def test_o3_state_dict_is_fp32_and_loads_back_into_an_o3_model():
    model = amp.initialize(_Net(), opt_level="O3")
    state = model.state_dict()
    assert all(v.dtype == torch.float32 for k, v in state.items() if "num_batches" not in k)
    other = amp.initialize(_Net(), opt_level="O3")
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_o2_masters_take_the_fp32_values_in_one_process_and_the_half_rounding_under_torch_distributed(
    tmp_path, monkeypatch
):
    """A checkpoint loaded before initialize gives exact masters; under a process group of several ranks the masters
    stay the half rounding, which DDP's broadcast of rank 0's half weights keeps equal on every rank (the group here
    has one rank, which alone trains as one process: it is told it has two)."""
    torch.manual_seed(0)
    weight = nn.Linear(4, 4).weight.detach().clone()

    def masters_after_initialize() -> torch.Tensor:
        model = nn.Linear(4, 4)
        with torch.no_grad():
            model.weight.copy_(weight)
        model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2")
        return list(amp.master_params(opt))[0].detach().clone()

    assert not torch.equal(weight.half().float(), weight)
    assert torch.equal(masters_after_initialize(), weight)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert torch.equal(masters_after_initialize(), weight)  # one rank: as one process
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
        assert torch.equal(masters_after_initialize(), weight.half().float())
    finally:
        torch.distributed.destroy_process_group()


def _ema_run(with_ema: bool, tmp_path) -> tuple[list[torch.Tensor], dict[str, torch.Tensor] | None]:
    """timm's Apex recipe: ``amp.initialize`` at O2, then an EMA copy made with ``copy.deepcopy`` and updated after
    each step, its ``state_dict()`` saved, and at the end that checkpoint loaded back into a new copy (a resume)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    ema = copy.deepcopy(model) if with_ema else None
    saved = None
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        with amp.scale_loss(F.mse_loss(model(x), y), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
        if ema is not None:
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.mul_(0.5).add_(p, alpha=0.5)
            if step == 3:
                torch.save(ema.state_dict(), tmp_path / "ema.pt")
                saved = {k: v.float() for k, v in ema.state_dict().items()}
                expected = {k: v.detach().float() for k, v in ema.named_parameters()}
                assert saved.keys() == expected.keys()
                for key in saved:  # the copy's own values, not the model's masters
                    assert torch.equal(saved[key], expected[key]), key
                restored = copy.deepcopy(model)  # a resume loads the EMA checkpoint into a fresh copy
                restored.load_state_dict(torch.load(tmp_path / "ema.pt"))
    return [p.detach().clone() for p in amp.master_params(optimizer)], saved


def test_an_ema_copy_made_after_initialize_saves_its_own_weights_and_loading_it_leaves_the_masters(tmp_path):
    """A ``copy.deepcopy`` of an O2 model carries its state-dict hooks; they act on the copy: its ``state_dict()``
    holds its own values, and loading a state dict into it leaves the model's FP32 masters alone. Training is bit
    for bit the run without the EMA copy."""
    masters_with, saved = _ema_run(True, tmp_path)
    _amp_state.reset()
    masters_without, _ = _ema_run(False, tmp_path)
    assert saved is not None
    for a, b in zip(masters_with, masters_without):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_a_model_after_initialize_pickles_and_runs_where_apex_could_not(tmp_path):
    """Apex patched ``model.forward`` with a closure, so ``torch.save(model)`` failed after ``initialize``; the
    hooks here pickle. The loaded model casts its inputs to half and its outputs to FP32 as before, and its
    ``state_dict()`` is FP32 (its own values: it has no masters)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    x = torch.randn(3, 8)
    assert loaded(x).dtype == torch.float32 and torch.equal(loaded(x), model(x))
    state = loaded.state_dict()
    assert all(v.dtype == torch.float32 for v in state.values())
    assert torch.equal(state["0.weight"], loaded[0].weight.float())
