"""A scale update between a GAN's two optimizer steps, before the engine knows the second optimizer.

Fabric's plugin meets an optimizer at its first step; a read of the scale (``plugin.scaler.get_scale()``,
``plugin.metrics()``) after D's step ends the iteration there. G's gradients, computed at the scale before that update,
must be unscaled by it at G's first step (engine.raw_steps ``UnheldParams.carry``/``settle``), as they are when G is
registered up front; the core ``Amp`` with an optimizer prepared late after an update, ``num_losses=2``, likewise.
The Trainer registers every optimizer at fit start (``lightning_setup``), so no gradient is pending on parameters no
registered optimizer holds there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin


def _fp16() -> FabricMixedPrecisionPlugin:
    return FabricMixedPrecisionPlugin("O2", half_dtype="float16", init_scale=256.0, growth_interval=1)


def _gan(
    mpx: FabricMixedPrecisionPlugin | None,
    read: str | None,
    *,
    register: bool = False,
    overflow: bool = False,
    regrad: bool = False,
) -> tuple[list[torch.Tensor], list[float]]:
    """A Fabric GAN: both backwards, D's step, a read (``read``: "scale" or "metrics"), G's step, three iterations
    (growth every iteration). ``overflow``: D's first loss overflows float16 (its step skipped at the update the read
    runs); ``regrad``: G's gradients zeroed after the read and computed again (nothing carried). ``mpx=None``: FP32.
    Returns the weights (G's first) and the scale after each iteration."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx] if mpx is not None else None,
                    precision=None if mpx is not None else "32-true")  # fmt: skip
    torch.manual_seed(0)
    g_net, d_net = nn.Linear(4, 4), nn.Linear(4, 1)
    g, g_opt = fabric.setup(g_net, torch.optim.SGD(g_net.parameters(), lr=0.1))
    d, d_opt = fabric.setup(d_net, torch.optim.SGD(d_net.parameters(), lr=0.1))
    if register and mpx is not None:
        mpx.setup_optimizers(g_opt, d_opt)
    scales = []
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        boost = 6e4 if overflow and step == 0 and mpx is not None else 1.0
        fabric.backward(d(x).float().pow(2).mean() * boost)
        fabric.backward(g(x).float().pow(2).mean())
        d_opt.step()
        if read == "scale":
            fabric._precision.scaler.get_scale()
        elif read == "metrics":
            mpx.metrics()  # type: ignore[union-attr]
        if regrad:
            g_opt.zero_grad(set_to_none=False)
            fabric.backward(g(x).float().pow(2).mean())
        g_opt.step()
        d_opt.zero_grad()
        g_opt.zero_grad()
        if mpx is not None:
            scales.append(mpx.scaler.get_scale())
    return [p.detach().float().clone() for p in (*g_net.parameters(), *d_net.parameters())], scales


def _max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want))


@pytest.mark.parametrize("read", ["scale", "metrics"])
def test_a_read_between_a_gans_first_steps_keeps_the_unregistered_generators_gradients(read: str) -> None:
    """Without ``mpx.setup_optimizers``: the same loop with a read after D's step gives the weights (and scales) of
    the loop without it, of the loop with both optimizers registered up front, and FP32's."""
    fp32, _ = _gan(None, None)
    without_read, scales = _gan(_fp16(), None)
    with_read, read_scales = _gan(_fp16(), read)
    assert _max_error(without_read, fp32) < 1e-3
    assert _max_error(with_read, without_read) < 1e-6
    assert _max_error(with_read, _gan(_fp16(), read, register=True)[0]) < 1e-6
    assert read_scales[-1] > scales[-1] > 256.0  # it grew, once more per iteration with the read (two updates)


def test_a_skip_in_ds_step_at_that_update_leaves_gs_first_step_at_its_scale() -> None:
    """D's first loss overflows: the update the read runs after D's step skips it and halves the scale; G's first
    step still unscales its gradients by the scale they were computed with (G's weights: FP32's; all: those of the
    loop without the read and of the registered one)."""
    fp32, _ = _gan(None, None)
    mpx = _fp16()
    with_read, scales = _gan(mpx, "scale", overflow=True)
    assert mpx.metrics()["mpx/skipped_steps"] == 1 and scales[0] == 256.0  # halved at the read, grown after G
    assert _max_error(with_read, _gan(_fp16(), None, overflow=True)[0]) < 1e-6
    assert _max_error(with_read, _gan(_fp16(), "scale", overflow=True, register=True)[0]) < 1e-6
    assert _max_error(with_read[:2], fp32[:2]) < 1e-3  # G's weight and bias: D's skip leaves G alone


def test_gs_gradients_recomputed_after_the_update_carry_nothing() -> None:
    """G's gradients zeroed in place after the read and computed again (at the new scale): G's first step unscales them
    by the new scale, as the registered loop does, and matches FP32."""
    fp32, _ = _gan(None, None, regrad=True)
    with_read, _ = _gan(_fp16(), "scale", regrad=True)
    assert _max_error(with_read, _gan(_fp16(), "scale", regrad=True, register=True)[0]) < 1e-6
    assert _max_error(with_read, fp32) < 1e-3


