"""``transformers.Trainer`` on the Accelerate adapter: ``MpxTrainer(model, args, opt_level="O2")``.

The Trainer builds its own ``accelerate.Accelerator`` in ``create_accelerator_and_postprocess``. The mixin
:class:`MpxTrainerMixin` lets it do so (with its gradient-accumulation plugin, dataloader configuration, FSDP
plugin and DDP kwargs unchanged), then replaces it with a :class:`~lightning_mpx.integrations.accelerate.Accelerator`
built from the same arguments with the opt level, before the Trainer prepares anything. It also carries the engine's
state (loss scales, FP32 masters, skip counters) in the Trainer's checkpoints, saves the FP32 weights at O2, and adds
``mpx/loss_scale``, ``mpx/overflows``, ... to the Trainer's training logs::

    from transformers import Trainer, TrainingArguments
    from lightning_mpx.accelerate import MpxTrainerMixin

    class MpxTrainer(MpxTrainerMixin, Trainer):
        pass

    trainer = MpxTrainer(model=model, args=TrainingArguments(...), train_dataset=data, opt_level="O2")

:func:`mpx_trainer` makes that class for any ``Trainer`` subclass (``mpx_trainer(Seq2SeqTrainer)``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import inspect
import os
import warnings
import weakref
from typing import Any, Callable

import torch
from torch import nn

from lightning_mpx.common.imports import require
from lightning_mpx.common.keywords import Required, check_keywords, checks_keywords, required
from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
from lightning_mpx.integrations.accelerate_checkpoint import AMP_STATE_NAME, masters_into, warn_frozen_half
from lightning_mpx.integrations.accelerate_forward import engine_of
from lightning_mpx.integrations.fp32_export import keep_replaced_parameters
from lightning_mpx.integrations.metric_counts import LOG_READER
from lightning_mpx.opt_levels import _check_opt_level

__all__ = ["MpxTrainerMixin", "mpx_trainer"]


class MpxTrainerMixin:
    """Put before ``transformers.Trainer`` (or a subclass) in a class's bases to train with an opt level.

    Args:
        *args: Passed to the Trainer.
        opt_level: ``"O0"`` to ``"O3"``; ``"O2"`` when left out.
        mpx_kwargs: The opt level's settings (``half_dtype``, loss-scaler settings, ``log_metrics``, ...); ``None``
            for the defaults.
        **kwargs: Passed to the Trainer.

    Raises:
        ValueError: for an unknown ``opt_level``, or ``TrainingArguments(fp16=True)``/``bf16=True`` (and their
            ``*_full_eval``), which turn on Accelerate's own mixed precision besides the opt level.
    """

    accelerator: Accelerator

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        ahead = [f"{base.__module__}.{base.__qualname__}" for base in mro[: mro.index(MpxTrainerMixin)]]
        if "transformers.trainer.Trainer" in ahead:
            # After the Trainer in the bases, the Trainer's own methods win: no opt level, and no error saying so.
            bases = ", ".join(base.__name__ for base in cls.__bases__)
            raise TypeError(
                f"class {cls.__name__}({bases}): MpxTrainerMixin comes after transformers.Trainer in its bases, so the "
                "Trainer's own methods would run and no opt level would apply. Put the mixin first: "
                f"class {cls.__name__}(MpxTrainerMixin, Trainer), or use mpx_trainer(Trainer)."
            )

    def __init__(
        self, *args: Any, opt_level: str = "O2", mpx_kwargs: MixedPrecisionKwargs | None = None, **kwargs: Any
    ) -> None:
        _check_opt_level(opt_level)  # the core's message: "o2" and "02" get their "did you mean 'O2'?"
        _refuse_unknown_keywords(super().__init__, kwargs)  # the Trainer's TypeError named neither ours nor its own
        if mpx_kwargs is not None and not isinstance(mpx_kwargs, MixedPrecisionKwargs):
            raise TypeError(
                f"mpx_kwargs={type(mpx_kwargs).__name__} is not a MixedPrecisionKwargs: pass "
                f"mpx_kwargs=MixedPrecisionKwargs(half_dtype=..., ...) (a dict d: MixedPrecisionKwargs(**d))."
            )
        self.mpx_opt_level = opt_level
        self.mpx_kwargs = mpx_kwargs
        super().__init__(*args, **kwargs)  # the Trainer calls create_accelerator_and_postprocess in here

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args: dict[str, Any] = super()._build_accelerator_args(**kwargs)  # type: ignore[misc]
        # The Trainer builds Accelerate's own Accelerator from these first: without mixed precision (the opt level
        # decides); ACCELERATE_MIXED_PRECISION=O2 would give it a value it does not know.
        args["mixed_precision"] = "no"
        self._mpx_accelerator_args = dict(args)
        return args

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's own set-up, then its Accelerator replaced with lightning_mpx's with the opt level."""
        targs = self.args  # type: ignore[attr-defined]
        flags = ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval")
        native = [f"{name}=True" for name in flags if getattr(targs, name)]
        if native:
            raise ValueError(
                f"TrainingArguments({', '.join(native)}) turns on the Trainer's own mixed precision, and "
                f"opt_level={self.mpx_opt_level!r} turns on lightning_mpx's: use one. Drop {', '.join(native)} to "
                "train with the opt level (set its dtype with mpx_kwargs=MixedPrecisionKwargs(half_dtype=...)), or "
                "use transformers.Trainer without the mixin." + _unset_bf16_hint(targs, native)
            )
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        args = dict(self._mpx_accelerator_args)
        handlers = list(args.pop("kwargs_handlers", None) or [])
        if self.mpx_kwargs is not None:
            handlers.append(self.mpx_kwargs)
        args["mixed_precision"] = self.mpx_opt_level
        # Accelerate's process and gradient states are shared singletons: this one sees the Trainer's set-up.
        self.accelerator = Accelerator(**args, kwargs_handlers=handlers)
        self.accelerator._mpx_prepared_by = "trainer.train"  # the call its errors name (the lazy-module refusal)
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=targs.eval_use_gather_object
            )

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        """The Trainer's own wrap. Over several GPUs without a distributed launch it wraps the model in
        ``nn.DataParallel``, and then prepares no model with the Accelerator (an "unhandled case" to it): the model
        ran without the opt level (FP32, silently; O2 refused the optimizer, prepared before any model). The model
        inside the wrapper is prepared here, once for training (once for evaluation before that); its replicas run
        in the calling thread's cast scope (:mod:`lightning_mpx.casting.replicas`). Prepared again by a new engine
        (the Trainer's ``free_memory()`` at each ``train()``: a second ``train()`` found it prepared by the first's)."""
        wrapped = super()._wrap_model(model, training, dataloader)  # type: ignore[misc]
        inner = getattr(wrapped, "module", None)
        amp = self.accelerator.amp
        if type(wrapped) is nn.DataParallel and inner is self.model and amp is not None:  # type: ignore[attr-defined]
            done = self.__dict__.get("_mpx_in_data_parallel")  # (the model, whether for training, the engine's ref)
            current = done is not None and done[0] is inner and done[2]() is amp
            if (not current or training) and not (current and done[1]):
                self.accelerator.prepare_model(inner, evaluation_mode=not training)
                self._mpx_in_data_parallel = (inner, training, weakref.ref(amp))
        return wrapped

    # -- checkpoints: the Trainer saves and loads its own GradScaler here; the engine's state goes with it ----------
    def _save_scaler(self, output_dir: str) -> None:
        super()._save_scaler(output_dir)  # type: ignore[misc]
        saved, self._mpx_saved_masters = getattr(self, "_mpx_saved_masters", None), None
        if self.accelerator.amp is not None:
            # At O2 the checkpoint's model file (written just before, by _save) holds the FP32 masters: the engine's
            # file names them instead of holding them again (the Trainer loads the model before _load_scaler).
            models, weights = [], []
            if saved is not None and saved[0] == output_dir:
                model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)  # type: ignore[attr-defined]
                state = model.state_dict()
                masters_into(engine_of(model, self.accelerator.amp), model, state)
                models, weights = [model], [_written({key: state[key] for key in saved[1]}, output_dir)]
            # No scaler.pt: a transformers Trainer resumed without fp16 (bf16=True, FP32, a CPU) loads any scaler.pt
            # into its accelerator.scaler, None there, and crashes; one with fp16 skips a missing file.
            self.accelerator._save_amp_state(models, weights, output_dir, grad_scaler=False)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self.accelerator.amp is None or self.accelerator.scaler is not None:
            # The Trainer loads a scaler.pt into accelerator.scaler; with an opt level there is none (the engine
            # scales) and the checkpoint's scaler.pt is the engine's scale written for Accelerate's own "fp16".
            super()._load_scaler(checkpoint)  # type: ignore[misc]
        if checkpoint is None or self.accelerator.amp is None:
            return
        if not os.path.isfile(os.path.join(checkpoint, AMP_STATE_NAME)):
            if not any(name.startswith(("optimizer", "scheduler", "scaler")) for name in os.listdir(checkpoint)):
                # Weights only (save_only_model=True): the Trainer resumes with them and a fresh optimizer; so do we.
                warnings.warn(
                    f"resume_from_checkpoint={checkpoint!r} holds the weights only (save_only_model=True): training "
                    "goes on from them with a fresh optimizer and scheduler, as transformers' Trainer does, and "
                    f"opt_level={self.mpx_opt_level!r} with its initial loss scale and FP32 masters made from them.",
                    stacklevel=2,
                )
                return
            raise FileNotFoundError(
                f"resume_from_checkpoint={checkpoint!r} has no {AMP_STATE_NAME}: it was not saved with an opt level, "
                f"so the loss scale and FP32 masters of opt_level={self.mpx_opt_level!r} cannot be restored. To start "
                "from its weights only, load them with from_pretrained and train without resume_from_checkpoint."
            )
        self.accelerator._load_amp_state([], checkpoint)

    # -- loads into a trained model: peft's load_adapter replaces the parameters the optimizer holds ------------------
    def _load_best_model(self) -> None:
        _keeping_parameters(self, super()._load_best_model)  # type: ignore[misc]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        _train_if_evaluated(self, self.model if model is None else model)  # type: ignore[attr-defined]
        load = functools.partial(super()._load_from_checkpoint, resume_from_checkpoint, model)  # type: ignore[misc]
        _keeping_parameters(self, load)

    # -- evaluation before training: the model is prepared for training, so that O2's masters start from FP32 ---------
    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``evaluation_loop`` (``evaluate``/``predict``). Before any training, the Trainer prepares
        the model for evaluation only, which at O2 makes it half without keeping its FP32 weights: the masters made
        when ``train()`` follows would start from their half rounding. A Trainer given a ``train_dataset`` prepares
        it for training here instead (its FP32 masters made now, from the FP32 weights)."""
        amp = self.accelerator.amp
        model = self.model  # type: ignore[attr-defined]
        if (
            amp is not None
            and amp.properties.master_weights
            and self.train_dataset is not None  # type: ignore[attr-defined]
            and len(self.accelerator._models) == 0
            and self.model_wrapped is model  # type: ignore[attr-defined]
            and not self.is_fsdp_enabled  # type: ignore[attr-defined]
        ):
            self.accelerator.prepare_model(model)
        return super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]

    # -- exporting: the FP32 weights training produced, not the O2 model's half copies --------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        amp = self.accelerator.amp
        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)  # type: ignore[attr-defined]
        if amp is not None:
            amp = engine_of(unwrapped, amp)  # after free_memory(): the engine that trained it holds its masters
        fp32 = state_dict is None and amp is not None and amp.properties.master_weights and not amp.sharded
        # Prepared for evaluation only (predict() on a Trainer without train_dataset): its FP32 values are gone, and
        # the half weights are saved as such (config.json naming the half dtype), as the Trainer's bf16_full_eval does.
        fp32 = fp32 and not (amp._masters.evaluation_only and not amp._masters.prune())  # type: ignore[union-attr]
        self._mpx_saved_masters: tuple[str, frozenset[str]] | None = None
        if fp32:
            state_dict = unwrapped.state_dict()
            replaced = masters_into(amp, unwrapped, state_dict)  # the masters, not copies; a frozen half base: half
            # For _save_scaler of the same checkpoint: the keys of the masters its model file holds (no tensors).
            folder = output_dir if output_dir is not None else self.args.output_dir  # type: ignore[attr-defined]
            self._mpx_saved_masters = (folder, frozenset(replaced))
            warn_frozen_half(amp, unwrapped, state_dict, "save_model()")  # type: ignore[arg-type]
        super()._save(output_dir, state_dict=state_dict)  # type: ignore[misc]
        config = getattr(unwrapped, "config", None)
        from transformers import PreTrainedModel

        # Only where save_pretrained wrote a config.json: a peft adapter's folder has none (its base is not saved).
        if fp32 and isinstance(unwrapped, PreTrainedModel) and config is not None:
            # save_pretrained names the model's (half) dtype in config.json, which from_pretrained loads in by default.
            config = copy.deepcopy(config)
            config.dtype = torch.float32
            config.save_pretrained(output_dir if output_dir is not None else self.args.output_dir)  # type: ignore[attr-defined]

    # -- the gradients a callback sees around the step ------------------------------------------------------------
    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        """The Trainer's (after its clip, which at O2 clips the FP32 masters' gradients only). At O2, with a callback
        of ``on_pre_optimizer_step`` or ``on_optimizer_step`` (which read or write ``p.grad`` there), the model's
        gradients then show the unscaled, clipped values the step uses, as under ``bf16=True``: a callback read
        them scaled and unclipped, and its write was refused at the step (with no way out in the Trainer's loop)."""
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)  # type: ignore[misc]
        amp = self.accelerator.amp
        if amp is not None and amp.properties.master_weights and _reads_gradients(self.callback_handler.callbacks):  # type: ignore[attr-defined]
            for owner in self.accelerator._amp_optimizers():
                if amp.is_unscaled(owner.optimizer):
                    amp.show_unscaled_on_model(owner.optimizer)
        return norm

    # -- metrics ------------------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float] = required("trainer.log()", "logs"), *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log``; a training log (one with ``"loss"``) also gets the engine's metrics since the
        previous one (``mpx/loss_scale``, ``mpx/overflows``, ``mpx/skipped_steps``, ...), unless
        ``MixedPrecisionKwargs(log_metrics=False)``; the Trainer's own values win on a name clash. ``logs`` left out
        or misspelt (``log(logz=...)``) is refused naming it."""
        accelerator = self.accelerator
        try:  # (no cost without an exception)
            training = "loss" in logs
        except TypeError:
            if isinstance(logs, Required) and kwargs:  # misspelt: named, with the one meant and the valid ones
                params = inspect.signature(super().log).parameters.values()  # type: ignore[misc]
                valid = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
                check_keywords("trainer.log()", kwargs, valid)
            raise
        if (
            training
            and accelerator.amp is not None
            and accelerator.mpx_kwargs is not None
            and accelerator.mpx_kwargs.log_metrics
            and accelerator.is_main_process
        ):
            logs = {**accelerator._read_mpx_metrics(LOG_READER), **logs}
        super().log(logs, *args, **kwargs)  # type: ignore[misc]


def _reads_gradients(callbacks: list[Any]) -> bool:
    """Whether one of the Trainer's ``callbacks`` has its own ``on_pre_optimizer_step`` or ``on_optimizer_step``."""
    from transformers import TrainerCallback

    base = (TrainerCallback.on_pre_optimizer_step, TrainerCallback.on_optimizer_step)
    return any(
        getattr(type(callback), "on_pre_optimizer_step", base[0]) is not base[0]
        or getattr(type(callback), "on_optimizer_step", base[1]) is not base[1]
        for callback in callbacks
    )


