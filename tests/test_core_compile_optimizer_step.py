"""A compiled optimizer step, torch's recipe ("Compiling the optimizer": ``torch.compile(opt.step)`` called in the
loop), as users port it to the doors (``aot_eager``/``eager`` backends, bfloat16 unless the dynamic scale is the point).

Measured (torch 2.13, CPU, 3 steps of Adam(foreach=True), tiny model; weights against the same loop eager):

- Fabric (``fabric.setup(model, opt)``, then ``torch.compile(opt.step)``) and a Trainer's manual optimization
  (``step = torch.compile(self.optimizers().step)``), O1 and O2 bfloat16: works, the weights are eager's (max
  difference 4e-7 of the FP32 masters; Trainer O1 5.6e-5 after 3 steps, bfloat16 forwards). O2 float16 with an
  overflow injected: the step is skipped and the scale halved, as eager. The cost is dynamo's: it traces the engine's
  step (unscale, overflow check, masters' copy): Fabric O2 14 graphs, 39 graph breaks, recompiles at the second step
  (guards on the engine's first-step state: ``self.steps == 0``, ``state.loss_id is None``,
  ``self._one_call is None``), then none; 12-19 s of tracing against 0.4 s eager on this machine. Not tested here
  (over this file's time budget).
- O2's second compiled fit (``trainer.validate`` then ``trainer.fit`` of the same ``torch.compile(module)``, or two
  fits): ``training_step`` recompiles once, guard ``___dict_contains(<hook id>,
  fn.fn.__self__._modules['net']._forward_hooks_always_called)``: the new plugin's boundary-cast hooks have new ids
  (docs/compile.md; not tested here: 6 s).
- The core loop: ``torch.compile(opt.step)`` called instead of ``amp.step(opt)`` is a raw step. O2 (masters in the
  groups) and a dynamic loss scale are refused at that call, naming ``amp.step(optimizer)``; O1 with bfloat16's
  static 1.0 scale steps the FP32 weights with the true gradients, as eager. ``torch.compile`` over a function that
  calls ``amp.step(opt)`` works (masters 1.2e-7 from eager after a step; an overflowing float16 step is skipped) but
  traces the engine as above (12 graphs, 25 breaks).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_mpx import Amp
from tests.test_compile_doors import _batch, _Net

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _core_loop(level: str, half_dtype: str, compiled: bool, steps: int = 2) -> torch.Tensor:
    """The core loop of docs/core.md with Adam(foreach=True), stepped by ``torch.compile(opt.step)`` (``compiled``)
    or ``amp.step(opt)``; the FP32 weights (O2: the masters) after ``steps`` steps, flat."""
    amp = Amp(level, half_dtype=half_dtype)
    net = amp.prepare_model(_Net())
    opt = amp.prepare_optimizer(torch.optim.Adam(net.parameters(), lr=1e-2, foreach=True))
    step = torch.compile(opt.step, backend="eager") if compiled else (lambda: amp.step(opt))
    for i in range(steps):
        x, y = _batch(i)
        with amp.forward_context():
            loss = F.cross_entropy(amp.cast_outputs(net(amp.cast_inputs(x))).float(), y)
        amp.backward(loss)
        step()
        amp.update()
        opt.zero_grad()
    return torch.cat([v.detach().float().flatten() for v in amp.fp32_state_dict(net).values()])


def test_core_o2_compiled_optimizer_step_is_refused_naming_amp_step():
    """O2: the groups hold the FP32 masters and the gradients are the half model's; a compiled ``opt.step`` in
    place of ``amp.step(opt)`` is refused at that call, naming the call to make."""
    with pytest.raises(RuntimeError, match=r"outside Amp\.step\(\).*amp\.step\(optimizer\)"):
        _core_loop("O2", "bfloat16", compiled=True)


def test_core_o1_float16_compiled_optimizer_step_is_refused_under_the_dynamic_scale():
    """O1 float16: the gradients carry the dynamic scale (65536); the compiled raw step would apply them multiplied
    by it. Refused at that call, naming ``amp.step(optimizer)``."""
    with pytest.raises(RuntimeError, match=r"dynamic loss scale.*amp\.step\(optimizer\)"):
        _core_loop("O1", "float16", compiled=True)


def test_core_o1_bfloat16_compiled_optimizer_step_trains_as_eager():
    """O1 bfloat16 (a static scale of 1.0, FP32 weights): the compiled raw step is torch's Adam on the true
    gradients; the weights after two steps are the eager loop's (``amp.step``)."""
    eager = _core_loop("O1", "bfloat16", compiled=False)
    compiled = _core_loop("O1", "bfloat16", compiled=True)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)
    assert (eager - torch.cat([p.detach().flatten() for p in _Net().parameters()])).abs().max() > 1e-3  # it trained
