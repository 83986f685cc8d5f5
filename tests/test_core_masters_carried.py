"""Hostile uses of the O2 masters carried between engines (lightning_mpx/masters/watch.py): a trained model made
another dtype, an old engine used after a second stage took its masters, memory a model kept in half holds, and a
frozen deep copy. Compared against the masters themselves (the FP32 weights training produced)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from lightning_mpx import Amp, release_masters

HALF = torch.bfloat16


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _step(amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
    optimizer.zero_grad()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
    with amp.forward_context():
        out = amp.cast_outputs(model(amp.cast_inputs(x)))
    amp.backward(out.float().pow(2).mean())
    amp.step(optimizer)
    amp.update()


def _trained(steps: int = 3, half: torch.dtype = HALF) -> tuple[nn.Module, Amp, torch.optim.Optimizer, list]:
    """A model trained ``steps`` at O2, its engine, optimizer and FP32 masters (cloned)."""
    model, amp = _net(), Amp("O2", half_dtype=half)
    amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for i in range(steps):
        _step(amp, model, optimizer, i)
    return model, amp, optimizer, _masters(amp, model)


def _masters(amp: Amp, model: nn.Module) -> list[torch.Tensor]:
    return [amp.master_of(p, refresh=False).detach().clone() for p in model.parameters()]


def _carried_bytes(model: nn.Module) -> int:
    """Bytes of the FP32 values a deep copy's parameters carry (torch.cuda-free: their tensors' storage)."""
    values = [p.__dict__.get("_mpx_fp32") for p in model.parameters()]
    return sum(v.untyped_storage().nbytes() for v in values if v is not None)


@pytest.mark.parametrize("convert", ["float", "to_float32", "double"])
def test_a_trained_model_made_fp32_holds_its_masters_and_lets_the_engine_go(convert: str) -> None:
    """The habit: train at O2, then ``model.float()`` for an FP32 export or evaluation. It gave the half rounding
    (9.7e-4 off the masters) while ``copy.deepcopy(model).float()`` gave the masters, and the masters stayed alive
    (linked from the parameters) as long as the model, engine deleted or not: 4 more bytes per parameter. The
    model takes the masters now, the engine lets them go (a later step of it is refused) and they die with it."""
    model, amp, optimizer, trained = _trained()
    made = {"float": nn.Module.float, "to_float32": lambda m: m.to(torch.float32), "double": nn.Module.double}
    made[convert](model)
    dtype = torch.float64 if convert == "double" else torch.float32
    assert all(type(p) is nn.Parameter and p.dtype == dtype for p in model.parameters())
    assert all(torch.equal(p.detach(), t.to(dtype)) for p, t in zip(model.parameters(), trained))
    with pytest.raises(RuntimeError, match="after prepare_model"):  # the engine's own refusal, as before
        _step(amp, model, optimizer, 9)
    held = weakref.ref(amp.master_weights[0])
    del amp, optimizer
    gc.collect()
    assert held() is None  # the model does not keep its old engine's masters


def test_a_bfloat16_model_made_float16_rounds_its_masters_once_and_a_float16_stage_starts_from_them() -> None:
    """``.half()`` of a bfloat16 O2 model (or a second stage at O2 in float16) rounded twice (FP32 -> bfloat16 ->
    float16) and a float16 engine's masters started from that. The float16 values are the masters' rounding now,
    and the FP32 values are carried for the next engine, which starts from them exactly."""
    model, amp, _, trained = _trained()
    copied = copy.deepcopy(model).half()
    assert all(torch.equal(p.detach(), t.half()) for p, t in zip(copied.parameters(), trained))
    other = Amp("O2", half_dtype=torch.float16)
    other.prepare_model(model)  # converts the bfloat16 model to float16 itself
    other.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert all(torch.equal(p.detach(), t.half()) for p, t in zip(model.parameters(), trained))
    assert all(torch.equal(a, b) for a, b in zip(_masters(other, model), trained))


def test_the_old_engines_fp32_export_after_a_second_stage_gives_the_masters_not_the_half_weights() -> None:
    """``amp.fp32_state_dict(model)`` of the first stage's engine after a second engine took the masters over gave
    the half weights upcast under FP32 names (1e-3 off), without a word; it gives the model's FP32 weights, held by
    the engine that holds them now, as the second engine's export does."""
    model, old, _, trained = _trained()
    new = Amp("O2", half_dtype=HALF)
    new.prepare_model(model)
    new_optimizer = new.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for amp in (old, new):
        exported = list(amp.fp32_state_dict(model).values())
        assert all(torch.equal(a, b) for a, b in zip(exported, trained))
    _step(new, model, new_optimizer, 5)
    assert all(torch.equal(a, b) for a, b in zip(old.fp32_state_dict(model).values(), _masters(new, model)))


