"""The Accelerate adapter's prepared optimizers (:mod:`lightning_mpx.integrations.accelerate`): the wrapper whose real
step is :meth:`Amp.step <lightning_mpx.engine.amp.Amp.step>`, and which of them train the parameters a clip is given.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, Iterable, Iterator, NoReturn

import torch

from lightning_mpx.common.imports import require
from lightning_mpx.common.keywords import check_keywords
from lightning_mpx.engine.amp import Amp

require("accelerate", feature="lightning_mpx.accelerate")
from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped]  # noqa: E402

__all__ = [
    "AmpOptimizer",
    "check_masters_exist",
    "gradient_targets",
    "holding",
    "keeping_grads",
    "owner_of",
    "pair_again",
    "params_of",
    "released_by_engine",
]


_UNPICKLED_STEP = (
    "this prepared optimizer was unpickled (or deep-copied): the loss scale and FP32 master weights it stepped with "
    "belong to the Accelerator that prepared it, and are not pickled with it. Prepare an optimizer again and load this "
    "one's state: `optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters()))` (after "
    "`accelerator.prepare(model)`), then `optimizer.load_state_dict(unpickled.state_dict())`; to carry a whole run "
    "(loss scales, masters), use accelerator.save_state(dir) and accelerator.load_state(dir)."
)


class AmpOptimizer(AcceleratedOptimizer):  # type: ignore[misc]
    """Accelerate's optimizer wrapper whose real step goes through :meth:`Amp.step`.

    ``step_was_skipped`` is true after an overflow, which keeps a prepared scheduler from advancing; inside
    ``accumulate()`` a step that does not synchronise gradients does nothing, as in Accelerate.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        amp: Amp,
        on_step: Callable[[AmpOptimizer], None],
        device_placement: bool = True,
    ) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=None)
        self.amp = amp
        self.on_step = on_step
        self.unscaled = False  # unscaled since the last step (by clip_grad_norm_/unscale_gradients)

    def step(self, closure: Callable[[], Any] | None = None, **misspelt: NoReturn) -> None:
        if misspelt:  # refused naming the valid one (keywords.py: no wrapper on a per-step call)
            check_keywords("optimizer.step()", misspelt, ("closure",))
        if not self.gradient_state.sync_gradients:
            return  # accumulating: Accelerate steps only on the synchronising micro-batch
        if self.amp is None:
            raise RuntimeError(_UNPICKLED_STEP)
        if closure is not None:
            raise ValueError(
                "closure: loss scaling cannot re-run a closure inside the optimizer step; call the closure, then "
                "optimizer.step() without it."
            )
        self._is_overflow = True  # stays true if Amp.step raises (LossScaleFloorError skips the step first)
        # A bool, or with skip_on_device a StepOutcome, read when step_was_skipped asks (a prepared scheduler does)
        self._stepped = self.amp.step(self.optimizer)  # (Amp turns the casts off inside accelerator.autocast())
        self.unscaled = False
        self.on_step(self)

    def train(self) -> None:
        """As Accelerate's: the optimizer's ``train()`` (a schedule-free optimizer's), at O2 on the FP32 masters it
        steps, then copied into the half model."""
        self._on_masters(super().train)

    def eval(self) -> None:
        """As Accelerate's: the optimizer's ``eval()`` (a schedule-free optimizer moves its parameters to the point
        to evaluate), at O2 on the FP32 masters it steps, then copied into the half model, which evaluates there."""
        self._on_masters(super().eval)

    def _on_masters(self, call: Callable[[], Any]) -> None:
        if self.amp is None or not callable(getattr(self.optimizer, "train", None)):
            call()
            return
        self.amp.call_on_masters(self.optimizer, call)

    @property
    def _is_overflow(self) -> bool:  # what Accelerate's step_was_skipped returns
        return not self.__dict__.get("_stepped", True)

    @_is_overflow.setter
    def _is_overflow(self, value: bool) -> None:
        self.__dict__["_stepped"] = not value

    def __getstate__(self) -> dict[str, Any]:
        """The optimizer (its parameter groups and state) and the last step's outcome, not the engine's run.

        The engine (loss scales, O2's masters and their link to the model's half parameters, hooks on the optimizer)
        belongs to the Accelerator that prepared the optimizer; a copy of it would step a model it does not train.
        The unpickled optimizer's ``state_dict()`` loads into an optimizer prepared again (see ``step``)."""
        state = super().__getstate__()
        state.pop("on_step", None)  # a bound method of the Accelerator: not part of the optimizer
        amp = state.pop("amp", None)
        if amp is not None and amp.properties.master_weights:
            state["optimizer"] = _with_masters_in_groups(self.optimizer, amp)
        if "_stepped" in state:
            state["_stepped"] = bool(state["_stepped"])  # a StepOutcome read now: the engine is not pickled
        return state  # type: ignore[no-any-return]

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.amp = None  # type: ignore[assignment]  # no engine: step() says what to do
        self.on_step = None  # type: ignore[assignment]


