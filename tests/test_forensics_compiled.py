"""The forward watch (health/forensics.ForwardWatch) of models run under ``torch.compile``: its resident hooks, put on
the modules inside a compiled model when it is prepared, record each model's own calls."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_mpx import Amp
from tests.forensics_models import make_batch, make_net


def test_the_forward_watch_of_each_compiled_instance_of_one_class_sees_its_own_overflow():
    # Resident hooks (ForwardWatch._hook_compiled) of three models of one class, each torch.compile'd and prepared by
    # an Amp of its own: dynamo's code cache holds the first instance's traced hooks, and a second instance must not
    # run them (its own watch would see nothing). Each record names the layer that overflowed in that model, as the
    # uncompiled run does; the clean model records none (aot_eager traces the same hooks).
    def first_modules(compiled: bool) -> list[str | None]:
        torch._dynamo.reset()
        runs = []
        for case in ("activation", "clean", "activation"):
            amp = Amp("O1", half_dtype="float16", diagnose_overflows=True)
            net = make_net(case)
            model = amp.prepare_model(torch.compile(net, backend="eager") if compiled else net)
            runs.append((amp, model, amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))))
        seen = []
        for amp, model, optimizer in runs + runs[::-1]:
            x, y = make_batch("activation")
            with amp.forward_context():
                loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()
            record = amp.last_overflow
            seen.append(None if record is None else record.first_module.replace("_orig_mod.", ""))
        return seen

    plain = first_modules(compiled=False)
    assert plain == ["blow", None, "blow", "blow", None, "blow"]
    assert first_modules(compiled=True) == plain
