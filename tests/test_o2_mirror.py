"""O2's FP32 masters and the model are one state, through what users do to a model after preparing it.

Every test drives the public API (``Amp``, or the Accelerate adapter) the way user code does, and compares with an
FP32 reference where there is one. Each scenario silently corrupted training before the masters became a mirror.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.masters.state_keys import has_own_key


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def _step(amp: Amp, model: nn.Module, opt: torch.optim.Optimizer, seed: int = 0, set_to_none: bool = True) -> bool:
    x, y = _batch(seed)
    with amp.forward_context():
        loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))), y)
    amp.backward(loss)
    stepped = amp.step(opt)
    amp.update()
    opt.zero_grad(set_to_none=set_to_none)
    return stepped


def _fp32_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int = 0) -> None:
    x, y = _batch(seed)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


HALF = pytest.mark.parametrize("half", ["float16", "bfloat16"])


@HALF
def test_pretrained_weights_loaded_after_prepare_are_trained_not_reverted(half):
    amp = Amp("O2", half_dtype=half)
    model = amp.prepare_model(_net(seed=0))
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    pretrained = _net(seed=1)
    model.load_state_dict(pretrained.state_dict())  # the usual order in fine-tuning scripts
    reference = copy.deepcopy(pretrained)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i in range(3):
        assert _step(amp, model, opt, seed=i)
        _fp32_step(reference, ref_opt, seed=i)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=0)  # half precision, not a 0.37 drift


def test_writes_under_no_grad_and_data_replacement_are_taken_elementwise():
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))  # lr 0: only the writes move weights
    _step(amp, model, opt)
    weight, bias = model[0].weight, model[0].bias
    master_before = amp.master_of(weight).clone()
    with torch.no_grad():
        weight[0].clamp_(-0.01, 0.01)  # a user's clamp of one row: the other rows keep their FP32 masters
    bias.data = torch.full_like(bias, 0.5)  # a new storage
    _step(amp, model, opt)
    master = amp.master_of(weight)
    clamped = weight[0] != master_before[0].to(weight.dtype)
    assert clamped.any() and not clamped.all()
    # The clamped elements take the model's value; the row's others, and the other rows, keep their exact FP32 ones.
    assert torch.equal(master[0], torch.where(clamped, weight[0].float(), master_before[0]))
    assert torch.equal(master[1:], master_before[1:])
    assert torch.equal(amp.master_of(bias), torch.full((8,), 0.5))
    assert torch.equal(weight[0], master[0].to(weight.dtype))


def test_writes_through_p_data_in_place_are_taken():
    # p.data has a version counter of its own, so the version check alone cannot see an in-place write through it;
    # the parameter tells its masters when its .data is handed out, and the next refresh compares that one.
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    model[2].weight.data.fill_(0.25)
    assert amp.refresh_masters() == ["2.weight"]
    assert torch.equal(amp.master_of(model[2].weight), torch.full((3, 8), 0.25))
    assert amp.refresh_masters() == []  # taken once
    model[0].bias.data.abs()  # read only: compared once, nothing taken, the FP32 master kept exact
    master = amp.master_of(model[0].bias).clone()
    assert amp.refresh_masters() == []
    assert torch.equal(amp.master_of(model[0].bias), master)


def test_checkpoint_loaded_into_the_model_after_the_masters_keeps_them_exact():
    # Frameworks restore the model's half weights and the masters in either order; the half weights are the
    # masters' rounding, so the masters must stay bit-exact, not become the rounding.
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    opt = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for i in range(3):
        _step(amp, model, opt, seed=i)
    state, weights = copy.deepcopy(amp.state_dict()), copy.deepcopy(model.state_dict())
    fresh = Amp("O2", half_dtype="bfloat16")
    fresh_model = fresh.prepare_model(_net(seed=5))
    fresh.prepare_optimizer(torch.optim.AdamW(fresh_model.parameters(), lr=1e-2))
    fresh.load_state_dict(state)
    fresh_model.load_state_dict(weights)  # after the masters: bumps every version counter
    fresh.refresh_masters()
    for (_, a), (_, b) in zip(amp.master_weights[0].half_pairs, fresh.master_weights[0].half_pairs):
        assert torch.equal(a, b)


@HALF
def test_param_group_added_after_prepare_gets_fp32_masters_and_trains(half):
    # Gradual unfreezing: the backbone is frozen when the masters are made, then added to the optimizer.
    torch.manual_seed(0)
    backbone, head = nn.Linear(6, 8), nn.Linear(8, 3)
    model = nn.Sequential(backbone, nn.ReLU(), head)
    reference = copy.deepcopy(model)
    backbone.requires_grad_(False)
    amp = Amp("O2", half_dtype=half)
    amp.prepare_model(model)
    opt = amp.prepare_optimizer(torch.optim.AdamW(head.parameters(), lr=1e-2))
    assert len(amp.master_weights[0].half_pairs) == 2  # the head's only: no memory for the frozen backbone
    backbone.requires_grad_(True)
    opt.add_param_group({"params": list(backbone.parameters()), "lr": 1e-2})
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for i in range(5):
        assert _step(amp, model, opt, seed=i)
        _fp32_step(reference, ref_opt, seed=i)
    for param in backbone.parameters():
        assert amp.master_of(param).dtype == torch.float32 and amp.master_of(param) is not param
        assert opt.state[amp.master_of(param)]["exp_avg_sq"].dtype == torch.float32
    for got, want in zip(model.parameters(), reference.parameters()):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=0)


def test_a_parameter_without_a_gradient_is_not_stepped_on_an_old_one():
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    _step(amp, model, opt)
    before = model[2].weight.detach().clone()
    # The next step trains the first layer only (the head is detached from the loss); the user zeroes the
    # model's gradients, not the optimizer's.
    model.zero_grad()
    x, y = _batch(1)
    features = model[1](model[0](amp.cast_inputs(x)))
    amp.backward(features.float().square().mean())
    assert amp.step(opt)
    amp.update()
    assert torch.equal(model[2].weight, before)


def test_models_sharing_a_submodule_each_get_masters_one_per_tensor():
    torch.manual_seed(0)
    shared = nn.Linear(6, 8)
    first, second = nn.Sequential(shared, nn.ReLU(), nn.Linear(8, 3)), nn.Sequential(shared, nn.Tanh(), nn.Linear(8, 2))
    amp = Amp("O2", loss_scale=128.0, half_dtype="bfloat16")
    amp.prepare_model(first)
    amp.prepare_model(second)
    opt = amp.prepare_optimizer(torch.optim.SGD([*first.parameters(), *second[2].parameters()], lr=0.1))
    masters = {id(p): amp.master_of(p) for p in [*first.parameters(), *second.parameters()]}
    assert all(m is not None and m.dtype == torch.float32 for m in masters.values())
    assert amp.master_of(second[2].weight) is not second[2].weight  # the second model's own head has one too
    x = torch.randn(4, 6)
    loss = first(amp.cast_inputs(x)).float().sum() + second(amp.cast_inputs(x)).float().sum()
    amp.backward(loss)
    before = second[2].weight.detach().clone()
    assert amp.step(opt)
    assert not torch.equal(second[2].weight, before)
    assert torch.equal(shared.weight, amp.master_of(shared.weight).to(shared.weight.dtype))


def test_tied_weights_keep_one_master():
    torch.manual_seed(0)
    embed, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, head)
    amp = Amp("O2", loss_scale=128.0, half_dtype="bfloat16")
    amp.prepare_model(model)
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(amp.master_weights[0].half_pairs) == 1  # made with the optimizer, once for the tied weight
    amp.backward(model(torch.tensor([1, 2, 3])).float().sum())
    assert amp.step(opt)
    assert model[1].weight is model[0].weight


def test_amp_keeps_no_model_or_optimizer_alive():
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    _step(amp, model, opt)
    model_ref, opt_ref = weakref.ref(model), weakref.ref(opt)
    del model, opt
    gc.collect()
    assert model_ref() is None and opt_ref() is None
    assert amp._optimizers == {}
    fresh = amp.prepare_model(_net(seed=3))  # a new model: the old one's masters are gone, not saved
    amp.prepare_optimizer(torch.optim.SGD(fresh.parameters(), lr=0.1))
    assert len(amp.master_weights) == 1 and len(amp.state_dict()["master_weights"]) == 1


def test_optimizer_step_called_directly_is_refused_and_its_state_dict_is_fp32():
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    opt = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _step(amp, model, opt)
    amp.backward(model(amp.cast_inputs(_batch()[0])).float().sum())
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) was called .* amp.step\(optimizer\)"):
        opt.step()
    saved = opt.state_dict()
    assert all(v.dtype == torch.float32 for s in saved["state"].values() for k, v in s.items() if k != "step")
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]
    # A reload keeps the moments in FP32 (torch casts optimizer state to the dtype of the parameters it sees).
    opt.load_state_dict(saved)
    assert all(
        v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step"
    ) and [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]


# -- through the Accelerate adapter ------------------------------------------------------------------------------------
accelerate = pytest.importorskip("accelerate")


def _accelerator(level: str = "O2", **kwargs):
    from lightning_mpx.integrations.accelerate import Accelerator

    return Accelerator(mixed_precision=level, cpu=True, **kwargs)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_accelerate_prepared_model_deepcopies_and_averages(level):
    from torch.optim.swa_utils import AveragedModel

    accelerator = _accelerator(level)
    model = accelerator.prepare(_net())
    twin = copy.deepcopy(model)
    averaged = AveragedModel(model)
    x = _batch()[0]
    with torch.no_grad():
        expected = model(x)
        assert torch.equal(twin(x), expected) and torch.equal(averaged(x), expected)
    assert twin.forward._amp is not model.forward._amp  # the copy has its own engine, with the same casts
    import pickle

    restored = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        assert torch.equal(restored(x), expected)


def test_accelerate_free_memory_releases_masters_and_optimizers():
    accelerator = _accelerator("O2")
    model, opt = accelerator.prepare(_net(), torch.optim.SGD(_net().parameters(), lr=0.1))
    model_ref = weakref.ref(model)
    old_amp = accelerator.amp
    model, opt = accelerator.free_memory(model, opt)
    gc.collect()
    assert model_ref() is None and accelerator.amp is not old_amp
    model = _net(seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    x, y = _batch()
    accelerator.backward(F.cross_entropy(model(x), y))
    opt.step()
    assert not opt.step_was_skipped
    assert len(accelerator.amp.master_weights) == 1 and len(accelerator.amp._optimizers) == 1


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_clipped_then_skipped_batch_leaves_no_master_gradient_behind(set_to_none):
    # Clip, skip the batch, zero the model's gradients, then a step in which the head gets no gradient: the head's
    # master must not be stepped on the skipped batch's unscaled gradient.
    amp = Amp("O2", loss_scale=128.0, half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batch()
    amp.backward(F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))), y))
    amp.clip_grad_norm_(opt, 1.0)  # unscaled into the masters ... and the batch is skipped
    amp.update()
    model.zero_grad(set_to_none=set_to_none)
    head = model[2].weight.detach().clone()
    features = model[1](model[0](amp.cast_inputs(x)))
    amp.backward(features.float().square().mean())
    assert amp.step(opt)
    assert torch.equal(model[2].weight, head)


@pytest.mark.parametrize("model_writes", ["versions", "values"])
def test_writes_through_p_data_follow_an_fp32_run(model_writes):
    # WGAN's weight clipping, `p.data.clamp_(-c, c)` after every step: the masters take it before the next step
    # (the default through the parameters' .data watch, "values" by comparing every weight each step).
    amp = Amp("O2", model_writes=model_writes, loss_scale=128.0, half_dtype="float16")
    model = amp.prepare_model(_net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    reference = _net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for i in range(3):
        _step(amp, model, opt, seed=i)
        _fp32_step(reference, ref_opt, seed=i)
        for net in (model, reference):
            for p in net.parameters():
                p.data.clamp_(-0.01, 0.01)
    masters = amp.state_dict()["master_weights"][0]  # what a checkpoint saves
    torch.testing.assert_close(masters["0.weight"], reference[0].weight.detach(), atol=5e-3, rtol=0)
    # The clamp ran on the half weights: a master that rounds to the clamped half value keeps its FP32 value.
    assert all(master.half().abs().max() <= 0.01 + 1e-5 for master in masters.values())
    with pytest.raises(ValueError, match=r"model_writes='always' is not valid; valid choices: 'versions', 'values'"):
        Amp("O2", model_writes="always", half_dtype="bfloat16")


def test_checkpoint_after_unfreezing_before_any_step_resumes_with_the_part_trainable():
    # Unfreeze + add_param_group, then save before the new group ever stepped: the resumed run prepares the model with
    # the part trainable (so with its master), and the checkpoint must hold that master too.
    torch.manual_seed(0)
    model = _net()
    model[0].requires_grad_(False)
    amp = Amp("O2", half_dtype="bfloat16")
    amp.prepare_model(model)
    opt = amp.prepare_optimizer(torch.optim.SGD(model[2].parameters(), lr=0.1))
    model[0].requires_grad_(True)
    opt.add_param_group({"params": list(model[0].parameters())})
    saved = copy.deepcopy({"amp": amp.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()})

    fresh = Amp("O2", half_dtype="bfloat16")
    resumed = fresh.prepare_model(_net(seed=4))
    fresh_opt = torch.optim.SGD(resumed[2].parameters(), lr=0.1)
    fresh_opt.add_param_group({"params": list(resumed[0].parameters())})
    fresh.prepare_optimizer(fresh_opt)
    resumed.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    fresh.load_state_dict(saved["amp"])
    assert torch.equal(fresh.master_of(resumed[0].weight), amp.master_of(model[0].weight))
    assert _step(fresh, resumed, fresh_opt)


@HALF
@pytest.mark.parametrize("overflow", [False, True])
def test_no_fp32_gradient_is_held_between_steps(half, overflow):
    """O2's FP32 master gradients live from the unscale to the end of the step: none is held through the next
    forward (the memory an O2 user expects: half gradients only, as the half model's), whether the step ran or was
    skipped on an overflow; the half gradients stay the user's until their zero_grad."""
    amp = Amp("O2", half_dtype=half, loss_scale="dynamic", init_scale=2.0**4, on_floor="continue")
    model = amp.prepare_model(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)))
    opt = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    masters = [amp.master_of(p) for p in model.parameters() if p.dtype != torch.float32]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    for step in range(3):
        x, y = _batch(step)
        with amp.forward_context():
            loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))), y)
        amp.backward(loss * (float("inf") if overflow and step == 1 else 1.0))
        assert amp.step(opt) is not (overflow and step == 1)
        amp.update()
        held = [i for i, m in enumerate(masters) if m.grad is not None]
        assert held == [], f"step {step}: FP32 gradients still held by masters {held}"
        assert all(p.grad is not None for p in model.parameters())  # the user's, until their zero_grad
        opt.zero_grad()


