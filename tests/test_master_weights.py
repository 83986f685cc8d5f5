"""Half-model conversion and FP32 master weights."""

import pytest
import torch
from torch import nn

from lightning_mpx import MasterWeights, convert_module


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=str)
def test_convert_keeps_identity_and_batchnorm(half):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.SyncBatchNorm(4), nn.Linear(4, 2))
    weight = model[0].weight
    convert_module(model, half)
    assert model[0].weight is weight and weight.dtype == half
    for bn in (model[1], model[2]):
        assert bn.weight.dtype == torch.float32 and bn.running_var.dtype == torch.float32
    assert model[1].num_batches_tracked.dtype == torch.int64  # integer buffers untouched
    out = model[1](torch.randn(2, 4, 5, 5, dtype=half))  # torch runs FP32 batch norm on half inputs
    assert out.dtype == half


def test_convert_without_keep_batchnorm():
    model = convert_module(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), torch.float16, keep_batchnorm_fp32=False)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert model[1].running_mean.dtype == torch.float16


def test_convert_refuses_modules_without_float_parameters():
    with pytest.raises(ValueError, match=r"module=Embedding has no floating-point parameters|module=ReLU"):
        convert_module(nn.ReLU(), torch.float16)


def test_masters_are_exact_fp32_copies_and_earlier_optimizer_state_moves_to_them():
    from lightning_mpx import Amp

    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model[0].weight.grad = torch.ones(3, 3)
    opt.step()  # creates momentum state for the FP32 weight, before conversion
    weight = model[0].weight.detach().clone()
    amp = Amp("O2")
    amp.prepare_model(model)
    amp.prepare_optimizer(opt)
    (masters,) = amp.master_weights
    pairs = dict((id(p), m) for p, m in masters.half_pairs)
    assert len(pairs) == 2  # linear weight and bias; batch norm is its own master
    assert torch.equal(pairs[id(model[0].weight)], weight)  # the FP32 weight itself, not its half rounding
    assert not torch.equal(weight.half().float(), weight)
    held = opt.param_groups[0]["params"]
    # The optimizer keeps the model's own parameters; its state for the half weight is now its master's, in FP32.
    assert held[0] is model[0].weight and held[2] is model[1].weight
    assert amp.master_params(opt)[0] is pairs[id(model[0].weight)]
    assert opt.state[pairs[id(model[0].weight)]]["momentum_buffer"].dtype == torch.float32
    assert masters.names == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_copy_to_model_and_state_round_trip_bit_exact():
    model = convert_module(nn.Linear(4, 4), torch.bfloat16)
    masters = MasterWeights(model.named_parameters())
    with torch.no_grad():
        for _, m in masters.half_pairs:
            m.add_(1e-3)  # a change too small to survive rounding through bfloat16 at some entries
    state = masters.state_dict()
    masters.copy_to_model()
    for p, m in masters.half_pairs:
        assert torch.equal(p, m.to(torch.bfloat16))
    other_model = convert_module(nn.Linear(4, 4), torch.bfloat16)  # masters live as long as their model
    other = MasterWeights(other_model.named_parameters())
    other.load_state_dict(state)
    for (_, a), (_, b) in zip(masters.half_pairs, other.half_pairs):
        assert torch.equal(a, b)
    with pytest.raises(KeyError, match=r"missing \['bias'\]"):
        other.load_state_dict({"weight": state["weight"]})


def test_load_state_dict_names_the_parameter_refuses_broadcasting_shapes_and_loads_nothing():
    model = convert_module(nn.Linear(4, 3), torch.float16)
    masters = MasterWeights(model.named_parameters())
    before = [m.clone() for _, m in masters.half_pairs]
    state = {"weight": torch.ones(1, 4), "bias": torch.ones(3)}  # (1, 4) would broadcast into (3, 4)
    with pytest.raises(ValueError, match=r"'weight' has shape \(1, 4\) in the checkpoint .* shape \(3, 4\)"):
        masters.load_state_dict(state)
    assert all(torch.equal(m, b) for (_, m), b in zip(masters.half_pairs, before))  # bias not loaded either


def test_masters_go_with_their_model():
    import gc

    model = convert_module(nn.Linear(4, 3), torch.float16)
    masters = MasterWeights(model.named_parameters())
    assert masters.alive and len(masters.half_pairs) == 2
    del model
    gc.collect()
    assert not masters.alive and masters.half_pairs == []


def test_sync_from_model_keeps_master_identity_and_takes_the_model_values():
    model = nn.Linear(4, 3)
    convert_module(model, torch.float16)
    masters = MasterWeights(model.named_parameters())
    before = [m for _, m in masters.half_pairs]
    with torch.no_grad():
        model.weight.fill_(0.25)  # e.g. a broadcast from rank zero after the masters were made
    masters.sync_from_model()
    after = [m for _, m in masters.half_pairs]
    assert all(a is b for a, b in zip(before, after))
    assert masters.master_of(model.weight).dtype == torch.float32
    assert torch.equal(masters.master_of(model.weight), torch.full((3, 4), 0.25))