def _unset_bf16_hint(targs: Any, native: list[str]) -> str:
    """For arguments whose class turns ``bf16`` on when it is left unset (TRL's ``SFTConfig``, ``DPOConfig``, ...:
    ``bf16=None`` becomes ``True`` unless ``fp16``), the refusal's hint that the user must pass ``bf16=False``."""
    if "bf16=True" not in native or not dataclasses.is_dataclass(targs):
        return ""
    field = next((f for f in dataclasses.fields(targs) if f.name == "bf16"), None)
    if field is None or field.default is not None:
        return ""
    name = type(targs).__name__
    return (
        f" {name} sets bf16=True when it is left unset ({name}'s default, not transformers'): pass "
        f"{name}(..., bf16=False) to train with the opt level."
    )


def _train_if_evaluated(trainer: Any, model: nn.Module) -> None:
    """Before ``train(resume_from_checkpoint=...)`` loads the checkpoint's weights: a model ``evaluate()``/``predict()``
    prepared for evaluation only (a Trainer made without a ``train_dataset``; at O2 half, no masters) is prepared for
    training, so that the FP32 weights loaded next become its masters exactly. Loaded into the half model alone they
    were rounded, and the engine's entry then refused the resume, saying the model's weights were not loaded."""
    accelerator = trainer.accelerator
    amp = accelerator.amp
    if amp is None or not amp.properties.master_weights or trainer.is_fsdp_enabled:
        return
    if model not in accelerator._converted:  # not prepared yet (prepare makes the masters from its FP32 weights)
        return
    if not any(masters.covers(param) for masters in amp.master_weights for param in model.parameters()):
        amp.prepare_model(model, train=True, rank_zero_fp32=accelerator.num_processes > 1)


