"""A pytest plugin that runs the host frameworks' own tests with lightning_mpx's precision in place of theirs.

Load it with ``-p mpx_substitute`` (this folder on ``PYTHONPATH``). Environment:

- ``MPX_OL``: the opt level put in place (``O2`` by default; ``O1``, ``O0``, ``O3`` also).
- ``MPX_ALL=1``: substitute also where a test asks for no mixed precision (``precision=None``/``"32-true"``,
  ``mixed_precision=None``/``"no"``), which is most of the frameworks' tests.
- ``MPX_HF=1``: substitute ``transformers.Trainer`` (see :func:`_patch_transformers`) instead of Accelerate's class.
- ``MPX_OFF=1``: substitute nothing (the rerun of a failure without the plugin, to classify it).

Where a test builds

- ``lightning.pytorch.Trainer(precision="16-mixed"|"bf16-mixed"|"16"|"bf16"|16)``: ``plugins=[MixedPrecisionPlugin]``;
- ``lightning.fabric.Fabric(precision=...)`` (same values): ``plugins=[FabricMixedPrecisionPlugin]``;
- ``accelerate.Accelerator(mixed_precision="fp16"|"bf16")``: :class:`MpxHarnessAccelerator`, a
  ``lightning_mpx.accelerate.Accelerator`` given the opt level;

``half_dtype`` float16 for the 16-bit values, bfloat16 otherwise (the ``MPX_ALL`` ones too). Left alone: a precision
plugin already in ``plugins``, a strategy instance that holds its own precision plugin, ``"16-true"``/``"bf16-true"``/
``"64-true"``/transformer-engine, ``"fp8"``, DeepSpeed/Megatron/FSDP plugins and torch's ``GradScalerKwargs``/
``AutocastKwargs`` in Accelerate (the opt level refuses those; the tests then run the framework's own precision).

The wrappers keep each ``__init__``'s signature (``functools.wraps``: Lightning reads it for ``PL_TRAINER_*``) and the
substituted Accelerator class lives at this module's top level (``pickle`` finds it by name). Nothing is patched under
``MPX_OFF=1``. The run's summary prints how many objects were substituted, by kind.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from typing import Any

_COUNTS: Counter[str] = Counter()
_SIXTEEN = {"16-mixed", "16", 16}
_BF16 = {"bf16-mixed", "bf16"}
_NONE = {None, "32-true", "32", 32}


def _level() -> str:
    return os.environ.get("MPX_OL", "O2")


def _all() -> bool:
    return os.environ.get("MPX_ALL", "") == "1"


def _off() -> bool:
    return os.environ.get("MPX_OFF", "") == "1"


def _half_for_precision(precision: Any) -> str | None:
    """The half dtype to substitute for a Lightning/Fabric ``precision`` value, or None to leave it alone."""
    if precision in _SIXTEEN:
        return "float16"
    if precision in _BF16:
        return "bfloat16"
    if _all() and precision in _NONE:
        return "bfloat16"
    return None


def _as_list(plugins: Any) -> list[Any]:
    if plugins is None:
        return []
    return list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]


def _wrap_lightning_init(cls: type, precision_base: type, strategy_base: type, make: Any, kind: str) -> None:
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        precision = kwargs.get("precision")
        half = _half_for_precision(precision)
        plugins = _as_list(kwargs.get("plugins"))
        strategy = kwargs.get("strategy")
        holds_own = isinstance(strategy, strategy_base) and getattr(strategy, "_precision_plugin", None) is not None
        if half is not None and not holds_own and not any(isinstance(p, precision_base) for p in plugins):
            kwargs.pop("precision", None)
            kwargs["plugins"] = [*plugins, make(_level(), half_dtype=half)]
            _COUNTS[kind] += 1
        original(self, *args, **kwargs)

    cls.__init__ = __init__


def _patch_lightning() -> None:
    try:
        import lightning.fabric as lf
        import lightning.pytorch as pl
    except ImportError:
        return
    from lightning.fabric.plugins.precision.precision import Precision as FabricPrecision
    from lightning.fabric.strategies import Strategy as FabricStrategy
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import Strategy

    from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin
    from lightning_mpx.integrations.lightning import MixedPrecisionPlugin

    _wrap_lightning_init(pl.Trainer, Precision, Strategy, MixedPrecisionPlugin, "Trainer")
    _wrap_lightning_init(lf.Fabric, FabricPrecision, FabricStrategy, FabricMixedPrecisionPlugin, "Fabric")


try:
    from lightning_mpx.integrations.accelerate import Accelerator as _MpxAccelerator
    from lightning_mpx.integrations.accelerate import MixedPrecisionKwargs as _MpxKwargs
except ImportError:  # accelerate not installed: nothing to substitute there
    _MpxAccelerator = None


if _MpxAccelerator is not None:

    class MpxHarnessAccelerator(_MpxAccelerator):  # type: ignore[misc,valid-type]
        """``lightning_mpx.accelerate.Accelerator`` with ``MPX_OL`` where a test asks for ``fp16``/``bf16`` (and,
        with ``MPX_ALL=1``, for none); every other set-up is passed on unchanged."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if args:  # Accelerate's positional order: (device_placement, split_batches, mixed_precision, ...)
                names = ("device_placement", "split_batches", "mixed_precision")
                for name, value in zip(names, args):
                    kwargs[name] = value
                if len(args) > len(names):
                    raise TypeError("mpx_substitute: more than 3 positional arguments to Accelerator")
                args = ()
            half = self._mpx_half(kwargs)
            if half is not None:
                kwargs["mixed_precision"] = _level()
                handlers = list(kwargs.get("kwargs_handlers") or [])
                kwargs["kwargs_handlers"] = [*handlers, _MpxKwargs(half_dtype=half)]
                _COUNTS["Accelerator"] += 1
            super().__init__(**kwargs)

        @staticmethod
        def _mpx_half(kwargs: dict[str, Any]) -> str | None:
            from accelerate.utils import AutocastKwargs, GradScalerKwargs

            value = kwargs.get("mixed_precision")
            if value is None:
                value = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
            value = str(getattr(value, "value", value)).lower()
            if any(kwargs.get(k) is not None for k in ("deepspeed_plugin", "deepspeed_plugins", "megatron_lm_plugin")):
                return None
            if kwargs.get("fsdp_plugin") is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "") == "true":
                return None
            if any(isinstance(h, (GradScalerKwargs, AutocastKwargs)) for h in kwargs.get("kwargs_handlers") or []):
                return None
            if value == "fp16":
                return "float16"
            if value == "bf16" or (_all() and value == "no"):
                return "bfloat16"
            return None


