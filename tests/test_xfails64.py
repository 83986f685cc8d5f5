"""Stop 64's strict xfails made to pass (tests/test_compile58.py, ...), and what their fixes also cover.

A model compiled after the Accelerate adapter's ``prepare`` traces ``Amp.forward_context`` (its new-group check and a
schedule-free optimizer's flags) into the graph: an attribute read of a torch optimizer's ``param_groups`` there made
dynamo guard on every value of every group, so a per-step learning-rate schedule recompiled the forward after the
first step, as a schedule-free group's step count did (tests/test_compile58.py's xfail)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_compile_doors import _batch, _counted, _Net, _no_worse


def _accelerate_scheduled(level: str | None) -> tuple[int, int, int]:
    """dynamo's counts over ``STEPS`` steps of a model compiled after ``accelerator.prepare``, its SGD's learning
    rate changed at every step by a prepared ``LambdaLR`` (``level`` None: Accelerate's own "bf16")."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator as TheirAccelerator

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import accelerate_state_reset

    with accelerate_state_reset():
        net = _Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
        runner = (Accelerator(mixed_precision=level, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])
                  if level else TheirAccelerator(mixed_precision="bf16"))  # fmt: skip
        model, opt, schedule = runner.prepare(net, opt, schedule)
        model = torch.compile(model, backend="aot_eager")

        def step(i: int) -> float:
            x, y = _batch(i)
            loss = F.cross_entropy(model(x).float(), y)
            runner.backward(loss)
            opt.step()
            schedule.step()
            opt.zero_grad()
            return loss.item()

        return _counted(step)[0]


@pytest.mark.usefixtures("fresh_dynamo")
def test_accelerate_o2_compiled_with_a_per_step_schedule_recompiles_nothing_as_bf16(monkeypatch) -> None:
    """Accelerate O2, the model compiled after ``prepare``, a ``LambdaLR`` stepped every step: one graph, no break,
    nothing compiled after the first step, as Accelerate's own "bf16" (before: a recompile at the second step, the
    forward guarded on the group's ``lr``). Two steps: the second one's is the recompile."""
    monkeypatch.setattr("tests.test_compile_doors.STEPS", 2)
    ours = _accelerate_scheduled("O2")
    assert ours[2] == 0, f"graphs compiled after the first step: {ours}"
    _no_worse(ours, _accelerate_scheduled(None))
