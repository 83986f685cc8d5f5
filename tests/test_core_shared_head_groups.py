"""gaps68: the gaps stop 67 left open, each tried from the user's side against FP32.

Two losses into a head two optimizers hold (each optimizer brought the other loss's gradient to the new scale: twice);
a group list swapped at the same length between a clip and the step (told by length: never unscaled); at O2 a clip
before ``add_param_group`` and a second step with no backward (the clip applied to the added group's gradients); a
``load_state_dict`` between a backward and the step, then a raw head step (the load forgot the backward's note: not
refused); ``strict=False`` and ``assign=True`` loads into a submodule (coverage)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _trunk(net: nn.Sequential) -> list[nn.Parameter]:
    return list(net[0].parameters()) + list(net[1].parameters())


def _weights(net: nn.Module, amp: Amp | None) -> dict[str, torch.Tensor]:
    values = amp.fp32_state_dict(net) if amp is not None and amp.opt_level == "O2" else net.state_dict()
    return {k: v.detach().float() for k, v in values.items()}


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=atol, msg=key)


def _forward_backward(amp: Amp | None, net: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_id: int = 0) -> None:
    if amp is None:
        F.mse_loss(net(x), y).backward() if loss_id == 0 else net(x).pow(2).mean().backward()
        return
    with amp.forward_context():
        out = net(amp.cast_inputs(x)).float()
    amp.backward(F.mse_loss(out, y) if loss_id == 0 else out.pow(2).mean(), loss_id=loss_id)


# -- two losses, a head two optimizers hold ------------------------------------------------------------------------
def _two_losses(level: str | None) -> dict[str, torch.Tensor]:
    net = _net()
    whole = torch.optim.SGD(net.parameters(), lr=0.05)
    head = torch.optim.SGD(net[2].parameters(), lr=0.3, momentum=0.9)
    amp = None
    if level is not None:
        amp = Amp(level, half_dtype="float16", num_losses=2, init_scale=2.0**10)
        amp.scalers[1].to("cpu").load_state_dict(
            {"scale": 2.0**4, "growth_tracker": 0, "hysteresis_tracker": 1, "overflows": 0}
        )
        amp.prepare_model(net)
        whole, head = amp.prepare_optimizer(whole), amp.prepare_optimizer(head)
    for step in range(3):
        x, y = _batch(step)
        _forward_backward(amp, net, x, y, loss_id=0)
        _forward_backward(amp, net, x, y, loss_id=1)  # the head's gradient holds both losses' parts
        for opt in (whole, head):
            amp.step(opt) if amp is not None else opt.step()
        if amp is not None:
            amp.update()
        whole.zero_grad()
        head.zero_grad()
    return _weights(net, amp)


def test_two_losses_into_a_head_two_optimizers_hold_train_as_fp32() -> None:
    """O1 float16, two losses of scales 2**10 and 2**4 into one backward's gradients, the head held by the whole
    model's optimizer and its own: the first loss's part is brought to the second's scale once (it was brought over
    by each optimizer holding the head: 64 times too small, the head 0.2 off FP32 after 3 steps)."""
    _close(_two_losses("O1"), _two_losses(None), atol=1e-3)


# -- a group list swapped at the same length between the clip and the step --------------------------------------------
def _swapped(level: str | None, half: str, how: str) -> dict[str, torch.Tensor]:
    net = _net()
    groups = [{"params": list(net[0].parameters()), "lr": 0.05}, {"params": list(net[1].parameters()), "lr": 0.1}]
    opt = torch.optim.SGD(groups, lr=0.05)
    amp = None
    if level is not None:
        amp = Amp(level, half_dtype=half)
        amp.prepare_model(net)
        opt = amp.prepare_optimizer(opt)
    for step in range(2):
        x, y = _batch(step)
        _forward_backward(amp, net, x, y)
        if amp is not None:
            amp.clip_grad_norm_(opt, 0.5)
        else:
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.5)
        if step == 0 and how == "swap":  # the norm's group replaced by the head's, two parameters each
            opt.param_groups = [opt.param_groups[0], {**opt.param_groups[1], "params": list(net[2].parameters())}]
        elif step == 0 and how == "reorder":
            opt.param_groups = opt.param_groups[::-1]
        if amp is not None:
            amp.step(opt)
            amp.update()
        else:
            opt.step()
        opt.zero_grad()
        net.zero_grad()
    return _weights(net, amp)


@pytest.mark.parametrize(("level", "half"), [("O1", "float16"), ("O2", "bfloat16")])
def test_a_group_list_swapped_at_the_same_length_after_the_clip_trains_as_fp32(level: str, half: str) -> None:
    """``optimizer.param_groups = [...]`` between the clip and the step, a group of two parameters put in place of
    one of two: the new parameters' gradients are unscaled before the step (told by length, they were not: at O1
    the head stepped 65536 times too far, at O2 it did not move)."""
    _close(_swapped(level, half, "swap"), _swapped(None, half, "swap"), atol=2e-3)


@pytest.mark.parametrize(("level", "half", "atol"), [("O1", "float16", 2e-4), ("O2", "bfloat16", 5e-4)])
def test_groups_reordered_after_the_clip_train_as_fp32(level: str, half: str, atol: float) -> None:
    """``optimizer.param_groups`` reversed between the clip and the step: at O2 the pairs are rebuilt in the new
    order, and the half gradients' marks (positional) were taken for gradients the user wrote since: the masters'
    clipped gradients replaced by the unclipped half ones (the clip lost, ~50x bfloat16's error; at float16 the
    scaled values)."""
    _close(_swapped(level, half, "reorder"), _swapped(None, half, "reorder"), atol=atol)


# -- O2: a clip, then add_param_group, then two steps with no backward between --------------------------------------
def _added_after_clip(level: str | None, half: str) -> dict[str, torch.Tensor]:
    net = _net()
    opt = torch.optim.SGD(_trunk(net), lr=0.05, momentum=0.9)
    amp = None
    if level is not None:
        amp = Amp(level, half_dtype=half)
        amp.prepare_model(net)
        opt = amp.prepare_optimizer(opt)
    x, y = _batch(0)
    _forward_backward(amp, net, x, y)
    if amp is not None:
        amp.clip_grad_norm_(opt, 0.5)
    else:
        torch.nn.utils.clip_grad_norm_(_trunk(net), 0.5)
    opt.add_param_group({"params": list(net[2].parameters()), "lr": 0.1})  # unclipped, as in FP32
    for _ in range(2):  # FP32's second step applies the same gradients again
        if amp is not None:
            amp.step(opt)
            amp.update()
        else:
            opt.step()
    return _weights(net, amp)


@pytest.mark.parametrize(("level", "half"), [("O2", "float16"), ("O1", "float16")])
def test_a_group_added_after_a_clip_stepped_twice_without_a_backward_trains_as_fp32(level: str, half: str) -> None:
    """The second step takes the gradients the first left (at O2 the half ones, brought up with the clips since the
    unscale): the clip made before the group was added is not applied to its gradients (it was at O2: the head 9%
    short of FP32's move)."""
    _close(_added_after_clip(level, half), _added_after_clip(None, half), atol=2e-4)


# -- a load between the backward and the step, then a raw head step --------------------------------------------------
def _loose_head_run(level: str, half: str, load: str, raw: bool) -> None:
    net = _net()
    amp = Amp(level, half_dtype=half)
    amp.prepare_model(net)
    opt = amp.prepare_optimizer(torch.optim.SGD(_trunk(net), lr=0.05))  # the head left out of every optimizer
    saved = {k: v.float().clone() for k, v in net.state_dict().items()}
    for step in range(3):
        x, y = _batch(step)
        _forward_backward(amp, net, x, y)
        if step == 1:
            if load == "whole":
                net.load_state_dict(saved)
            elif load == "trunk":  # strict=False, the head's entries lacked
                net.load_state_dict({k: v for k, v in saved.items() if not k.startswith("2.")}, strict=False)
            elif load == "submodule":  # another module than the head
                net[0].load_state_dict({"weight": saved["0.weight"], "bias": saved["0.bias"]})
            elif load == "head-weight":
                net[2].load_state_dict({"weight": saved["2.weight"]}, strict=False)
            if raw:
                head = torch.optim.SGD(net[2].parameters(), lr=0.05)
                head.step()
                head.zero_grad()
        amp.step(opt)
        amp.update()
        opt.zero_grad()
        net.zero_grad()


@pytest.mark.parametrize("load", ["trunk", "submodule", "head-weight"])
@pytest.mark.parametrize(("level", "half"), [("O2", "bfloat16"), ("O1", "float16")])
@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_a_raw_head_step_after_a_load_between_backward_and_step_is_refused(level: str, half: str, load: str) -> None:
    """A load between the backward and the step that did not write the head (or only its weight), then a raw SGD
    step over it (scaled gradients, at O2 no master): refused at the step as without the load (the load forgot the
    backward's note, and nothing was refused)."""
    with pytest.raises(RuntimeError, match="which no optimizer prepared by lightning_mpx holds"):
        _loose_head_run(level, half, load, raw=True)


@pytest.mark.parametrize("load", ["whole", "trunk", "head-weight"])
@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_a_load_between_backward_and_step_with_no_raw_step_is_not_refused(load: str) -> None:
    _loose_head_run("O2", "bfloat16", load, raw=False)


# -- loads into a submodule -------------------------------------------------------------------------------------------
def test_o2_loads_into_a_submodule_strict_false_and_assign() -> None:
    """``model[2].load_state_dict(sd, strict=False)`` at O2: the FP32 value goes to the master exactly, the entry it
    lacked keeps this run's master; ``assign=True`` into the submodule is refused as into the root."""
    net = _net()
    amp = Amp("O2", half_dtype="bfloat16")
    amp.prepare_model(net)
    amp.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.05))
    bias = amp.master_of(net[2].bias).clone()
    value = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = net[2].load_state_dict({"weight": value}, strict=False)
    assert result.missing_keys == ["bias"]
    assert torch.equal(amp.master_of(net[2].weight), value)
    assert torch.equal(amp.master_of(net[2].bias), bias)
    assert net[2].weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"assign=True.*first: 'weight'"):
        net[2].load_state_dict({"weight": value, "bias": torch.zeros(4)}, assign=True)
    assert net[2].weight.dtype == torch.bfloat16 and amp.master_of(net[2].weight) is not None


