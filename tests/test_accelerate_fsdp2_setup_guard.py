"""Stop 64's FSDP2 set-up guard and O3 resume check, attacked with a careless user's habits.

The Accelerate adapter at O2 under ``FullyShardedDataParallelPlugin(fsdp_version=2)`` puts a guard on FSDP's root
pre-hook (``engine/sharding.guard_fsdp_setup``) and the forward scope translates FSDP's set-up ``AssertionError``
(``engine/surgery.ForwardErrors``): here ``unwrap_model`` (with and without the FP32 wrapper), ``save_state`` before
the first forward and ``load_state`` after, a second ``prepare``, ``free_memory`` then ``prepare`` again, a model
compiled after ``prepare`` and a user's own ``assert`` in a forward train as Accelerate's ``"bf16"`` does (refused
nowhere), and half parameters unfrozen before the first forward of a model prepared second, or after
``free_memory``, are still named. In-process on a gloo group of one (``launched_alone``, tests/conftest.py).

The O3 resume check (``engine/held_masters``) through the Accelerate adapter's and the Apex layer's entries: an O2
checkpoint resumed at O3 with only the engine's entry loaded is refused at the next step, with the model's entry too it
trains on the masters' rounding; an O2 float16 checkpoint resumed at O3 in bfloat16 (the model's entry holds the FP32
masters, which it rounds once to either dtype) is now checked too: it trained on this run's weights silently, the
entry holding the checksums of the float16 rounding only.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.core_fsdp2_unfreeze_script import Net, accelerate_prepared
from tests.test_core_fsdp2_forward_guard import _batch, _check_named

pytest.importorskip("accelerate")
_gloo = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="FSDP needs torch.distributed with gloo",
)


def fsdp(test: Any) -> Any:
    """FSDP2 on a gloo group of one, this process (``launched_alone``)."""
    return _gloo(pytest.mark.usefixtures("launched_alone")(test))


def _full(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().full_tensor().float().clone() for k, v in net.named_parameters()}


def _step(accelerator: Any, model: nn.Module, optimizer: Any) -> float:
    x, y = _batch()
    loss = F.cross_entropy(model(x).float(), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _habits(mixed_precision: str, tmp_path: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``save_state`` before the first forward, steps through ``unwrap_model`` (with the FP32 wrapper, then without),
    ``load_state`` after them, a step, a second model prepared and stepped, then the first stepped again: the losses
    and both models' weights."""
    torch.manual_seed(0)
    accelerator, net, optimizer = accelerate_prepared(mixed_precision)
    accelerator.save_state(str(tmp_path / mixed_precision))
    losses = [_step(accelerator, accelerator.unwrap_model(net), optimizer)]
    losses.append(_step(accelerator, accelerator.unwrap_model(net, keep_fp32_wrapper=False), optimizer))
    accelerator.load_state(str(tmp_path / mixed_precision))
    losses.append(_step(accelerator, net, optimizer))
    torch.manual_seed(1)
    other = Net()
    other, other_optimizer = accelerator.prepare(
        other, torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-2)
    )
    losses += [_step(accelerator, other, other_optimizer), _step(accelerator, net, optimizer)]
    weights = _full(net)
    weights.update({f"other.{k}": v for k, v in _full(other).items()})
    return losses, weights


def _assert_close(ours: tuple[list[float], dict[str, torch.Tensor]], theirs: tuple[list[float], dict]) -> None:
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-3, atol=1e-3)
    assert ours[1].keys() == theirs[1].keys()
    for name, value in ours[1].items():
        torch.testing.assert_close(value, theirs[1][name], rtol=1e-2, atol=1e-3, msg=name)


@fsdp
def test_accelerate_fsdp2_o2_trains_as_bf16_through_unwrap_save_load_and_a_second_prepare(tmp_path) -> None:
    """Nothing refused, the guard left nothing behind that changes training: losses and weights match ``"bf16"``."""
    ours = _habits("O2", tmp_path)
    torch.distributed.destroy_process_group()  # Accelerate's next state starts its own group
    theirs = _habits("bf16", tmp_path)
    assert len(set(ours[0])) > 1  # it trained
    _assert_close(ours, theirs)


