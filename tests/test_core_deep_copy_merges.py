"""Review of stop 63's merged changes (review63), from the user's side:

1. Apex's ``amp.initialize`` given an optimizer the engine refuses (``LBFGS``, a wrapper that never ran
   ``Optimizer.__init__``) raised only after it had left the earlier call's O1 scope, reset its scale and cast the new
   model to half: the earlier run lost its casts silently. Now refused before anything is touched, as the other bad
   arguments (stop 63's smallfix).
2. A deep copy (or pickle) of a model trained at O2, prepared again at O2 (a second phase of training), kept the
   plain methods its copied wrappers became: peft's ``merge_and_unload`` merged in half again (two roundings) and
   ``save_pretrained`` wrote ``"dtype": "bfloat16"`` for FP32 weights. The wrappers are put on the copy again.
3. ``merge_and_unload(safe_merge=True)`` at O2 float16 wrote ``inf`` into the base where the FP32 merge of the masters
   is finite but overflows float16 once rounded; peft's merge in float16 (and its ``safe_merge`` promise) refuses it.
   Now the same ``ValueError``, nothing written nor noted as merged.
4. FSDP at O2: a user's backward hook in a folder named ``fsdp`` raising an error about a dtype was taken for FSDP's
   own and renamed as the unfrozen-half refusal. Only torch's FSDP package counts now.
5. Fabric's rank-0-only reads (stop 63's fabricread63): a state machine over steps, backwards, clips, reads
   (``mpx.metrics()``, the ``mpx.scaler`` view, ``mpx.amp.metrics()``) and ``fabric.save``/``fabric.load``, O1/O2,
   one or two losses, ``skip_on_device``, a body left requiring grad, an optimizer met late, against the same run
   without the reads and against one process: nothing counted twice, lost or below zero, the reads change nothing,
   and, until a step comes after a held read, each read is what one process reads (no defect found; kept as a guard).
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_mpx.apex import amp as apex_amp
from lightning_mpx.apex._state import _amp_state

# -- 1. Apex's initialize refuses an optimizer the engine cannot take before it touches anything ---------------------


class _NeverInitialized(torch.optim.Optimizer):
    """A Lookahead-style wrapper that shares its inner optimizer's groups without ``Optimizer.__init__``."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:  # noqa: D107 - no super().__init__ on purpose
        self.inner = inner
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults


@pytest.fixture
def fresh_apex_state():
    _amp_state.reset()
    yield
    _amp_state.reset()


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (lambda params: torch.optim.LBFGS(params), ValueError, r"optimizer=LBFGS re-evaluates the loss"),
        (
            lambda params: _NeverInitialized(torch.optim.SGD(params, lr=0.1)),
            TypeError,
            r"optimizer=_NeverInitialized never ran torch\.optim\.Optimizer\.__init__",
        ),
    ],
    ids=["lbfgs", "never_initialized"],
)
def test_apex_initialize_refusing_an_optimizer_leaves_the_earlier_run_as_it_was(fresh_apex_state, make, error, pattern):
    """Before: the O1 run's scope was left (its matmuls FP32 after the failed call), its scale reset and the new model
    cast to float16 with hooks on it; now the error comes first and the run goes on with its casts and scale."""
    from tests.test_core_misspelt_keywords import _run, _snapshot

    model, optimizer = apex_amp.initialize(*_run(), opt_level="O1", verbosity=0)
    _amp_state.loss_scalers[0]._loss_scale = 4.0
    before = _snapshot()
    other = nn.Linear(4, 4)
    with pytest.raises(error, match=pattern):
        apex_amp.initialize(other, make(other.parameters()), opt_level="O2", verbosity=0)
    assert _snapshot() == before
    assert other.weight.dtype == torch.float32 and not other._forward_hooks and not other._forward_pre_hooks
    x = torch.randn(2, 4)
    assert (x @ x.T).dtype == torch.float16  # the O1 scope is still entered
    with apex_amp.scale_loss(model(x).float().sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert _amp_state.loss_scalers[0].loss_scale() == 4.0


# -- 2. and 3. peft and Hugging Face wrappers on a copy prepared again; safe_merge's overflow ------------------------


def _peft_helpers() -> Any:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests import test_accelerate_peft_lora, test_core_peft_merges

    return test_accelerate_peft_lora, test_core_peft_merges


def _copy_trained_again(model: nn.Module) -> tuple[nn.Module, Any]:
    """``model`` trained two steps at O2 (Accelerate), deep-copied, and the copy trained two more at O2 with a new
    ``Accelerator`` (a second phase): the copy and its ``Accelerator``."""
    peft61, _ = _peft_helpers()
    accelerator, prepared, optimizer = peft61._prepared("O2", model)
    peft61._train(accelerator, prepared, optimizer, range(2))
    twin = copy.deepcopy(accelerator.unwrap_model(prepared))
    second, prepared, optimizer = peft61._prepared("O2", twin)
    peft61._train(second, prepared, optimizer, range(2, 4))
    return twin, second


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_deep_copy_prepared_again_at_o2_merges_as_the_rounding_of_the_fp32_merge() -> None:
    """A LoRA GPT-2 trained at O2, deep-copied and trained on at O2 with a new ``Accelerator``: the copy's
    ``merge_and_unload`` is the bfloat16 rounding of peft's FP32 merge of its masters (before: peft's merge of the
    half copies, which differs in ``c_attn``)."""
    peft61, xfails63 = _peft_helpers()
    twin, second = _copy_trained_again(peft61._lora())
    want = xfails63._merged(xfails63._fp32_twin(twin, second.amp))
    got = xfails63._merged(twin)
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value.to(peft61.HALF)), name


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_deep_copy_prepared_again_at_o2_saves_pretrained_as_float32(tmp_path: Path) -> None:
    """A GPT-2 trained at O2, deep-copied and trained on at O2: ``save_pretrained`` writes the FP32 masters and a
    ``config.json`` naming float32, as for the original (before: bfloat16, so ``from_pretrained`` rounded them)."""
    peft61, _ = _peft_helpers()
    twin, _ = _copy_trained_again(peft61._gpt2())
    twin.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"


