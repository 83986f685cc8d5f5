"""Overflow forensics (issue 13, point 1): models that overflow for a known reason, through Amp directly (O1, O2), a
Lightning Trainer and an Accelerator; the record is compared with the gradients' kinds computed by the test itself."""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin
from lightning_mpx.health.forensics import OverflowRecord, merge_kinds, merge_records, module_of, overflow_tag
from tests.forensics_models import (
    CASES,
    CULPRIT,
    ORIGIN,
    ForensicsData,
    ForensicsModule,
    kind_of,
    make_batch,
    make_net,
    reference_kinds,
)
from tests.lightning_helpers import RecordingLogger, loader, make_trainer


def _setup(level: str, case: str, **settings: Any) -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    amp = Amp(level, **{"half_dtype": "float16", **settings})
    net = amp.prepare_model(make_net(case))
    return amp, net, amp.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=1e-3))


def _iteration(amp: Amp, net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One training iteration; returns the reference kinds of the (scaled) gradients the step sees."""
    with amp.forward_context():
        loss = F.cross_entropy(amp.cast_outputs(net(amp.cast_inputs(x))), y)
    amp.backward(loss)
    reference = reference_kinds((n, p.grad) for n, p in net.named_parameters())
    amp.step(opt)
    amp.update()
    opt.zero_grad()
    return reference


def _backward(amp: Amp, net: nn.Module, case: str) -> dict:
    """A forward and backward of ``case``'s batch; returns the reference kinds of the (scaled) gradients."""
    x, y = make_batch(case)
    with amp.forward_context():
        loss = F.cross_entropy(net(x), y)
    amp.backward(loss)
    return reference_kinds((n, p.grad) for n, p in net.named_parameters())


def _hooks(net: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in net.modules())


def _grad_hooks(net: nn.Module) -> int:
    return sum(len(p._backward_hooks or {}) for p in net.parameters())


def _modules_of(kinds: dict[str, str]) -> dict[str, str]:
    out: dict[str, Any] = {}
    for name, kind in kinds.items():
        out[module_of(name)] = merge_kinds(out.get(module_of(name)), kind)  # type: ignore[arg-type]
    return out


# -- Amp directly ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_record_names_the_layer_the_kind_and_the_origin(level, case):
    amp, net, opt = _setup(level, case, diagnose_overflows=True)
    outputs: dict[str, str | None] = {}  # the reference for the forward: what each layer really produced

    def remember(module: nn.Module, args: Any, out: torch.Tensor, name: str) -> None:
        outputs.setdefault(name, kind_of(out))

    for name in ("inp", "blow", "explode", "out"):
        getattr(net, name).register_forward_hook(functools.partial(remember, name=name))
    reference = _iteration(amp, net, opt, *make_batch(case))
    record = amp.last_overflow
    assert isinstance(record, OverflowRecord)
    assert reference  # the model does overflow
    assert record.parameters == reference and amp.last_overflow_parameters == list(reference)
    assert record.modules == _modules_of(reference)
    assert record.origin == ORIGIN[case]
    assert record.culprits() == [CULPRIT[case]]
    assert record.step == 0 and record.loss_ids == (0,) and record.scales == (2.0**16,)
    assert record.rank == 0 and record.ranks == (0,)
    if case == "gradient":
        assert record.first_module is None and record.loss_nonfinite is False
        assert record.modules == {"explode": "inf"}  # the forward was finite; only explode's weight got inf
        assert set(outputs.values()) == {None} and record.nonfinite_outputs == {}
    else:
        assert record.first_module == CULPRIT[case] and record.loss_nonfinite is True
        # The first non-finite output: an activation past 65504 (inf) in blow, the data's NaN in inp.
        first_kind = {"activation": "inf", "data": "nan"}[case]
        assert outputs[CULPRIT[case]] == first_kind
        assert list(record.nonfinite_outputs.items())[0] == (CULPRIT[case], first_kind)
        assert {k: v for k, v in record.nonfinite_outputs.items() if k in outputs} == {
            k: v for k, v in outputs.items() if v is not None
        }
    if case == "data":
        assert set(record.parameters.values()) == {"nan"}
    # The counts go out once, then stay at 0 for the modules seen.
    metrics = amp.metrics()
    assert {k: v for k, v in metrics.items() if k.startswith("mpx/overflow/")} == {
        overflow_tag(m): 1.0 for m in _modules_of(reference)
    }
    assert {k: v for k, v in amp.metrics().items() if k.startswith("mpx/overflow/")} == {
        overflow_tag(m): 0.0 for m in _modules_of(reference)
    }


def test_evaluation_forwards_are_not_watched():
    # A no-grad forward with a NaN between the training forward and the step cannot cause an overflow: the record
    # of the gradient explosion still says backward.
    amp, net, opt = _setup("O1", "gradient", diagnose_overflows=True)
    x, y = make_batch("gradient")
    with amp.forward_context():
        loss = F.cross_entropy(net(x), y)
    amp.backward(loss)
    with torch.no_grad():
        net(make_batch("data")[0])
    amp.step(opt)
    assert amp.last_overflow.origin == "backward" and amp.last_overflow.modules == {"explode": "inf"}


def test_no_hooks_by_default_and_origin_unknown_above_the_floor():
    amp, net, opt = _setup("O1", "clean")
    for step in range(3):
        _iteration(amp, net, opt, *make_batch("clean", seed=step))
        assert _hooks(net) == 0 and _grad_hooks(net) == 0
    assert amp.last_overflow is None and not any(k.startswith("mpx/overflow/") for k in amp.metrics())

    amp, net, opt = _setup("O1", "activation")  # overflows, but the scale can still back off
    reference = _iteration(amp, net, opt, *make_batch("activation"))
    record = amp.last_overflow
    assert record.parameters == reference and record.origin == "unknown" and record.first_module is None
    assert record.loss_nonfinite is None and record.culprits() == list(_modules_of(reference))
    assert _hooks(net) == 0


def test_overflow_at_the_floor_watches_until_a_clean_step():
    amp, net, opt = _setup("O1", "activation", init_scale=1024.0, min_loss_scale=1024.0, on_floor="continue")
    x, y = make_batch("activation")
    small = torch.zeros_like(x)  # inp (no bias) gives zeros: blow's outputs stay finite
    _iteration(amp, net, opt, x, y)
    assert amp.last_overflow.origin == "unknown"  # not watched yet
    assert _hooks(net) == len(list(net.modules()))  # armed by the overflow at the floor
    assert _grad_hooks(net) == len(list(net.parameters()))
    _iteration(amp, net, opt, x, y)
    assert amp.last_overflow.step == 1 and amp.last_overflow.origin == "forward"
    assert amp.last_overflow.culprits() == ["blow"]
    assert amp.skipped_steps == [2]
    _iteration(amp, net, opt, small, y)  # no overflow: the watch ends
    assert amp.skipped_steps == [2] and _hooks(net) == 0 and _grad_hooks(net) == 0
    _iteration(amp, net, opt, x, y)
    assert amp.last_overflow.step == 3 and amp.last_overflow.origin == "unknown"
    assert amp.metrics()["mpx/overflow/blow"] == 3.0


def test_diagnose_overflows_can_be_switched_and_is_validated():
    amp, net, opt = _setup("O2", "clean")
    others = _hooks(net)  # O2's loss regions hook the loss-free blocks: not the forensics' to remove
    amp.diagnose_overflows = True
    assert _hooks(net) == others + len(list(net.modules()))
    amp.diagnose_overflows = False
    assert _hooks(net) == others
    with pytest.raises(TypeError, match="diagnose_overflows='yes' must be True or False"):
        Amp("O1", diagnose_overflows="yes", half_dtype="bfloat16")
    with pytest.raises(TypeError, match="diagnose_overflows=1 must be True or False"):
        MixedPrecisionPlugin("O1", diagnose_overflows=1, half_dtype="bfloat16")


def test_second_optimizer_on_the_same_forward_reads_the_same_flags():
    # Two optimizers stepping on one forward: the flags are cleared at the next watched forward, not by a step.
    amp = Amp("O1", diagnose_overflows=True, half_dtype="float16")
    net = amp.prepare_model(make_net("activation"))
    first = amp.prepare_optimizer(torch.optim.SGD(list(net.inp.parameters()) + list(net.blow.parameters()), lr=0.1))
    second = amp.prepare_optimizer(torch.optim.SGD(list(net.explode.parameters()) + list(net.out.parameters()), lr=0.1))
    x, y = make_batch("activation")
    with amp.forward_context():
        loss = F.cross_entropy(net(x), y)
    amp.backward(loss)
    amp.step(first)
    assert amp.last_overflow.first_module == "blow" and set(amp.last_overflow.modules) == {"inp", "blow"}
    amp.step(second)
    assert amp.last_overflow.first_module == "blow" and set(amp.last_overflow.modules) == {"explode", "out"}
    assert amp.last_overflow.step == 1


def test_merge_records_names_the_rank_whose_forward_was_non_finite():
    common = dict(step=3, loss_ids=(0,), scales=(8.0,))
    grads = {"net.inp.weight": "nan"}
    rank0 = OverflowRecord(**common, parameters=grads, modules={"net.inp": "nan"}, origin="backward", rank=0)
    rank1 = OverflowRecord(**common, parameters={"net.inp.weight": "inf"}, modules={"net.inp": "inf"},
                           origin="forward", first_module="net.inp", rank=1, loss_nonfinite=True)
    merged = merge_records([rank0, rank1])
    assert merged.rank == 1 and merged.ranks == (1,) and merged.origin == "forward"
    assert merged.first_module == "net.inp" and merged.parameters == {"net.inp.weight": "inf+nan"}
    both_backward = merge_records([rank0, OverflowRecord(**common, parameters=grads, modules={}, origin="backward",
                                                         rank=1)])
    assert both_backward.ranks == (0, 1) and both_backward.origin == "backward" and both_backward.rank == 0
    with pytest.raises(ValueError, match="records"):
        merge_records([])


# -- Lightning ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_lightning_o1_record_log_and_metrics(case, caplog):
    plugin = MixedPrecisionPlugin("O1", diagnose_overflows=True, half_dtype="float16")
    model = ForensicsModule(case)
    logger = RecordingLogger()
    trainer = make_trainer(plugin, max_steps=2, logger=logger, log_every_n_steps=1)
    with caplog.at_level(logging.INFO, logger="lightning_mpx"):
        trainer.fit(model, loader(ForensicsData(case), batch_size=4))
    record = model.records[0]
    reference = model.grad_kinds[0]
    assert reference and record.parameters == reference
    assert record.modules == _modules_of(reference)
    assert record.origin == ORIGIN[case] and record.culprits() == [f"net.{CULPRIT[case]}"]
    if ORIGIN[case] == "forward":
        assert record.first_module == f"net.{CULPRIT[case]}" and f"net.{CULPRIT[case]}" in record.nonfinite_outputs
    else:
        assert record.nonfinite_outputs == {} and record.loss_nonfinite is False
    messages = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert f"culprit net.{CULPRIT[case]}" in messages[0] and f"origin {ORIGIN[case]}" in messages[0]
    assert "rank 0" in messages[0]
    first_step, logged = logger.logged[0]
    assert first_step == 0
    assert {k: v for k, v in logged.items() if k.startswith("mpx/overflow/")} == {
        overflow_tag(m): 1.0 for m in _modules_of(reference)
    }


@pytest.mark.parametrize("case", CASES)
def test_lightning_unwatched_record_under_gradient_clip_val_reads_the_backward_kinds(case):
    # The common configuration: gradient_clip_val (by norm) and no diagnose_overflows. Before, the clip's
    # coefficient 0 turned every overflowed gradient into NaN before the step built the record.
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16")
    model = ForensicsModule(case)
    trainer = make_trainer(plugin, max_steps=1, gradient_clip_val=1.0)
    trainer.fit(model, loader(ForensicsData(case), batch_size=4))
    record, reference = model.records[0], model.grad_kinds[0]
    assert record.origin == "unknown" and reference and record.parameters == reference
    assert record.modules == _modules_of(reference)


def test_lightning_without_diagnose_registers_no_hooks():
    plugin = MixedPrecisionPlugin("O1", half_dtype="bfloat16")
    seen: list[int] = []

    class Probe(ForensicsModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(_hooks(self))
            return super().training_step(batch, batch_idx)

    model = Probe("clean")
    make_trainer(plugin, max_steps=3).fit(model, loader(ForensicsData("clean"), batch_size=4))
    assert seen == [0, 0, 0] and _hooks(model) == 0 and _grad_hooks(model) == 0
    assert plugin.amp.last_overflow is None


# -- Accelerate -----------------------------------------------------------------------------------------------------
def test_accelerator_reports_the_record_and_the_counts():
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    handler = MixedPrecisionKwargs(diagnose_overflows=True, half_dtype="float16")  # float16's overflow
    accelerator = Accelerator(mixed_precision="O1", kwargs_handlers=[handler])
    net = make_net("gradient")
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    net, opt = accelerator.prepare(net, opt)
    x, y = make_batch("gradient")
    accelerator.backward(F.cross_entropy(net(x), y))
    opt.step()
    assert opt.step_was_skipped
    record = accelerator.amp.last_overflow
    assert record.origin == "backward" and record.modules == {"explode": "inf"}
    assert accelerator.mpx_metrics()["mpx/overflow/explode"] == 1.0
    with pytest.raises(TypeError, match="diagnose_overflows"):
        MixedPrecisionKwargs(diagnose_overflows="no")


def test_gradient_kinds_in_chunks_match_the_whole_tensor():
    from lightning_mpx.health.forensics import _inf_nan

    for positions in [(), (3,), (95,), (3, 95), (57,)]:
        grad = torch.randn(100)
        for i, p in enumerate(positions):
            grad[p] = float("inf") if i == 0 else float("nan")
        whole = [bool(grad.isinf().any()), bool(grad.isnan().any())]
        assert _inf_nan(grad).tolist() == _inf_nan(grad, chunk=7).tolist() == whole


def test_a_watched_model_can_be_pickled_and_deep_copied():
    import copy
    import io

    amp, net, opt = _setup("O1", "activation", diagnose_overflows=True)
    buffer = io.BytesIO()
    torch.save(net, buffer)  # the whole module, hooks included
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(net)
    x, y = make_batch("activation")
    for other in (loaded, twin):
        other(x)  # its hooks belong to a disarmed copy of the watch: they record nothing
    reference = _iteration(amp, net, opt, x, y)
    assert amp.last_overflow.parameters == reference and amp.last_overflow.first_module == "blow"


@pytest.mark.parametrize("clip", ["norm", "value"])
@pytest.mark.parametrize("case", CASES)
def test_watched_record_sees_the_gradients_before_an_o1_clip(case, clip):
    # At O1 the gradients are unscaled and clipped in place before the step reads them: a value clip turns inf into
    # the clip value (a norm clip leaves a non-finite norm's gradients alone, see below). The gradient hooks of the
    # watch keep what the backward produced.
    amp, net, opt = _setup("O1", case, diagnose_overflows=True)
    reference = _backward(amp, net, case)
    if clip == "norm":
        amp.clip_grad_norm_(opt, 1.0)
    else:
        amp.clip_grad_value_(opt, 1.0)
    after_clip = reference_kinds((n, p.grad) for n, p in net.named_parameters())
    if clip == "norm":  # a non-finite norm: the gradients are left as the backward made them
        assert after_clip == reference
    elif case == "gradient":  # explode.weight's inf became 1.0; elsewhere all was NaN already
        assert after_clip != reference
    amp.step(opt)
    record = amp.last_overflow
    assert record.parameters == reference and record.modules == _modules_of(reference)
    assert record.origin == ORIGIN[case] and record.culprits() == [CULPRIT[case]]
    assert record.backward_nonfinite is True


@pytest.mark.parametrize("backend", ["auto", "foreach", "reference"])
@pytest.mark.parametrize("when", ["fused", "after unscale_"])
@pytest.mark.parametrize("case", CASES)
def test_unwatched_record_after_a_norm_clip_reads_what_the_backward_made(case, when, backend):
    # torch's clip_grad_norm_ multiplies by max_norm / inf = 0 on an overflow: finite gradients became zeros, infinite
    # ones NaN, and the unwatched record (what the step finds) read "nan" where the backward had made inf. A
    # non-finite norm now leaves the gradients alone (the step is skipped either way); finite norms clip as torch.
    amp, net, opt = _setup("O1", case, unscale_backend=backend)
    reference = _backward(amp, net, case)
    if when == "after unscale_":
        amp.unscale_(opt)
    norm = amp.clip_grad_norm_(opt, 1.0)
    assert not torch.isfinite(norm)
    assert amp.step(opt) is False
    assert amp.last_overflow.origin == "unknown"  # not watched
    assert amp.last_overflow.parameters == reference and amp.last_overflow.modules == _modules_of(reference)


@pytest.mark.parametrize("backend", ["auto", "foreach", "reference"])
@pytest.mark.parametrize("when", ["fused", "after unscale_"])
def test_a_finite_norm_clips_as_torch_does(when, backend):
    torch.manual_seed(0)
    amp = Amp("O1", unscale_backend=backend, init_scale=2.0**10, half_dtype="float16")
    net = amp.prepare_model(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)))
    opt = amp.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=1e-3))
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    with amp.forward_context():
        loss = F.cross_entropy(net(x), y)
    amp.backward(loss)
    if when == "after unscale_":
        amp.unscale_(opt)
    unscaled = [p.grad.clone() if when == "after unscale_" else p.grad * (1 / 2.0**10) for p in net.parameters()]
    holders = [torch.nn.Parameter(torch.zeros_like(g)) for g in unscaled]
    for holder, grad in zip(holders, unscaled):
        holder.grad = grad
    want_norm = torch.nn.utils.clip_grad_norm_(holders, 0.1)
    norm = amp.clip_grad_norm_(opt, 0.1)
    assert torch.equal(norm, want_norm)
    for p, h in zip(net.parameters(), holders):
        assert torch.equal(p.grad, h.grad)


