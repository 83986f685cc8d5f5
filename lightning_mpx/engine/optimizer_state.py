"""The state of one prepared optimizer: where it is in its iteration, and the overflow its checks found.

One :class:`_OptimizerState` per prepared optimizer, as ``torch.amp.GradScaler`` keeps one stage per optimizer: its
:class:`_Stage` moves READY -> UNSCALED on an unscale (or a clip), back to READY after the step, and
:meth:`~lightning_mpx.engine.amp.Amp.update` resets every optimizer for the next iteration (one left UNSCALED without a
step becomes SKIPPED). It also caches the optimizer's (parameter, master) pairs for the master swap
(:mod:`lightning_mpx.masters.pairs`). Plain data: the stages that use it (:mod:`~lightning_mpx.engine.grad_checks`,
:mod:`~lightning_mpx.engine.rescale`, :mod:`~lightning_mpx.masters.swap`) read and write its fields, so that a step
never calls back into this module but to :meth:`_OptimizerState.reset` at its end.
"""

from __future__ import annotations

import enum
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from lightning_mpx.common.keywords import check_keywords
from lightning_mpx.masters.mirror import Mirror
from lightning_mpx.scaling.workspace import UnscaleWorkspace


class _Stage(enum.Enum):
    """Where an optimizer is in its iteration (one state machine per optimizer, as ``torch.amp.GradScaler``'s)."""

    READY = "ready"  # its gradients, if any, carry the scale of `loss_id`
    UNSCALED = "unscaled"  # unscale_() or clip_grad_*() ran: its gradients hold true values, step() is next
    # update() closed an iteration in which it was unscaled but did not step (a skipped batch): the gradients it
    # left behind, unless zeroed since, still hold true values
    SKIPPED = "skipped"
    # A step (taken or skipped) used its gradients and they are still there unless cleared since (stepped_marks tells):
    # true values where unscaled in place (O1; parameters without a master), the scale of `loss_id` in the half
    # model's at O2 (`grad_scale` once update() changed the scaler). The next backward, unscale or step settles it
    # (lightning_mpx.engine.rescale), as FP32 would treat gradients left after its step.
    STEPPED = "stepped"


