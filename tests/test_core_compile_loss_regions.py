"""``torch.compile`` at O2 bfloat16 with stop 57's and 58's changes in what dynamo sees: the loss regions' hooks on a
prepared model's loss-free children (``casting/loss_regions.py``), a schedule-free optimizer's
``eval()``/``train()`` redone on the masters at the next forward (``masters/swap.py`` ``follow_modes``) and SAM's two
passes; each against the same code eager (losses, weights) and the framework's own precision compiled the same way
(``torch.autocast``, ``"bf16-mixed"``, ``mixed_precision="bf16"``): no more graphs, graph breaks or recompiles.
Counts are dynamo's (``aot_eager``), by ``tests/test_compile_doors.py``'s ``_counted``.

Through Fabric with the model compiled after ``fabric.setup`` and a schedule-free optimizer flipped
``train()``/``eval()`` around each step's evaluation, dynamo runs ``_FabricModule.forward`` eagerly (Fabric's backward
hook breaks it) and compiled each call in it as a frame of its own: the plugin's forward scope traced ``follow_modes``
(``masters/swap.py`` ``call_on_masters``, ``masters/mirror.py`` ``copy_to_model``) and guarded on the ``train_mode``
flags: 18 graphs / 23 breaks / 6 recompiles over 3 steps (two per flip) against "bf16-mixed"'s 6/1/0. The plugin
now runs its scope untraced once it met a schedule-free optimizer (``integrations/fabric.py`` ``_untraced_scope``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_mpx import Amp
from tests.test_compile_doors import _batch, _counted, _Net, _no_worse
from tests.test_core_sam import DoorSAM
from tests.test_lightning_schedule_free import ScheduleFreeAdamW

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _compile(module: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(module, backend="aot_eager")


def _weights(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in net.state_dict().items()}


def _core(place: str | None, sam: bool = False) -> tuple[tuple[int, int, int], list[float], dict[str, torch.Tensor]]:
    """The core loop at O2 bfloat16 (``place``: "after" ``prepare_model``, "inplace" ``model.compile()``, None eager;
    ``"autocast"``: FP32 under ``torch.autocast``, compiled); SGD, or SAM's two passes (the documented recipe)."""
    net = _Net()
    if place == "autocast":
        model, amp = _compile(net), None
    else:
        amp = Amp("O2", half_dtype="bfloat16")
        model = amp.prepare_model(net)
        if place == "after":
            model = _compile(model)
        elif place == "inplace":
            model.compile(backend="aot_eager")
    base = DoorSAM(net.parameters(), torch.optim.SGD, lr=0.1) if sam else torch.optim.SGD(net.parameters(), lr=0.1)
    opt = base if amp is None else amp.prepare_optimizer(base)

    def loss_at(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if amp is None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return F.cross_entropy(model(x).float(), y)
        with amp.forward_context():
            return F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)

    def backward(loss: torch.Tensor) -> None:
        loss.backward() if amp is None else amp.backward(loss)

    def step(i: int) -> float:
        x, y = _batch(i)
        loss = loss_at(x, y)
        backward(loss)
        if sam:
            opt.first_step(zero_grad=True)
            backward(loss_at(x, y))  # at the perturbed weights
            opt.second_step()
        if amp is None:
            opt.step()
        else:
            amp.step(opt)
            amp.update()
        opt.zero_grad()
        return loss.item()

    counts, losses = _counted(step)
    return counts, losses, _weights(net)


@pytest.mark.parametrize(("place", "sam"), [("after", False), ("inplace", False), ("after", True)])
def test_core_o2_compiles_as_autocast_and_trains_as_eager(place: str, sam: bool) -> None:
    """``torch.compile(model)`` after ``amp.prepare_model`` (the regions' hooks traced, the casts in the graph) or
    ``model.compile()`` in place, with SGD or SAM's two passes per step: autocast's counts (one graph, no break, no
    recompile), eager O2's losses and weights."""
    counts, losses, weights = _core(place, sam)
    _no_worse(counts, _core("autocast", sam)[0])
    _, eager_losses, eager_weights = _core(None, sam)
    assert losses == eager_losses
    for key, value in eager_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")


