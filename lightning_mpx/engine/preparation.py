"""The models one engine prepared: converted for the opt level (in place), named, watched by the forensics, their
FP32 modules promoted, their load and boundary hooks put on; and the device of the first one, adopted by the O1 cast
policy at its first forward.

:class:`PreparedModels` is what :meth:`Amp.prepare_model <lightning_mpx.engine.amp.Amp.prepare_model>` and
:meth:`Amp.forward_context <lightning_mpx.engine.amp.Amp.forward_context>` do; the masters the models get are
:class:`~lightning_mpx.masters.store.Masters`'. The cast itself and the FP32 values kept through it are
:mod:`lightning_mpx.engine.model_cast`'s, the load hooks :mod:`lightning_mpx.engine.load_hooks`'.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import nn

from lightning_mpx.casting.lists import AUTOCAST_ACTIONS
from lightning_mpx.casting.loss_regions import LossRegions
from lightning_mpx.casting.policy import CastPolicy
from lightning_mpx.casting.replicas import carry_scope_into_replicas
from lightning_mpx.casting.table import CastTable

# The hooks' old import path kept: _EngineHook's (lightning_mpx.apex's hooks), and the hook classes' for a model pickled
# whole with them on it (torch.save(model)) by an earlier release, whose pickle names them here.
from lightning_mpx.engine.load_hooks import (  # noqa: F401
    _EngineHook,
    _FollowModes,
    _ForgetWrites,
    _LoadIntoMasters,
    _MissingKept,
    hook_loads,
)
from lightning_mpx.engine.model_cast import (
    _convert,
    _fp32_buffers,
    _fp32_from_masters,
    _keep_fp32_buffers,
    _keep_fp32_values,
    run_tied_in_fp32,
    values_before_cast,
)
from lightning_mpx.engine.optimizers import StepMachine
from lightning_mpx.engine.sharding import Sharding, is_sharded, parameter_names
from lightning_mpx.engine.surgery import ForwardErrors
from lightning_mpx.health.forensics import OverflowForensics
from lightning_mpx.health.promotion import Promotion
from lightning_mpx.masters.handover import HookRelease, let_go_of, masters_of
from lightning_mpx.masters.pairs import StrayParameterError
from lightning_mpx.masters.rank_zero import agree_on_rank_zero, several_ranks
from lightning_mpx.masters.store import Masters
from lightning_mpx.masters.watch import release_masters
from lightning_mpx.masters.weights import _multi_process, refuse_lazy, refuse_meta
from lightning_mpx.opt_levels import Properties
from lightning_mpx.settings import MixedPrecisionSettings


class PreparedModels:
    """The models an engine prepared, and what preparing them put on them.

    Args:
        settings: The engine's settings.
        policy: The engine's cast policy (``None`` at O0 and O3).
        promotion: The engine's FP32 modules.
        forensics: The engine's overflow forensics (its forward watch).
        masters: The engine's FP32 masters.
        machine: The engine's optimizers (their states, for a loaded FP32 value; the sharding of a sharded model).

    Attributes:
        sharded: Whether the prepared model is sharded by PyTorch FSDP.
        loss_regions: O2: the submodules whose code computes no loss, where the loss policy's mode is taken off.
    """

    def __init__(
        self,
        settings: MixedPrecisionSettings,
        policy: CastPolicy | None,
        promotion: Promotion,
        forensics: OverflowForensics,
        masters: Masters,
        machine: StepMachine,
    ) -> None:
        self.settings = settings
        self.properties: Properties = settings.properties
        self.policy = policy
        if policy is not None and self.properties.master_weights:  # O2: a forward's dtype error names a new module
            policy.forward_error = ForwardErrors(self)  # type: ignore[attr-defined]
        self.promotion = promotion
        self.forensics = forensics
        self.masters = masters
        self.machine = machine
        self.names = machine.names
        self.sharded = False
        # The parameters named for each model prepared unsharded: FSDP replaces them if it shards the model after.
        self._unsharded: weakref.WeakKeyDictionary[nn.Module, list[int]] = weakref.WeakKeyDictionary()
        # O1 with no table given: the table of the device of the first model prepared (CastTable.for_device), picked
        # at the first forward (frameworks move the model to its device after converting it), as long as nobody
        # changed the policy's own default table or engine before then.
        self._device_table: tuple[CastTable, int] | None = (
            (policy.table, policy.table._version) if policy is not None
            and settings.cast_table is None and self.properties.patch_torch_functions else None
        )
        self._device_model: weakref.ref[nn.Module] | None = None
        self._device_pending = policy is not None and self.properties.patch_torch_functions
        # O2: the loss policy's mode is taken off inside the submodules whose code computes no loss.
        self.loss_regions = (
            LossRegions(policy) if policy is not None and not self.properties.patch_torch_functions else None
        )
        self._regions_hooks: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()
        # O2: each prepared model's load_state_dict pre-hooks (FP32 values loaded go to the masters exactly).
        self._load_hooks: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()
        # O2/O3: each prepared model's hooks on the submodules tied to an fp32_modules module (_run_tied_in_fp32).
        self._tied_hooks: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()
        # O2/O3: one parameter of each prepared model that prepare_model() made half (see _check_dtypes).
        # By the module's id, with a weak reference that drops the entry when the module goes: a plain dict, whose
        # values a forward walks in C, where a WeakKeyDictionary's items() costs five Python calls.
        self._half_marks: dict[int, tuple[weakref.ref[nn.Module], torch.Tensor | None]] = {}
        # O2/O3: the ids of the parameters prepare() converted to the half dtype (from FP32 or another floating dtype),
        # by model: a frozen one among them lost its values to the rounding (no master keeps them); one the user
        # loaded in half did not (see made_half). Not a weak reference to the parameter: torch cannot swap a
        # parameter that has one (set_swap_module_params_on_conversion).
        self._made_half: weakref.WeakKeyDictionary[nn.Module, set[int]] = weakref.WeakKeyDictionary()
        # O1 while the policy casts only FP32 to the half dtype: one floating parameter of each prepared model, by the
        # module's id (as _half_marks); a forward that finds it in the other half dtype (model.half() after
        # prepare_model under a bfloat16 run) has the policy cast that dtype too (see other_half_met).
        self._other_marks: dict[int, tuple[weakref.ref[nn.Module], torch.Tensor]] = {}
        #: The half dtype that is not the run's (float16 under bfloat16, bfloat16 under float16).
        self.other_half = torch.bfloat16 if self.properties.half_dtype == torch.float16 else torch.float16
        # O2: what takes this engine's hooks off each model it holds the masters of, once another engine took them.
        self._releases: weakref.WeakKeyDictionary[nn.Module, HookRelease] = weakref.WeakKeyDictionary()

    def prepare(
        self, module: nn.Module, *, train: bool, rank_zero_fp32: bool = False, keep_frozen_fp32: bool = False
    ) -> nn.Module:
        """:meth:`Amp.prepare_model <lightning_mpx.engine.amp.Amp.prepare_model>` (arguments checked)."""
        if self._device_pending and self._device_model is None:
            self._device_model = weakref.ref(module)  # its device is read at the first forward
        self.hook_regions(module)
        if is_sharded(module):
            self._prepare_sharded(module)
            return module
        if self.sharded:
            raise ValueError(
                f"module={type(module).__name__} is not sharded, but this Amp prepared an FSDP-sharded model: one "
                "engine trains either sharded models or unsharded ones; use one Amp per kind."
            )
        carry_scope_into_replicas(module)  # nn.DataParallel's replicas run in worker threads: the scope goes there
        props = self.properties
        if props.master_weights and train:
            refuse_meta(module)
            refuse_lazy(module, "prepare_model()")  # a clear error, not torch's on a parameter without a shape
        olds = masters_of(module) if train else ()  # engines holding its masters: this one takes them over
        live = self.masters.prune()
        # A model prepared again (a head added since) keeps its first prefix: its masters are one model's.
        prefix = self.masters.prefix_of(module, f"model{len(live)}." if live else "")
        for name, param in module.named_parameters():
            self.names.setdefault(id(param), prefix + name)
        self._unsharded[module] = [id(param) for param in module.parameters()]
        self.forensics.watch.add_model(module, prefix)
        self.forensics.user_names.add_model(module, prefix)  # a data-parallel wrapper's "module": not in the tags
        # FP32 values held through the cast: the trainable parameters' for their masters (O2: one process, or rank
        # zero's on every rank, agreed by one broadcast) and the fp32_modules' own; not those of the other frozen ones
        # (a LoRA base), which would raise the cast's peak memory.
        agree = rank_zero_fp32 and props.master_weights and train and several_ranks()
        agreed = agree_on_rank_zero(module, frozen=keep_frozen_fp32) if agree else None
        masters_from_fp32 = props.master_weights and train and (agreed is not None or not _multi_process())
        before_cast, tied = values_before_cast(
            module, props, prefix, self.promotion.patterns, masters=masters_from_fp32, frozen=keep_frozen_fp32,
            agreed=agreed,
        )
        buffers = _fp32_buffers(module) if props.casts_model and self.promotion.patterns else None
        half = props.half_dtype
        converting = [p for p in module.parameters() if props.casts_model and p.is_floating_point() and p.dtype != half]
        _convert(module, props)
        self._note_made_half(module, converting)
        self.promotion.add_model(module, prefix)  # fp32_modules: back to FP32 before any master is made
        if tied:
            run_tied_in_fp32(module, tied, self._tied_hooks, props.half_dtype)
        if buffers:
            _keep_fp32_buffers(module, buffers)
        if olds and not props.master_weights:  # O0 made them FP32 above, from the masters
            if props.casts_model:  # O3 trains the half weights themselves
                release_masters(module)
            else:  # O1 trains FP32 weights: the masters' exact values (a .data cast of a watched one takes them)
                _fp32_from_masters(module)
        if self.policy is not None and not props.casts_model and _holds_other_half(module, props.half_dtype):
            self.other_half_met()  # O1 of a model in the other half dtype: its weights meet the run's casts
        elif self.policy is not None and props.patch_torch_functions and self.policy._to_half == (torch.float32,):
            first = next((p for p in module.parameters() if p.is_floating_point() and not p.is_complex()), None)
            if first is not None:  # looked at each forward (Amp.forward_context), without a call
                self._mark(self._other_marks, module, first)
        initial = _keep_fp32_values(module, before_cast, agreed, frozen=keep_frozen_fp32)
        if props.casts_model:  # one half parameter, looked at each forward: the dtype prepare_model() gave the model
            self._mark(self._half_marks, module, next((p for p in module.parameters() if p.dtype == half), None))
        if props.master_weights and not train:
            self.masters.evaluation_only = True
        if props.master_weights and train:
            # The FP32 values are kept until each one's master is made, whenever (and by whichever optimizer) that is.
            weights = self.masters.add_model(module, self.names, prefix, initial if masters_from_fp32 else None)
            if masters_from_fp32:  # frozen now, no FP32 value kept: a master made later comes from the rounding
                rounded = {id(p) for p in converting if p.dtype == half and not (p.requires_grad or id(p) in initial)}
                # Made half by an earlier prepare for evaluation only (train=False), which kept no FP32 value.
                new = {id(p) for p in converting}
                evaluated = {id(p) for p in module.parameters() if id(p) not in new and self.made_half(p)}
                for masters in self.masters.weights:
                    masters.note_rounded(rounded)
                    masters.note_rounded(evaluated, cause="evaluation")
            if weights is not None:
                tables = (self._regions_hooks, self._load_hooks, self._tied_hooks, self.promotion.hooks)
                weights.let_go = self._releases[module] = HookRelease(module, tables, self.forget)
            hook_loads(self, module, self._load_hooks, masters=True)  # a load's FP32 values go to the masters
        elif train:  # no masters (O0, O1, O3): a load still writes the parameters, which is no raw step
            hook_loads(self, module, self._load_hooks, masters=False)
        let_go_of(olds)  # the engines that handed over all of them take their hooks off it
        return module

    @staticmethod
    def _mark(marks: dict[int, Any], module: nn.Module, param: torch.Tensor | None) -> None:
        """Put ``module``'s ``param`` in ``marks`` by the module's id, the entry dropped when the module goes."""
        key = id(module)
        ref = weakref.ref(module, lambda ref: marks.pop(key) if marks.get(key, (None,))[0] is ref else None)
        marks[key] = ref, param

    def other_half_met(self) -> None:
        """O1: a prepared model holds the other half dtype (loaded in it, or made it after ``prepare_model``:
        ``model.half()`` under a bfloat16 run): the policy's half ops cast that dtype to the run's too, as
        ``torch.autocast`` does, and the forwards stop looking for it."""
        assert self.policy is not None
        self.policy.cast_other_half()
        self._other_marks.clear()

    def hold(self, module: nn.Module, handle: Any) -> bool:
        """Have ``handle`` (anything with ``remove()``: an adapter's forward) removed from ``module`` with this
        engine's hooks when another engine takes the model over; ``False`` when this engine holds no masters of it."""
        release = self._releases.get(module)
        if release is not None:
            release.hold(handle)
        return release is not None

    def made_half(self, param: torch.Tensor) -> bool:
        """Whether :meth:`prepare` converted ``param`` to the half dtype (it had another floating dtype, FP32 most
        often), so that its half values are a rounding of what the user gave; ``False`` for a parameter the user
        made or loaded in the half dtype, one kept in FP32, and one of a model no engine prepared."""
        key = id(param)
        return param.dtype == self.properties.half_dtype and any(key in ids for ids in self._made_half.values())

    def replaced_in_fp32(self) -> list[str]:
        """The names of the parameters :meth:`prepare` made half that are FP32 now, in a module not pinned or promoted
        to FP32: their data was replaced with an FP32 tensor after it (``param.data = fp32_tensor``, as Lightning's
        ``ModelPruning`` lottery-ticket reset does), which :meth:`before_forward` sees only for the one parameter per
        model it looks at. Read on an error's path only (the run's dtype error), never per step."""
        return [
            name
            for module, ids in list(self._made_half.items())
            for name, param in module.named_parameters()
            if id(param) in ids and param.dtype == torch.float32
            and not self.promotion.runs_fp32(name.rpartition(".")[0])
        ]

    def _note_made_half(self, module: nn.Module, params: list[torch.Tensor]) -> None:
        """Record which of ``module``'s ``params`` (floating, not half before the conversion) the conversion made
        half (a model prepared again keeps those of its first preparation)."""
        made = {id(p) for p in params if p.dtype == self.properties.half_dtype and not p.is_complex()}
        self._made_half.setdefault(module, set()).update(made)

    def name_stray(self, error: StrayParameterError) -> ValueError:
        """``error``, naming its first parameter and the module it was set on when a model prepared for training
        holds it (set on it after preparing: an untie's ``nn.Parameter(w.detach().clone())``); asked on that error's
        path only."""
        param = error.params[0]
        for module in list(self._releases.keys()):
            for name, candidate in module.named_parameters(remove_duplicate=False):
                if candidate is param:
                    path = name.rpartition(".")[0]
                    owner = f"{type(module.get_submodule(path)).__name__} {path!r}" if path else "the model"
                    return ValueError(
                        f"optimizer holds the half parameter {name!r} (shape {tuple(param.shape)}, {param.dtype}), "
                        f"set on {owner} after prepare_model() (e.g. an untie by nn.Parameter(w.detach().clone()), or "
                        "a Hugging Face model's resize_token_embeddings()): "
                        "it has no FP32 master, so it cannot train at O2. Make that change before prepare_model() "
                        "(Trainer: before fit; Fabric: before fabric.setup; Accelerate: before prepare)."
                    )
        return error

    def forget(self, module: nn.Module) -> None:
        """After another engine took ``module`` over: this engine no longer hooks its FP32 modules (its hooks are off
        it already, see :class:`~lightning_mpx.masters.handover.HookRelease`); its forward refuses the model made
        another dtype since, as before."""
        self.promotion.forget_model(module)
        self._releases.pop(module, None)

    def before_forward(self) -> None:
        """At a forward (outside a compiled region, where it would be traced: the first eager forward does it): the
        device adopted at the first one, and O2's loss regions found again when the table changed."""
        if self._device_pending and self._device_model is not None and not torch.compiler.is_compiling():
            self._adopt_device()
        regions = self.loss_regions
        # regions.stale()'s usual answer read inline (a call saved per forward): the table it was read from, as is
        if regions is not None and not (regions._fixed_names is None and regions._read is not None
                                        and regions._read == ((table := regions.policy.table), table._version)):
            if regions.stale() and not torch.compiler.is_compiling():
                self._hook_regions_again()
        half = self.properties.half_dtype
        for ref, param in list(self._half_marks.values()):
            if param is not None and param.dtype != half and (module := ref()) is not None:
                self._check_dtypes(module, param)

    def _check_dtypes(self, module: nn.Module, param: torch.Tensor) -> None:
        """Raise when ``module`` is no longer in the dtype :meth:`prepare` gave it (``model.half()``, ``.float()`` or
        ``.to(dtype)`` after it: its inputs are still cast to the half dtype and its masters were made for it); a
        parameter promoted to FP32 (``on_floor="promote"``) while others stay half is not that: another is looked at."""
        half = self.properties.half_dtype
        other = next((p for p in module.parameters() if p.dtype == half), None)
        if param.dtype == torch.float32 and other is not None:
            self._half_marks[id(module)] = self._half_marks[id(module)][0], other
            return
        raise RuntimeError(
            f"module={type(module).__name__} was converted to {param.dtype} after prepare_model(), which made it "
            f"{half} (opt_level={self.properties.opt_level!r}): its inputs are cast to {half} and its FP32 masters "
            "follow that dtype. Call model.half()/.float()/.to(dtype) before prepare_model(), not after; for another "
            "precision, build an Amp with that half_dtype or opt_level. A parameter's data replaced by a tensor of "
            "another dtype (param.data = fp32_tensor, as a callback resetting weights from FP32 copies does: "
            "Lightning's ModelPruning with use_lottery_ticket_hypothesis=True) converts it too: write the values with "
            "param.data.copy_(tensor), which keeps the dtype (at O2 the masters take the values written)."
        )

    def _adopt_device(self) -> None:
        """At the first forward: point the O1 policy at the device of the first model prepared, its
        ``torch.autocast`` device and, when no table was given, that device's table (:meth:`CastTable.for_device`:
        on CUDA, autocast's dispatch alone). A table the user changed, or an engine set by hand, is left as it is."""
        policy, module = self.policy, self._device_model() if self._device_model is not None else None
        self._device_pending, self._device_model = False, None
        device = _device_type(module) if module is not None else None
        if policy is None or device not in AUTOCAST_ACTIONS:  # no tensors, or a device autocast is not run on
            return
        if policy.device_type is None:
            policy.device_type = device
        untouched, self._device_table = self._device_table, None
        if (untouched is not None and (policy.table, policy.table._version) == untouched and policy.engine == "auto"
                and policy.device_type == device):
            policy.table = CastTable.for_device(device, policy.half_dtype, module)

    def hook_regions(self, module: nn.Module) -> None:
        """O2: put the loss regions' hooks on ``module`` unless they are on it."""
        if self.loss_regions is not None and module not in self._regions_hooks:
            self._regions_hooks[module] = self.loss_regions.install(module)

    def unhook_regions(self, module: nn.Module) -> bool:
        """O2: take the loss regions' hooks off ``module`` (the Trainer's teardown: a fitted model then carries no
        engine hook, which ``torch.jit.script``/``to_torchscript()`` cannot compile); whether it had them.
        :meth:`hook_regions` puts them back."""
        handles = self._regions_hooks.pop(module, None)
        for handle in handles or ():
            handle.remove()
        return handles is not None

    def _hook_regions_again(self) -> None:
        """O2's table changed since the models were hooked (a row registered, a table replaced): find the regions
        of every prepared model again with the table's names as they are now."""
        assert self.loss_regions is not None
        for module, handles in list(self._regions_hooks.items()):
            for handle in handles:
                handle.remove()
            self._regions_hooks[module] = self.loss_regions.install(module)

    def _prepare_sharded(self, module: nn.Module) -> None:
        from lightning_mpx.integrations.fsdp import check_sharded_model

        if self.masters.prune():
            raise ValueError(
                f"module={type(module).__name__} is sharded by FSDP, but this Amp already made FP32 masters for an "
                "unsharded model: one engine trains either sharded models or unsharded ones; use one Amp per kind."
            )
        check_sharded_model(module, self.settings)  # puts units an evaluation left gathered back to their shards
        # Prepared unsharded before FSDP sharded it (Fabric's ModelParallelStrategy shards after the precision plugin
        # converts; O0, O1 and O3, whose casts FSDP's policies repeat): its old parameters' ids may be reused.
        for key in self._unsharded.pop(module, ()):
            self.names.pop(key, None)
        for name, param in parameter_names(module):  # FSDP1's wrapper segments left out of the names
            self.names.setdefault(id(param), name)
        self.forensics.watch.add_model(module, "")
        self.forensics.user_names.add_model(module, "")
        self.sharded = True  # before the promotion: it leaves an FSDP model's dtypes to FSDP's policies
        self.promotion.add_model(module, "")
        if self.machine.sharding is None:
            self.machine.sharding = Sharding(module, masters=self.properties.master_weights)
        else:
            self.machine.sharding.add_model(module)


def _device_type(module: nn.Module) -> str | None:
    """The device type of ``module``'s first floating parameter or buffer (a DTensor's local device), or ``None``."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_floating_point():
            return tensor.device.type
    return None


def _holds_other_half(module: nn.Module, half_dtype: torch.dtype) -> bool:
    """Whether ``module`` holds a parameter or buffer of the half dtype that is not ``half_dtype``."""
    other = torch.bfloat16 if half_dtype == torch.float16 else torch.float16
    return any(t.dtype == other for t in itertools.chain(module.parameters(), module.buffers()))