def test_a_frozen_deep_copy_lets_its_carried_values_go_and_release_masters_frees_a_half_model() -> None:
    """A frozen reference (DPO, a distillation teacher: ``copy.deepcopy(model).requires_grad_(False)``) carried an
    FP32 value per parameter (4 bytes on 2: the copy cost 3 times its half weights) that nothing reads: an engine
    makes no master for a frozen parameter. Freezing lets it go. ``release_masters`` lets a model kept in half
    after training (inference) drop its masters, which otherwise live as long as the model."""
    model, amp, optimizer, trained = _trained(steps=1)
    half_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert _carried_bytes(copy.deepcopy(model)) == 2 * half_bytes  # what a deep copy carries
    reference = copy.deepcopy(model).requires_grad_(False)
    assert _carried_bytes(reference) == 0 and all(type(p) is nn.Parameter for p in reference.parameters())
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(reference.parameters(), model.parameters()))

    half = [p.detach().clone() for p in model.parameters()]
    assert release_masters(model) == len(half)
    assert all(type(p) is nn.Parameter and torch.equal(p.detach(), h) for p, h in zip(model.parameters(), half))
    assert all(amp.master_of(p, refresh=False) is p for p in model.parameters())
    with pytest.raises(RuntimeError, match="release_masters"):
        _step(amp, model, optimizer, 9)
    held = weakref.ref(amp.master_weights[0])
    del amp, optimizer
    gc.collect()
    assert held() is None


def test_engines_preparing_the_model_for_evaluation_only_leave_its_masters_to_the_engine_training_it() -> None:
    """Two more engines prepare the trained model for evaluation only (``train=False``: an eval loop, a second
    Fabric for metrics) while the first trains it: they take no master (a step of the first is not refused) and the
    first engine's run is bit for bit the one without them."""
    reference, amp, optimizer, _ = _trained()
    for i in range(3, 5):
        _step(amp, reference, optimizer, i)
    want = _masters(amp, reference)

    model, amp, optimizer, _ = _trained()
    for _ in range(2):
        other = Amp("O2", half_dtype=HALF)
        other.prepare_model(model, train=False)
        with torch.no_grad(), other.forward_context():
            other.cast_outputs(model(other.cast_inputs(torch.randn(4, 8))))
        assert all(other.master_of(p, refresh=False) is p for p in model.parameters())
    for i in range(3, 5):
        _step(amp, model, optimizer, i)
    assert all(torch.equal(a, b) for a, b in zip(_masters(amp, model), want))


@pytest.mark.parametrize("level", ["O3", "O1", "O0"])
def test_an_engine_without_masters_training_an_o2_trained_model_takes_it_from_the_o2_engine(level: str) -> None:
    """An O3 (or O1) engine preparing an O2-trained model for training left the O2 engine's masters in place: both
    engines stepped the model, the O2 one from its masters. It trains the model's half weights (O3) or, at O0 and
    O1, its FP32 weights made from the masters exactly (O1 trained the rounded half weights in half, with no masters:
    not the FP32 model O1 trains); the O2 engine hands over (its later step,
    its master_params() and its clipping are refused) and takes its hooks off the model; the new engine trains as on
    a model it prepared fresh from those weights."""
    model, old, old_optimizer, trained = _trained()
    reference = _net()
    with torch.no_grad():
        for r, p, t in zip(reference.parameters(), model.parameters(), trained):
            r.data = (t if level in ("O0", "O1") else p.detach()).clone()
    new = Amp(level, half_dtype=HALF)
    new.prepare_model(model)
    optimizer = new.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-2))
    assert all(type(p) is nn.Parameter for p in model.parameters())
    refused = "converted to torch.float32" if level in ("O0", "O1") else "handed to another engine"  # FP32 now
    with pytest.raises(RuntimeError, match=refused):
        _step(old, model, old_optimizer, 9)
    with pytest.raises(RuntimeError, match="handed over"):
        old.clip_grad_norm_(old_optimizer, 1.0)
    fresh = Amp(level, half_dtype=HALF)
    fresh.prepare_model(reference)
    fresh_optimizer = fresh.prepare_optimizer(torch.optim.SGD(reference.parameters(), lr=1e-2))
    assert _hook_counts(model) == _hook_counts(reference)  # the new engine's alone
    for i in range(2):
        _step(new, model, optimizer, i)
        _step(fresh, reference, fresh_optimizer, i)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(model.parameters(), reference.parameters()))