def _keeping_parameters(trainer: Any, load: Callable[[], Any]) -> None:
    """Run the Trainer's ``load`` of weights into its model, then put back the model parameters it replaced
    (:func:`~lightning_mpx.integrations.fp32_export.keep_replaced_parameters`: peft's ``load_adapter`` of a PeftModel's
    best or resumed adapter would replace them with FP32 copies of their half rounding that no optimizer steps)."""
    if trainer.accelerator.amp is None or trainer.is_fsdp_enabled:
        load()
        return
    keep_replaced_parameters(trainer.model, load)


def _written(masters: dict[str, torch.Tensor], folder: str) -> dict[str, torch.Tensor]:
    """``masters`` (by state-dict key) that the model files ``save_pretrained`` wrote in ``folder`` hold under their
    key in FP32 with their shape (read from the files' headers, not their data: a checkpoint does not read the model
    back): a tied copy it dropped, a key it renamed (a peft adapter's), a file format read here without its tensors
    or a tensor of another dtype (a user's ``_save`` writing half weights) is left out, and the engine's file then
    keeps that master itself."""
    kept: dict[str, torch.Tensor] = {}
    for name in os.listdir(folder):
        if not name.startswith(("model", "pytorch_model", "adapter_model")):
            continue
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as file:
                for key in masters.keys() & set(file.keys()):
                    stored = file.get_slice(key)
                    if stored.get_dtype() == "F32" and list(stored.get_shape()) == list(masters[key].shape):
                        kept[key] = masters[key]
        elif name.endswith(".bin"):
            stored_bin = torch.load(path, map_location="cpu", mmap=True, weights_only=True)  # mapped, not read
            for key in masters.keys() & stored_bin.keys():
                value = stored_bin[key]
                if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                    if value.shape == masters[key].shape:
                        kept[key] = masters[key]
    return kept


