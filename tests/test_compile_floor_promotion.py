"""on_floor="promote" and the overflow forensics of models run under ``torch.compile``: the module blamed is the one
that overflowed, as in the same run without compilation, or the floor error says why none can be told; never the
whole model through the compiled wrapper's ``_orig_mod``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin, LossScaleFloorError


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.boom, self.norm, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.boom(self.enc(x))))


@pytest.mark.parametrize("diagnose", [False, True])
def test_fabric_reapplies_compile_after_preparing_and_the_floor_error_says_the_watch_saw_no_module(diagnose):
    # fabric.setup(torch.compile(net)) prepares the net and compiles it afterwards: the watch armed at the floor puts
    # its hooks on after compilation, which are not traced in, and saw only the net's own call. The floor error said
    # "the last 2 overflows at the floor came from different modules (boom, enc, head, norm / )" (the second: the
    # whole model, an empty name); the advice it gives now (diagnose_overflows=True) promotes boom.
    from lightning.fabric import Fabric

    torch._dynamo.reset()  # a model class compiled before in this process keeps its code, traced without hooks
    torch.manual_seed(0)
    plugin = FabricMixedPrecisionPlugin(
        "O1", half_dtype="float16", init_scale=4.0, min_loss_scale=1.0, on_floor="promote", diagnose_overflows=diagnose
    )
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _Net()
    model, optimizer = fabric.setup(torch.compile(net, backend="eager"), torch.optim.SGD(net.parameters(), lr=1e-3))
    firsts: set[str] = set()

    def train(steps: int) -> None:
        for step in range(steps):
            if step == 2:
                with torch.no_grad():
                    net.boom.weight.mul_(3e5)
            fabric.backward(model(torch.randn(4, 8)).float().square().mean())
            optimizer.step()
            optimizer.zero_grad()
            firsts.update(key for key in plugin.amp.metrics() if key.startswith("mpx/overflow_first/"))

    if diagnose:
        train(7)
        assert plugin.amp.fp32_modules == ["boom"]
        assert firsts == {"mpx/overflow_first/boom"}
        return
    with pytest.raises(LossScaleFloorError, match="saw the call of the whole model but of no module inside it"):
        train(7)
    assert plugin.amp.fp32_modules == [] and firsts == set()  # the whole model is not named as the first


class _Scaled(nn.Module):
    """A model whose own forward scales ``enc``'s output (``gain``): code in the root model's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.boom, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.boom(self.enc(x) * self.gain))


def _floor_error(compiled: bool) -> tuple[str, list[str]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    amp = Amp("O2", half_dtype="float16", init_scale=4.0, min_loss_scale=1.0, on_floor="promote")
    net = _Scaled()
    model = amp.prepare_model(torch.compile(net, backend="eager") if compiled else net)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    with pytest.raises(LossScaleFloorError) as raised:
        for step in range(7):
            net.gain = 1e6 if step >= 2 else 1.0
            with amp.forward_context():
                loss = amp.cast_outputs(model(amp.cast_inputs(torch.randn(4, 8)))).float().square().mean()
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()
    return str(raised.value), amp.fp32_modules


def test_code_in_a_compiled_models_own_forward_is_refused_at_o2_as_without_compile():
    # At O2 torch.compile(net) named the code in _orig_mod's forward, took _orig_mod for a submodule and promoted it
    # (fp32_modules ['_orig_mod']: the whole model) and the next step crashed on the dtype of an FP32 parameter ("Call
    # model.half()/.float()/.to(dtype) before prepare_model()"); the same model uncompiled is refused at the floor.
    plain, plain_modules = _floor_error(compiled=False)
    compiled, compiled_modules = _floor_error(compiled=True)
    assert plain_modules == compiled_modules == []
    told = "cannot run the code in <root>'s forward, between enc's output and boom's input in FP32"
    assert told in plain and told in compiled, compiled


def _promoting_run(level: str, compiled: bool, state: dict | None = None) -> tuple[Amp, list[float]]:
    """A float16 run of ``_Net`` whose ``boom`` overflows from step 2 on (promoted at step 5), six steps; resumed
    from ``state`` (with the weights of ``state["model"]``): two more steps. The losses of the steps."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    amp = Amp(level, half_dtype="float16", init_scale=4.0, min_loss_scale=1.0, on_floor="promote")
    net = _Net()
    model = amp.prepare_model(torch.compile(net, backend="eager") if compiled else net)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    if state is not None:
        amp.load_state_dict(state["amp"])
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    generator = torch.Generator().manual_seed(1 if state is not None else 0)
    losses = []
    for step in range(2 if state is not None else 6):
        if step == 2 and state is None:
            with torch.no_grad():
                net.boom.weight.mul_(3e5)
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(torch.randn(4, 8, generator=generator)))).float()
            loss = loss.square().mean()
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    if state is None:  # the state the resumes start from
        amp._saved = {"amp": amp.state_dict(), "model": net.state_dict(), "optimizer": optimizer.state_dict()}
    return amp, losses


def test_a_compiled_runs_promotion_resumes_without_compile_as_the_uncompiled_runs_checkpoint():
    # The checkpoint of a compiled run promoted "_orig_mod.boom": the same model resumed without torch.compile (an
    # evaluation, a debugging session) was refused: "KeyError: the checkpoint promoted module '_orig_mod.boom' to
    # FP32, but the prepared model(s) have no module of that name". It is the user's "boom", as the tags name it, and
    # the resume trains as the resume of the same run uncompiled (eager backend: the same kernels).
    compiled_run, compiled_losses = _promoting_run("O1", compiled=True)
    plain_run, plain_losses = _promoting_run("O1", compiled=False)
    assert (compiled_run.fp32_modules, plain_run.fp32_modules) == (["_orig_mod.boom"], ["boom"])
    assert compiled_losses[:2] == pytest.approx(plain_losses[:2], rel=1e-4)  # (then NaN: boom overflows)
    resumed, resumed_losses = _promoting_run("O1", compiled=False, state=compiled_run._saved)
    reference, reference_losses = _promoting_run("O1", compiled=False, state=plain_run._saved)
    assert resumed.fp32_modules == reference.fp32_modules == ["boom"]
    assert {k for k in resumed.metrics() if "promoted" in k} == {"mpx/promoted/boom"}
    assert resumed_losses == pytest.approx(reference_losses, rel=1e-4)
    assert all(torch.isfinite(torch.tensor(resumed_losses)))
