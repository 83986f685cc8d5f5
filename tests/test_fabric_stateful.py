"""Random sequences of what a Fabric user's loop does (litgpt's pretrain/finetune habits), through
``Fabric(plugins=[FabricMixedPrecisionPlugin(...)])`` side by side with a reference Fabric run.

The references: at O1 (with ``CastTable.autocast_aligned("cpu")``, whose casts are autocast's) Fabric's own
``"bf16-mixed"``; at O2, Fabric's ``"32-true"`` from the same FP32 values as the masters. Rules: a forward and
``fabric.backward`` (accumulated over two parts, the first under ``fabric.no_backward_sync``), a gradient made
non-finite, ``fabric.clip_gradients`` by norm or by value, ``optimizer.step()``, ``zero_grad`` either way, an
evaluation forward under ``torch.no_grad()`` between ``model.eval()`` and ``model.train()``, a learning-rate change in
the param groups, a scheduler step, ``mpx.metrics()``, ``fabric.save`` and later ``fabric.load`` into fresh Fabric,
plugin, model, optimizer and scheduler objects (the run goes on from them).

After each step the update of what the optimizer trains (the FP32 masters at O2) matches the reference's update from
the same point, to a relative tolerance a wrong step breaks (``test_a_wrong_step_breaks_the_comparison``); the
reference then takes our values. A poisoned step is skipped as ``torch.amp.GradScaler`` decides (its scale update,
``torch._amp_update_scale_``, gives the expected scale), leaving weights, masters and optimizer state bit for bit;
a resume restores them, the scale and the counters exactly. Nothing changes dtype.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import CastTable, FabricMixedPrecisionPlugin
from tests.stateful_helpers import assert_same, assert_same_state, stateful_settings

# The rules call a scheduler before any step, as a loop that starts with a warm-up step may.
pytestmark = pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler\.step\(\)` before")

HALF = torch.bfloat16
INIT_SCALE = 2.0**8
# Per step, the update (after - before) against the reference's from the same point, norm-wise: at O1 the same
# autocast casts (rounding order only); at O2 a bfloat16 forward and backward against FP32's.
STEP_RTOL = {"O1": 1e-2, "O2": 6e-2}
LOSS_RTOL = {"O1": 1e-3, "O2": 2e-2}


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    # No bias before the batch norm: its gradient is zero but for rounding, which AdamW's update would magnify.
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def _batch(seed: int, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    return x[rows], y[rows]


class _Run:
    """One Fabric run: its Fabric, set-up model and optimizer, scheduler, and the plugin (``None``: the reference)."""

    def __init__(
        self, level: str, optimizer: str, growth: int, reference: bool, init_seed: int = 0, register: bool = True
    ) -> None:
        self.level = level
        if reference:
            self.mpx = None
            precision = "bf16-mixed" if level == "O1" else "32-true"
            self.fabric = Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]
        else:
            table = {"cast_table": CastTable.autocast_aligned("cpu")} if level == "O1" else {}
            self.mpx = FabricMixedPrecisionPlugin(level, half_dtype=HALF, loss_scale="dynamic", init_scale=INIT_SCALE,
                                                  growth_interval=growth, **table)  # fmt: skip
            self.fabric = Fabric(accelerator="cpu", devices=1, plugins=[self.mpx])
        net = _net(init_seed)
        opt: torch.optim.Optimizer = (
            torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
            if optimizer == "sgd"
            else torch.optim.AdamW(net.parameters(), lr=1e-2)
        )
        self.scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        self.model, self.opt = self.fabric.setup(net, opt)
        if self.mpx is not None and (register or level == "O2"):
            self.mpx.setup_optimizers(self.opt)  # needed before fabric.load at O2 only (docs/fabric.md)

    def state(self) -> dict[str, Any]:
        state = {"model": self.model, "optimizer": self.opt, "scheduler": self.scheduler}
        return {**state, "mpx": self.mpx} if self.mpx is not None else state

    def trained(self) -> list[torch.Tensor]:
        """What the optimizer updates: the FP32 masters at O2, the parameters otherwise."""
        if self.mpx is not None:
            return list(self.mpx.master_params(self.opt))
        return list(self.model.parameters())

    def snapshot(self) -> dict[str, Any]:
        return {
            "trained": [t.detach().clone() for t in self.trained()],
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "opt": copy.deepcopy(self.opt.state_dict()),
            "scale": float(self.mpx.amp.scalers[0].scale_tensor) if self.mpx is not None else 1.0,
        }

    def forward_backward(self, seed: int, parts: int, in_autocast: bool = False) -> float:
        total = 0.0
        for part in range(parts):
            x, y = _batch(seed, slice(part * 16 // parts, (part + 1) * 16 // parts))
            # litgpt's accumulation: every part but the last without the gradients' all-reduce (a no-op here)
            scope = self.fabric.autocast() if in_autocast else contextlib.nullcontext()
            with self.fabric.no_backward_sync(self.model, enabled=part < parts - 1), scope:
                loss = F.cross_entropy(self.model(x), y) / parts
                self.fabric.backward(loss)
            total += loss.item()
        return total


def assert_same_update(got: list[torch.Tensor], want: list[torch.Tensor], before: list[torch.Tensor], rtol: float):
    """Our update (``got - before``) equals the reference's (``want - before``), norm-wise per tensor."""
    for mine, ref, start in zip(got, want, before, strict=True):
        ours, theirs = mine.detach().float() - start.float(), ref.detach().float() - start.float()
        error, size = (ours - theirs).norm().item(), theirs.norm().item()
        assert error <= rtol * size + 1e-6, f"update off by {error:.3g} (|reference update| {size:.3g})"


