"""The Accelerate adapter's gradient unscaling and clipping (:class:`GradientClipping`, a base of
:class:`~lightning_mpx.integrations.accelerate.Accelerator`): ``unscale_gradients``, ``clip_grad_norm_`` and
``clip_grad_value_`` on the engine, the parameters mapped to the optimizers that train them."""

from __future__ import annotations

from typing import Any, Callable, Iterable, NoReturn

import torch

from lightning_mpx.common.imports import require
from lightning_mpx.common.keywords import check_keywords, required
from lightning_mpx.engine.clipping import clip_limit, follow_model_writes

require("accelerate", feature="lightning_mpx.accelerate")
from lightning_mpx.integrations.accelerate_optimizer import (  # noqa: E402
    AmpOptimizer,
    gradient_targets,
    owner_of,
    params_of,
)

__all__ = ["GradientClipping"]


class GradientClipping:
    """Accelerate's gradient calls for an accelerator whose ``amp`` is a :class:`~lightning_mpx.Amp` (or ``None``:
    Accelerate's own)."""

    # What the Accelerator this is a base of provides (declared here for readers and type checkers).
    amp: Any
    sync_gradients: bool
    _amp_optimizers: Callable[[], list[AmpOptimizer]]  # its prepared optimizers' wrappers

    def unscale_gradients(self, optimizer: Any = None, **misspelt: NoReturn) -> None:
        """Unscale the gradients of ``optimizer`` (one, a list, or ``None``: every prepared optimizer that holds
        gradients). At O2 the unscaled gradients are the FP32 masters' ``.grad``, and the model's gradients show them.
        An optimizer already unscaled since its last step (by a clip) is not unscaled again; at O2 the model's
        gradients then show its unscaled, clipped ones, so a write to them after this call trains as under
        Accelerate's own precisions. Call it right before the step: a later backward would add scaled gradients to
        unscaled ones."""
        if misspelt:  # a keyword of none of them, refused naming them (keywords.py: no wrapper on a per-step call)
            check_keywords("accelerator.unscale_gradients()", misspelt, ("optimizer",))
        if self.amp is None:
            super().unscale_gradients(optimizer)
            return
        self._check_sync("unscale_gradients")
        if optimizer is None:
            owners = [o for o in self._amp_optimizers() if any(p.grad is not None for p in params_of(o.optimizer))]
        else:
            optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
            owners = [owner_of(self._amp_optimizers(), opt) for opt in optimizers]
        # unscaled already by a clip (one fused pass, into the masters' gradients only): the model's gradients still
        # hold the scaled values; shown now, clipped, as Accelerate's own clip leaves them (a write to them was
        # refused at the step as made on scaled values)
        earlier = [owner for owner in owners if self.amp.is_unscaled(owner.optimizer)]
        self._unscale(owners)
        self._show_clipped(earlier)

    def clip_grad_norm_(
        self,
        parameters: Any = required("accelerator.clip_grad_norm_()", "parameters"),
        max_norm: float = required("accelerator.clip_grad_norm_()", "max_norm"),
        norm_type: float = 2,
        **misspelt: NoReturn,
    ) -> torch.Tensor:
        """Clip the unscaled gradients of ``parameters`` to a global norm; returns the norm before clipping.

        With an opt level, ``parameters`` (the model's or the optimizer's) are mapped to the optimizers that train
        them, which are unscaled first; when they are one optimizer's parameters (its frozen ones may be left out)
        and ``norm_type`` is 2, unscaling, the overflow check, the norm and the clip are one fused pass, and the norm
        is logged as ``mpx/grad_norm``. Under FSDP the norm is the global one (over every rank's shards); only that
        fused case is supported there.

        Raises:
            RuntimeError: inside ``accumulate()`` on a step that does not synchronise gradients.
            ValueError: when ``max_norm`` is not a positive number (``math.inf`` is: the norm without clipping), a
                parameter with a gradient belongs to no optimizer prepared by this accelerator, or under FSDP for a
                part of an optimizer's parameters or a norm_type other than 2.
            TypeError: for a keyword it does not take (``max_nrom=``), naming the valid ones and the one meant; for
                ``parameters`` or ``max_norm`` left out, naming it.
        """
        if misspelt:
            check_keywords("accelerator.clip_grad_norm_()", misspelt, ("parameters", "max_norm", "norm_type"))
        if self.amp is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)  # type: ignore[no-any-return]
        if type(max_norm) not in (int, float) or not max_norm > 0:  # torch's clip (below) would flip or zero them
            clip_limit("max_norm", max_norm)
        self._check_sync("clip_grad_norm_")
        owners, targets = gradient_targets(self.amp, self._amp_optimizers(), parameters)
        if float(norm_type) == 2.0 and len(owners) == 1:
            owner = owners[0]
            # the library's read: not handed out for the user's writes (engine.master_writes), nor its clip's noted
            masters = self.amp._machine.master_params(owner.optimizer, with_masters=self.amp._with_masters, hand=False)
            if _covers(targets, masters):
                shown = owner.unscaled  # unscale_gradients() first: at O2 the model's gradients show the true values
                norm = self.amp.clip_grad_norm_(owner.optimizer, max_norm)
                owner.unscaled = True
                if shown:  # ... and then the clipped ones, as Accelerate's own "fp16" leaves them
                    self._show_clipped(owners)
                self._unscale_others(owners)
                return norm
        if self.amp.sharded:
            raise ValueError(
                f"clip_grad_norm_ with norm_type={norm_type!r} on {len(targets)} parameter(s) of {len(owners)} "
                "optimizer(s): under FSDP the global norm (one collective across ranks) is computed for exactly "
                "one optimizer's parameters with norm_type=2. Pass model.parameters() (or that optimizer's "
                "parameters) and norm_type=2."
            )
        self._unscale(owners)
        if len(owners) > 1 and self._skip_together(owners):
            # one optimizer's gradients overflowed: the joint norm is not finite, and torch's clip would multiply the
            # others' finite gradients by 0 or NaN, which their steps (their own checks clean) would apply
            return torch.nn.utils.get_total_norm([t.grad for t in targets if t.grad is not None], norm_type)
        norm = torch.nn.utils.clip_grad_norm_(targets, max_norm, norm_type=norm_type)
        self._show_clipped(owners)
        self._unscale_others(owners)
        return norm

    def clip_grad_value_(
        self,
        parameters: Any = required("accelerator.clip_grad_value_()", "parameters"),
        clip_value: float = required("accelerator.clip_grad_value_()", "clip_value"),
        **misspelt: NoReturn,
    ) -> None:
        """Clamp the unscaled gradients of ``parameters`` to ``[-clip_value, clip_value]`` (see
        :meth:`clip_grad_norm_` for how parameters are mapped)."""
        if misspelt:
            check_keywords("accelerator.clip_grad_value_()", misspelt, ("parameters", "clip_value"))
        if self.amp is None:
            super().clip_grad_value_(parameters, clip_value)
            return
        if type(clip_value) not in (int, float) or not clip_value > 0:  # torch's clamp would pin or zero them
            clip_limit("clip_value", clip_value)
        self._check_sync("clip_grad_value_")
        owners, targets = gradient_targets(self.amp, self._amp_optimizers(), parameters)
        self._unscale(owners)
        torch.nn.utils.clip_grad_value_(targets, clip_value)
        self._show_clipped(owners)
        self._unscale_others(owners)

    def _skip_together(self, owners: list[AmpOptimizer]) -> bool:
        """Whether any of ``owners`` (unscaled, clipped by one norm) overflowed; if so every one of them skips its
        step, as that optimizer does (one host read for them all, which their steps then take instead of reading
        again: the engine's ``overflowed_together``). Before, the NaN norm made the other optimizers' gradients NaN
        and they stepped on them: NaN weights, silently (Accelerate's own ``"fp16"`` does the same: ``GradScaler``
        read their flags at the unscale)."""
        assert self.amp is not None
        machine = self.amp._machine
        hits = machine.overflowed_together([owner.optimizer for owner in owners])
        overflowed = [owner for owner, hit in zip(owners, hits) if hit]
        if not overflowed:
            return False
        for loss_id in {machine.state(owner.optimizer).loss_id or 0 for owner in overflowed}:
            machine.share_overflow([owner.optimizer for owner in owners], loss_id)
        return True

    def _check_sync(self, what: str) -> None:
        if not self.sync_gradients:
            raise RuntimeError(
                f"{what}() was called while accelerator.sync_gradients is False (inside accumulate(), before the "
                "last micro-batch): the gradients are still accumulating, scaled. Call it under "
                "`if accelerator.sync_gradients:`."
            )

    def _show_clipped(self, owners: Iterable[AmpOptimizer]) -> None:
        """O2, after torch's clip of the masters' gradients (which the engine does not see): the model's gradients,
        which the unscale showed unclipped, show the clipped ones, as Accelerate's own ``"fp16"`` leaves the model's
        (a write to them before the step, taken as true values, lost the clip: 0.13 off FP32, silently)."""
        assert self.amp is not None
        if self.amp.properties.master_weights:
            for owner in owners:
                self.amp.show_unscaled_on_model(owner.optimizer)

    def _unscale_others(self, owners: list[AmpOptimizer]) -> None:
        """After a clip of ``owners``' parameters: the other prepared optimizers that hold gradients are unscaled too
        (at O2 the model's gradients show the true values), as Accelerate's own clip calls ``unscale_gradients()`` of
        every optimizer: a read of another model's gradients after the clip gave them times the loss scale (740 for
        0.72), and an additive write to them was divided by it at their step. Nothing to look at with one optimizer."""
        others = [o for o in self._amp_optimizers() if all(o is not owner for owner in owners)]
        if others:
            self._unscale([o for o in others if any(p.grad is not None for p in params_of(o.optimizer))])

    def _unscale(self, owners: Iterable[AmpOptimizer]) -> None:
        """Unscale ``owners`` not unscaled since their step; at O2 the writes to the model's gradients since an
        earlier unscale (``unscale_gradients()``, then ``p.grad.zero_()``) are taken into the masters' gradients, which
        torch's clip then measures and clips (it ignored them: the norm of the unwritten values, the write lost)."""
        assert self.amp is not None
        for owner in owners:
            if not self.amp.is_unscaled(owner.optimizer):  # the engine's stage: a skipped batch's clip is forgotten
                self.amp.unscale_(owner.optimizer)
                owner.unscaled = True
            elif self.amp.properties.master_weights:
                follow_model_writes(self.amp._machine, owner.optimizer)


def _covers(targets: list[torch.Tensor], params: list[torch.Tensor]) -> bool:
    """Whether ``targets`` are ``params`` but for frozen ones without a gradient (``requires_grad=False``, which an
    optimizer made from ``model.parameters()`` holds): the norm of the rest is then the norm of them all. One frozen
    after it got a gradient (which the step still applies) is not left out of the fused norm silently."""
    wanted = {id(p) for p in targets}
    return wanted <= {id(p) for p in params} and all(
        not p.requires_grad and p.grad is None for p in params if id(p) not in wanted
    )
