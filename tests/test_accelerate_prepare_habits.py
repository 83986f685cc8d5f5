"""The Accelerate adapter driven with habits the earlier hostile rounds left out, each checked against a reference:
the same script prepared in one call, or Accelerate's own ``mixed_precision="no"``.

Habits covered: a model prepared in a later ``prepare`` call than the optimizer that trains it (alone after
``prepare(model, optimizer)``, or model, optimizer and model in three calls; for evaluation only); the weights
``get_state_dict``, ``save_model`` and ``save_state`` write at O2 (then resumed by Accelerate's own ``"bf16"``, or
loaded into a new run; after ``free_memory()``; a model with extra state).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("accelerate")

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402
from tests.accelerate_helpers import reset_accelerate_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _accelerator(level, half="bfloat16", **kwargs):
    reset_accelerate_state()  # a fresh Accelerator, as in a new process
    handlers = [MixedPrecisionKwargs(half_dtype=half, init_scale=2.0**8)] if level.startswith("O") else None
    return Accelerator(mixed_precision=level, kwargs_handlers=handlers, cpu=True, **kwargs)


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- a model prepared after the optimizer that trains it ---------------------------------------------------------------
@functools.cache  # the references (one call; Accelerate's "no") serve both cases
def _encoder_head_run(calls, level="O2"):
    """An encoder and a head trained by one SGD (lr 1e-3, 5 steps), prepared as ``calls`` says; returns the FP32
    weights training produced (each model's ``fp32_state_dict`` at O2) and the head's master dtypes."""
    accelerator = _accelerator(level)
    encoder = _net()
    torch.manual_seed(1)
    head = nn.Linear(3, 3)
    opt = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=1e-3)
    if calls == "one":
        encoder, head, opt = accelerator.prepare(encoder, head, opt)
    elif calls == "head after":
        encoder, opt = accelerator.prepare(encoder, opt)
        head = accelerator.prepare(head)
    else:  # encoder, optimizer, head: three calls
        encoder = accelerator.prepare(encoder)
        opt = accelerator.prepare(opt)
        head = accelerator.prepare(head)
    for step in range(5):
        x, y = _batch(step)
        accelerator.backward(F.cross_entropy(head(encoder(x)), y))
        opt.step()
        opt.zero_grad()
    weights = []
    for model in (encoder, head):
        inner = accelerator.unwrap_model(model)
        state = accelerator.amp.fp32_state_dict(inner) if level == "O2" else inner.state_dict()
        weights += [v.float() for v in state.values()]
    dtypes = {p.dtype for p in accelerator.amp.master_params(opt.optimizer)} if level != "no" else set()
    return weights, dtypes


@pytest.mark.parametrize("calls", ["head after", "three calls"])
def test_a_model_prepared_after_its_optimizer_trains_on_fp32_masters(calls):
    """Found at stop 50: at O2 a model prepared in a later ``prepare`` call than the optimizer that trains it got no
    FP32 masters (its parameters were FP32, paired with themselves, when the optimizer was registered; the conversion
    to half came after), so the optimizer stepped its bfloat16 weights directly: at lr 1e-3 each update rounded away
    and the head never moved (0.0 after 5 steps). Now the optimizer is registered again once its model is converted:
    the run is the one prepared in a single call, bit for bit, and follows Accelerate's ``"no"``."""
    weights, dtypes = _encoder_head_run(calls)
    reference, _ = _encoder_head_run("one")
    assert dtypes == {torch.float32}
    assert _same(weights, reference)
    native, _ = _encoder_head_run("one", level="no")
    torch.testing.assert_close(weights, native, atol=1e-3, rtol=0)
    torch.manual_seed(1)
    assert (weights[-2] - nn.Linear(3, 3).weight).abs().max() > 2e-4  # the head trained (not at all before the fix)


def test_a_model_its_optimizer_trains_is_refused_for_evaluation_only():
    """The same order with the head prepared for evaluation only (no masters at O2): refused, naming the argument
    and what to call, before anything is converted (the optimizer still steps the encoder)."""
    accelerator = _accelerator("O2")
    encoder, head = _net(), nn.Linear(3, 3)
    opt = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=1e-3)
    encoder, opt = accelerator.prepare(encoder, opt)
    with pytest.raises(ValueError, match=r"evaluation_mode=True, but optimizer=SGD .* accelerator.prepare\(model\)"):
        accelerator.prepare_model(head, evaluation_mode=True)
    assert head.weight.dtype == torch.float32
    assert {p.dtype for p in accelerator.amp.master_params(opt.optimizer)[:4]} == {torch.float32}