def _refuse_unknown_keywords(trainer_init: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Refuse a keyword that neither the mixin nor the Trainer's ``__init__`` takes, before the Trainer runs: a
    misspelt ``opt_level`` or a setting of the opt level (``half_dtype=``, which goes into ``mpx_kwargs``) named as
    such, anything else with the valid keywords and the closest of them. A Trainer that takes any keyword names its
    own."""
    try:
        parameters = inspect.signature(trainer_init).parameters
    except (TypeError, ValueError):  # no signature to read: the Trainer's own error
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    accepted = [n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    settings = [f.name for f in dataclasses.fields(MixedPrecisionKwargs) if f.init]
    valid = ["opt_level", "mpx_kwargs", *accepted]
    for name in (n for n in kwargs if n not in accepted):
        near = difflib.get_close_matches(name, valid + settings, n=1)
        if name in settings or (near and near[0] not in valid):
            setting = name if name in settings else near[0]
            raise TypeError(
                f"{name!r} is not a keyword of the Trainer"
                + (f" (did you mean {setting!r}?)" if setting != name else "")
                + f": it is a setting of the opt level; pass mpx_kwargs=MixedPrecisionKwargs({setting}=...)."
            )
        check_keywords("Trainer()", {name: kwargs[name]}, valid)


@checks_keywords("mpx_trainer()")
def mpx_trainer(trainer_cls: type | None = None) -> type:
    """``trainer_cls`` (``transformers.Trainer`` by default, or a subclass of it) with :class:`MpxTrainerMixin`:
    ``mpx_trainer()(model=model, args=args, train_dataset=data, opt_level="O2")``; a class that has the mixin already
    is returned as it is.

    Raises:
        TypeError: ``trainer_cls`` is not a subclass of ``transformers.Trainer``.
    """
    transformers = require("transformers", feature="lightning_mpx.accelerate.mpx_trainer")
    base = transformers.Trainer if trainer_cls is None else trainer_cls
    if not (isinstance(base, type) and issubclass(base, transformers.Trainer)):
        raise TypeError(f"trainer_cls={base!r} is not a subclass of transformers.Trainer.")
    if issubclass(base, MpxTrainerMixin):
        return base  # it has the mixin already (a second one makes no consistent method order)
    return type(f"Mpx{base.__name__}", (MpxTrainerMixin, base), {"__module__": base.__module__})