def _freed_and_compiled(mixed_precision: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``free_memory()`` after ``prepare``, a new model prepared, compiled (``aot_eager``) and stepped."""
    accelerator, _, _ = accelerate_prepared(mixed_precision)
    accelerator.free_memory()
    torch.manual_seed(1)
    net = Net()
    net, optimizer = accelerator.prepare(net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad]))
    compiled = torch.compile(net, backend="aot_eager")
    return [_step(accelerator, compiled, optimizer) for _ in range(2)], _full(net)


@fsdp
@pytest.mark.usefixtures("fresh_dynamo")
def test_accelerate_fsdp2_o2_free_memory_then_prepare_and_compile_trains_as_bf16() -> None:
    ours = _freed_and_compiled("O2")
    torch.distributed.destroy_process_group()
    theirs = _freed_and_compiled("bf16")
    _assert_close(ours, theirs)


@fsdp
@pytest.mark.parametrize("how", ["second_prepare", "after_free_memory"])
def test_accelerate_names_the_half_base_of_a_model_prepared_later(how) -> None:
    """The guard is on each prepared model: the second model's (or, after ``free_memory``, the new model's) half base
    unfrozen before its first forward is named as the first model's is."""
    accelerator, net, optimizer = accelerate_prepared("O2")
    if how == "second_prepare":
        _step(accelerator, net, optimizer)
    else:
        accelerator.free_memory()
    other = Net()
    other, _ = accelerator.prepare(other, torch.optim.AdamW([p for p in other.parameters() if p.requires_grad]))
    other.first.fc.requires_grad_(True)
    with pytest.raises(ValueError) as raised:
        other(_batch()[0])
    _check_named(raised.value)


class _Asserting(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float64, f"my model wants float64 inputs, got dtype {x.dtype}"
        return x


@fsdp
def test_accelerate_passes_a_users_own_assertion_in_the_forward_through() -> None:
    """A user's ``assert`` (about a dtype) in a forward of the model prepared at O2 under FSDP2: raised as it is, at
    the first forward (the guard's) and at a later one (the scope's)."""
    accelerator, net, optimizer = accelerate_prepared("O2")
    net.second.adapter.register_forward_pre_hook(lambda module, args: _Asserting()(args[0]))
    for _ in range(2):
        with pytest.raises(AssertionError, match="my model wants float64") as raised:
            net(_batch()[0])
        assert type(raised.value) is AssertionError and raised.value.__cause__ is None


# -- the O3 resume check through the Accelerate adapter and the Apex layer --------------------------------------------
def _tiny(shift: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift)  # a fresh run's weights: not the checkpoint's
    return model


def _tiny_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
CASES = [("bfloat16", "bfloat16"), ("float16", "bfloat16"), ("bfloat16", "float16")]


def _accelerate_resume(
    saved: str, resumed: str, with_model: bool, tmp_path: Any
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """An O2 run in ``saved`` saved by ``save_state``; a fresh O3 run in ``resumed`` loads it (``with_model`` false: a
    load pre-hook, as diffusers' scripts register, takes the models out of ``load_state`` and loads none). Returns
    (the error of the next step or None, the saved FP32 masters of ``0.weight``)."""
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import accelerate_state_reset

    with accelerate_state_reset():
        accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=saved)])
        model = _tiny()
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
        for _ in range(2):
            x, y = _tiny_batch()
            accelerator.backward(F.cross_entropy(model(x).float(), y))
            optimizer.step()
            optimizer.zero_grad()
        accelerator.save_state(str(tmp_path))
        master = model.state_dict()["0.weight"].clone()
    with accelerate_state_reset():
        accelerator = Accelerator(mixed_precision="O3", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=resumed)])
        model = _tiny(1.0)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
        if not with_model:
            accelerator.register_load_state_pre_hook(lambda models, input_dir: models.clear())
        accelerator.load_state(str(tmp_path))
        loaded = model[0].weight.detach().clone()
        try:
            x, y = _tiny_batch()
            accelerator.backward(F.cross_entropy(model(x).float(), y))
            optimizer.step()
        except RuntimeError as error:
            return error, loaded, master
    return None, loaded, master