@dataclass
class _OptimizerState:
    optimizer_ref: weakref.ref[torch.optim.Optimizer]  # Amp keeps no optimizer alive that the user let go
    stage: _Stage = _Stage.READY
    loss_id: int | None = None  # the loss whose scale the optimizer's pending gradients carry
    # The scale those gradients carry when update() has changed the scaler since (else None: the scaler's own).
    grad_scale: torch.Tensor | None = None
    # Overflow flag per loss whose gradients the optimizer holds: each check charges the non-finite values it finds
    # to the loss whose backward ran since the previous check (the ones found before are already charged, and stay
    # non-finite), so that one loss's overflow does not back off another's scale.
    found_by_loss: dict[int, torch.Tensor] = field(default_factory=dict)
    found_inf: torch.Tensor | None = None  # all of them together: the skip decision
    # The overflow a backward found where it brought pending gradients to its scale, by their loss: charged at the next
    # check only where that check finds one still (grad_checks.carry); a zero_grad since dropped it.
    carried_found: dict[int, torch.Tensor] | None = None
    # The flag a host read of Amp.overflowed() read, and what it said: the step reads that flag again only if it is
    # another tensor. Sound because a flag is never written after the check that made it (each check charges a new
    # tensor, grad_checks.charge); the one write in place, a reducer's across processes, forgets it.
    flag_read: tuple[torch.Tensor, bool] | None = None
    grad_norm: torch.Tensor | None = None
    workspace: UnscaleWorkspace = field(default_factory=UnscaleWorkspace)  # fused unscale's tables, kept across steps
    # (model parameter, its FP32 master or itself) for the optimizer's parameters, the masters of each parameter
    # group in order (what the groups hold during a step), and the parameter lists (identity, length) they were
    # built from
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    group_masters: list[list[torch.Tensor]] = field(default_factory=list)
    pairs_key: tuple[tuple[int, int], ...] | None = None
    # the last group's parameter list the pairs were made from, held (its id is never another list's): a group added
    # in place of a removed one, at the same count, is seen at the next forward (engine.amp.Amp.forward_context)
    last_params: list[torch.Tensor] | None = None
    # O2: the half parameters paired with themselves (frozen when the pairs were made): one that requires a gradient
    # or has one since makes the pairs be made again, with its master.
    unmastered: list[torch.Tensor] = field(default_factory=list)
    # The pairs as two lists (parameters, masters), and the positions of the parameters with a master of their own:
    # what a step reads with C-level maps instead of a Python loop over every pair.
    pair_params: list[torch.Tensor] = field(default_factory=list)
    pair_masters: list[torch.Tensor] = field(default_factory=list)
    mastered: list[int] = field(default_factory=list)
    # Where the masters' new FP32 gradients lie in the one buffer a step makes for them (masters.pairs.GradLayout);
    # None: not worked out since the pairs were made; False: the masters cannot share one (devices, dtypes, layouts).
    grad_layout: Any = None
    swapped: list[list[torch.Tensor]] | None = None  # the groups' own lists while the masters stand in for them
    hooks: list[Any] = field(default_factory=list)  # handles of the hooks registered on the optimizer
    # O2: weak references to the inner optimizers sharing its param_groups (a Lookahead's base optimizer), which carry
    # the state-dict hooks too (engine.optimizers.shared_inners)
    inners: list[Any] = field(default_factory=list)
    on_new_pairs: Any = None  # called with the state and the optimizer when its pairs are made again (masters.pairs)
    mirrors: list[Mirror] | None = None  # O2: the step-time view of its half parameters' masters
    # O2, from an unscale to the end of the iteration: the version of each half gradient the unscale read (by id).
    # A half gradient that is gone or was written since (zero_grad either way) was cleared by the user, and the
    # unscaled copy its master holds must not outlive it.
    unscaled_marks: tuple[tuple[int, int] | None, ...] = ()
    # From an unscale the user's code may follow (unscale_(), a clip) to the step: the parameter lists of the groups
    # as it read them, and their lengths; a parameter added since (add_param_group) was not unscaled
    # (rescale.unscale_late).
    unscaled_groups: tuple[tuple[list[Any], ...], tuple[int, ...]] | None = None
    # STEPPED: (id, version) of each gradient the step left; one gone or written since (zero_grad) was cleared.
    stepped_marks: frozenset[tuple[int, int]] | None = None
    # STEPPED: weak references to marks those gradients hold (rescale.after_step; none to the gradients, which
    # torch.utils.swap_tensors refuses): an id in stepped_marks is theirs only while they live (CPython gives a freed
    # tensor's id to the next one made), so a tensor the user assigned since is told from one kept or written.
    stepped_refs: tuple[weakref.ref[set[Any]], ...] = ()
    # STEPPED: the ids of those gradients, in stepped_refs' order (which refer to an FSDP2 gradient's local shard).
    stepped_ids: tuple[int, ...] = ()
    # STEPPED: the ids of the parameters the optimizer held at the step: a gradient on another one (a group added since)
    # came from a backward, scaled, not from the step.
    stepped_params: frozenset[int] = frozenset()
    # The versions of its parameters at the first backward since its step (engine.raw_steps): a later backward with no
    # step between finds those an optimizer lightning_mpx did not prepare stepped by hand.
    backward_versions: tuple[int, ...] | None = None
    noted_at: int = 0  # the engine's count of steps (of any optimizer) when they were noted
    # O2: writes between accumulated backwards that looked like a raw step, judged at the next step (engine.kept_writes)
    kept_writes: list[Any] = field(default_factory=list)
    # A SAM-style two-pass optimizer (engine.raw_steps): the count of steps at which its first_step's perturbation was
    # let through (one per step: a second write with the gradients cleared before the step is its base step, raw).
    perturbed_at: int = -1
    # O2: a SAM-style optimizer (engine.raw_steps.is_two_pass, asked at registration): its step takes no write made
    # to the half parameters since the last step (first_step's perturbation, and its undo) into the masters.
    two_pass: bool = False
    # O2: whether the step left true values in the half gradients too (shown: show_unscaled_on_model copied them
    # there before the step), not the scale of loss_id.
    shown: bool = False
    stepped_true: bool = False
    # O2, STEPPED and not stepped_true: (id, version) of the shared half gradients the step left holding true values,
    # which another optimizer's unscale showed there (engine.shared_grads.SharedGrads.settled); the others hold the
    # scale of loss_id.
    stepped_shown: frozenset[tuple[int, int]] = frozenset()
    # O2, STEPPED and not stepped_true: (id, version) of the shared half gradients the step left holding the FP32
    # values it stepped with (another optimizer's clip in them, this one's too) times the scale of loss_id, which no
    # clip is applied to again (engine.shared_clips)
    stepped_final: frozenset[tuple[int, int]] = frozenset()
    # O2, no parameter shared, from an unscale the user's code may follow (unscale_(), a clip) to the step: the masters'
    # FP32 gradients as the engine last left them, (a view of their one buffer, whose counter every view moves, and
    # its version; or each gradient and its version where they have no one buffer): a write since, through
    # amp.master_params() or a list of the masters kept from before, is told by it (engine.masters_left)
    masters_left: tuple[Any, ...] | None = None
    # O2, from amp.master_params(optimizer) after a show to the step: by the master's id, (master, its FP32 gradient,
    # that gradient's version) as handed out or as the engine last wrote it (engine.master_writes)
    handed: dict[int, tuple[torch.Tensor, torch.Tensor, int]] | None = None
    # O2: the clips of the masters' gradients since the unscale (or the show), which the half gradients lack:
    # ("norm", norm, max_norm) or ("value", None, clip_value), applied to what a step leaves of them if it is used;
    # a fourth item: the ids of the half gradients of a group added after that clip, left out (rescale.unscale_late).
    clips: tuple[tuple[Any, ...], ...] = ()
    # O2: the overflow flag the last norm clip of ``clips`` was made under (kept across the step with them): an
    # infinite norm of finite gradients (flag unset) zeroed the masters' gradients (torch's coefficient 0), an
    # overflow's left them (coefficient 1); unscale.clip_coefficient
    clips_found: torch.Tensor | None = None
    # Under FSDP: whether the flags in found_by_loss are already summed across ranks (by a clip's collective).
    flags_reduced: bool = False
    # Whether Amp.share_overflow charged an overflow to this optimizer since its last step (its own gradients may be
    # finite: the log then says so instead of naming nothing).
    shared_overflow: bool = False
    # skip_on_device: whether this optimizer's steps skip on the device, decided for the number of parameter groups it
    # had then (``decided_groups``; 0: not decided yet): a group added later is decided again at the next step.
    on_device: bool = False
    decided_groups: int = 0
    # Whether the optimizer holds a complex parameter (unscaled as real views), noted for the number of parameters its
    # groups held then (``complex_groups``; 0: not noted yet): grad_checks.note_complex.
    has_complex: bool = False
    complex_groups: int = 0
    # Under FSDP: the optimizer's parameters as the last unscale saw them (grad_checks.unscale): a list changed since
    # (a parameter appended, or put in place of another) is checked again (half parameters refused at O2).
    sharded_params: tuple[torch.Tensor, ...] = ()
    # O2: a schedule-free optimizer's per-group ``train_mode`` flags as the engine last saw them (None: its groups carry
    # no such flag). Its own ``eval()``/``train()`` called where the groups hold the half parameters moves nothing
    # (its state is keyed by the masters): a flag changed since is redone on the masters (masters.swap.follow_modes).
    train_modes: tuple[Any, ...] | None = None
    # O2: writes through p.grad.data between an unscale and the step (engine.data_writes): None, not looked at yet;
    # False, looked at once and none found (nothing more is paid); True, found (compared at every step). The copy of
    # the half gradients the look compares against, from the note to the step.
    data_habit: bool | None = None
    data_watch: Any = None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        optimizer = self.optimizer_ref()
        if optimizer is None:
            raise RuntimeError("the optimizer was garbage-collected")
        return optimizer

    def clear_checks(self) -> None:
        """Forget the overflow flags and the norm of the checks since the last step."""
        self.found_by_loss, self.found_inf, self.grad_norm = {}, None, None
        self.carried_found = self.flag_read = None
        self.flags_reduced = False

    def reset(self) -> None:
        """Back to READY with no pending gradients: after a step, stepped or skipped."""
        self.stage = _Stage.READY
        self.loss_id = None
        self.grad_scale = None
        self.unscaled_marks = ()
        self.unscaled_groups = None
        self.stepped_marks = None
        self.stepped_refs = ()
        self.stepped_ids = ()
        self.stepped_params = frozenset()
        self.backward_versions = None
        self.shown = self.stepped_true = False
        self.stepped_shown = self.stepped_final = frozenset()
        self.masters_left = None
        self.handed = None
        self.clips = ()
        self.clips_found = None
        self.found_by_loss = {}
        self.found_inf = None
        self.carried_found = self.flag_read = None
        self.grad_norm = None
        self.flags_reduced = False
        self.shared_overflow = False


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters of every group of ``optimizer``, in order."""
    for group in optimizer.param_groups:
        yield from group["params"]


#: The keywords of a scaled backward: the loss's scaler, then ``Tensor.backward``'s own.
BACKWARD_KEYWORDS: tuple[str, ...] = ("loss_id", "gradient", "retain_graph", "create_graph", "inputs")


def backward_loss(loss: torch.Tensor, backward_kwargs: dict[str, Any]) -> torch.Tensor:
    """``loss``, refused with an error that says what is wrong with it (instead of autograd's) unless a backward can
    start from it: a floating-point tensor that requires grad, with one element (or a ``gradient`` given); a keyword
    ``Tensor.backward`` does not take (``loss_idx=``) is refused naming the valid ones (torch's error named neither
    ``loss_id`` nor them)."""
    if backward_kwargs:
        check_keywords("backward()", backward_kwargs, BACKWARD_KEYWORDS)
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        kind = loss.dtype if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(
            f"loss={kind} must be a floating-point torch.Tensor (such as loss_fn(output, target)), not a Python "
            "number or an integer tensor."
        )
    if not loss.requires_grad:
        raise ValueError(
            "loss does not require grad, so backward() has nothing to differentiate: it was computed under "
            "torch.no_grad() or inference_mode(), detached, or from a model whose parameters are all frozen."
        )
    if loss.numel() != 1 and backward_kwargs.get("gradient") is None:
        raise ValueError(
            f"loss has shape {tuple(loss.shape)}; backward() needs one element: reduce it (loss.mean() or "
            "loss.sum()), or pass gradient=."
        )
    return loss


def loss_index(loss_id: int, num_losses: int) -> int:
    """``loss_id`` as a Python int (numpy and other integer types accepted; bool refused), checked in range.

    Raises:
        TypeError: ``loss_id`` is not an integer (a string, a float, a bool, ``None``), naming the valid type.
        ValueError: an integer out of range, naming the valid ones.
    """
    choices = f"valid choices: 0 to {num_losses - 1} (num_losses={num_losses})"
    try:
        # numpy's bool is refused like Python's: numpy before 2.3 still lets operator.index read it as 0 or 1.
        kind = type(loss_id)
        is_bool = (
            isinstance(loss_id, bool)
            or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))
            or (isinstance(loss_id, torch.Tensor) and loss_id.dtype == torch.bool)
        )
        index = None if is_bool else operator.index(loss_id)
    except TypeError:
        index = None
    if index is None:  # "0", 0.0, True, None: "out of range" named no type before
        raise TypeError(
            f"loss_id={loss_id!r} ({type(loss_id).__name__}) must be an int (a Python or numpy integer, or a 0-d "
            f"integer tensor); {choices}."
        )
    if not 0 <= index < num_losses:
        raise ValueError(f"loss_id={loss_id!r} is out of range; {choices}.")
    return index