# -- the weights get_state_dict, save_model and save_state give at O2 ------------------------------------------------
def _trained_o2(steps=3, model=None, first=0, optimizer=torch.optim.Adam):
    accelerator = _accelerator("O2")
    model = _net() if model is None else model
    opt = optimizer(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    for step in range(first, first + steps):
        x, y = _batch(step)
        accelerator.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    return accelerator, model, opt


@pytest.mark.parametrize("export", ["save_model", "get_state_dict"])
def test_o2_exported_weights_are_the_fp32_masters_and_a_new_run_goes_on_from_them(tmp_path, export):
    """Found at stop 50: at O2 ``get_state_dict(model)`` and ``save_model(model, dir)`` gave the half (bfloat16)
    weights, where Accelerate's own ``"bf16"`` gives FP32 ones; Hugging Face's ``no_trainer`` habit
    ``save_pretrained(dir, state_dict=accelerator.get_state_dict(model))`` and a later run loading that file started
    from weights rounded by up to 1e-3. Now both give the FP32 masters: a fresh model loaded with them and prepared by
    a new Accelerator goes on exactly as the uninterrupted run (SGD: no optimizer state to carry)."""
    accelerator, model, opt = _trained_o2(optimizer=torch.optim.SGD)
    if export == "save_model":
        from safetensors.torch import load_file

        accelerator.save_model(model, str(tmp_path))
        exported = load_file(str(tmp_path / "model.safetensors"))
    else:
        exported = accelerator.get_state_dict(model)
    masters = accelerator.amp.fp32_state_dict(accelerator.unwrap_model(model))
    assert {v.dtype for v in exported.values()} == {torch.float32}
    assert _same([exported[key] for key in masters], list(masters.values()))
    fresh = _net(5)
    fresh.load_state_dict(exported)
    resumed, resumed_model, _ = _trained_o2(model=fresh, first=3, optimizer=torch.optim.SGD)
    straight, straight_model, _ = _trained_o2(steps=6, optimizer=torch.optim.SGD)
    assert _same(
        list(resumed.amp.fp32_state_dict(resumed.unwrap_model(resumed_model)).values()),
        list(straight.amp.fp32_state_dict(straight.unwrap_model(straight_model)).values()),
    )


@pytest.mark.parametrize("safe", [True, False])
def test_o2_save_state_writes_fp32_weights_that_accelerate_bf16_resumes(tmp_path, safe):
    """Found at stop 50: at O2 ``save_state`` wrote the model file with the half weights (bfloat16), where Accelerate's
    own ``"bf16"`` writes FP32 ones; a run resumed with Accelerate's ``"bf16"`` (or ``"no"``, or anything that reads
    the model file: ``load_checkpoint_in_model``, an evaluation script) took weights up to 1e-3 off the FP32 masters
    training produced. Now the file holds the masters (FP32): resuming natively gives them exactly, the optimizer
    state with them, and the O2 resume stays bit for bit (tests/test_hostile_accelerate.py)."""
    accelerator, model, opt = _trained_o2()
    accelerator.save_state(str(tmp_path), safe_serialization=safe)
    masters = accelerator.amp.fp32_state_dict(accelerator.unwrap_model(model))
    if safe:
        from safetensors.torch import load_file

        written = load_file(str(tmp_path / "model.safetensors"))
    else:
        written = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert {key: value.dtype for key, value in written.items()} == {key: torch.float32 for key in masters}
    assert _same(list(written.values()), [masters[key] for key in written])
    native = _accelerator("bf16")
    twin = _net(5)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-3)
    twin, twin_opt = native.prepare(twin, twin_opt)
    native.load_state(str(tmp_path))
    assert _same(list(twin.state_dict().values()), list(masters.values()))
    moments = [s["exp_avg"] for s in twin_opt.state_dict()["state"].values()]
    assert _same(moments, [s["exp_avg"] for s in opt.state_dict()["state"].values()])