def _with_masters_in_groups(optimizer: torch.optim.Optimizer, amp: Amp) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` holding what it steps at O2: the FP32 masters in its groups, its state (keyed by the
    masters) its entries. Between steps the engine keeps the model's half parameters in the groups and swaps the
    masters in only for a step or a state-dict call, with hooks that a pickle does not carry."""
    groups = [{**group, "params": [amp.master_of(p) for p in group["params"]]} for group in optimizer.param_groups]
    twin = optimizer.__class__.__new__(optimizer.__class__)
    state = collections.defaultdict(dict, optimizer.state)  # keyed by the masters, as its groups (not re-keyed)
    twin.__setstate__({"defaults": optimizer.defaults, "state": state, "param_groups": groups})
    return twin


def params_of(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters of ``optimizer``, group by group."""
    for group in optimizer.param_groups:
        yield from group["params"]


def owner_of(optimizers: Iterable[AmpOptimizer], optimizer: Any) -> AmpOptimizer:
    """The prepared optimizer among ``optimizers`` that is ``optimizer`` or wraps it."""
    for opt in optimizers:
        if optimizer is opt or optimizer is opt.optimizer:
            return opt
    raise ValueError(f"optimizer={type(optimizer).__name__} was not prepared by this Accelerator.")


def gradient_targets(
    amp: Amp, optimizers: Iterable[AmpOptimizer], parameters: Any
) -> tuple[list[AmpOptimizer], list[torch.Tensor]]:
    """The optimizers that train ``parameters``, and the tensors whose ``.grad`` hold their unscaled gradients
    (the FP32 masters at O2, the parameters themselves otherwise)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    index: dict[int, tuple[AmpOptimizer, torch.Tensor]] = {}
    for opt in optimizers:
        for param in params_of(opt.optimizer):
            master = amp.master_of(param, refresh=False)  # where the unscaled gradient lives
            index[id(param)] = index[id(master)] = (opt, master)
    owners: dict[int, AmpOptimizer] = {}
    targets: dict[int, torch.Tensor] = {}
    strays = 0
    for param in params:
        hit = index.get(id(param))
        if hit is None:
            strays += param.grad is not None
            continue
        owners.setdefault(id(hit[0]), hit[0])
        targets.setdefault(id(hit[1]), hit[1])
    if strays:
        raise ValueError(
            f"parameters holds {strays} tensor(s) with gradients that no optimizer prepared by this Accelerator "
            "trains: their gradients are scaled and cannot be unscaled. Prepare the optimizer that trains them."
        )
    return list(owners.values()), list(targets.values())


def check_masters_exist(amp: Amp, optimizer: torch.optim.Optimizer, models_prepared: int) -> None:
    """Refuse, naming the calls, an optimizer at O2 before any model was prepared for training: it steps the FP32
    masters that preparing a model (for training) makes (``models_prepared``: how many models were prepared)."""
    if not amp.properties.master_weights or amp.sharded or amp.master_weights:
        return
    level = amp.opt_level
    name = type(optimizer).__name__
    if not models_prepared:
        raise RuntimeError(
            f"optimizer={name} was prepared before its model, and no model has been prepared by this Accelerator: "
            f"at mixed_precision={level!r} the optimizer steps the FP32 master weights that preparing the model "
            "makes. Prepare the model first or in the same call: `model, optimizer = accelerator.prepare(model, "
            "optimizer)` (any order), or `model = accelerator.prepare(model)` before "
            "`optimizer = accelerator.prepare(optimizer)`."
        )
    raise RuntimeError(
        f"optimizer={name} was prepared, but every model this Accelerator prepared was prepared for evaluation "
        f"(`prepare_model(model, evaluation_mode=True)`), which makes no FP32 master weights; at "
        f"mixed_precision={level!r} the optimizer steps them. Prepare its model for training first: "
        "`model = accelerator.prepare(model)` (or `accelerator.prepare_model(model)`), then "
        "`optimizer = accelerator.prepare(optimizer)`."
    )