def _schedule_free(
    door: str, level: str | None, compiled: bool = True
) -> tuple[tuple[int, int, int], list[float], dict[str, Any]]:
    """A schedule-free optimizer flipped ``train()``/``eval()`` around every step's evaluation (under ``no_grad``), the
    model compiled after ``fabric.setup`` / ``accelerator.prepare`` (``level`` None: the framework's own bf16;
    ``compiled`` False: eager)."""
    from tests.accelerate_helpers import accelerate_state_reset

    with accelerate_state_reset():
        net = _Net()
        opt = ScheduleFreeAdamW(net.parameters(), lr=0.01)
        if door == "fabric":
            pytest.importorskip("lightning")
            from lightning.fabric import Fabric

            from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin

            ours = {"plugins": [FabricMixedPrecisionPlugin(level, half_dtype="bfloat16")]} if level else {}
            runner = Fabric(accelerator="cpu", devices=1, **(ours or {"precision": "bf16-mixed"}))
            model, opt = runner.setup(net, opt)
        else:
            pytest.importorskip("accelerate")
            from accelerate import Accelerator as TheirAccelerator

            from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

            runner = (Accelerator(mixed_precision=level, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])
                      if level else TheirAccelerator(mixed_precision="bf16"))
            model, opt = runner.prepare(net, opt)
        model = _compile(model) if compiled else model
        evals = []

        def step(i: int) -> float:
            x, y = _batch(i)
            opt.train()
            loss = F.cross_entropy(model(x).float(), y)
            runner.backward(loss)
            opt.step()
            opt.zero_grad()
            opt.eval()
            with torch.no_grad():
                evals.append(F.cross_entropy(model(x).float(), y).item())
            return loss.item()

        counts, losses = _counted(step)
        return counts, losses, {"evals": evals, **_weights(net)}


def test_fabric_schedule_free_flips_compile_as_bf16_mixed_and_train_as_eager(monkeypatch) -> None:
    """Fabric O2, the model compiled after ``fabric.setup``, ``opt.train()``/``opt.eval()`` around every step: no more
    graphs, breaks or recompiles than "bf16-mixed" compiled the same way (before: 18/23/6 over two steps), and eager
    O2's losses, evaluations (at the averaged point) and final weights exactly. Two steps: the second one's flips."""
    monkeypatch.setattr("tests.test_compile_doors.STEPS", 2)
    counts, losses, values = _schedule_free("fabric", "O2")
    _no_worse(counts, _schedule_free("fabric", None)[0])
    _, eager_losses, eager_values = _schedule_free("fabric", "O2", compiled=False)
    assert losses == eager_losses
    assert values.pop("evals") == eager_values.pop("evals")
    for key, value in eager_values.items():
        torch.testing.assert_close(values[key], value, rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")


# Measured (tests/test_core_compile_loss_regions.py's probes): the compiled O2 runs of both doors hold eager O2's
# losses, evaluations and weights exactly. Fabric's own "bf16-mixed" compiled after setup: 6 graphs, 1 break (its
# backward hook), no recompile; Accelerate's "bf16": 2/0/0, as O2 now (3/0/1 before stop 64: Amp.forward_context, traced
# inside the adapter's compiled forward, read opt.param_groups, and dynamo guarded on the group's step count 'k' == 0).
@pytest.mark.parametrize("door", ["accelerate"])
def test_schedule_free_flips_between_compiled_steps_recompile_nothing(door: str, monkeypatch) -> None:
    """``opt.train()``/``opt.eval()`` around every step, the model compiled after the door: nothing compiled after
    the first step (its training and ``no_grad`` evaluation graphs), as under the framework's own bf16."""
    monkeypatch.setattr("tests.test_compile_doors.STEPS", 2)  # the second step's flips are the point
    counts, _, values = _schedule_free(door, "O2")
    assert all(map(torch.isfinite, map(torch.as_tensor, values["evals"])))
    assert counts[2] == 0, f"graphs compiled after the first step: {counts[2]} (graphs, breaks, after: {counts})"
