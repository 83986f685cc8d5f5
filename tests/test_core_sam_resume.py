"""O2 SAM: a checkpoint made between ``first_step`` and the step (a preemption handler's) resumes as the unbroken run
(docs/master_weights.md, "SAM and two-pass optimizers"). The model's entry holds the masters (the weights before
``first_step``), SAM's ``old_p`` goes to the masters' state, and the optimizer's state dict carries the perturbed half
weights the second pass runs at (``mpx_pass_weights``), put back into the half model when it loads. Through the core
``Amp`` here; through Fabric in tests/test_core_sam_ddp.py."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_mpx.masters.swap import PASS_WEIGHTS
from tests.test_core_sam import DoorSAM, _batch, _net, _weights

STEPS = 3


class StepSAM(DoorSAM):
    """The other recipe: no ``second_step``; ``step()`` restores ``old_p`` and then steps the base optimizer."""

    second_step = None  # type: ignore[assignment]

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if "old_p" in self.state[p]:
                        p.data = self.state[p].pop("old_p")
        return self.base_optimizer.step(closure)


def _roundtrip(obj: Any) -> Any:
    """Through a file's bytes, as a checkpoint goes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _run(cls: type = DoorSAM, *, save_at: int | None = None, ckpt: dict | None = None, edit: Any = None) -> dict:
    """O2 bfloat16 through the core: ``save_at``: the checkpoint (engine, model, optimizer, and the FP32 export)
    made right after that iteration's first_step (the run stops there); ``ckpt``: a fresh run loads it (``edit``
    applied to its optimizer entry first) and finishes that iteration and the rest."""
    from lightning_mpx import Amp

    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    optimizer = amp.prepare_optimizer(cls(model.parameters(), torch.optim.SGD, lr=0.1))
    start, mid = 0, False
    if ckpt is not None:
        ckpt = _roundtrip(ckpt)
        if edit is not None:
            edit(ckpt["optimizer"])
        amp.load_state_dict(ckpt["amp"])
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start, mid = ckpt["i"], True

    def backward(x: torch.Tensor, y: torch.Tensor) -> None:
        amp.backward(F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y))

    for i in range(start, STEPS):
        x, y = _batch(i)
        if not mid:
            backward(x, y)
            optimizer.first_step(zero_grad=True)
            if i == save_at:
                return {"amp": amp.state_dict(), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "i": i, "fp32": amp.fp32_state_dict(model), "half": _weights(model)}
        mid = False
        backward(x, y)  # at the perturbed weights
        if cls.second_step is not None:
            optimizer.second_step()
        assert amp.step(optimizer)
        optimizer.zero_grad()
        amp.end_iteration()
    return {**_weights(model), "masters": torch.cat([m.detach().flatten() for m in amp.master_params(optimizer)])}


@pytest.mark.parametrize("cls", [DoorSAM, StepSAM], ids=["second_step-restores", "step-restores"])
def test_core_o2_resumed_between_the_passes_equals_the_unbroken_run(cls: type):
    """amp/model/optimizer state dicts made after first_step, loaded into a fresh engine: the resumed run's second
    pass runs at the perturbed weights, and it ends bit-equal to the unbroken run (it ran the plain gradient's step,
    before). The engine's entry (the masters) and the FP32 export hold the weights before first_step, and SAM's
    old_p (keyed by the master, in FP32) holds their half rounding."""
    want = _run(cls)
    ckpt = _run(cls, save_at=1)
    passed = ckpt["optimizer"][PASS_WEIGHTS]
    params = list(ckpt["fp32"])
    assert sorted(passed) == list(range(len(params)))
    for index, name in enumerate(params):
        assert torch.equal(ckpt["amp"]["master_weights"][0][name], ckpt["fp32"][name])  # FP32, before first_step
        assert torch.equal(ckpt["optimizer"]["state"][index]["old_p"], ckpt["fp32"][name].bfloat16().float())
        assert torch.equal(passed[index], ckpt["half"][name])  # the perturbed half weights (the core's model entry)
        assert not torch.equal(passed[index].float(), ckpt["fp32"][name].bfloat16().float())
    got = _run(cls, ckpt=ckpt)
    assert all(torch.equal(got[k], want[k]) for k in want), {k: (got[k] - want[k]).abs().max().item() for k in want}


def test_checkpoint_without_the_pass_entry_loads_as_before():
    """A checkpoint of an earlier release (no mpx_pass_weights) loads: the second pass runs at the weights before
    first_step, as it did (the plain gradient's step); and one made after a step carries no such entry."""
    want = _run()
    ckpt = _run(save_at=1)
    got = _run(ckpt=ckpt, edit=lambda sd: sd.pop(PASS_WEIGHTS))
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    assert 1e-3 < diff < 5e-2  # measured 2e-2: the one step that took the plain gradient
    from lightning_mpx import Amp

    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(_net())
    optimizer = amp.prepare_optimizer(DoorSAM(model.parameters(), torch.optim.SGD, lr=0.1))
    assert PASS_WEIGHTS not in optimizer.state_dict()


def test_pass_entry_loads_where_nothing_reads_it_and_a_foreign_one_is_refused():
    """The entry is an extra key: an FP32 optimizer (an earlier release, or no engine) loads the state dict and
    ignores it. An entry that matches none of the optimizer's parameters is refused before anything loads."""
    ckpt = _roundtrip(_run(save_at=1))
    plain = DoorSAM(_net().parameters(), torch.optim.SGD, lr=0.1)
    plain.load_state_dict(ckpt["optimizer"])
    assert "old_p" in plain.state[plain.param_groups[0]["params"][0]]
    bad = dict(ckpt["optimizer"], **{PASS_WEIGHTS: {7: torch.zeros(2)}})
    with pytest.raises(ValueError, match=r"mpx_pass_weights\[7\] of the optimizer's state dict matches none of its 4"):
        _run(ckpt={**ckpt, "optimizer": bad})


@pytest.mark.parametrize("when", ["after-a-step", "between-the-passes"])
def test_o2_state_dict_leaves_a_step_restoring_sam_run_unchanged(when: str):
    """The recipe whose step() restores old_p: its restore runs where the groups hold the masters and finds none, so
    the old_p of each first_step stays with the half parameter. optimizer.state_dict() (a checkpoint each epoch) moved
    it to the master for good, and the next step wrote the master with it: a stale point, 7e-2 off the run without
    the state dict. The state is put back where it was once the state dict is made: bit-equal."""
    from lightning_mpx import Amp

    def run(save: bool) -> torch.Tensor:
        amp = Amp("O2", half_dtype="bfloat16")
        model = amp.prepare_model(_net())
        optimizer = amp.prepare_optimizer(StepSAM(model.parameters(), torch.optim.SGD, lr=0.1))
        for i in range(STEPS):
            x, y = _batch(i)
            for k in range(2):
                amp.backward(F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y))
                if k == 0:
                    optimizer.first_step(zero_grad=True)
                    if save and i == 1 and when == "between-the-passes":
                        assert "old_p" in optimizer.state_dict()["state"][0]
            amp.step(optimizer)
            optimizer.zero_grad()
            amp.end_iteration()
            if save and i == 0 and when == "after-a-step":
                optimizer.state_dict()
        return torch.cat([m.detach().flatten() for m in amp.master_params(optimizer)])

    want, got = run(False), run(True)
    assert torch.equal(got, want), (got - want).abs().max().item()