def test_an_o3_accelerator_training_an_o2_trained_model_takes_it_from_the_o2_engine() -> None:
    """The Accelerate adapter at O3 (a second stage's script) takes the model from the O2 engine as ``Amp`` does."""
    from lightning_mpx.accelerate import Accelerator

    model, old, old_optimizer, _ = _trained()
    accelerator = Accelerator(mixed_precision="O3", cpu=True)
    module, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    accelerator.backward(module(torch.randn(4, 8, dtype=next(model.parameters()).dtype)).float().pow(2).mean())
    optimizer.step()
    with pytest.raises(RuntimeError, match="handed to another engine|after prepare_model"):  # its half dtype or not
        _step(old, model, old_optimizer, 9)
    with pytest.raises(RuntimeError, match="handed over"):
        old.master_params(old_optimizer)
    assert all(type(p) is nn.Parameter for p in model.parameters())


def test_an_o3_trainer_stage_after_an_o2_stage_takes_the_model_from_the_first_plugin() -> None:
    """The Trainer's plugin at O3 for a second stage takes an O2-trained model from the first stage's plugin: the
    first engine's masters let go (its ``master_params`` refused) and its hooks off the model, the first Trainer
    let go or not."""
    pytest.importorskip("lightning.pytorch")
    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

    data = loader(classification_data(n=16))
    model = Classifier(optimizer="adamw", lr=1e-2)
    first = MixedPrecisionPlugin("O2", half_dtype=HALF)
    trainer = make_trainer(first, max_steps=1)
    trainer.fit(model, data)
    fresh = Classifier(optimizer="adamw", lr=1e-2)
    make_trainer(MixedPrecisionPlugin("O3", half_dtype=HALF), max_steps=1).fit(fresh, data)
    make_trainer(MixedPrecisionPlugin("O3", half_dtype=HALF), max_steps=1).fit(model, data)
    assert all(type(p) is nn.Parameter and p.dtype == HALF for p in model.parameters())
    assert _hook_counts(model) == _hook_counts(fresh)
    with pytest.raises(RuntimeError, match="handed over"):
        first.amp.master_params(trainer.optimizers[0])


def _hook_counts(model: nn.Module) -> list[int]:
    return [
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._load_state_dict_pre_hooks) for m in model.modules()
    ]


def test_the_old_engines_master_params_after_a_second_stage_are_not_the_new_engines_masters() -> None:
    """The old engine's ``master_params()`` after a second stage gave the new engine's masters from its cached step
    pairs: clipping (its ``clip_grad_norm_``) or zeroing them changed the other engine's training. It raises, naming
    the handover; the new engine's are its own."""
    model, old, old_optimizer, _ = _trained()
    new = Amp("O2", half_dtype=HALF)
    new.prepare_model(model)
    new_optimizer = new.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    with pytest.raises(RuntimeError, match="'0.weight' and 3 more whose FP32 masters this engine handed over"):
        old.master_params(old_optimizer)
    with pytest.raises(RuntimeError, match="handed over"):
        old.clip_grad_norm_(old_optimizer, 1.0)
    taken = [new.master_of(p, refresh=False) for p in model.parameters()]
    assert [id(m) for m in new.master_params(new_optimizer)] == [id(m) for m in taken]


