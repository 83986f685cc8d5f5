"""The per-optimizer stages through a real ``lightning_mpx.integrations.accelerate.Accelerator`` on CPU, against the
same loop with Accelerate in FP32 (``mixed_precision="no"``): a loop that clips and then skips a bad batch, a backward
between a clip and the step, a GAN whose overflow is charged to its own loss, numpy loss ids and consecutive
hysteresis."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("accelerate")

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402
from tests.accelerate_helpers import prepared_gan, reset_accelerate_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's singleton state: none at each start

TOLERANCE = dict(rtol=1e-3, atol=5e-4)  # float16 against FP32 after a few steps


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(seed: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _accelerator(level: str, **settings) -> Accelerator:
    if level == "no":
        return Accelerator(mixed_precision="no")
    return Accelerator(mixed_precision=level, kwargs_handlers=[MixedPrecisionKwargs(**settings)])


def _trained(opt) -> list[torch.Tensor]:
    """What the optimizer updates: the model's parameters, or the FP32 masters at O2."""
    amp = getattr(opt, "amp", None)
    if amp is not None:
        return amp.master_params(opt.optimizer)
    return [p for group in opt.param_groups for p in group["params"]]


def _run(level: str, loop, **settings) -> list[torch.Tensor]:
    """Run ``loop(accelerator, model, opt)`` at ``level`` and return what the optimizer trains (FP32 masters at O2)."""
    reset_accelerate_state()
    accelerator = _accelerator(level, **settings)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    model, opt = accelerator.prepare(model, opt)
    loop(accelerator, model, opt)
    return [p.detach().float().clone() for p in _trained(opt)]


def _assert_trains_as_fp32(level: str, loop) -> None:
    """What ``loop`` trains at ``level`` (initial scale 2**10) is what it trains with Accelerate in FP32."""
    got = _run(level, loop, init_scale=2.0**10)
    want = _run("no", loop)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOLERANCE)


def _clip(accelerator, model, how: str) -> torch.Tensor | None:
    if how == "clip_grad_norm_":  # the fused path: the engine unscales, checks, measures and clips in one pass
        return accelerator.clip_grad_norm_(model.parameters(), 10.0)
    if how == "clip_grad_value_":  # the adapter unscales, then clamps
        accelerator.clip_grad_value_(model.parameters(), 0.1)  # bites on some true gradients, not all
        return None
    accelerator.unscale_gradients()  # then a clip of your own
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0, norm_type=float("inf"))


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("how", ["clip_grad_norm_", "clip_grad_value_", "unscale_gradients"])
def test_a_loop_that_clips_then_skips_a_bad_batch_matches_fp32(level, how):
    # The adapter calls no update() when no optimizer stepped. Before the fix, the skipped batch's unscale stayed in
    # force: the next batch's gradients were stepped still scaled (clipped to 10 by norm, or clamped to 0.1 and then
    # unscaled by the adapter's own stale flag for the value clip).
    def loop(accelerator, model, opt):
        for seed in range(4):
            x, y = _batch(seed)
            accelerator.backward(F.cross_entropy(model(x), y))
            _clip(accelerator, model, how)
            if seed == 1:  # a bad batch: skipped after the clip
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()

    _assert_trains_as_fp32(level, loop)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_backward_between_clip_and_step_matches_fp32(level):
    # Accumulating after a clip: before the fix the second backward's gradients were stepped 1024x too large here.
    def loop(accelerator, model, opt):
        for seed in range(0, 6, 2):
            for part, (x, y) in enumerate((_batch(seed), _batch(seed + 1))):
                accelerator.backward(F.cross_entropy(model(x), y))
                if part == 0:
                    accelerator.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()

    _assert_trains_as_fp32(level, loop)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("id_type", [int, np.int64])
def test_a_discriminator_overflow_backs_off_only_its_own_scale(level, id_type):
    # The generator's loss (1) reaches the discriminator, whose gradients are zeroed with set_to_none=False. Before
    # the fix the zeroed tensors made loss 1 count in the discriminator's next step: both scales backed off. numpy
    # loss ids were refused.
    accelerator = _accelerator(level, num_losses=2, init_scale=256.0, half_dtype="float16")  # dynamic scales
    gen, disc, opt_g, opt_d = prepared_gan(accelerator)
    bce = F.binary_cross_entropy_with_logits
    skipped = []
    for it in range(3):
        z, real = torch.randn(16, 4), torch.randn(16, 8)
        d_loss = bce(disc(real), torch.ones(16, 1)) + bce(disc(gen(z).detach()), torch.zeros(16, 1))
        accelerator.backward(d_loss, loss_id=id_type(0))
        if it == 1:
            with torch.no_grad():
                disc[0].weight.grad[0, 0] = float("nan")
        opt_d.step()
        opt_d.zero_grad(set_to_none=False)
        accelerator.backward(bce(disc(gen(z)), torch.ones(16, 1)), loss_id=id_type(1))
        opt_g.step()
        opt_g.zero_grad(set_to_none=False)
        opt_d.zero_grad(set_to_none=False)
        skipped.append((opt_d.step_was_skipped, opt_g.step_was_skipped))
    assert skipped == [(False, False), (True, False), (False, False)]
    metrics = accelerator.mpx_metrics()
    assert (metrics["mpx/loss_scale/loss0"], metrics["mpx/loss_scale/loss1"]) == (128.0, 256.0)
    assert accelerator.amp.skipped_steps == [1, 0]


def test_consecutive_hysteresis_through_the_kwargs_handler():
    accelerator = _accelerator("O1", hysteresis=2, consecutive_hysteresis=True)
    assert accelerator.amp.scalers[0].consecutive_hysteresis is True
    with pytest.raises(TypeError, match="consecutive_hysteresis='on' must be True or False"):
        MixedPrecisionKwargs(consecutive_hysteresis="on")