def _overflowing_lora(peft: Any) -> nn.Module:
    """One ``nn.Linear`` with a LoRA adapter whose merge takes an entry of the base from 65000 to 66000: finite in
    FP32, past float16's largest value (65504) once rounded."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 4))
    with torch.no_grad():
        base[0].weight[0, 0] = 65000.0
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"], init_lora_weights=False))
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_A.default.weight.zero_()
        layer.lora_B.default.weight.zero_()
        layer.lora_A.default.weight[0, 0] = 1.0
        layer.lora_B.default.weight[0, 0] = 1000.0 / layer.scaling["default"]
    return model


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_o2_float16_safe_merge_refuses_a_merge_that_overflows_float16_as_peft_does() -> None:
    """peft's merge of the float16 model refuses it (``safe_merge=True``); at O2 the FP32 merge was finite and its
    rounding, ``inf``, was written into the merged weight. Now the same ``ValueError``, the layer unchanged and not
    marked merged; a plain merge still writes what peft's writes (``inf``: peft's own, unchecked)."""
    peft = pytest.importorskip("peft")
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    with pytest.raises(ValueError, match="NaNs detected in the merged weights"):
        _overflowing_lora(peft).half().merge_and_unload(safe_merge=True)  # the reference: peft's merge in float16
    reset_accelerate_state()
    accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=torch.float16)])
    model = _overflowing_lora(peft)
    trained = [p for p in model.parameters() if p.requires_grad]
    model, _ = accelerator.prepare(model, torch.optim.SGD(trained, lr=0.0))
    inner = accelerator.unwrap_model(model)
    layer = inner.base_model.model[0]
    base = layer.base_layer.weight.detach().clone()
    with pytest.raises(ValueError, match=r"NaNs detected in the merged weights: base_layer\.weight overflow"):
        layer.merge(safe_merge=True)
    assert torch.equal(layer.base_layer.weight, base) and layer.merged_adapters == []
    layer.merge()
    assert torch.isinf(layer.base_layer.weight[0, 0]) and layer.merged_adapters == ["default"]


# -- 4. FSDP at O2: an error of the user's hook is not taken for FSDP's -----------------------------------------------


@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="FSDP needs torch.distributed with gloo",
)
def test_a_dtype_error_of_a_hook_in_a_folder_named_fsdp_is_raised_as_it_is(one_rank, tmp_path: Path) -> None:
    """A unit of half parameters unfrozen (its backward works) and a user's hook, in ``<project>/fsdp/hooks.py``,
    that raises an error naming a dtype: its own error (before: the refusal of unfrozen half parameters, from it)."""
    from lightning_mpx import Amp
    from lightning_mpx.integrations.fsdp import shard_model
    from tests.core_fsdp2_unfreeze_script import Block
    from tests.test_core_fsdp2_unfreeze import _core_run, _half_unit_net

    amp = Amp("O2", half_dtype="bfloat16")
    net = _half_unit_net()
    shard_model(net, amp, blocks=Block)
    amp.prepare_model(net)
    raised = RuntimeError("a hook's own error about a dtype")
    source = "def hook(grad):\n    if net.first.fc.weight.requires_grad:\n        raise raised\n"
    scope = {"net": net, "raised": raised}
    exec(compile(source, os.path.join(str(tmp_path), "fsdp", "hooks.py"), "exec"), scope)  # noqa: S102
    run = _core_run(amp, net, "requires_grad", hook=scope["hook"])
    assert run["error"] is raised


_GLOO = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="FSDP needs torch.distributed with gloo",
)


def _sharded_run(net: nn.Module, params: list[nn.Parameter], change: Any) -> Any:
    """The engine's loop at O2 under FSDP2 (``shard_model`` per ``Block``, a gloo group of one), ``change(optimizer)``
    made before the second of three steps; returns the optimizer."""
    from lightning_mpx import Amp
    from lightning_mpx.integrations.fsdp import shard_model
    from tests.core_fsdp2_unfreeze_script import Block

    amp = Amp("O2", half_dtype="bfloat16")
    shard_model(net, amp, blocks=Block)
    amp.prepare_model(net)
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(params(net) if callable(params) else params, lr=1e-2))
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        if step == 1:
            change(net, optimizer)
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        with amp.forward_context():
            out = net(amp.cast_inputs(x))
        amp.backward(nn.functional.cross_entropy(out.float(), y))
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
    return optimizer


@_GLOO
def test_fsdp_o2_a_group_changed_by_fp32_parameters_trains_on(one_rank) -> None:
    """stop 63's check at the unscale after a group's parameter count changed refuses half parameters only: an FP32
    shard appended, a parameter removed, then given back by ``add_param_group``, train on (Adam's moments FP32)."""
    from tests.core_fsdp2_unfreeze_script import Net

    def change(net: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        params = optimizer.param_groups[0]["params"]
        assert params.pop() is net.head.bias
        params.append(net.second.adapter.weight)
        optimizer.add_param_group({"params": [net.head.bias]})

    optimizer = _sharded_run(Net(), lambda net: [net.first.adapter.weight, *net.head.parameters()], change)
    assert len(optimizer.state) == 4 and {s["exp_avg"].dtype for s in optimizer.state.values()} == {torch.float32}


@_GLOO
def test_fsdp_o2_a_half_parameter_swapped_into_a_group_is_refused_as_an_appended_one(one_rank) -> None:
    """Under FSDP at O2 a half parameter put in a group's list in place of another (the list rebuilt with as many
    parameters: the trainable block moved from the head to a base loaded in bfloat16) is refused at the next unscale,
    as an appended one is. Was: stop 63's check rode the parameter count, which did not change, and Adam stepped it in
    bfloat16 with bfloat16 moments; the unscale under FSDP now compares the groups' lists by identity."""
    from tests.test_core_fsdp2_unfreeze import _half_unit_net

    def change(net: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        net.head.weight.requires_grad_(False)
        net.first.fc.weight.requires_grad_(True)
        optimizer.param_groups[0]["params"] = [net.second.adapter.weight, net.first.fc.weight]

    with pytest.raises(ValueError, match=r"1 half parameter\(s\) of a model sharded by FSDP at O2: first\.fc\.weight"):
        _sharded_run(_half_unit_net(), lambda net: [net.second.adapter.weight, net.head.weight], change)


# -- 5. Fabric's reads on rank 0 alone: a state machine against the run without reads and one process ---------------

_READS = ("metrics", "get_scale", "view_state", "engine", "metrics_engine")


class _FabricRun:
    """A GAN-shaped Fabric loop (``g`` and ``d``, an optimizer each) at ``level``, float16, a dynamic scale growing
    every 2 steps; ``grouped``: the found-inf reducer of a process group (installed by hand on a group of one: the
    reads that may not end the iteration hold its update back); ``body``: ``d``'s optimizer holds its head only
    (its body keeps gradients); ``late``: ``g``'s optimizer set up apart (met at its first step)."""

    def __init__(self, tmp: Path, *, grouped: bool, reads: bool, losses: int, skip: bool, level: str, body: bool,
                 late: bool) -> None:  # fmt: skip
        from lightning.fabric import Fabric

        from lightning_mpx import FabricMixedPrecisionPlugin
        from lightning_mpx.integrations.collectives import all_reduce_max

        self.reads, self.losses, self.tmp = reads, losses, tmp
        self._suffix = "/loss0" if losses > 1 else ""
        self.mpx = FabricMixedPrecisionPlugin(
            level, half_dtype="float16", init_scale=256.0, growth_interval=2, num_losses=losses, skip_on_device=skip
        )
        self.fabric = Fabric(accelerator="cpu", devices=1, plugins=self.mpx)
        torch.manual_seed(0)
        make = (lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True)) if skip else (lambda p: torch.optim.SGD(p, lr=0.1))
        nets = {"g": nn.Linear(4, 4), "d": nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)) if body else nn.Linear(4, 1)}
        self.models: dict[str, Any] = {}
        self.opts: dict[str, Any] = {}
        for who, net in nets.items():
            params = net[1].parameters() if body and who == "d" else net.parameters()
            if late and who == "g":
                self.models[who], self.opts[who] = self.fabric.setup(net), self.fabric.setup_optimizers(make(params))
            else:
                self.models[who], self.opts[who] = self.fabric.setup(net, make(params))
        if grouped:
            self.mpx.amp.found_inf_reducer = all_reduce_max
        self.saved: dict[str, Any] | None = None
        self.base: dict[str, float] = {}  # per count: the position the last load resumed the reader from
        self.sums: dict[str, float] = {}  # per count: the overflows read since the last load

    def _entries(self) -> dict[str, Any]:
        return {**self.models, **{f"opt_{who}": opt for who, opt in self.opts.items()}, "mpx": self.mpx}

    def _count(self, metrics: dict[str, Any], summed: bool = True) -> dict[str, float]:
        """The scale and overflows read, each count never below zero; ``summed``: a read of the ``"default"``
        reader (``mpx.metrics()``'s), whose counts add up to the run's."""
        read = {k: float(v) for k, v in metrics.items() if k.startswith(("mpx/loss_scale", "mpx/overflows"))}
        for name, value in read.items():
            if name.startswith("mpx/overflows"):
                assert value >= 0, read
                if summed:
                    self.sums[name] = self.sums.get(name, 0.0) + value
        return read

    def do(self, op: tuple[Any, ...], index: int) -> Any:
        kind = op[0]
        if kind == "backward":
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(index))
            loss = self.models[op[1]](x).float().pow(2).mean() * (float("inf") if op[2] else 1.0)
            self.fabric.backward(loss, loss_id=1 if self.losses == 2 and op[1] == "g" else 0)
        elif kind == "step":
            self.opts[op[1]].step()
        elif kind == "zero":
            self.opts[op[1]].zero_grad()
        elif kind == "clip":
            self.fabric.clip_gradients(self.models[op[1]], self.opts[op[1]], max_norm=1.0)
        elif kind == "save":
            path = self.tmp / f"{id(self)}-{index}.pt"
            self.fabric.save(path, self._entries())
            self.saved = {"path": path, "mpx": torch.load(path, weights_only=False)["mpx"]}
        elif kind == "load" and self.saved is not None:
            self.fabric.load(self.saved["path"], self._entries())
            state = self.saved["mpx"]
            positions = state["metric_readers"]["default"]
            names = [f"mpx/overflows/loss{i}" if self.losses > 1 else "mpx/overflows" for i in range(self.losses)]
            self.base = {n: min(positions.get(n, 0), s["overflows"]) for n, s in zip(names, state["scalers"])}
            self.sums = {}
        elif kind in _READS and self.reads:
            if kind == "metrics":
                return ("metrics", {k: v for k, v in self._count(self.mpx.metrics()).items()})
            if kind == "engine":  # the engine's own read, a reader of its own: the live scale, its own count
                self._count(self.mpx.amp.metrics("engine"), summed=False)
                return None
            if kind == "metrics_engine":  # both, one after the other, the same reader: a held read, then the live
                self._count(self.mpx.metrics())
                return ("metrics_engine", self._count(self.mpx.amp.metrics())["mpx/overflows" + self._suffix])
            view = self.mpx.scaler
            if kind == "get_scale":
                return ("get_scale", view.get_scale())
            state = view.state_dict()
            return ("view_state", state["scale"], state["_growth_tracker"])
        return None

    def live(self) -> Any:
        weights = [p.detach().clone() for model in self.models.values() for p in model.parameters()]
        return [s.state_dict() for s in self.mpx.amp.scalers], self.mpx.amp.iteration.index, weights


