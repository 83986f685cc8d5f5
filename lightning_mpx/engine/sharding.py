"""Gradients of a model that PyTorch FSDP shards: each rank's local shards, and the one collective of a step.

Under FSDP every rank holds a shard of each gradient: an FSDP2 ``DTensor`` (its ``to_local()`` view), or with FSDP1
a plain tensor that is already the rank's piece of a flat parameter. The engine unscales, checks and measures those
local pieces with its usual kernels; what a rank finds is only its part of the answer, so one all-reduce per step
(:meth:`Sharding.reduce`) sums the overflow flags and the squared norm across ranks. Then every rank makes the same
skip decision, keeps the same scale and clips by the same global norm.

A tensor held whole on several ranks (an FSDP2 ``Replicate`` placement such as HSDP's replica dimension, a parameter
FSDP ignores, a ``DTensor`` on a sub-mesh such as FSDP's ``"data_parallel"`` dimension of a tensor-parallel model,
held alike by every tensor-parallel rank) would be counted once per copy by that sum: its squared norm is weighted by
one over its number of copies, so the sum counts it once (:meth:`Sharding.weight`).
"""

from __future__ import annotations

import os
import weakref
from typing import Iterable, Sequence

import torch
from torch import nn

from lightning_mpx.common.dtypes import HALF_DTYPES, dtype_name

__all__ = [
    "Sharding", "gathered_params", "guard_fsdp_setup", "is_sharded", "local_tensor", "parameter_names",
    "refuse_gathered", "refuse_half_params", "refuse_unfrozen_half", "reshard_gathered",
]  # fmt: skip

#: The module names FSDP1 and activation checkpointing insert between a module and its children.
_WRAPPER_SEGMENTS = frozenset(("_fsdp_wrapped_module", "_checkpoint_wrapped_module"))


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed support
        return None
    return DTensor


def _fsdp_types() -> tuple[type, ...]:
    """FSDP2's ``FSDPModule`` and FSDP1's ``FullyShardedDataParallel``, as far as this torch has them."""
    types: list[type] = []
    try:
        from torch.distributed.fsdp import FSDPModule

        types.append(FSDPModule)
    except ImportError:
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        types.append(FullyShardedDataParallel)
    except ImportError:
        pass
    return tuple(types)


def is_sharded(module: nn.Module) -> bool:
    """Whether FSDP (FSDP2's ``fully_shard`` or FSDP1's ``FullyShardedDataParallel``) shards ``module`` or one of its
    submodules."""
    types = _fsdp_types()
    return bool(types) and any(isinstance(m, types) for m in module.modules())