def test_a_second_engine_leaves_one_set_of_hooks_on_the_model() -> None:
    """Each engine preparing the model (a stage) added its loss-region forward hooks and ``load_state_dict``
    pre-hooks beside those of the engines before it, which stayed (the engine let go or not): N stages, N sets run
    on every forward (and a compiled model recompiles on their count). The engine that handed over the model's
    masters takes its own off; the model trains on as after one stage."""
    model, _, _, _ = _trained(steps=0)
    hooks = _hook_counts(model)
    assert sum(hooks) > 0
    for _ in range(3):
        amp = Amp("O2", half_dtype=HALF)
        amp.prepare_model(model)
        optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        assert _hook_counts(model) == hooks
    _step(amp, model, optimizer, 0)
    weights = {k: v.float() + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(weights)  # FP32 values loaded go to the last engine's masters exactly
    assert all(torch.equal(amp.master_of(p, refresh=False), weights[n]) for n, p in model.named_parameters())


def test_an_accelerate_trained_model_trains_in_a_later_stage_of_another_engine_at_another_half_dtype() -> None:
    """The Accelerate adapter's forward stayed on a model another engine took over and refused every step at another
    half dtype; the handover takes it off with the old engine's hooks."""
    from lightning_mpx.accelerate import Accelerator

    model = _net()
    accelerator = Accelerator(mixed_precision="O2", cpu=True)
    module, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    accelerator.backward(module(torch.randn(4, 8)).float().pow(2).mean())
    optimizer.step()
    trained = _masters(accelerator.amp, model)
    other = HALF if next(model.parameters()).dtype == torch.float16 else torch.float16
    new = Amp("O2", half_dtype=other)
    new.prepare_model(model)
    new_optimizer = new.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert all(torch.equal(a, b) for a, b in zip(_masters(new, model), trained))
    _step(new, model, new_optimizer, 3)


def test_a_second_engine_with_fp32_modules_leaves_one_set_of_boundary_hooks() -> None:
    """The FP32-boundary hooks of fp32_modules were kept per engine: each stage added two more on the pinned module."""
    model = _net()
    counts = []
    for _ in range(2):
        amp = Amp("O2", half_dtype=HALF, fp32_modules=["2"])
        amp.prepare_model(model)
        amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        counts.append(_hook_counts(model))
    assert counts[0] == counts[1]


def test_the_old_engines_checkpoint_after_a_second_stage_warns_and_the_new_engines_resumes_the_masters() -> None:
    """The first engine's ``state_dict()`` after a later stage took its masters held none and saved without a word
    (a Trainer's ``save_checkpoint`` too); resuming from it fails. Saving it warns, naming the handover and the
    checkpoint to save; the engine that took the masters resumes them exactly."""
    model, old, _, trained = _trained()
    new = Amp("O2", half_dtype=HALF)
    new.prepare_model(model)
    new.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    with pytest.warns(UserWarning, match=r"no FP32 master for parameter\(s\) '0.weight' and 3 more: it handed"):
        stale = old.state_dict()
    state, weights = new.state_dict(), model.state_dict()
    resumed, amp = _net(), Amp("O2", half_dtype=HALF)
    amp.prepare_model(resumed)
    amp.prepare_optimizer(torch.optim.AdamW(resumed.parameters(), lr=1e-2))
    resumed.load_state_dict(weights)
    with pytest.raises(ValueError, match="master weights for 0 model"):
        amp.load_state_dict(stale)
    amp.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(_masters(amp, resumed), trained))


def test_a_deep_copy_under_inference_mode_is_a_half_copy_as_in_torch() -> None:
    """``copy.deepcopy`` of an O2 model inside ``torch.inference_mode()`` (an evaluation helper copying the model)
    failed with "Inference tensors do not track version counter"; plain torch copies it. The copy is a half copy
    then (it cannot be trained), as in torch; one made outside and made FP32 inside still takes its FP32 values."""
    model, _, _, trained = _trained()
    with torch.inference_mode():
        copied = copy.deepcopy(model)
        out = copied(torch.randn(4, 8, dtype=HALF))
    assert out.dtype == HALF and all(type(p) is nn.Parameter for p in copied.parameters())
    outside = copy.deepcopy(model)
    with torch.inference_mode():
        outside.float()
    assert all(torch.equal(p.detach(), t) for p, t in zip(outside.parameters(), trained))


def test_a_deep_copy_made_fp32_with_module_swapping_takes_its_carried_values() -> None:
    """Under tensor swapping (Module._apply sets no .data) a deep copy's .float() gave the half rounding."""
    model, _, _, trained = _trained()
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        copied = copy.deepcopy(model).float()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    assert all(torch.equal(p.detach(), t) for p, t in zip(copied.parameters(), trained))