@pytest.mark.parametrize("diagnose", [True, False], ids=["diagnose_overflows", "automatic-watch"])
def test_the_forward_watch_leaves_activation_checkpointing_working(diagnose, fresh_accelerate_state):
    """transformers' GPT-2 with gradient checkpointing (torch.utils.checkpoint, non-reentrant) through the
    Accelerator, with the forward watch on from the start (``diagnose_overflows``, against the same run unwatched) or
    armed by an overflow at the floor (bfloat16's static scale, ``on_floor="continue"``): every backward after it
    recomputes under the watch's hooks. The run trains on, the overflow is recorded, and watching changes no weight.
    (The hooks' bookkeeping once built autograd graph inside the checkpointed region: the recomputation then saved
    other tensors than the forward, and torch.utils.checkpoint refused the backward.)"""
    pytest.importorskip("transformers")
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state
    from tests.real_models import build_gpt2, digits, gpt2_forward, gpt2_loss

    pixels, labels, _, _ = digits()
    runs = []
    for watched in ((False, True) if diagnose else (False,)):
        reset_accelerate_state()
        accelerator = Accelerator(mixed_precision="O1", kwargs_handlers=[MixedPrecisionKwargs(
            half_dtype="bfloat16", on_floor="continue", diagnose_overflows=watched)])  # fmt: skip
        torch.manual_seed(0)
        net = build_gpt2()
        model, opt = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
        armed, moved = [], []
        for index in range(4):
            rows = slice(8 * index, 8 * index + 8)
            armed.append(accelerator.amp.forensics.watch.active)
            before = [p.detach().clone() for p in model.parameters()]
            loss = gpt2_loss(gpt2_forward(model, pixels[rows], labels[rows]), pixels[rows], labels[rows])
            accelerator.backward(loss * float("inf") if index == 1 else loss)
            opt.step()
            opt.zero_grad()
            moved.append(any(not torch.equal(a, b) for a, b in zip(before, model.parameters())))
        amp = accelerator.amp
        runs.append(([p.detach().clone() for p in model.parameters()], amp.skipped_steps, amp.last_overflow, armed))
        assert moved == [True, False, True, True] and amp.skipped_steps == [1]
    if diagnose:
        (plain, *_), (weights, _, record, armed) = runs
        assert armed == [True] * 4 and "origin forward (the loss was non-finite)" in record.describe()
        assert all(torch.equal(a, b) for a, b in zip(plain, weights))  # watching changes nothing
    else:
        ((_, _, record, armed),) = runs
        assert armed == [False, False, True, False]  # armed by the overflow, ended by the next clean step
        assert record is not None and record.step == 1
