"""The FP32 masters in a framework's copy of a model's state dict, at O2: what every front door exports or checkpoints
as the model's weights (Accelerate's ``get_state_dict``/``save_model``/``save_state``, the ``transformers.Trainer``
mixin's ``save_model``, the Lightning plugin's checkpoints) and, through :class:`MastersInStateDict`, what the model's
own ``state_dict()`` gives under the Trainer and Fabric plugins (``fabric.save``), so that what reads them without
lightning_mpx gets the weights training produced, not their half rounding; and the warning about frozen parameters
the conversion rounded, which no master keeps."""

from __future__ import annotations

import copy
import inspect
import warnings
import weakref
from typing import Any, Callable

import torch
from torch import nn

from lightning_mpx.engine.amp import Amp
from lightning_mpx.integrations.peft_fp32 import (
    AllocateInFp32,
    CombineInFp32,
    MergeInFp32,
    _class_method_of,
    holds_own,
    is_adalora_model,
    is_lora_model,
    is_tuner_layer,
)
from lightning_mpx.masters.weights import current_fp32_values

__all__ = ["Fp32SavePretrained", "KeptAdapterLoad", "MastersInStateDict", "keep_replaced_parameters", "masters_into",
           "warn_frozen_half"]


class MastersInStateDict:
    """A state-dict post-hook on a model trained at O2 (the Trainer plugin's LightningModule, each model the Fabric
    plugin sets up): ``state_dict()`` gives each half parameter's FP32 master
    (not copied, as the half value is not) in place of the half value, as ``"bf16-mixed"``'s FP32 model gives its
    weights: a weights-only checkpoint (``ModelCheckpoint(save_weights_only=True)``, ``trainer.save_checkpoint(path,
    weights_only=True)``, which Lightning writes without the precision plugin's hooks), ``self.state_dict()`` in a
    callback or an EMA habit, and a submodule's own ``state_dict()`` (``self.model.save_pretrained(path)``, peft's
    ``get_peft_model_state_dict``) get the weights training produced, and ``load_state_dict`` of them into the half
    model rounds them as before. ``state_dict(keep_vars=True)`` (the parameters themselves), a frozen half parameter or
    a half buffer (no master), a model whose masters another engine took over since, a sharded model and a copy or an
    unpickled model (the hook is inert there: it holds the engine weakly and pickles as inert) keep the model's
    values. A Hugging Face model in it gets :class:`Fp32SavePretrained` too (its ``config.json`` then says float32),
    a peft model :class:`KeptAdapterLoad`, each peft tuner layer the FP32 merges of
    :class:`~lightning_mpx.integrations.peft_fp32.MergeInFp32`, a LoRA model the FP32 combinations of
    :class:`~lightning_mpx.integrations.peft_fp32.CombineInFp32` and an AdaLoRA model the FP32 scores of
    :class:`~lightning_mpx.integrations.peft_fp32.AllocateInFp32`.
    """

    def __init__(self, amp: Amp | None, *, nested: bool = False) -> None:
        self._amp = weakref.ref(amp) if amp is not None else None
        # On a submodule: acts only when its own state_dict() is called (prefix ""; ``self.model.save_pretrained``,
        # peft's ``get_peft_model_state_dict(self.model)``); inside the root's state dict the root's hook acts.
        self._nested = nested

    def __reduce__(self) -> tuple[Any, ...]:
        return (MastersInStateDict, (None,))

    @classmethod
    def install(cls, module: nn.Module, amp: Amp) -> _Handles:
        """Put the hook of ``amp`` on ``module`` and each of its submodules in place of any earlier one (a model set
        up again, by another engine too); returns their handles (``.remove()`` takes them all off)."""
        handles: list[Any] = []
        for sub in module.modules():
            for key, hook in list(sub._state_dict_hooks.items()):
                if isinstance(hook, cls):
                    del sub._state_dict_hooks[key]
            handles.append(sub.register_state_dict_post_hook(cls(amp, nested=sub is not module)))
            if hasattr(type(sub), "config_class") and callable(getattr(type(sub), "save_pretrained", None)):
                wrapper = Fp32SavePretrained.install(sub, amp)  # a transformers PreTrainedModel
                if wrapper is not None:
                    handles.append(wrapper)
            if type(sub).__module__.split(".")[0] == "peft" and callable(getattr(type(sub), "load_adapter", None)):
                kept = KeptAdapterLoad.install(sub)  # a PeftModel
                if kept is not None:
                    handles.append(kept)
            if is_tuner_layer(sub):  # its merges (merge_and_unload...) on the FP32 masters, rounded once
                handles.append(MergeInFp32.install(sub, amp))
            elif is_adalora_model(sub):  # its importance scores from the masters and the true gradients
                handles.append(AllocateInFp32.install(sub, amp))
            if is_lora_model(sub):  # add_weighted_adapter combines the adapters' FP32 masters
                handles.append(CombineInFp32.install(sub, amp))
        return _Handles(handles)

    def __call__(self, module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if self._nested and prefix and _inside_parent(state, prefix):
            return  # a submodule inside a parent's state dict: the root's hook covers it
        amp = self._amp() if self._amp is not None else None
        if amp is None or amp.sharded or not amp.properties.master_weights:
            return
        halves = (torch.float16, torch.bfloat16)
        params = [(prefix + name, p) for name, p in module.named_parameters(remove_duplicate=False)]
        params = [(key, p) for key, p in params if p.dtype in halves and state.get(key) is not p and key in state]
        if not params:
            return
        amp.follow_optimizer_modes()  # a schedule-free optimizer's eval()/train() since the last forward
        fp32: dict[int, torch.Tensor] = {}
        for weights in amp._masters.prune():
            # Writes made to the model since the last step, as the step will take them, not taken: an EMA swapped in
            # for a save and restored before the step leaves the masters exact (masters.weights.current_fp32_values).
            fp32.update(current_fp32_values(weights))
        lent = []
        for key, param in params:
            master = fp32.get(id(param))
            if master is not None:
                state[key] = master.detach()
                lent.append((param, master))
        amp._masters.lend(lent)  # a write through this state dict reaches the model at the next forward


class Fp32SavePretrained:
    """A Hugging Face model's ``save_pretrained`` (an attribute of the instance: its class and other instances are
    untouched) while :class:`MastersInStateDict` is on it at O2: the weights it writes are the FP32 masters, so the
    ``config.json`` it writes names ``float32`` (as ``"bf16-mixed"``'s or Accelerate's FP32 model), not the half dtype
    of the model's first parameter that ``transformers`` writes there; ``from_pretrained(path)`` without a ``dtype``
    then loads the weights training produced, not their half rounding. A copy of the config is written again after
    the model's call (on the main process; with ``push_to_hub=True``, whose upload comes inside that call, just
    before the upload). With a ``state_dict=`` of the user's, its dtype for the model's first parameter decides
    (FP32 from ``amp.fp32_state_dict(model)``: float32); with a peft adapter (no config.json), or no master for the
    model's first parameter (a copy, another engine's model now), what ``transformers`` wrote stays. A deep copy or
    pickle of the model gets the plain method back."""

    def __init__(self, model: nn.Module, amp: Amp) -> None:
        # Both weakly: the model holds this (no reference cycle keeping a model dropped alive until a gc pass).
        self._model = weakref.ref(model)
        self._amp = weakref.ref(amp)

    @classmethod
    def install(cls, model: nn.Module, amp: Amp) -> Fp32SavePretrained | None:
        """Put one of ``amp`` on ``model`` in place of an earlier one (not over a ``save_pretrained`` the instance
        holds of its own: returns ``None``); ``remove()`` takes it off."""
        if holds_own(model, "save_pretrained", cls):
            return None
        wrapper = cls(model, amp)
        model.save_pretrained = wrapper  # type: ignore[method-assign]
        return wrapper

    def remove(self) -> None:
        """Take it off its model (if still there)."""
        model = self._model()
        if model is not None and model.__dict__.get("save_pretrained") is self:
            del model.save_pretrained

    def __reduce__(self) -> tuple[Any, ...]:
        return (_class_method_of, (self._model(), "save_pretrained"))

    def __call__(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        model = self._model()
        if model is None:
            raise ReferenceError("save_pretrained of a model that no longer exists")
        name, first = next(((n, p) for n, p in model.named_parameters() if p.is_floating_point()), ("", None))
        state = args[1] if len(args) > 1 else kwargs.get("state_dict")
        # Read before the call: transformers empties a given state dict as it writes the shards.
        given = state.get(name) if state is not None and hasattr(state, "get") else None
        if not (kwargs.get("push_to_hub") or (len(args) > 2 and args[2])):
            output = type(model).save_pretrained(model, save_directory, *args, **kwargs)
            self._write_fp32_config(model, first, state, given, save_directory, args, kwargs)
            return output

        # push_to_hub=True: transformers uploads the folder inside its call, so the config is rewritten just before
        # its upload, by an instance attribute for the call only (its class and other instances untouched)
        def upload(folder: Any, *a: Any, **k: Any) -> Any:
            self._write_fp32_config(model, first, state, given, folder, args, kwargs)
            return type(model)._upload_modified_files(model, folder, *a, **k)

        if not hasattr(type(model), "_upload_modified_files") or "_upload_modified_files" in model.__dict__:
            return type(model).save_pretrained(model, save_directory, *args, **kwargs)  # another transformers
        model._upload_modified_files = upload
        try:
            return type(model).save_pretrained(model, save_directory, *args, **kwargs)
        finally:
            del model._upload_modified_files

    def _write_fp32_config(self, model: nn.Module, first: torch.Tensor | None, state: Any, given: Any,
                           save_directory: Any, args: tuple, kwargs: dict) -> None:  # fmt: skip
        """After transformers wrote the folder: ``config.json`` again naming ``float32`` where the weights written
        are the FP32 masters (see the class)."""
        amp = self._amp()
        if (amp is None or not (args[0] if args else kwargs.get("is_main_process", True))
                or getattr(model, "_hf_peft_config_loaded", False) or getattr(model, "config", None) is None
                or not amp.properties.master_weights or amp.sharded or first is None or first.dtype == torch.float32):
            return  # (an FP32 model: transformers wrote float32)
        if state is not None:  # the user's (amp.fp32_state_dict(model)): the dtype it holds for that parameter
            if not isinstance(given, torch.Tensor) or given.dtype != torch.float32:
                return
        elif amp.master_of(first, refresh=False).dtype != torch.float32:
            return
        config = copy.deepcopy(model.config)  # as the transformers.Trainer mixin's save_model: the model's untouched
        config.dtype = torch.float32
        config.save_pretrained(save_directory)


def keep_replaced_parameters(model: nn.Module, load: Callable[[], Any]) -> Any:
    """Run ``load`` (a load of weights into ``model``), then put back the parameters of ``model`` it replaced, loading
    the values of a replacement that holds others into the old one (at O2: into its FP32 master, exactly).

    peft's ``load_adapter`` loads the values, then upcasts a half adapter to FP32 with new ``nn.Parameter`` objects:
    at O2 the model would hold FP32 copies of the values' half rounding that no optimizer steps, while the parameters
    the optimizer holds (and their FP32 masters, which the load wrote exactly) leave the model. Each kept parameter
    takes the replacement's ``requires_grad``. Returns what ``load`` returned."""
    before = dict(model.named_parameters())
    output = load()
    for name, new in list(model.named_parameters()):
        old = before.get(name)
        if old is None or new is old:
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        setattr(owner, leaf, old)
        old.requires_grad_(new.requires_grad)
        if not torch.equal(new.detach().to(old.dtype), old.detach()):
            owner.load_state_dict({leaf: new.detach()}, strict=False)  # FP32 values go to the masters exactly
    return output


class KeptAdapterLoad:
    """A peft model's ``load_adapter`` (an attribute of the instance, beside :class:`MastersInStateDict`) that keeps
    the parameters the optimizer holds (:func:`keep_replaced_parameters`): an adapter loaded into the prepared model
    mid-training at O2 goes on training from the file's FP32 values, as under the frameworks' own precisions, instead
    of being replaced by FP32 copies of their half rounding that no optimizer steps (``low_cpu_mem_usage=True`` too,
    which into an existing adapter only assigns the file's tensors). A new adapter name is loaded as peft loads it.
    A deep copy or pickle of the model gets the plain method back."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)  # weakly: the model holds this

    @classmethod
    def install(cls, model: nn.Module) -> KeptAdapterLoad | None:
        """Put one on ``model`` (not over a ``load_adapter`` the instance holds of its own: returns ``None``)."""
        if holds_own(model, "load_adapter", cls):
            return None
        wrapper = cls(model)
        model.load_adapter = wrapper  # type: ignore[method-assign]
        return wrapper

    def remove(self) -> None:
        """Take it off its model (if still there)."""
        model = self._model()
        if model is not None and model.__dict__.get("load_adapter") is self:
            del model.load_adapter

    def __reduce__(self) -> tuple[Any, ...]:
        return (_class_method_of, (self._model(), "load_adapter"))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self._model()
        if model is None:
            raise ReferenceError("load_adapter of a model that no longer exists")
        call = inspect.signature(type(model).load_adapter).bind(model, *args, **kwargs)
        if call.arguments.get("low_cpu_mem_usage") and call.arguments.get("adapter_name", "default") in getattr(
            model, "peft_config", {}
        ):
            # Into an adapter the model has, peft's low_cpu_mem_usage only loads with assign=True: it would replace
            # the parameters the optimizer holds (refused at O2), where a plain load writes into them.
            call.arguments["low_cpu_mem_usage"] = False
        return keep_replaced_parameters(model, lambda: type(model).load_adapter(*call.args, **call.kwargs))


def _inside_parent(state: dict[str, Any], prefix: str) -> bool:
    """Whether the ``state_dict()`` call that gave a module ``prefix`` is its parent's: the call's root notes its
    own metadata first (under its prefix without the dot), so a submodule's own call with a ``prefix=`` of the
    user's (``self.backbone.state_dict(prefix="backbone.")``) is told apart; without metadata (a ``destination=``
    of the user's) a prefix is taken for a parent's."""
    metadata = getattr(state, "_metadata", None)
    if not metadata:
        return True
    return next(iter(metadata)) != prefix[:-1]


class _Handles:
    """The handles of the hooks :meth:`MastersInStateDict.install` put on a model and its submodules."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        """Take every hook off."""
        for handle in self.handles:
            handle.remove()


def masters_into(amp: Amp, module: nn.Module, state: dict[str, Any]) -> list[str]:
    """At O2, put the FP32 masters in place of the half weights in ``state`` (``module``'s state dict), in place: the
    weights training produced, FP32 as the frameworks' own mixed precisions give them.

    The masters are handed as they are, not copied; an entry without an FP32 value (a frozen half parameter, a LoRA
    base; a half buffer; a model prepared for evaluation only) stays as the model holds it: its upcast would add no
    information and, for a LoRA base, twice the base's memory on its device at every save. Returns the keys replaced."""
    if not amp.properties.master_weights or amp.sharded:
        return []
    fp32: dict[int, torch.Tensor] = {}
    for weights in amp._masters.prune():
        # By id of the half parameter: its master (or the FP32 value kept for it), with the writes made to the model
        # since the last step as the step will take them, not taken (see masters.weights.current_fp32_values).
        fp32.update(current_fp32_values(weights))
    replaced: list[str] = []
    for key, value in module.state_dict(keep_vars=True).items() if fp32 else ():
        master = fp32.get(id(value)) if isinstance(value, torch.Tensor) else None
        if master is not None and key in state:
            state[key] = master.detach()
            replaced.append(key)
    return replaced


def warn_frozen_half(
    amp: Amp,
    module: nn.Module,
    state: dict[str, Any],
    call: str,
    *,
    keep: str = "MixedPrecisionKwargs",
    when: str = "",
    whole: bool = False,
) -> list[str]:
    """Warn, at an O2 export by ``call`` of ``module``'s ``state`` (after :func:`masters_into`), about its frozen
    parameters (``requires_grad=False``) that ``state`` holds in the half dtype and that ``prepare`` converted to it
    (:attr:`Amp.made_half <lightning_mpx.engine.amp.Amp.made_half>`; not one the user gave in half, where nothing was
    lost): their half rounding, not the FP32 values they had before ``prepare`` (O2 keeps no FP32 copy of them, so
    that a frozen base does not take twice its memory). The warning names them and the ways to keep them exact
    (``keep``: whose ``fp32_modules=`` keeps a module FP32; ``when``: the moment, e.g. ``"before prepare"``). A
    peft model is left out (its ``save_pretrained`` exports its adapters, not its base) unless ``whole``: ``call``
    writes the whole model, the half base too (Accelerate's ``save_model``). Under a process group the warning is
    issued on rank zero only (Lightning's convention: every rank checkpoints, one writes); every rank returns the
    names warned about."""
    peft = type(module).__module__.split(".")[0] == "peft"
    if not amp.properties.master_weights or amp.sharded or (peft and not whole):
        return []
    halves = (torch.float16, torch.bfloat16)
    names = [
        name
        for name, param in module.named_parameters()
        if not param.requires_grad and isinstance(state.get(name), torch.Tensor) and state[name].dtype in halves
        and amp.made_half(param)
    ]
    if not names:
        return []
    owners = list(dict.fromkeys(name.rpartition(".")[0] or name for name in names))
    shown = ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    dtype = str(state[names[0]].dtype).removeprefix("torch.")
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return names
    warnings.warn(
        f"{call} at O2 exports {len(names)} frozen parameter(s) (requires_grad=False: {shown}) as the {dtype} values "
        f"the model holds: O2 keeps no FP32 copy of a frozen parameter, so these are the {dtype} rounding of the "
        f"values they had {when or 'before prepare'}, not those values (the trained parameters are exported as their "
        f"FP32 masters). To export them exactly, keep their modules in FP32 with {keep}(fp32_modules="
        f"{owners[:5]!r}) or train at O1 (both keep them FP32 in memory), or take them from the checkpoint they came "
        "from" + (" (a peft model's base: save the adapters with save_pretrained, FP32, and load them onto the FP32 "
                  "base with PeftModel.from_pretrained)." if peft else "."),
        UserWarning,
        stacklevel=3,
    )
    return names