@st.composite
def _loops(draw: Any) -> tuple[dict[str, Any], list[tuple[Any, ...]]]:
    """A configuration and a loop of the habits people have: a step once per backward (never again on the same
    gradients), a clip of gradients there, reads anywhere, saves and loads of the whole run."""
    config = dict(
        losses=draw(st.sampled_from([1, 2])), skip=draw(st.booleans()), level=draw(st.sampled_from(["O1", "O2"])),
        body=draw(st.booleans()), late=draw(st.booleans()),
    )  # fmt: skip
    ops: list[tuple[Any, ...]] = []
    fresh = {"g": False, "d": False}  # gradients of a backward no step has taken
    for _ in range(draw(st.integers(6, 14))):
        who = draw(st.sampled_from("gd"))
        kind = draw(st.sampled_from(["backward", "backward", "step", "step", "zero", "clip", "save", "load", *_READS]))
        if kind == "backward":
            ops.append(("backward", who, draw(st.booleans())))
            fresh[who] = True
        elif kind in ("step", "clip"):
            if fresh[who]:
                ops.append((kind, who))
                fresh[who] = kind == "clip"
        elif kind == "zero":
            ops.append(("zero", who))
            fresh[who] = False
        else:
            ops.append((kind,))
    return config, ops


@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="the found-inf reducer needs torch.distributed with gloo",
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(loop=_loops())
@example(  # the body keeps gradients: every read holds the update back; the held read, then the engine's own
    loop=(
        dict(losses=1, skip=False, level="O2", body=True, late=False),
        [("backward", "d", True), ("step", "d"), ("metrics_engine",), ("backward", "d", False), ("step", "d"),
         ("metrics",), ("save",), ("backward", "g", True), ("metrics_engine",), ("step", "g"), ("load",),
         ("metrics",)],
    )
)  # fmt: skip
@example(  # a GAN read between D's step and G's (G's gradients wait: held back), G overflowing
    loop=(
        dict(losses=2, skip=True, level="O1", body=False, late=False),
        [("backward", "d", False), ("backward", "g", True), ("step", "d"), ("metrics",), ("step", "g"),
         ("backward", "d", False), ("backward", "g", False), ("step", "d"), ("view_state",), ("step", "g"),
         ("metrics",)],
    )
)  # fmt: skip
def test_rank_zero_reads_count_each_overflow_once_change_nothing_and_read_as_one_process(
    one_rank, tmp_path: Path, loop: tuple[dict[str, Any], list[tuple[Any, ...]]]
) -> None:
    config, ops = loop
    read = _FabricRun(tmp_path, grouped=True, reads=True, **config)
    quiet = _FabricRun(tmp_path, grouped=True, reads=False, **config)
    alone = _FabricRun(tmp_path, grouped=False, reads=True, **config)
    same = True  # until a step or a checkpoint comes where the held read left an update one process made
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the body requires grad on purpose; the overflows' own messages
        for index, op in enumerate(ops):
            parted = read.mpx.amp.iteration.update_pending != alone.mpx.amp.iteration.update_pending
            same = same and not (parted and op[0] in ("step", "clip", "save", "load"))
            got = read.do(op, index)
            quiet.do(op, index)
            if same:
                assert got == alone.do(op, index), (index, op)
        for run in (read, quiet):
            run.mpx.amp.end_iteration()  # as every rank's next call
        unread = dict(read.sums)
        last = read._count(read.mpx.metrics())
    for name, value in last.items():  # what was read since the last load, and now, is what the run counted
        if name.startswith("mpx/overflows"):
            loss = int(name[-1]) if "/loss" in name else 0
            total = read.mpx.amp.scalers[loss].state_dict()["overflows"]
            assert unread.get(name, 0.0) + value == total - read.base.get(name, 0), (name, ops)
    (scalers, index, weights), (quiet_scalers, quiet_index, quiet_weights) = read.live(), quiet.live()
    assert (scalers, index) == (quiet_scalers, quiet_index)
    assert all(torch.equal(a, b) for a, b in zip(weights, quiet_weights))