def holding(amp: Amp, optimizers: Iterable[AmpOptimizer], model: torch.nn.Module, *, train: bool) -> list[AmpOptimizer]:
    """The prepared ``optimizers`` that hold parameters of ``model``, which ``amp`` is about to convert: at O2 each
    paired them with themselves while they were FP32 (prepared before ``model``, in an earlier ``prepare`` call) and
    must be paired again after the conversion (:func:`pair_again`). Refuses ``model`` for evaluation only (no masters)
    when one of them trains it."""
    if not amp.properties.master_weights or amp.sharded:
        return []
    ids = {id(param) for param in model.parameters()}  # frozen ones too: unfrozen later, they need a master
    found = [o for o in optimizers if o.amp is amp and any(id(param) in ids for param in params_of(o.optimizer))]
    if not train and any(p.requires_grad and id(p) in ids for o in found for p in params_of(o.optimizer)):
        raise ValueError(
            f"model={type(model).__name__} is prepared with evaluation_mode=True, but optimizer="
            f"{type(found[0].optimizer).__name__} prepared by this Accelerator trains its parameters: at "
            f"mixed_precision={amp.opt_level!r} it would step them in half without FP32 masters. Prepare it for "
            "training: `model = accelerator.prepare(model)`."
        )
    return found


def pair_again(amp: Amp, optimizers: Iterable[AmpOptimizer]) -> None:
    """Register ``optimizers`` (from :func:`holding`) again with ``amp`` once their model is converted: its half
    parameters get their FP32 masters (from the FP32 values kept at the conversion; the optimizer's state moves to
    them)."""
    for opt in optimizers:
        amp.release_optimizer(opt.optimizer)
        amp.prepare_optimizer(opt.optimizer)


@contextlib.contextmanager
def keeping_grads(model: torch.nn.Module) -> Iterator[None]:
    """Keep the gradients ``model``'s parameters hold across its conversion to half, which drops them: a model
    prepared inside an accumulation window (its optimizer prepared before it) keeps the micro-batches accumulated so
    far, as under Accelerate's own modes; each is put back in its parameter's new dtype."""
    grads = [(param, param.grad) for param in model.parameters() if param.grad is not None]
    yield
    for param, grad in grads:
        if param.grad is None and grad.shape == param.shape:
            param.grad = grad.to(device=param.device, dtype=param.dtype)


def released_by_engine(optimizer: Any, amp: Amp) -> bool:
    """``optimizer`` is an :class:`AmpOptimizer` of another engine that no longer steps it (released by
    ``Accelerator.free_memory()``): ``amp`` can take it over."""
    if not isinstance(optimizer, AmpOptimizer) or optimizer.amp is None or optimizer.amp is amp:
        return False
    return id(optimizer.optimizer) not in optimizer.amp._optimizers