def _fsdp2_units(module: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def reshard_gathered(module: nn.Module) -> None:
    """Put FSDP2 units that a forward left gathered back to their shards (``FSDPModule.reshard()``, a no-op for a
    sharded unit).

    The root of ``fully_shard``'s default (``reshard_after_forward=None``) keeps its parameters gathered after its
    forward, for the backward that usually follows; after a forward with no backward (an evaluation) the model's
    ``parameters()`` are then the gathered copies until the next backward. What reads the stored parameters (the
    opt-level checks, the parameter names) reads them sharded.
    """
    for unit in _fsdp2_units(module):
        unit.reshard()  # type: ignore[operator]


def gathered_params(module: nn.Module) -> dict[int, str]:
    """The gathered (unsharded) parameters FSDP2 made for ``module``'s units, by ``id``, with the name of the sharded
    parameter each stands for: tensors an optimizer must not hold (FSDP moves the gradients to the shards, so a
    gathered parameter never gets one, and what a step wrote to it is overwritten by the next gather).

    This reads FSDP2's private ``FSDPParam._unsharded_param`` (and finds nothing where a torch lacks it); a unit's
    state holds its groups as ``_fsdp_param_groups`` (torch 2.13) or its one group as ``_fsdp_param_group`` (2.11).
    """
    names = {}
    for unit in _fsdp2_units(module):
        state = unit._get_fsdp_state()  # type: ignore[operator]
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = () if group is None else (group,)
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                gathered = getattr(fsdp_param, "_unsharded_param", None)
                if gathered is not None:
                    info = getattr(fsdp_param, "_module_info", None)
                    names[id(gathered)] = getattr(fsdp_param, "_param_fqn", None) or getattr(info, "param_name", "?")
    return names


def refuse_gathered(modules: Iterable[nn.Module], params: Iterable[torch.Tensor]) -> None:
    """Raise ``ValueError`` when ``params`` (an optimizer's) hold gathered copies of FSDP2 parameters of ``modules``
    instead of their shards, naming them and the fix (see :func:`gathered_params`)."""
    gathered: dict[int, str] = {}
    for module in modules:
        gathered.update(gathered_params(module))
    held = [gathered[id(p)] for p in params if id(p) in gathered]
    if held:
        # FSDPModule.reshard() is not recursive: with reshard_after_forward=False the blocks stay gathered too.
        raise ValueError(
            f"the optimizer holds {len(held)} gathered (unsharded) FSDP parameter(s) instead of their shards: "
            f"{', '.join(held[:5])}{', ...' if len(held) > 5 else ''}. It was built (or a group added) while a "
            "forward with no backward (an evaluation) had left FSDP units gathered (the root, by FSDP's default), so "
            "model.parameters() returned the gathered copies; they never get a gradient and would not train. Call "
            "model.reshard() before building the optimizer (it reshards the root only: with "
            "reshard_after_forward=False call lightning_mpx.fsdp.reshard_gathered(model), which reshards every "
            "unit), or build it before evaluating."
        )


def refuse_half_params(modules: Iterable[nn.Module], params: Iterable[torch.Tensor]) -> None:
    """Raise ``ValueError`` when ``params`` (an O2 optimizer's, under FSDP) hold half-dtype parameters, naming them
    (by their names in ``modules``) and the fix.

    Under FSDP at O2 the optimizer steps FSDP's sharded FP32 parameters: they are the masters, and no other master is
    made. A half parameter (a frozen base loaded in half, which ``check_sharded_model`` lets through) would be stepped
    in half, losing precision silently, once it trains; a frozen one is refused too, since unfreezing it later
    (``requires_grad_(True)``) is a change no check sees.
    """
    half = [p for p in params if p.dtype in HALF_DTYPES]
    if not half:
        return
    names = {id(p): name for module in modules for name, p in parameter_names(module)}
    held = [names.get(id(p), f"<unnamed {dtype_name(p.dtype)} {tuple(p.shape)}>") for p in half]
    raise ValueError(
        f"the optimizer holds {len(held)} half parameter(s) of a model sharded by FSDP at O2: "
        f"{', '.join(held[:5])}{', ...' if len(held) > 5 else ''}. Under FSDP, FSDP's sharded FP32 parameters are "
        "the master weights (no separate FP32 masters are made): a half parameter would be stepped in half, losing "
        "precision, once it trains (a frozen one when unfrozen later). Build the optimizer over the trainable "
        "parameters only, [p for p in model.parameters() if p.requires_grad] (in a LightningModule's "
        "configure_optimizers: filter(lambda p: p.requires_grad, self.parameters())), as peft and the Hugging Face "
        "Trainer do, and add no frozen half parameter later; to train the base, load it in FP32 before sharding."
    )


def refuse_unfrozen_half(sharding: Sharding | None, error: BaseException, *, forward: bool = False) -> None:
    """Raise ``ValueError`` from ``error`` (an exception a backward raised; with ``forward``, one a forward raised)
    when it is FSDP failing on half parameters unfrozen (``requires_grad_(True)``) beside FP32 ones in one FSDP unit,
    at O2 (``sharding.masters``); return otherwise, for the caller to re-raise ``error`` as it is. Called only once a
    backward or a forward has raised: nothing per step.

    A base loaded in half and frozen shares its FSDP unit with FP32 parameters (a LoRA model's adapters, or
    ``shard_model`` without ``blocks``). FSDP sets a unit up at the model's first forward, from the parameters
    trainable then. Unfrozen after that set-up, the half ones make FSDP's backward fail: it fixed the unit's gradient
    dtype (FP32, the adapters'), and fails assigning them an FP32 gradient ("attempting to assign a gradient with dtype
    'float' to a tensor with grad_dtype 'BFloat16'"; without a mixed-precision policy, "FSDP reduce-scatter expects
    uniform gradient dtype"), with or without them in an optimizer. Unfrozen before it (after the optimizer was built:
    Lightning's ``BaseFinetuning`` unfreezing at epoch 0), the set-up itself fails in the first forward ("FSDP expects
    uniform original parameter dtype": a unit's trainable parameters must share one dtype). They could not train
    anyway: under FSDP at O2 FSDP's FP32 shards are the masters, and a half parameter has none. (A half unit of its own
    reduces in half: its backward succeeds, and an optimizer given its parameters is refused at the next step by
    :func:`refuse_half_params`.)
    """
    found = _unfrozen_half(sharding, error)
    if found is None:
        return
    held, dtype = found
    named = (
        f"{len(held)} half parameter(s) of a model sharded by FSDP at O2 require a gradient: "
        f"{', '.join(held[:5])}{', ...' if len(held) > 5 else ''}. "
    )
    masters = (
        "Under FSDP at O2, FSDP's sharded FP32 parameters are the master weights and no other master is made: a "
        f"parameter loaded in {dtype} has no FP32 master to train"
    )
    in_fp32 = (
        f"load the base in FP32 before sharding: O2 then gathers it in {dtype} for the forward and its FP32 shards are "
        "its masters (O1 needs it in FP32 too)."
    )
    if forward:
        raise ValueError(
            f"{named}They were unfrozen (requires_grad_(True)) after the model was sharded and before its first "
            "forward, and share an FSDP unit with FP32 parameters: FSDP sets its units up at the first forward, "
            "where a unit's trainable parameters must have one dtype, and its set-up failed on them in this forward "
            f"(its error above). {masters}. No step ran and no weight changed, but FSDP's set-up stopped half done "
            "and a next forward would not redo it: build and shard the model again, and keep them frozen (in a "
            "BaseFinetuning callback's finetune_function, unfreeze only FP32 modules), or, to train them, "
            f"{in_fp32}"
        ) from error
    raise ValueError(
        f"{named}They were frozen when FSDP set their unit up and unfrozen since (requires_grad_(True)), and FSDP's "
        f"backward failed on them (its error above). {masters}, and FSDP fixed its unit's gradient dtype (FP32, the "
        "unit's trainable parameters') when it set the unit up, at its first forward; a sharded unit's dtypes cannot "
        "change. FSDP's state after its failed backward is not to be trusted: start again (from a checkpoint) and "
        f"keep them frozen, or, to train them, {in_fp32}"
    ) from error


def _unfrozen_half(sharding: Sharding | None, error: BaseException) -> tuple[list[str], str] | None:
    """For :func:`refuse_unfrozen_half`: the names of the half parameters of ``sharding``'s models that require a
    gradient and their dtype's name, when ``error`` is a dtype error of torch's FSDP at O2; ``None`` otherwise."""
    if sharding is None or not sharding.masters or "dtype" not in str(error) or not _raised_by_fsdp(error):
        return None
    models = [m for m in (ref() for ref in sharding._models) if m is not None]
    for module in models:  # a failed backward (forward) may have left units gathered: their half copies are not params
        reshard_gathered(module)
    half = [
        (name, p)
        for module in models
        for name, p in parameter_names(module)
        if p.requires_grad and p.dtype in HALF_DTYPES
    ]
    if not half:
        return None
    return [name for name, _ in half], dtype_name(half[0][1].dtype)


def guard_fsdp_setup(module: nn.Module, machine: object) -> None:
    """Put :func:`refuse_unfrozen_half` (``forward=True``) on the error path of FSDP2's set-up of ``module``'s units:
    ``module``'s own FSDP forward pre-hook (a root's lazy set-up, at the model's first forward), wrapped until a
    forward got through it, then FSDP's hook again, in its place: no call added per step. ``machine``: the engine's
    ``StepMachine`` (its ``sharding`` read on the error's path only), held weakly.

    For a door whose own code runs inside the model's ``forward`` (the Accelerate adapter's forward wrapper): FSDP's
    pre-hook, and so its set-up, runs before it. A door whose forward scope is entered around the call
    (``Amp.forward_context``, the Lightning plugins') meets the error in its cast policy's scope instead. Nothing is
    done for a module without an FSDP2 pre-hook of its own."""
    get_state = getattr(module, "_get_fsdp_state", None)
    state = get_state() if callable(get_state) else None
    handle = getattr(state, "_pre_forward_hook_handle", None)
    hooks = module._forward_pre_hooks
    if handle is None or handle.id not in hooks or isinstance(hooks[handle.id], _SetUpGuard):
        return
    guard = _SetUpGuard()
    guard.hook, guard.hooks, guard.key, guard.machine = hooks[handle.id], hooks, handle.id, weakref.ref(machine)
    hooks[handle.id] = guard


class _SetUpGuard:
    """FSDP2's forward pre-hook with :func:`refuse_unfrozen_half` on its error's path (:func:`guard_fsdp_setup`);
    once a call got through, FSDP's hook is put back in the module's hooks (the same key: the same place). (FSDP2
    modules are neither deep-copied nor pickled: FSDP refuses both.)"""

    __slots__ = ("hook", "hooks", "key", "machine")

    def __call__(self, *args: object) -> object:
        if torch.compiler.is_compiling():  # traced (a compiled model): FSDP's hook, which runs outside the graph
            return self.hook(*args)
        try:
            result = self.hook(*args)
        except (RuntimeError, AssertionError) as error:  # the error's path only
            machine = self.machine()
            refuse_unfrozen_half(getattr(machine, "sharding", None), error, forward=True)
            raise
        if self.hooks.get(self.key) is self:
            self.hooks[self.key] = self.hook  # FSDP set the units up: its own hook from now on
        return result


def _raised_by_fsdp(error: BaseException) -> bool:
    """Whether ``error`` was raised in torch's FSDP package (its innermost Python frame), not in a hook of the
    user's that FSDP's backward ran (a script in a folder of its own named ``fsdp`` too)."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    import torch.distributed.fsdp

    package = os.path.dirname(os.path.abspath(torch.distributed.fsdp.__file__)) + os.sep
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(package)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's local shard of a ``DTensor`` (in-place work on it changes the ``DTensor``), any other tensor as it
    is."""
    return local_tensors([tensor])[0]


def local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`local_tensor` of each of ``tensors``, the type looked up once. A shard is the ``DTensor``'s own local
    tensor, which ``to_local()`` returns through an autograd ``Function`` (a dozen Python calls per gradient, every
    step): gradients need no graph."""
    if set(map(type, tensors)) <= {torch.Tensor}:  # not sharded: nothing to unwrap (C-level: no call per tensor)
        return tensors
    dtensor = _dtensor_type()
    if dtensor is None:
        return tensors
    return [tensor._local_tensor if isinstance(tensor, dtensor) else tensor for tensor in tensors]


class Sharding:
    """How the gradients of a sharded model add up across ranks, and the step's collective.

    Args:
        module: The sharded model (after ``fully_shard`` or the FSDP1 wrapper).
        group: The process group the gradients are sharded over (default: the default group).
        masters: O2: FSDP's sharded FP32 parameters are the master weights, and an optimizer holding a half
            parameter is refused (:func:`refuse_half_params`).

    Attributes:
        world_size: The number of ranks in ``group``.
        shards: The ids of the plain tensors that are FSDP1 shards (each rank holds a different piece).
    """

    def __init__(self, module: nn.Module, group: object | None = None, *, masters: bool = False) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "a model sharded by FSDP needs an initialized default process group "
                "(torch.distributed.init_process_group) before prepare_model()."
            )
        self.group = group
        self.masters = masters
        self.world_size = dist.get_world_size(group)
        self.shards: set[int] = set(_fsdp1_shards(module))
        self._models = [weakref.ref(module)]
        # No cache of the parameters' weights: a weak reference to a parameter makes torch.utils.swap_tensors refuse
        # it, and FSDP2's _apply (the Trainer's model.to() at its next stage) swaps every parameter.

    def add_model(self, module: nn.Module) -> None:
        """Take in the FSDP1 shards of another prepared model."""
        self.shards.update(_fsdp1_shards(module))
        self._models.append(weakref.ref(module))

    def refuse_gathered(self, params: Iterable[torch.Tensor]) -> None:
        """:func:`refuse_gathered` over the prepared models; at O2 (``masters``) also :func:`refuse_half_params`.
        Called when an optimizer is prepared, when its number of parameter groups changes and at the unscale after
        its number of parameters changed (``grad_checks.unscale``: parameters appended to a group's list): no cost
        per step."""
        models = [m for m in (ref() for ref in self._models) if m is not None]
        params = list(params)
        refuse_gathered(models, params)
        if self.masters:
            refuse_half_params(models, params)

    def weight(self, param: torch.Tensor) -> float:
        """One over the number of ranks that hold the same values of ``param``'s gradient (1 for a shard)."""
        return self._weight(param, _dtensor_type())

    def _weight(self, param: torch.Tensor, dtensor: type | None) -> float:
        if dtensor is not None and isinstance(param, dtensor):
            mesh = param.device_mesh
            # Ranks outside the DTensor's mesh hold copies of their own: FSDP over device_mesh["data_parallel"] of a
            # tensor-parallel model shards a parameter that tensor parallelism left whole (a norm's) over that
            # sub-mesh only, and each tensor-parallel rank holds the same shard.
            copies = max(self.world_size // mesh.size(), 1)
            for dim, placement in enumerate(param.placements):
                if placement.is_replicate():
                    copies *= mesh.size(dim)
            return 1.0 / copies
        if id(param) in self.shards:
            return 1.0
        return 1.0 / self.world_size  # a whole tensor on every rank (a parameter FSDP ignores)

    def groups(self, params: Sequence[torch.Tensor]) -> dict[float, list[int]]:
        """Indices of ``params`` by weight (usually one weight: every gradient a shard)."""
        out: dict[float, list[int]] = {}
        dtensor = _dtensor_type()
        for index, param in enumerate(params):
            out.setdefault(self._weight(param, dtensor), []).append(index)
        return out

    def reduce(self, flags: Iterable[torch.Tensor], squared_norm: torch.Tensor | None) -> list[torch.Tensor]:
        """Sum ``flags`` (overflow flags, nonzero on overflow) and the weighted ``squared_norm`` across ranks in one
        all-reduce; returns the summed flags, then the global squared norm when one was given."""
        import torch.distributed as dist

        parts = [f.reshape(1).float() for f in flags]
        if squared_norm is not None:
            parts.append(squared_norm.reshape(1).float())
        if not parts:
            return []
        buffer = torch.cat(parts)
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group)
        return list(buffer.unbind(0))


def _fsdp1_shards(module: nn.Module) -> Iterable[int]:
    """Ids of the parameters an FSDP1 wrapper in ``module`` shards (its flat parameters, or with
    ``use_orig_params=True`` the original parameters that are views into them)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return
    for wrapper in module.modules():
        if not isinstance(wrapper, FullyShardedDataParallel):
            continue
        flat = getattr(wrapper, "_flat_param", None)  # the wrapper's FlatParameter (None when it holds none)
        if flat is not None:
            yield id(flat)
            for param in getattr(flat, "_params", None) or ():  # use_orig_params=True: the original parameters
                yield id(param)


def parameter_names(module: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    """``module.named_parameters()`` by the names of the model the user wrote: without the segments FSDP1 and
    activation checkpointing insert (``_fsdp_wrapped_module.0.weight`` is ``0.weight``), and an FSDP1 flat parameter
    (``use_orig_params=False``) named by the parameters it holds (``[flat: 0.weight, 0.bias, 2.weight, +1 more]``),
    so that overflow records and telemetry name what the user can find in the model."""

    def clean(name: str) -> str:
        return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)

    for name, param in module.named_parameters():
        path = clean(name)
        fqns = getattr(param, "_fqns", None)  # FSDP1's FlatParameter: the names of what it flattened, under its unit
        if fqns and name.rsplit(".", 1)[-1] == "_flat_param":
            owner = path.rsplit(".", 1)[0] if "." in path else ""
            held = [clean(f) for f in fqns]
            shown = ", ".join(held[:3]) + (f", +{len(held) - 3} more" if len(held) > 3 else "")
            path = (f"{owner}." if owner else "") + f"[flat: {shown}]"
        yield path, param
