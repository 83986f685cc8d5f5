"""What a refusal of a raw step says: the parameters it names (:func:`_shown`, by their names in the prepared models)
and the fix each kind of refusal gives the user, door by door: a raw step after a backward (``_FIX``), one beside a
prepared optimizer's step (``_BESIDE_FIX``), a SAM-style optimizer's second write (``_SAM_FIX``), a step along the
gradients kept between accumulated backwards (``_KEPT_FIX``).

Used by engine.raw_steps (:func:`~lightning_mpx.engine.raw_steps.refuse_raw_step` and
:class:`~lightning_mpx.engine.raw_steps.UnheldParams`; that module re-exports ``_SAM_FIX`` for engine.optimizers'
refusal of a SAM-style optimizer's base step); read only on the path of a refusal, never in the usual step.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_mpx.masters.weights import MasterWeights


def _name(param: torch.Tensor, master_weights: Sequence[MasterWeights], names: dict[int, str]) -> str:
    found = next((n for m in master_weights if (n := m.name_of(param)) is not None), None)
    return found or names.get(id(param)) or f"<shape {tuple(param.shape)}>"


def _shown(params: Sequence[torch.Tensor], master_weights: Sequence[MasterWeights], names: dict[int, str]) -> str:
    named = [_name(p, master_weights, names) for p in params]
    return ", ".join(repr(n) for n in named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")


_FIX = (
    "a torch optimizer that lightning_mpx did not prepare (or a hand-written update) stepped them, with still-scaled "
    "gradients (at O2 the half model's, with no FP32 master update). Step a prepared optimizer instead: under the "
    "Trainer, return it from configure_optimizers and step self.optimizers() (manual optimization); with Fabric, "
    "fabric.setup(model, optimizer) and step the optimizer it returns; with Accelerate, "
    "accelerator.prepare(model, optimizer); with the core Amp, amp.prepare_optimizer(optimizer) and "
    "amp.step(optimizer). A write of your own with the gradients cleared and no step between (a rollback by copy_ "
    "after a loss spike, a layer re-initialised by reset_parameters() on a skipped batch) looks the same: restore "
    "with model.load_state_dict(...) instead, or call refresh_masters(force=True) right after the write (on the "
    "Trainer's trainer.precision_plugin.amp, Fabric's plugin.amp, accelerator.amp or the Amp itself), which takes it "
    "as yours (at O2 into the FP32 masters); neither is a raw step. A SAM-style two-pass optimizer (first_step, "
    "second_step): see 'SAM and two-pass optimizers' in docs/master_weights.md."
)
_BESIDE_FIX = (
    "a torch optimizer that lightning_mpx did not prepare (a second one, such as a head's, stepped before or after "
    "the prepared one) stepped them with gradients still multiplied by the loss scale (at O2 the half model's, with no "
    "FP32 master update); their weights took that step (reload them if you go on from here). Give that optimizer to "
    "lightning_mpx too: under the Trainer, return it from configure_optimizers beside the other and step "
    "self.optimizers() (manual optimization); with Fabric, fabric.setup(model, optimizer, head_optimizer) and step "
    "what it returns; with Accelerate, accelerator.prepare(model, optimizer, head_optimizer); with the core Amp, "
    "amp.prepare_optimizer(optimizer) and amp.step(optimizer). Or, at O1, unscale them before your own step: give each "
    "parameter its true gradient (for p, g in zip(params, amp.true_grads(params)): p.grad = g, with the Trainer's "
    "trainer.precision_plugin.amp, Fabric's plugin.amp, accelerator.amp or the Amp itself). A write of your own while "
    "they held their gradients (a clamp) looks the same: call refresh_masters(force=True) on that amp right after it, "
    "which takes it as yours. Parameters left out of every optimizer on purpose: freeze them (requires_grad_(False))."
)
_SAM_FIX = (
    "with still-scaled gradients (at O2 the half model's, with no FP32 master update). Give the optimizer a step() "
    "that steps its base optimizer (def step(self, closure=None): return self.base_optimizer.step(closure)); after "
    "the second backward undo the perturbation (second_step's restore of old_p, without its base step) and step "
    "through the door: amp.step(optimizer), or optimizer.step() on the optimizer self.optimizers(), fabric.setup() "
    "or accelerator.prepare() returned. See 'SAM and two-pass optimizers' in docs/master_weights.md."
)
_KEPT_FIX = (
    "a torch optimizer that lightning_mpx did not prepare (or a hand-written update) stepped the half weights, which "
    "the next step takes into the FP32 masters at their half rounding only: what of that update is below the rounding "
    "is lost, where FP32 (and bf16-mixed) keeps it. Step a prepared optimizer instead: under the Trainer, return it "
    "from configure_optimizers and step self.optimizers() (manual optimization); with Fabric, fabric.setup(model, "
    "optimizer, other_optimizer) and step what it returns; with Accelerate, accelerator.prepare(model, optimizer); "
    "with the core Amp, amp.prepare_optimizer(optimizer) and amp.step(optimizer). A write of your own meant to stand "
    "(a constraint applied by hand): call refresh_masters(force=True) right after it (on the Trainer's "
    "trainer.precision_plugin.amp, Fabric's plugin.amp, accelerator.amp or the Amp itself), which takes it into the "
    "FP32 masters as yours."
)