@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="the found-inf reducer needs torch.distributed with gloo",
)
def test_a_read_between_d_s_step_and_a_g_step_without_gradients_changes_nothing(one_rank, tmp_path: Path) -> None:
    """A GAN whose G gets a loss every other iteration and whose ``opt_g.step()`` runs every iteration (a no-op
    without gradients), read on rank 0 between D's step and G's: before, on the iterations without G's gradients the
    read ended the iteration on the reading rank alone (no gradient waited), G's step then fell in the next one there
    and in the same one on the other ranks, so the ranks' growth trackers, and then their scales, parted (here: the
    run with the reads against the same run without them). Now a registered optimizer that has not stepped holds the
    update back, gradients or not."""
    loop = []
    for it in range(4):
        loop += [("zero", "d"), ("zero", "g"), ("backward", "d", it == 2)]
        loop += [("backward", "g", False)] if it % 2 == 0 else []
        loop += [("step", "d"), ("metrics",), ("step", "g")]
    config = dict(losses=1, skip=False, level="O1", body=False, late=False)
    read = _FabricRun(tmp_path, grouped=True, reads=True, **config)
    quiet = _FabricRun(tmp_path, grouped=True, reads=False, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index, op in enumerate(loop):
            read.do(op, index)
            quiet.do(op, index)
        for run in (read, quiet):
            run.mpx.amp.end_iteration()  # as every rank's next call
    (scalers, index, weights), (quiet_scalers, quiet_index, quiet_weights) = read.live(), quiet.live()
    assert (scalers, index) == (quiet_scalers, quiet_index) and index == 4
    assert all(torch.equal(a, b) for a, b in zip(weights, quiet_weights))
    assert sum(read.sums.values()) == 1  # the overflow of iteration 2, read once
