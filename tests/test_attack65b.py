"""Helper attack65b: a hostile Accelerate / HF Trainer / Apex / peft user, against Accelerate's own ``"bf16"``, FP32
and Apex's documented behaviour.

Found and fixed:

1. Apex: ``amp.initialize`` given again a model an earlier call prepared, beside a model it then refused (a lazy
   module, one on the meta device, one with nothing to cast), dropped the earlier call's hooks and optimizer wrapper
   before the refusal; the ``_Undo`` put ``_amp_state`` back, not them. A script that caught the error and trained on
   with the earlier ``(model, optimizer)`` failed at O2 in torch's ``mat1 and mat2 must have the same dtype``. These
   refusals now come before anything is touched: the earlier pair trains on as if the call had not been made.
2. A lazy module (``nn.LazyLinear``) at O2 through the Accelerate adapter, the Apex layer or the core got torch's
   ``Can't access the shape of an uninitialized parameter ... in load_state_dict``; it now gets the Lightning doors'
   refusal, naming the parameters, the call (``accelerator.prepare``, ``amp.initialize``, ``prepare_model()``) and the
   remedy (one forward first).

Tiny models on CPU, bfloat16 unless the scale is the point.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.apex import amp as apex_amp
from lightning_mpx.apex._state import _amp_state

BF16 = torch.bfloat16


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)


@pytest.fixture
def fresh_apex() -> Any:
    _amp_state.reset()
    yield
    _amp_state.reset()


# -- 1. a refused amp.initialize given the earlier call's model again ------------------------------------------------
def _apex_steps(model: nn.Module, optimizer: Any, start: int, stop: int) -> None:
    for step in range(start, stop):
        x, y = _batch(step)
        with apex_amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()


def _apex_run(refused: Callable[[], nn.Module] | None) -> dict[str, torch.Tensor]:
    """O2 bfloat16 (a dynamic scale: the scale's path counts too), 3 steps, then (``refused``) a second
    ``amp.initialize`` of the same model and optimizer beside a model it refuses, then 3 steps more with the first
    call's pair: the FP32 weights."""
    _amp_state.reset()
    net = _net()
    base = torch.optim.Adam(net.parameters(), lr=1e-2)
    kw = dict(opt_level="O2", cast_model_type=BF16, loss_scale="dynamic", verbosity=0)
    model, optimizer = apex_amp.initialize(net, base, **kw)
    _apex_steps(model, optimizer, 0, 3)
    if refused is not None:
        with pytest.raises(ValueError) as error:
            apex_amp.initialize([net, refused()], base, **kw)
        assert "amp.initialize" in str(error.value) or "module=" in str(error.value)
    _apex_steps(model, optimizer, 3, 6)
    return {k: v.float().clone() for k, v in model.state_dict().items()}


REFUSED: dict[str, Callable[[], nn.Module]] = {
    "lazy": lambda: nn.LazyLinear(4),
    "meta": lambda: nn.Linear(4, 4, device="meta"),
    "nothing_to_cast": lambda: nn.ReLU(),
}


@pytest.mark.usefixtures("fresh_apex")
@pytest.mark.parametrize("refused", list(REFUSED))
def test_a_refused_initialize_given_the_model_again_leaves_the_earlier_pair_training(refused: str) -> None:
    """The earlier ``(model, optimizer)`` trains on after the refused call exactly as if it had not been made (bit
    for bit: its hooks, wrapper, masters and scale untouched). Before, its hooks were gone: the next forward failed
    with torch's "mat1 and mat2 must have the same dtype"."""
    want, got = _apex_run(None), _apex_run(REFUSED[refused])
    assert all(torch.equal(want[k], got[k]) for k in want)


# -- 2. lazy modules at O2 outside the Lightning doors ---------------------------------------------------------------
def _lazy() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.usefixtures("fresh_apex")
def test_a_lazy_module_at_o2_is_refused_naming_the_call_at_every_door(fresh_accelerate_state: None) -> None:
    """Accelerate's ``prepare``, Apex's ``initialize`` and the core's ``prepare_model`` at O2 name the lazy parameters,
    their call and the remedy (torch's error spoke of ``load_state_dict``); O1 and O3 still take the lazy module."""
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    pattern = r"0\.weight, 0\.bias of Sequential are not initialized yet .* before any forward\. Run one forward on"
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bf16")])
    model = _lazy()
    with pytest.raises(ValueError, match=pattern + r" an example batch before accelerator\.prepare"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model = _lazy()
    with pytest.raises(ValueError, match=pattern + r" an example batch before amp\.initialize"):
        apex_amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    with pytest.raises(ValueError, match=pattern + r" an example batch before prepare_model\(\)"):
        Amp("O2", half_dtype="bfloat16").prepare_model(_lazy())
    for level in ("O1", "O3"):  # no masters: the lazy module trains
        amp = Amp(level, half_dtype="bfloat16")
        model = amp.prepare_model(_lazy())
        optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = _batch(0)
        with amp.forward_context():
            amp.backward(F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))), y))
        assert amp.step(optimizer)