def _core(late: bool | None) -> list[torch.Tensor]:
    """The core ``Amp`` at O2, float16, ``num_losses=2`` (D on loss 0, G on loss 1): both backwards, D's step, an
    update (loss 0's scale grows), G's step. ``late``: G's optimizer prepared only after the first update; ``None``:
    FP32 (no engine)."""
    amp = None if late is None else Amp("O2", num_losses=2, half_dtype="float16", init_scale=256.0, growth_interval=1)
    torch.manual_seed(0)
    g_net, d_net = nn.Linear(4, 4), nn.Linear(4, 1)
    if amp is not None:
        amp.prepare_model(g_net), amp.prepare_model(d_net)
    d_opt, g_opt = torch.optim.SGD(d_net.parameters(), lr=0.1), torch.optim.SGD(g_net.parameters(), lr=0.1)
    for opt in (d_opt, g_opt) if amp is not None and not late else (d_opt,) if amp is not None else ():
        amp.prepare_optimizer(opt)  # type: ignore[union-attr]
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        if amp is None:
            d_net(x).pow(2).mean().backward()
            g_net(x).pow(2).mean().backward()
            d_opt.step(), g_opt.step(), d_opt.zero_grad(), g_opt.zero_grad()
            continue
        with amp.forward_context():
            d_loss, g_loss = d_net(x.half()).float().pow(2).mean(), g_net(x.half()).float().pow(2).mean()
        amp.backward(d_loss, loss_id=0)
        amp.backward(g_loss, loss_id=1)
        amp.step(d_opt)
        amp.update()
        if late and step == 0:
            amp.prepare_optimizer(g_opt)
        amp.step(g_opt)
        amp.update()
        d_opt.zero_grad(), g_opt.zero_grad()
    if amp is None:
        return [p.detach().clone() for p in (*g_net.parameters(), *d_net.parameters())]
    states: list[dict[str, Any]] = [amp.fp32_state_dict(m) for m in (g_net, d_net)]
    return [v.float().clone() for state in states for v in state.values()]


def test_core_amp_optimizer_prepared_after_an_update_takes_its_losss_scale() -> None:
    """G's optimizer prepared after the update that grew loss 0's scale: its first step unscales G's gradients by
    loss 1's scale, which they carry (as when it was prepared up front), not loss 0's."""
    late, early = _core(True), _core(False)
    assert _max_error(late, early) < 1e-6
    assert _max_error(late, _core(None)) < 1e-3


# -- the cost where nothing is registered late: an optimizer over part of a model whose rest still requires grad -------


def _fine_tune(dtype: str, layers: int) -> tuple[Amp, nn.Sequential, Any]:
    """Core ``Amp`` at O2: an optimizer over the last layer only, the layers before it left requiring grad (a head
    fine-tuned without freezing the backbone): their gradients, on parameters no optimizer holds, pile up."""
    torch.manual_seed(0)
    amp = Amp("O2", half_dtype=dtype)
    model = amp.prepare_model(nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)]))
    opt = amp.prepare_optimizer(torch.optim.SGD(model[-1].parameters(), lr=1e-3))
    x = torch.randn(4, 8)

    def step() -> None:
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().pow(2).mean()
        amp.backward(loss)
        amp.step(opt)
        amp.update()
        opt.zero_grad()

    return amp, model, step


def _engine_calls_per_step(dtype: str, layers: int) -> tuple[float, float]:
    """Python calls per steady step into engine/raw_steps.py and engine/carried_scales.py (what the unheld
    parameters cost), and into carried_scales.py alone."""
    import sys

    _, _, step = _fine_tune(dtype, layers)
    for _ in range(2):
        step()
    counts = [0, 0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            counts[0] += name.endswith(("raw_steps.py", "carried_scales.py"))
            counts[1] += name.endswith("carried_scales.py")

    sys.setprofile(profile)
    try:
        for _ in range(4):
            step()
    finally:
        sys.setprofile(None)
    return counts[0] / 4, counts[1] / 4


_UNHELD = pytest.mark.filterwarnings("ignore:.*require grad but no optimizer holds them")


@_UNHELD
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_backbone_left_requiring_grad_costs_no_python_call_per_parameter(dtype: str) -> None:
    """A static scale (bfloat16's) never moves: nothing is kept for a late optimizer, so no step calls into
    engine/carried_scales.py. A dynamic one (float16): a fixed few calls per step, however many parameters no optimizer
    holds (C-level maps, not a loop over them)."""
    shallow, deep = _engine_calls_per_step(dtype, 2), _engine_calls_per_step(dtype, 6)
    assert shallow[0] == deep[0], (shallow, deep)  # nothing per parameter
    assert deep[1] == (0 if dtype == "bfloat16" else 2), deep  # float16: the note at the backward, the carry at update


@_UNHELD
def test_zero_grad_frees_the_gradients_no_optimizer_holds_at_a_dynamic_scale() -> None:
    """What is kept of the gradients on the backbone (to carry their scale) holds none of them: ``zero_grad()`` over
    the model frees them."""
    import weakref

    amp, model, step = _fine_tune("float16", 3)
    for _ in range(3):
        step()
    grads = [weakref.ref(p.grad) for p in model[0].parameters()]
    assert all(ref() is not None for ref in grads)
    model.zero_grad(set_to_none=True)
    assert all(ref() is None for ref in grads)
