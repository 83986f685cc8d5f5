"""O2, a model the Trainer evaluates before its first ``fit`` (``trainer.validate``/``test``/``predict``, a baseline
evaluation before training).

The stage needs the half model only, with no FP32 masters; but the ``fit`` after it should start its masters from the
exact FP32 weights the LightningModule holds, as it does without the evaluation (and as Lightning's ``"bf16-mixed"``
does). :meth:`EvaluationValues.prepare` prepares the model for the stage with the engine, keeping the FP32 values the
cast replaces (and those a load in the stage brings, ``ckpt_path=``), which go back into the model when the stage
ends (:meth:`EvaluationValues.restore`, at the plugin's ``teardown``): between stages the model is the FP32 model the
user gave, so a later ``fit`` makes its masters from it exactly and a model only ever evaluated keeps nothing extra.
The cost: during the stage the FP32 values stay where they were (host memory, as Lightning casts the model before
moving it to its device) next to the half copy the stage runs.

Under DDP Lightning does not wrap the model for an evaluation but broadcasts rank zero's parameters and buffers after
the cast (``_sync_module_states``): rank 1's half tensors became rank zero's, and the stage's end gave rank 1 their
rounding in FP32, not rank zero's FP32 values. :meth:`EvaluationValues.prepare` makes that same broadcast once before
the cast, in FP32 (``rank_zero_fp32``): every rank holds rank zero's exact values, the cast rounds them alike, and
every rank ends the stage with rank zero's FP32 values (its own, where the ranks agreed before).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.pytorch.overrides.distributed import _sync_module_states
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_mpx.masters.rank_zero import several_ranks

__all__ = ["EvaluationValues"]


class EvaluationValues:
    """The FP32 values of one model converted to half for an evaluation stage, until the stage ends."""

    def __init__(self) -> None:
        # (parameter, its FP32 value) and (module, buffer name, its FP32 value) for the tensors the cast made half.
        self._params: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        self._dtypes: list[tuple[nn.Module, torch.dtype]] = []  # LightningModule.dtype before the cast
        self._converted: weakref.ref[nn.Module] | None = None  # the model the values are held for
        self._restored: weakref.ref[nn.Module] | None = None
        self._load_hook: RemovableHandle | None = None

    @property
    def restored(self) -> nn.Module | None:
        """The model :meth:`restore` last made FP32 again (until the next :meth:`keep`), which the engine holds as
        half: a next stage prepares it again."""
        return self._restored() if self._restored is not None else None

    def prepare(
        self, amp: Any, module: nn.Module, *, fitting: bool, rank_zero_fp32: bool = False, keep_frozen: bool = False
    ) -> None:
        """``amp.prepare_model(module, train=fitting, rank_zero_fp32=rank_zero_fp32, keep_frozen_fp32=keep_frozen)``;
        at O2 not fitting, with the FP32 values the cast replaces kept until :meth:`restore` (``rank_zero_fp32``
        under a process group: rank zero's, broadcast in FP32 first as the strategy then broadcasts the half ones;
        call it on every rank)."""
        if fitting or not amp.properties.master_weights:
            amp.prepare_model(module, train=fitting, rank_zero_fp32=rank_zero_fp32, keep_frozen_fp32=keep_frozen)
            return
        if rank_zero_fp32 and several_ranks():
            _sync_module_states(module)  # Lightning's own broadcast for an evaluation, before the cast: in FP32
        before = self.keep(module)
        amp.prepare_model(module, train=False)
        self.converted(before)

    @property
    def held(self) -> bool:
        """Whether values are kept (a stage converted a model, and has not ended)."""
        return bool(self._params or self._buffers)

    def keep(self, module: nn.Module) -> dict[str, Any]:
        """Before the cast: what ``module`` holds in FP32 (its tensors, not copies). Pass the result to
        :meth:`converted` after the cast."""
        self.restore()  # (a stage that did not end: its values first)
        self._restored = None
        return {
            "module": weakref.ref(module),
            "params": [(p, p.data) for p in module.parameters() if p.dtype == torch.float32],
            "buffers": [
                (sub, name, buffer)
                for sub in module.modules()
                for name, buffer in sub._buffers.items()
                if buffer is not None and buffer.dtype == torch.float32
            ],
            "dtypes": [(sub, sub._dtype) for sub in module.modules() if isinstance(sub, _DeviceDtypeModuleMixin)],
        }

    def converted(self, before: dict[str, Any]) -> None:
        """After the cast: hold the FP32 values of the tensors it made half (the others are the model's own)."""
        self._params = [(p, value) for p, value in before["params"] if p.dtype != torch.float32]
        self._buffers = [
            (sub, name, value) for sub, name, value in before["buffers"]
            if (now := sub._buffers.get(name)) is not None and now.dtype != torch.float32
        ]
        self._dtypes = before["dtypes"] if self.held else []
        self._converted = before["module"] if self.held else None
        module = before["module"]()
        if self.held and module is not None:  # weights loaded in the stage (ckpt_path=...): their FP32 values
            self._load_hook = module.register_load_state_dict_pre_hook(self._loading)

    def _loading(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """A load into the half model in the stage (``validate(model, ckpt_path=...)``): the FP32 values it loads are
        what the model takes back at the stage's end, not their half rounding."""
        names = {id(p): name for name, p in module.named_parameters()}
        self._params = [(p, _loaded(state_dict, prefix + names.get(id(p), ""), value)) for p, value in self._params]
        subs = {id(sub): name for name, sub in module.named_modules()}
        self._buffers = [
            (sub, name, _loaded(state_dict, prefix + _dotted(subs.get(id(sub), ""), name), value))
            for sub, name, value in self._buffers
        ]

    def fp32_values(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """By ``module``'s state-dict names, the FP32 values its tensors in half take back at the stage's end (what a
        checkpoint saved in the stage holds, as ``"bf16-mixed"``'s FP32 model gives them); empty outside a stage."""
        if self._converted is None or self._converted() is not module:
            return {}
        names = {id(p): name for name, p in module.named_parameters()}
        out = {names[id(p)]: _back(p.data, value) for p, value in self._params if id(p) in names}
        subs = {id(sub): name for name, sub in module.named_modules()}
        for sub, name, value in self._buffers:
            now = sub._buffers.get(name)
            if now is not None and id(sub) in subs:
                out[_dotted(subs[id(sub)], name)] = _back(now, value)
        return out

    def restore(self) -> None:
        """At the stage's end: the model takes back its FP32 values (on the device it is on now: Lightning moves it
        to the CPU first). A value the stage changed (written into the half tensor) is kept, in FP32."""
        with torch.no_grad():
            for param, value in self._params:
                param.data = _back(param.data, value)
            for sub, name, value in self._buffers:
                now = sub._buffers.get(name)
                if now is not None:
                    sub._buffers[name] = _back(now, value)
        for sub, dtype in self._dtypes:
            sub._dtype = dtype
        if self._converted is not None:
            self._restored, self._converted = self._converted, None
        self._params, self._buffers, self._dtypes = [], [], []
        if self._load_hook is not None:
            self._load_hook.remove()
            self._load_hook = None


def _back(now: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The FP32 tensor to put in place of ``now`` (the half tensor the stage ran with): ``value``, the one it held
    before the cast, unless the stage wrote other values (then those, in FP32)."""
    if now.dtype == torch.float32 or now.shape != value.shape:
        return now  # converted since by something else: left as it is
    value = value.to(now.device)
    return value if torch.equal(now, value.to(now.dtype)) else now.float()


def _loaded(state_dict: dict[str, Any], key: str, value: torch.Tensor) -> torch.Tensor:
    """The FP32 value ``state_dict`` loads at ``key`` (a copy), or ``value`` where it loads none of that shape."""
    new = state_dict.get(key)
    if isinstance(new, torch.Tensor) and new.dtype == torch.float32 and new.shape == value.shape:
        return new.detach().to(value.device, copy=True)
    return value


def _dotted(module_name: str, name: str) -> str:
    return f"{module_name}.{name}" if module_name else name