class _WithExtraState(nn.Linear):
    """A layer with ``get_extra_state`` (TransformerEngine's habit): a dict in its state dict, not a tensor."""

    def get_extra_state(self):
        return {"recipe": "delayed"}

    def set_extra_state(self, state):
        self.recipe = state["recipe"]


def _trained_with_extra_state():
    torch.manual_seed(0)
    return _trained_o2(steps=1, model=nn.Sequential(_WithExtraState(8, 3)), optimizer=torch.optim.SGD)


def test_o2_save_state_of_a_model_with_extra_state_still_saves_and_resumes(tmp_path):
    """The FP32 export must not break what saved before it: a model whose state dict holds a module's extra state
    (not a tensor) saves with ``save_state`` (pickled files) and loads back into a fresh O2 Accelerator, masters
    exact and the extra state restored."""
    accelerator, model, opt = _trained_with_extra_state()
    accelerator.save_state(str(tmp_path), safe_serialization=False)
    masters = [p.clone() for p in accelerator.amp.master_params(opt.optimizer)]
    fresh = nn.Sequential(_WithExtraState(8, 3))
    twin, twin_model, twin_opt = _trained_o2(steps=0, model=fresh, optimizer=torch.optim.SGD)
    twin.load_state(str(tmp_path))
    assert _same(twin.amp.master_params(twin_opt.optimizer), masters)
    assert twin.unwrap_model(twin_model)[0].recipe == "delayed"


def test_o2_get_state_dict_of_a_model_with_extra_state_gives_the_fp32_masters():
    """A module's extra state (any object) passes through ``fp32_state_dict`` as the state dict has it; the weights
    beside it are the masters (``.detach()`` of the extra state raised before)."""
    accelerator, model, opt = _trained_with_extra_state()
    assert accelerator.amp.fp32_state_dict(accelerator.unwrap_model(model))["0._extra_state"] == {"recipe": "delayed"}
    state = accelerator.get_state_dict(model)
    assert torch.equal(state["0.weight"], accelerator.amp.master_params(opt.optimizer)[0])


def test_o2_get_state_dict_after_free_memory_still_gives_the_masters():
    """``free_memory()`` once training is over (releasing the optimizer, as a script tidying up before its export
    does), then ``get_state_dict(model)``: the masters of the engine that trained the model, exactly, not its half
    weights upcast (1e-3 off before: the accelerator's fresh engine had no masters for it); a deep copy of the model
    (an EMA kept on the side), which has no masters, gives its half weights as they are (no FP32 copy made)."""
    import copy

    accelerator, model, opt = _trained_o2(optimizer=torch.optim.SGD)
    masters = accelerator.amp.fp32_state_dict(accelerator.unwrap_model(model))
    twin = copy.deepcopy(accelerator.unwrap_model(model))
    accelerator.free_memory()
    state = accelerator.get_state_dict(model)
    assert _same([state[key] for key in masters], list(masters.values()))
    copied = accelerator.get_state_dict(twin)
    assert [v.dtype for v in copied.values()] == [v.dtype for v in twin.state_dict().values()]
    assert _same(list(copied.values()), list(twin.state_dict().values()))