# -- two optimizers sharing parameters of an FSDP-sharded model (two ranks, one launch) ------------------------------
FSDP_CASES = ("fsdp2-shared", "fsdp2-clip", "fsdp2-groups", "fsdp1-shared")


@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One two-process launch for every multi-rank case of this file (tests/fabric_fsdp_shared_optimizers_script.py)."""
    pytest.importorskip("lightning.fabric")
    from tests.launch import rank_results, run_script

    out = tmp_path_factory.mktemp("gaps68")
    run_script("fabric_fsdp_shared_optimizers_script.py", out, timeout=150, MPX_CASES=",".join(FSDP_CASES))
    return rank_results(out)


def _fsdp_fp32(case: str) -> torch.Tensor:
    """The same loop in FP32 on one process (the whole batch: the ranks' mean gradient)."""
    from tests.fabric_fsdp_shared_optimizers_script import CLIP, batches, build

    net = build()
    if case == "fsdp2-groups":
        groups = [{"params": list(net[0].parameters())}, {"params": list(net[2].parameters()), "lr": 0.3}]
        opts = [torch.optim.SGD(groups, lr=0.05)]
    else:
        head = net.parameters() if case == "fsdp1-shared" else net[2].parameters()
        opts = [torch.optim.SGD(net.parameters(), lr=0.05), torch.optim.SGD(head, lr=0.3)]
    for x, y in batches():
        F.mse_loss(net(x), y).backward()
        for i, opt in enumerate(opts):
            if i == 1 and case == "fsdp2-clip":
                torch.nn.utils.clip_grad_norm_(net[2].parameters(), CLIP)
            opt.step()
        for opt in opts:
            opt.zero_grad()
    return torch.cat([p.detach().double().flatten() for p in net.parameters()])


@pytest.mark.parametrize("case", FSDP_CASES)
def test_two_optimizers_sharing_fsdp_sharded_parameters_train_as_fp32(
    fsdp_ranks: list[dict[str, Any]], case: str
) -> None:
    """O1 float16 (dynamic scale 2**10) under Fabric's FSDP2 (``ModelParallelStrategy``) and FSDP1 (``FSDPStrategy``)
    on two ranks: the whole model's optimizer and the head's own (FSDP1: two over the flat parameter), and one
    optimizer with a group each, the head's gradients clipped between the steps: every rank ends on FP32's weights
    (each shard unscaled once; the head's optimizer divided them again, and FP32's weights were 0.12 away)."""
    want = _fsdp_fp32(case)
    for rank, result in enumerate(fsdp_ranks):
        assert "error" not in result[case], f"{case}, rank {rank}:\n{result[case].get('error')}"
        weights = result[case]["weights"]
        got = torch.tensor([v for w in weights for v in w] if isinstance(weights[0], list) else weights).double()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3)


@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_a_rollback_load_between_two_backwards_is_no_raw_step() -> None:
    """A load of the whole model between two backwards (a rollback after a loss spike), the gradients cleared, then
    the next backward and the step: the head's write is the load's (kept note, loaded parameters left out at the
    backward's look too), not refused."""
    net = _net()
    amp = Amp("O2", half_dtype="bfloat16")
    amp.prepare_model(net)
    opt = amp.prepare_optimizer(torch.optim.SGD(_trunk(net), lr=0.05))
    saved = {k: v.float().clone() for k, v in net.state_dict().items()}
    for step in range(2):
        x, y = _batch(step)
        _forward_backward(amp, net, x, y)
        net.load_state_dict(saved)
        net.zero_grad()
        _forward_backward(amp, net, x, y)
        amp.step(opt)
        amp.update()
        net.zero_grad()