class FabricAgainstReference(RuleBasedStateMachine):
    @initialize(level=st.sampled_from(["O1", "O2"]), optimizer=st.sampled_from(["sgd", "adamw"]),
                growth=st.sampled_from([1, 3]), register=st.booleans(), data=st.data())  # fmt: skip
    def setup(self, level: str, optimizer: str, growth: int, register: bool = True, data: Any = None) -> None:
        """``register``: ``mpx.setup_optimizers`` called (else the plugin meets the optimizer at its first step;
        O2 always calls it, for ``fabric.load``). With ``data``, one or two iterations first, so that every sequence
        trains (the derandomized examples of CI are short)."""
        self.level, self.optimizer, self.growth = level, optimizer, growth
        self.ours = _Run(level, optimizer, growth, reference=False, register=register)
        self.ref = _Run(level, optimizer, growth, reference=True)
        self._sync_reference()
        # torch.amp.GradScaler's scale and growth tracker, updated by its own kernel with the reference's decision.
        self.scale, self.tracker = torch.tensor([INIT_SCALE]), torch.zeros(1, dtype=torch.int32)
        self.scale_before = INIT_SCALE  # the scale until the pending update is made (at the next forward/backward)
        self.pending = False  # a backward since the last step
        self.clipped = False  # clipped since the last backward
        self.poisoned = False  # a non-finite gradient in the model's gradients (until zero_grad)
        self.skips = self.steps = 0
        self.saved: dict[str, Any] = {}
        # An overflow a clip found in a window then dropped (zero_grad): counted toward the next update, as
        # GradScaler's unscale_ records it (the library steps the next window, where GradScaler would skip it).
        self.clip_found = False
        # engine/raw_steps.py: after a backward with no step since, a write by hand (or a raw step) and a clear of
        # every gradient (set to None), in either order, is refused at the next backward (a raw optimizer's look).
        self.noted = self.written = self.cleared = False
        self._tmp = tempfile.TemporaryDirectory()
        for _ in range(data.draw(st.integers(1, 2)) if data is not None else 0):
            self.iteration(data)

    def teardown(self) -> None:
        if hasattr(self, "_tmp"):
            self._tmp.cleanup()

    # -- helpers ----------------------------------------------------------------------------------------------
    def _sync_reference(self) -> None:
        """The reference takes our trained values, buffers and optimizer state (not the learning rates, not the
        steps' counts, which are compared)."""
        with torch.no_grad():
            for ref, mine in zip(self.ref.model.parameters(), self.ours.trained(), strict=True):
                ref.copy_(mine.float())
            for ref, mine in zip(self.ref.model.buffers(), self.ours.model.buffers(), strict=True):
                ref.copy_(mine)
        ours = self.ours.opt.state_dict()["state"]
        for index, ref in enumerate(self.ref.model.parameters()):
            for name, value in ours.get(index, {}).items():
                if name != "step":
                    self.ref.opt.state[ref][name] = value.detach().clone().float()

    def _expected_scale(self, skipped: bool) -> None:
        self.scale_before = float(self.scale)
        found_inf = torch.tensor([1.0 if skipped else 0.0])
        torch._amp_update_scale_(self.scale, self.tracker, found_inf, 2.0, 0.5, self.growth)

    # -- rules ------------------------------------------------------------------------------------------------
    @precondition(lambda self: not self.clipped)
    @rule(seed=st.integers(0, 50), parts=st.sampled_from([1, 2]), in_autocast=st.booleans())
    def backward(self, seed: int, parts: int, in_autocast: bool) -> None:
        """``in_autocast``: the forward, loss and ``fabric.backward`` inside ``fabric.autocast()``."""
        if self.noted and self.written and self.cleared:
            with pytest.raises(RuntimeError, match="did not prepare"):
                self.ours.forward_backward(seed, parts, in_autocast)
            self.teardown()
            self.setup(self.level, self.optimizer, self.growth)  # the user fixes the script
            return
        loss = self.ours.forward_backward(seed, parts, in_autocast)
        self.noted, self.written, self.cleared = True, False, False
        want = self.ref.forward_backward(seed, parts, in_autocast)
        assert abs(loss - want) <= LOSS_RTOL[self.level] * abs(want) + 1e-4
        self.pending = True

    @precondition(lambda self: self.pending and not self.clipped and self.ours.model.module[3].weight.grad is not None)
    @rule(row=st.integers(0, 3), value=st.sampled_from([float("inf"), float("nan")]))
    def poison_gradient(self, row: int, value: float) -> None:
        """A non-finite gradient (the reference's stays finite: it never sees it, and skips its step)."""
        self.ours.model.module[3].weight.grad[row, 0] = value
        self.poisoned = True

    @precondition(lambda self: self.pending)
    @rule(how=st.sampled_from(["norm", "inf-norm", "value"]))
    def clip(self, how: str) -> None:
        kwargs: dict[str, Any] = {"clip_val": 0.02}
        if how != "value":
            kwargs = {"max_norm": 0.3, "norm_type": 2.0 if how == "norm" else float("inf")}
        norm = self.ours.fabric.clip_gradients(self.ours.model, self.ours.opt, **kwargs)
        if self.poisoned:  # the step is skipped: nothing clipped, a norm of 0 (docs/fabric.md)
            assert how == "value" or float(norm) == 0.0
        else:
            want = self.ref.fabric.clip_gradients(self.ref.model, self.ref.opt, **kwargs)
            if how != "value":
                torch.testing.assert_close(float(norm), float(want), rtol=STEP_RTOL[self.level], atol=1e-6)
        self.clipped = True
        self.clip_found = self.clip_found or self.poisoned

    @precondition(lambda self: self.pending and self.clipped)
    @rule(how=st.sampled_from(["mul_", "new", "value"]))
    def write_grads_after_clip(self, how: str) -> None:
        """After ``fabric.clip_gradients`` (by norm or by value), a write to the model's gradients before the step:
        ``p.grad.mul_(0.5)``, ``p.grad = p.grad * 0.5`` or the user's own ``clip_grad_value_(model.parameters(),
        0.01)``. At O2 the plugin shows the clipped values on the model (stop 69: the write was made on the unclipped
        ones, and the clip lost), so the write is FP32's. On a poisoned step the step is still skipped (the clip found
        the overflow, as ``GradScaler.unscale_`` records it), whatever the write makes of the non-finite value."""
        for run in (self.ours, self.ref):
            params = [p for p in run.model.parameters() if p.grad is not None]
            if how == "value":
                torch.nn.utils.clip_grad_value_(params, 0.01)
            for param in params if how != "value" else ():
                if how == "mul_":
                    param.grad.mul_(0.5)
                else:
                    param.grad = param.grad * 0.5

    @precondition(lambda self: self.pending)
    @rule()
    def step(self) -> None:
        before = self.ours.snapshot()
        self.ours.opt.step()
        skipped = self.ours.mpx.step_was_skipped(self.ours.opt)
        assert skipped == self.poisoned  # GradScaler's decision: a non-finite gradient skips the step
        self._expected_scale(skipped or self.clip_found)
        self.clip_found = self.noted = False
        if skipped:
            self.skips += 1
            after = self.ours.snapshot()
            assert_same(after["trained"], before["trained"])
            assert_same(list(after["model"].values()), list(before["model"].values()))
            assert_same_state(after["opt"], before["opt"])
        else:
            self.steps += 1
            self.ref.opt.step()
            rtol = STEP_RTOL[self.level]
            got, want = self.ours.trained(), list(self.ref.model.parameters())
            if self.optimizer == "adamw" and self.level == "O2":
                # AdamW's update is about lr * sign(gradient): a gradient near zero, whose sign bfloat16's rounding
                # may flip, moves its weight by up to 2 lr. Its first moment, linear in the gradients, is compared
                # as the update is, and the update element by element within that bound.
                ours, theirs = self.ours.opt.state_dict()["state"], self.ref.opt.state_dict()["state"]
                old = before["opt"]["state"]
                start = [old[i]["exp_avg"] if i in old else torch.zeros_like(ours[i]["exp_avg"]) for i in ours]
                assert_same_update([ours[i]["exp_avg"] for i in ours], [theirs[i]["exp_avg"] for i in ours], start,
                                   rtol)  # fmt: skip
                bound = 2.2 * self.ours.opt.param_groups[0]["lr"]
                for mine, ref in zip(got, want, strict=True):
                    assert (mine.detach() - ref.detach()).abs().max() <= bound, "update off by more than 2 lr"
            else:
                assert_same_update(got, want, before["trained"], rtol)
        self._sync_reference()
        self.pending = self.clipped = False

    @precondition(lambda self: not self.clipped)
    @rule(data=st.data())
    def iteration(self, data: st.DataObject) -> None:
        """A whole iteration of a litgpt loop, the rules above in a row (so that short sequences train too: the
        derandomized examples of the rules alone took no step): usually ``optimizer.zero_grad()``, a backward of one
        or two parts, maybe a non-finite gradient (a skipped step), maybe a clip, the step."""
        if data.draw(st.integers(0, 3)) > 0:
            self.zero_grad(set_to_none=data.draw(st.booleans()), through_model=False)
        self.backward(seed=data.draw(st.integers(0, 50)), parts=data.draw(st.sampled_from([1, 2])),
                      in_autocast=data.draw(st.booleans()))  # fmt: skip
        if not self.pending:  # refused (a write and a clear since the last backward), and started afresh
            return
        if data.draw(st.integers(0, 4)) == 0:
            self.poison_gradient(row=data.draw(st.integers(0, 3)), value=float("inf"))
        if data.draw(st.booleans()):
            self.clip(how=data.draw(st.sampled_from(["norm", "inf-norm", "value"])))
        self.step()

    @rule(set_to_none=st.booleans(), through_model=st.booleans())
    def zero_grad(self, set_to_none: bool, through_model: bool) -> None:
        """``optimizer.zero_grad`` or ``model.zero_grad`` (the same parameters)."""
        for run in (self.ours, self.ref):
            (run.model if through_model else run.opt).zero_grad(set_to_none=set_to_none)
        self.pending = self.clipped = self.poisoned = False
        self.cleared = self.cleared or set_to_none  # zeros in place keep the gradients: no clear to raw_steps.py

    def _take_write(self, before: list[torch.Tensor], want: list[torch.Tensor]) -> None:
        """After a write by hand into the model's weights: what the optimizer trains took it (read through
        ``amp.master_of``, which takes it as the next step would): exactly at O1, at O2 the write's half rounding (O2
        keeps no FP32 value of a write it never saw: docs/master_weights.md), within a unit in the last place of
        ``want`` (the write done in FP32); the reference then takes our values."""
        got = [self.ours.mpx.amp.master_of(p).detach() for p in self.ours.model.parameters()]
        for name, mine, value, was in zip(self.names, got, want, before, strict=True):
            if self.level == "O1" or mine.dtype == torch.float32 and ".1." in f".{name}":  # FP32 weights
                assert torch.equal(mine, value), f"{name}: a hand write not taken"
            else:
                ulp = (value.abs() + was.abs()) * 2.0**-7 + 1e-6  # bfloat16's unit in the last place, of both
                assert ((mine - value).abs() <= ulp).all(), f"{name}: a hand write not taken"
        self._sync_reference()

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.ours.model.module.named_parameters()]

    @precondition(lambda self: not self.clipped)
    @rule(kind=st.sampled_from(["decay", "clamp"]))
    def hand_write(self, kind: str) -> None:
        """``p.mul_(1 - wd)`` or a clamp over every weight, by hand, at any point (between the backwards of an
        accumulation too): never refused while the gradients are kept, and the next step is the reference's from the
        written values. Followed by a clear of every gradient with no step (a dropped batch), it looks as a raw
        optimizer's step and is refused at the next backward (engine/raw_steps.py; ``refresh_masters(force=True)``
        after the write takes it as the user's)."""
        before = [t.detach().clone() for t in self.ours.trained()]
        with torch.no_grad():
            for p in self.ours.model.parameters():
                p.mul_(1 - 1e-2) if kind == "decay" else p.clamp_(-0.2, 0.2)
        self._take_write(before, [v * (1 - 1e-2) if kind == "decay" else v.clamp(-0.2, 0.2) for v in before])
        self.written = True

    @precondition(lambda self: not self.clipped)
    @rule(seed=st.integers(0, 50), keys=st.sets(st.sampled_from(["0.weight", "1.weight", "3.weight", "3.bias"]),
                                               min_size=1, max_size=3))  # fmt: skip
    def load_subset(self, seed: int, keys: set[str]) -> None:
        """``model.load_state_dict(subset, strict=False)`` of FP32 values at any point: the loaded weights go to what
        the optimizer trains exactly (the O2 masters), the missing ones keep their trained values."""
        g = torch.Generator().manual_seed(seed)
        shapes = dict(self.ours.model.module.named_parameters())
        state = {k: 0.3 * torch.randn(shapes[k].shape, generator=g) for k in sorted(keys)}
        before = [t.detach().clone() for t in self.ours.trained()]
        result = self.ours.model.load_state_dict(state, strict=False)
        assert not result.unexpected_keys and not set(result.missing_keys) & keys
        got = [self.ours.mpx.amp.master_of(p).detach() for p in self.ours.model.parameters()]
        for name, mine, was in zip(self.names, got, before, strict=True):
            assert torch.equal(mine, state[name] if name in keys else was), f"{name}: {name in keys and 'not '}loaded"
        self._sync_reference()
        self.noted = False  # a load forgets what the last backward noted (engine/raw_steps.py)

    @precondition(lambda self: self.pending and not self.clipped)
    @rule(slot=st.sampled_from(["a", "b"]))
    def save_mid_window(self, slot: str) -> None:
        """``fabric.save`` between the backwards of an accumulation window (the run goes on, and a resume comes back
        to that point, without the window's gradients)."""
        pending, self.pending = self.pending, False
        try:
            self.save(slot)
        finally:
            self.pending = pending

    # SGD only: AdamW's per-parameter step counts (checked by an invariant) lag where the raw zero_grad cleared a
    # gradient. Not poisoned: the raw step would write the non-finite gradient into the weights (the user's NaN).
    @precondition(lambda self: not self.clipped and not self.poisoned and self.optimizer == "sgd")
    @rule()
    def raw_head_step(self) -> None:
        """A second optimizer over the last layer, never prepared, its parameters held by the prepared optimizer:
        ``SGD(head.parameters(), lr=1e-3).step()`` and its ``zero_grad()``, at any point. Never refused (but as a
        hand write followed by a clear of every gradient, see :meth:`hand_write`): a head held
        by the prepared optimizer is no raw step beside it (engine/beside_steps.py), and a write while other
        parameters of the optimizer keep their gradients is none between backwards either (engine/raw_steps.py: an
        EMA teacher's habit; at O1 the step applied gradients times the loss scale, which nothing sees). The next
        step is the reference's from the written values."""
        head = self.ours.model.module[3]
        before = [t.detach().clone() for t in self.ours.trained()]
        grads = [None if p.grad is None else p.grad.detach().float().clone() for p in self.ours.model.parameters()]
        raw = torch.optim.SGD(head.parameters(), lr=1e-3)
        raw.step()
        raw.zero_grad()
        self.ref.model.module[3].zero_grad()
        want = [v.add(g, alpha=-1e-3) if i >= 3 and g is not None else v for i, (v, g) in enumerate(zip(before, grads))]
        self._take_write(before, want)
        self.written = True

    @rule(seed=st.integers(0, 50), inference=st.booleans())
    def evaluate(self, seed: int, inference: bool) -> None:
        """Under ``torch.no_grad()`` (litgpt's validate) or ``torch.inference_mode()`` (Lightning's), between
        steps or in the middle of an accumulation."""
        x, _ = _batch(seed)
        outs = []
        for run in (self.ours, self.ref):
            buffers = [b.clone() for b in run.model.buffers()]
            run.model.eval()
            with torch.inference_mode() if inference else torch.no_grad():
                outs.append(run.model(x))
            run.model.train()
            assert_same(list(run.model.buffers()), buffers)  # eval mode: the running statistics are only read
        assert outs[0].dtype == torch.float32
        torch.testing.assert_close(outs[0], outs[1].float(), rtol=4 * LOSS_RTOL[self.level], atol=2e-2)

    @rule(factor=st.sampled_from([0.5, 2.0]))
    def change_lr(self, factor: float) -> None:
        for run in (self.ours, self.ref):
            for group in run.opt.param_groups:
                group["lr"] *= factor

    @rule()
    def scheduler_step(self) -> None:
        self.ours.scheduler.step()
        self.ref.scheduler.step()

    @rule()
    def log_metrics(self) -> None:
        metrics = self.ours.mpx.metrics()  # makes the pending scale update
        assert metrics["mpx/loss_scale"] == float(self.scale)
        assert metrics["mpx/skipped_steps"] == self.skips

    @precondition(lambda self: not self.pending)
    @rule(slot=st.sampled_from(["a", "b"]))
    def save(self, slot: str) -> None:
        path = Path(self._tmp.name) / slot
        # The FP32 export (litgpt's final save of the weights): the values the optimizer trains, exactly.
        exported = self.ours.mpx.fp32_state_dict(self.ours.model)
        names = [name for name, _ in self.ours.model.module.named_parameters()]
        assert_same([exported[name] for name in names], [t.detach() for t in self.ours.trained()])
        self.ours.fabric.save(path, self.ours.state())
        # After the save (a checkpoint makes the pending scale update): what a resume must bring back.
        self.saved[slot] = dict(
            path=path, ours=self.ours.snapshot(), ref=copy.deepcopy(self.ref.model.state_dict()),
            ref_opt=copy.deepcopy(self.ref.opt.state_dict()), ref_sched=copy.deepcopy(self.ref.scheduler.state_dict()),
            sched=copy.deepcopy(self.ours.scheduler.state_dict()), scale=self.scale.clone(),
            tracker=self.tracker.clone(), skips=self.skips, steps=self.steps, poisoned=self.poisoned,
        )  # fmt: skip
        assert self.saved[slot]["ours"]["scale"] == float(self.scale)

    @precondition(lambda self: self.saved and not self.pending)
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        """``fabric.load`` into fresh objects (another initialisation: everything must come from the file)."""
        saved = self.saved[data.draw(st.sampled_from(sorted(self.saved)))]
        register = data.draw(st.booleans())
        self.ours = _Run(self.level, self.optimizer, self.growth, reference=False, init_seed=1, register=register)
        self.ours.fabric.load(saved["path"], self.ours.state())
        got = self.ours.snapshot()
        assert_same(got["trained"], saved["ours"]["trained"])
        assert_same(list(got["model"].values()), list(saved["ours"]["model"].values()))
        assert_same_state(got["opt"], saved["ours"]["opt"])
        assert got["scale"] == saved["ours"]["scale"]
        assert self.ours.scheduler.state_dict() == saved["sched"]
        self.ref.model.load_state_dict(saved["ref"])
        self.ref.opt.load_state_dict(copy.deepcopy(saved["ref_opt"]))  # a copy: loading keeps the given tensors
        self.ref.scheduler.load_state_dict(saved["ref_sched"])
        self.ref.opt.zero_grad(set_to_none=True)  # the fresh model has no gradients
        self.scale, self.tracker = saved["scale"].clone(), saved["tracker"].clone()
        self.scale_before = float(self.scale)
        self.skips, self.steps = saved["skips"], saved["steps"]
        self.pending = self.clipped = self.poisoned = self.clip_found = self.noted = False

    # -- invariants -------------------------------------------------------------------------------------------
    @invariant()
    def weights_agree_and_keep_their_dtypes(self) -> None:
        half = HALF if self.level == "O2" else torch.float32
        trained = self.ours.trained()
        for name, param in self.ours.model.named_parameters():
            assert param.dtype == (torch.float32 if ".1." in f".{name}" else half), name  # batch norm stays FP32
            assert param.grad is None or param.grad.dtype == param.dtype, name
        for weight, value, ref in zip(self.ours.model.parameters(), trained, self.ref.model.parameters(), strict=True):
            assert value.dtype == torch.float32 and ref.dtype == torch.float32
            assert torch.equal(weight.detach(), value.detach().to(weight.dtype))  # the model holds the trained values
            torch.testing.assert_close(value.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
        for values in self.ours.opt.state_dict()["state"].values():
            assert all(v.dtype == torch.float32 for v in values.values() if torch.is_tensor(v))

    @invariant()
    def steps_learning_rates_and_scale_agree(self) -> None:
        assert [g["lr"] for g in self.ours.opt.param_groups] == [g["lr"] for g in self.ref.opt.param_groups]
        for run in (self.ours, self.ref):
            for index, values in run.opt.state_dict()["state"].items():
                if "step" in values:  # AdamW: the steps taken, a skipped step not counted
                    assert float(values["step"]) == self.steps, (run.mpx is None, index)
        scaler = self.ours.mpx.amp.scalers[0]
        pending = self.ours.mpx.amp.iteration.update_pending
        assert float(scaler.scale_tensor) == (self.scale_before if pending else float(self.scale))


FabricAgainstReference.TestCase.settings = stateful_settings(max_examples=6, steps=12)
test_fabric_plugin_against_fabric_reference = FabricAgainstReference.TestCase


@pytest.mark.parametrize("level,optimizer", [("O1", "sgd"), ("O1", "adamw"), ("O2", "sgd"), ("O2", "adamw")])
def test_a_wrong_step_breaks_the_comparison(level, optimizer):
    # The tolerances are tight enough that a step 30% too long (SGD; AdamW at O1), or whose gradients are 30% off
    # (AdamW's first moment at O2: its update hardly depends on the gradients' size), fails them.
    machine = FabricAgainstReference()
    machine.setup(level=level, optimizer=optimizer, growth=3)
    machine.backward(seed=0, parts=2, in_autocast=False)
    if optimizer == "adamw" and level == "O2":
        for param in machine.ours.model.parameters():
            param.grad.mul_(1.3)
    else:
        machine.ours.opt.param_groups[0]["lr"] *= 1.3  # the reference's stays as it was
    with pytest.raises(AssertionError, match="update off by"):
        machine.step()
    machine.teardown()


# -- what the random sequences found, each written out ----------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("norm_type", [float("inf"), 2.0])
def test_an_overflow_step_clipped_by_the_infinity_norm_is_skipped(level, norm_type):
    # Found by the sequences: on an overflow step the plugin hands Fabric's clip a stand-in for the parameters; an
    # empty one made torch's infinity norm raise ("cannot compute the infinity norm on an empty tensor").
    run = _Run(level, "sgd", growth=3, reference=False)
    run.forward_backward(seed=0, parts=1)
    before = [t.detach().clone() for t in run.trained()]
    run.model.module[3].weight.grad[0, 0] = float("inf")
    norm = run.fabric.clip_gradients(run.model, run.opt, max_norm=0.3, norm_type=norm_type)
    assert float(norm) == 0.0  # nothing clipped
    run.opt.step()
    assert run.mpx.step_was_skipped(run.opt)
    assert_same(run.trained(), before)