def _frozen_first_run(frozen_first: bool) -> tuple[Amp, nn.Sequential, torch.optim.Optimizer]:
    """O2 fine-tuning code: the model, its first layer frozen or not, then AdamW over every parameter."""
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net(seed=0))
    model[0].requires_grad_(not frozen_first)
    return amp, model, amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def _train(amp: Amp, model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x, y = _batch(seed)
    with amp.forward_context():
        loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))), y)
    amp.backward(loss)
    amp.step(opt)
    amp.update()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("order", ["amp-first", "optimizer-first"])
def test_resuming_with_a_trained_layer_frozen_again_goes_on_as_the_straight_run(order):
    """A layer trains, is frozen, the run is checkpointed and resumed by code that builds the model with that layer
    frozen (it has no master then), and the layer is unfrozen later: the resumed run goes on bit for bit as the run
    that was never interrupted. Its Adam moments must load into an FP32 master (into the half parameter they would
    be rounded to bfloat16 and then lost when the layer gets its master). "amp-first" is Lightning's order (the
    precision plugin's state before the optimizers'); found by hypothesis (tests/test_frozen_params_stateful.py)."""
    straight = _frozen_first_run(frozen_first=False)
    _train(*straight, seed=0)
    _train(*straight, seed=1)
    straight[1][0].requires_grad_(False)
    amp, model, opt = straight
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
    resumed = _frozen_first_run(frozen_first=True)
    resumed[1].load_state_dict(saved["model"])
    if order == "amp-first":
        resumed[0].load_state_dict(saved["amp"])
        resumed[2].load_state_dict(saved["opt"])
    else:
        resumed[2].load_state_dict(saved["opt"])
        resumed[0].load_state_dict(saved["amp"])
    for run in (straight, resumed):
        own = [n for n, p in run[1].named_parameters() if has_own_key(run[2].state, p)]
        assert not own, "state kept by a half parameter"
    for seed in (2, 3):
        _train(*straight, seed=seed)
        _train(*resumed, seed=seed)
    for run in (straight, resumed):
        run[1][0].requires_grad_(True)  # unfrozen: its moments are the ones it trained with
    for seed in (4, 5):
        _train(*straight, seed=seed)
        _train(*resumed, seed=seed)
    for (name, a), b in zip(straight[1].named_parameters(), resumed[1].parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(straight[0].master_of(a), resumed[0].master_of(b)), name