def _apex_resume(saved: str, resumed: str, with_model: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """As :func:`_accelerate_resume` through ``lightning_mpx.apex.amp`` (``cast_model_type`` the half dtype): the
    checkpoint ``{"model": model.state_dict(), "amp": amp.state_dict()}``, ``amp.load_state_dict`` alone or after
    ``model.load_state_dict``."""
    from lightning_mpx.apex import _amp_state, amp

    def step(model: nn.Module, optimizer: Any) -> None:
        x, y = _tiny_batch()
        loss = F.cross_entropy(model(x.to(model[0].weight.dtype)).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()

    try:
        _amp_state.reset()
        _amp_state.registrations.clear()
        model = _tiny()
        model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), opt_level="O2",
                                          cast_model_type=DTYPES[saved], verbosity=0)  # fmt: skip
        step(model, optimizer)
        ckpt = {"model": model.state_dict(), "amp": amp.state_dict()}
        _amp_state.reset()
        _amp_state.registrations.clear()
        model = _tiny(1.0)
        model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), opt_level="O3",
                                          cast_model_type=DTYPES[resumed], verbosity=0)  # fmt: skip
        if with_model:
            model.load_state_dict(ckpt["model"])
        amp.load_state_dict(ckpt["amp"])
        loaded = model[0].weight.detach().clone()
        try:
            step(model, optimizer)
        except RuntimeError as error:
            return error, loaded, ckpt["model"]["0.weight"]
        return None, loaded, ckpt["model"]["0.weight"]
    finally:
        _amp_state.reset()
        _amp_state.registrations.clear()


@pytest.mark.parametrize("door", ["accelerate", "apex"])
@pytest.mark.parametrize(("saved", "resumed"), CASES, ids=[f"{a}_to_{b}" for a, b in CASES])
def test_an_o2_checkpoint_resumed_at_o3_with_only_the_engines_entry_is_refused(
    door: str, saved: str, resumed: str, tmp_path: Any
) -> None:
    """Only the engine's entry loaded: the next step raises naming the masters left to the model's entry, in the same
    half dtype and in the other (before: an O2 float16 entry resumed at O3 in bfloat16, or the reverse, trained on
    this run's weights silently)."""
    run = _accelerate_resume(saved, resumed, False, tmp_path) if door == "accelerate" else _apex_resume(
        saved, resumed, False)  # fmt: skip
    error = run[0]
    assert isinstance(error, RuntimeError) and "'0.weight'" in str(error), error
    assert "model's weights were not loaded" in str(error) or "model' entry" in str(error), error


@pytest.mark.parametrize("door", ["accelerate", "apex"])
@pytest.mark.parametrize(("saved", "resumed"), CASES[:2], ids=[f"{a}_to_{b}" for a, b in CASES[:2]])
def test_an_o2_checkpoint_resumed_at_o3_with_the_models_entry_trains_on_its_rounding(
    door: str, saved: str, resumed: str, tmp_path: Any
) -> None:
    """The model's entry loaded too: no error, and the half model holds the saved FP32 masters' rounding to this run's
    half dtype (rounded once, whatever the saving run's half dtype)."""
    error, loaded, master = (
        _accelerate_resume(saved, resumed, True, tmp_path)
        if door == "accelerate"
        else _apex_resume(saved, resumed, True)
    )
    assert error is None, error
    assert master.dtype == torch.float32
    assert torch.equal(loaded, master.to(DTYPES[resumed]))