def _patch_accelerate() -> None:
    if _MpxAccelerator is None:
        return
    import accelerate
    import accelerate.accelerator

    accelerate.Accelerator = MpxHarnessAccelerator
    accelerate.accelerator.Accelerator = MpxHarnessAccelerator


def _patch_transformers() -> None:
    """``transformers.Trainer`` -> a ``MpxTrainerMixin`` subclass with ``MPX_OL`` (``MPX_HF=1`` only: importing
    transformers costs seconds). Every Trainer is substituted; ``TrainingArguments(fp16=True)`` (or its
    ``*_full_eval``) gives float16 and is turned off (the mixin refuses both precisions at once), else bfloat16.
    Patched before the test modules import, so a test's ``class MyTrainer(Trainer)`` subclasses it too."""
    import transformers
    import transformers.trainer

    from lightning_mpx.integrations.accelerate import MixedPrecisionKwargs
    from lightning_mpx.integrations.hf_trainer import MpxTrainerMixin

    class MpxHarnessTrainer(MpxTrainerMixin, transformers.trainer.Trainer):  # type: ignore[misc,name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            targs = kwargs.get("args", args[1] if len(args) > 1 else None)
            half = "bfloat16"
            if targs is not None:
                if targs.fp16 or targs.fp16_full_eval:
                    half = "float16"
                for name in ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval"):
                    setattr(targs, name, False)
            kwargs.setdefault("opt_level", _level())
            kwargs.setdefault("mpx_kwargs", MixedPrecisionKwargs(half_dtype=half))
            _COUNTS["Trainer(transformers)"] += 1
            super().__init__(*args, **kwargs)

    transformers.Trainer = MpxHarnessTrainer
    transformers.trainer.Trainer = MpxHarnessTrainer


def pytest_configure(config: Any) -> None:
    if _off():
        return
    _patch_lightning()
    if os.environ.get("MPX_HF", "") == "1":
        # Not Accelerate's class as well: the Trainer builds Accelerate's own Accelerator first (mixed_precision "no",
        # which MPX_ALL would turn into an opt level) before the mixin replaces it with ours.
        _patch_transformers()
    else:
        _patch_accelerate()


def pytest_runtest_logreport(report: Any) -> None:
    """With ``MPX_OUTCOMES=<file>``: one line per test id and outcome (``passed``, ``failed``, ``skipped``, ``error``
    for a failed set-up or teardown), appended as each test ends, so that a run cut off still leaves its outcomes."""
    path = os.environ.get("MPX_OUTCOMES")
    if not path:
        return
    if report.when == "call" or report.outcome != "passed" or (report.when == "setup" and report.skipped):
        outcome = report.outcome if report.when == "call" or report.skipped else "error"
        with open(path, "a") as f:
            f.write(f"{outcome}\t{report.nodeid}\n")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _off():
        terminalreporter.write_line("mpx_substitute: MPX_OFF=1, nothing substituted")
        return
    counts = ", ".join(f"{kind} {n}" for kind, n in sorted(_COUNTS.items())) or "none"
    terminalreporter.write_line(f"mpx_substitute: {_level()}, MPX_ALL={int(_all())}, substituted: {counts}")
