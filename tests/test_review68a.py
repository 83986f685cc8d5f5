"""review68a: stop 68's engine fixes attacked as a hostile user (the O2 shared masters, gaps68, the backward after
an unscale, the O2 rollback), against FP32.

Found and fixed: at O2, in an accumulation loop that clips every micro-batch (``amp.clip_grad_norm_``, which leaves
the model's half gradients scaled), a raw ``torch.optim.SGD(model.parameters()).step()`` between the clip and the next
backward stepped the half weights with the still-scaled gradients: no refusal, the run silently 6.5 off FP32 (float16,
scale 2**8). The backward after an unscale never looked for a raw step (the accumulated-backwards look of
engine/raw_steps.py ran only on gradients no unscale had touched); now it looks at O2 as any accumulated backward does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


# -- 3. a raw step between an unscale (a clip) and the next accumulated backward -------------------------------------
def _clip_each_micro_batch(level: str | None, write: str) -> torch.Tensor:
    """Two micro-batches per step, a clip after each backward; after the first micro-batch's clip ``write``: a raw
    SGD step (``"raw"``), the same step undone from a copy (``"probe"``), a clamp (``"clamp"``)."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    amp = None
    if level is not None:
        amp = Amp(opt_level=level, half_dtype="float16", init_scale=2.0**8)
        net = amp.prepare_model(net)
        opt = amp.prepare_optimizer(opt)
    raw = torch.optim.SGD(net.parameters(), lr=0.1)
    for i, (x, y) in enumerate(_batches(4)):
        if amp is None:
            F.cross_entropy(net(x), y).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        else:
            with amp.forward_context():
                loss = F.cross_entropy(net(amp.cast_inputs(x)).float(), y)
            amp.backward(loss)
            amp.clip_grad_norm_(opt, 1.0)
        if i == 0 and write != "none":
            copies = [p.detach().clone() for p in net.parameters()]
            if write == "clamp":
                with torch.no_grad():
                    for p in net.parameters():
                        p.clamp_(-0.3, 0.3)
            else:
                raw.step()
            if write == "probe":
                with torch.no_grad():
                    for p, c in zip(net.parameters(), copies):
                        p.copy_(c)
        if i % 2 == 1:
            amp.step(opt) if amp is not None else opt.step()
            if amp is not None:
                amp.update()
            opt.zero_grad()
    values = amp.fp32_state_dict(net) if amp is not None else net.state_dict()
    return torch.cat([v.detach().float().flatten() for v in values.values()])


def test_o2_raw_step_between_a_clip_and_the_next_accumulated_backward_is_refused() -> None:
    """Was let through: the half weights stepped with gradients 256 times too large, 6.5 off FP32 after 2 steps."""
    with pytest.raises(RuntimeError, match="stepped along their gradients between two backwards"):
        _clip_each_micro_batch("O2", "raw")


@pytest.mark.parametrize("write", ["probe", "clamp", "none"])
def test_o2_writes_undone_or_of_another_kind_after_a_clip_train_as_fp32(write: str) -> None:
    """A descent probe undone before the next backward and a clamp are no raw step: trained on, as FP32."""
    got, want = _clip_each_micro_batch("O2", write), _clip_each_micro_batch(None, write)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


def test_o1_raw_step_after_a_clip_steps_true_gradients_as_fp32() -> None:
    """At O1 the clip unscaled the gradients in place: the raw step applies true values, as FP32's (left alone)."""
    torch.testing.assert_close(_clip_each_micro_batch("O1", "raw"), _clip_each_micro_batch(None, "raw"), rtol=0,
                               atol=2e-3)  # fmt: skip
