"""litgpt's own fine-tuning entry points (LoRA, full) with an opt level.

``litgpt finetune_lora`` builds its ``Fabric`` from a precision string, so a precision plugin cannot be handed to it.
:func:`finetune_lora` is litgpt's ``litgpt.finetune.lora.setup`` (its arguments and defaults) with the ``Fabric``
built with ``plugins=[FabricMixedPrecisionPlugin(opt_level, **mpx_kwargs)]`` instead of ``precision=``; it does what
that ``setup`` does before ``fabric.launch`` (checkpoint folder, LoRA config, logger, strategy) and then launches
litgpt's own ``main`` (its ``fit``, validation, LoRA save and ``merge_lora``), nothing of litgpt patched.
:func:`finetune_full` does the same for ``litgpt.finetune.full``, :func:`pretrain` for ``litgpt.pretrain``. Each
adds the plugin's ``mpx/*`` metrics to the training records litgpt logs (:func:`log_mpx_metrics`).

``python -m lightning_mpx.litgpt finetune_lora|finetune_full <checkpoint_dir> --opt_level O2 [litgpt's flags]`` is
the command line: litgpt's own parser (``--config`` YAMLs included) with ``--opt_level`` and ``--mpx_kwargs`` (a JSON
object of :class:`~lightning_mpx.FabricMixedPrecisionPlugin` keywords) added.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import io
import json
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin
from lightning_mpx.opt_levels import _check_opt_level

# What litgpt's ``finetune/lora.py`` ``main`` takes, in the order its ``setup`` passes it (litgpt 0.5.13).
LORA_MAIN_PARAMETERS = ("fabric", "devices", "seed", "config", "data", "checkpoint_dir", "out_dir", "train", "eval",
                        "optimizer", "num_nodes", "precision")  # fmt: skip
# litgpt's precision for its ``merge_lora`` at the end of ``main``: the merged ``lit_model.pth`` is FP32, the dtype of
# the saved LoRA file (the FP32 masters at O2), as after litgpt's own ``bf16-mixed`` run.
MERGE_PRECISION = "32-true"
# litgpt's ``finetune/full.py`` ``main`` (litgpt 0.5.13).
FULL_MAIN_PARAMETERS = ("fabric", "devices", "resume", "seed", "config", "data", "checkpoint_dir", "out_dir", "train",
                        "eval", "optimizer", "num_nodes")  # fmt: skip
# litgpt's ``pretrain.py`` ``main``: its ``setup`` calls ``fabric.launch()`` and then ``main``.
PRETRAIN_MAIN_PARAMETERS = ("fabric", "devices", "seed", "initial_checkpoint_dir", "resume", "config", "data",
                            "out_dir", "tokenizer_dir", "tokenizer", "train", "eval", "optimizer",
                            "num_nodes")  # fmt: skip
COMMANDS = ("finetune_lora", "finetune", "finetune_full", "pretrain")


def _litgpt_version() -> str:
    try:
        return version("litgpt")
    except Exception:  # pragma: no cover - litgpt imported from a source tree
        return "unknown"


def check_main(main: Any, expected: Sequence[str]) -> None:
    """Refuse a litgpt whose ``main`` no longer takes what its ``setup`` passed when this was written.

    Raises:
        RuntimeError: naming the installed litgpt version, the parameters found and those expected.
    """
    found = tuple(inspect.signature(main).parameters)
    if found != tuple(expected):
        raise RuntimeError(
            f"litgpt {_litgpt_version()}: {main.__module__}.main takes {found}, lightning_mpx.litgpt passes "
            f"{tuple(expected)} (litgpt 0.5.13's); this litgpt version is not supported by lightning_mpx.litgpt: build "
            "the Fabric by hand as examples/fabric_litgpt_lora.py does"
        )


def _bind(setup: Any, checkpoint_dir: Path | str, setup_kwargs: dict[str, Any]) -> dict[str, Any]:
    """litgpt's ``setup`` arguments with its defaults applied; refuses what the opt level replaces."""
    for name in ("precision", "quantize"):
        if setup_kwargs.get(name) is not None:
            raise ValueError(
                f"{name}={setup_kwargs[name]!r} with an opt level: the FabricMixedPrecisionPlugin sets the precision"
                + (" (litgpt refuses mixed precision with quantize= too); drop quantize=, or run litgpt's own "
                   "`litgpt finetune_lora --quantize` without an opt level" if name == "quantize" else
                   "; pass opt_level= (and mpx_kwargs=) instead of precision=")
            )  # fmt: skip
    try:
        bound = inspect.signature(setup).bind(checkpoint_dir, **setup_kwargs)
    except TypeError as error:
        raise TypeError(f"{error}: it takes {setup.__module__}.setup's arguments") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _flag_value(value: Any) -> str:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, str):
        return value
    return json.dumps(value, default=_plain)


def _plain(value: Any) -> Any:
    """A value jsonargparse reads back: paths as strings, litgpt's prompt styles by their registered name."""
    if isinstance(value, Path):
        return str(value)
    from litgpt.prompts import prompt_styles

    for name, style in prompt_styles.items():
        if type(value) is style:
            return name
    raise TypeError(f"cannot write {value!r} as a command-line value")


def _argv(arguments: dict[str, Any]) -> list[str]:
    """The litgpt flags standing for ``arguments`` (without ``precision``/``quantize``); the first one (the checkpoint
    folder, or pretrain's model name) is the positional one."""
    first = next(iter(arguments))
    argv = [str(arguments[first])]
    for name, value in arguments.items():
        if name in (first, "precision", "quantize") or value is None:
            continue
        if name == "data" and dataclasses.is_dataclass(value):
            init = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
            value = {"class_path": f"{type(value).__module__}.{type(value).__qualname__}", "init_args": init}
        elif dataclasses.is_dataclass(value):
            # the fields off their defaults: jsonargparse refuses `null` for an optional field nested in an optional
            # dataclass (pretrain's `model_config: Config | None`), and checks each flag of it (seconds for a Config)
            argv += [f"--{name}.{f.name}={_flag_value(getattr(value, f.name))}" for f in dataclasses.fields(value)
                     if _off_default(f, getattr(value, f.name))]  # fmt: skip
            continue
        argv.append(f"--{name}={_flag_value(value)}")
    return argv


def _off_default(field: dataclasses.Field, value: Any) -> bool:
    """Whether a dataclass field holds other than its default (a field without one: always)."""
    if field.default is not dataclasses.MISSING:
        return bool(value != field.default)
    if field.default_factory is not dataclasses.MISSING:
        return bool(value != field.default_factory())
    return True


def _recorded_argv(setup: Any, arguments: dict[str, Any]) -> list[str]:
    """The flags litgpt's ``save_hyperparameters`` will parse (it reads ``sys.argv``): all of ``arguments`` where
    litgpt's parser reads them back, else the ones ``merge_lora`` needs (checkpoint, LoRA settings), with a warning."""
    from jsonargparse import capture_parser
    from litgpt.utils import CLI

    try:
        argv = _argv(arguments)
        with contextlib.redirect_stderr(io.StringIO()):
            capture_parser(lambda: CLI(setup)).parse_args(argv)
        return argv
    except (Exception, SystemExit) as error:
        kept = ("out_dir", "seed", "devices", "num_nodes", "optimizer", "logger_name")
        first = next(iter(arguments))
        essential = {k: v for k, v in arguments.items() if k.startswith("lora_") or k in kept or k == first}
        warnings.warn(
            f"hyperparameters.yaml records litgpt's defaults for some arguments ({type(error).__name__}: {error}); "
            "the checkpoint folder and the LoRA settings merge_lora reads are recorded",
            stacklevel=3,
        )
        return _argv(essential)


def _with_litgpt_argv(argv: list[str], main: Callable[..., Any], *args: Any) -> Any:
    """Run litgpt's ``main`` with ``sys.argv`` as litgpt's own flags (``argv``): its ``save_hyperparameters`` parses
    ``sys.argv``. Swapped in the launched function, in each process, not around ``fabric.launch``: Fabric's
    subprocess launcher starts the other ranks from the real ``sys.argv`` (this process's command line)."""
    saved = sys.argv
    sys.argv = [saved[0] if saved else "litgpt", *argv]
    try:
        return main(*args)
    finally:
        sys.argv = saved


def finetune_lora(checkpoint_dir: Path | str, *, opt_level: str = "O2", mpx_kwargs: dict[str, Any] | None = None,
                  **setup_kwargs: Any) -> Any:  # fmt: skip
    """litgpt's LoRA fine-tuning (``litgpt.finetune.lora.setup``, its arguments and defaults) at ``opt_level``.

    The ``Fabric`` gets ``plugins=[FabricMixedPrecisionPlugin(opt_level, **mpx_kwargs)]`` in place of litgpt's
    ``precision=``; litgpt's ``main`` trains, validates, saves ``final/lit_model.pth.lora`` (the LoRA weights in FP32:
    the masters at O2) and merges it into an FP32 ``final/lit_model.pth``. Returns the ``Fabric`` it ran (its
    ``strategy.precision`` is the plugin); litgpt's ``setup`` returns nothing.

    Raises:
        ValueError: for ``precision=`` or ``quantize=`` (the opt level sets the precision), or a bad opt level.
        TypeError: for an argument litgpt's ``setup`` does not take.
        RuntimeError: when the installed litgpt's ``main`` takes other parameters than litgpt 0.5.13's.
    """
    return _finetune_lora(checkpoint_dir, opt_level, mpx_kwargs, setup_kwargs, None)


def _finetune_lora(checkpoint_dir: Path | str, opt_level: str, mpx_kwargs: dict[str, Any] | None,
                   setup_kwargs: dict[str, Any], argv: list[str] | None) -> Any:  # fmt: skip
    """:func:`finetune_lora`; ``argv``: the litgpt flags it was given on the command line (recorded as they are)."""
    from litgpt.finetune import lora

    check_main(lora.main, LORA_MAIN_PARAMETERS)
    args, plugin, recorded = _arguments(lora.setup, checkpoint_dir, opt_level, mpx_kwargs, setup_kwargs, argv)
    checkpoint_dir, devices, out_dir = _prepare(args)
    config = lora.Config.from_file(checkpoint_dir / "model_config.yaml",
                                   **{k: v for k, v in args.items() if k.startswith("lora_")})  # fmt: skip
    strategy: Any = "auto"
    if devices * args["num_nodes"] > 1:
        from lightning.fabric.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(parallelize_fn=lora.parallelize_fn, tensor_parallel_size=1,
                                         data_parallel_size=devices * args["num_nodes"])  # fmt: skip
    fabric = _fabric(args, f"finetune-{config.name}", out_dir, devices, strategy, plugin)
    fabric.launch(functools.partial(_with_litgpt_argv, recorded, lora.main), devices, args["seed"], config,
                  args["data"], checkpoint_dir, out_dir, args["train"], args["eval"], args["optimizer"],
                  args["num_nodes"], MERGE_PRECISION)  # fmt: skip
    return fabric


def finetune_full(checkpoint_dir: Path | str, *, opt_level: str = "O2", mpx_kwargs: dict[str, Any] | None = None,
                  **setup_kwargs: Any) -> Any:  # fmt: skip
    """litgpt's full fine-tuning (``litgpt.finetune.full.setup``, its arguments and defaults) at ``opt_level``.

    As :func:`finetune_lora`: litgpt's ``main`` trains and saves ``final/lit_model.pth`` (``fabric.save`` of the
    model: the FP32 masters at O2, as ``"bf16-mixed"``'s FP32 weights). Returns the ``Fabric`` it ran.

    Raises:
        ValueError: for ``precision=``, a bad opt level, or ``resume=`` with FP32 masters (O2): litgpt's ``main``
            loads the optimizer's state before the plugin meets the optimizer, which at O2 is refused at the first
            step (docs/fabric.md, "Checkpoints at O2").
        TypeError: for an argument litgpt's ``setup`` does not take.
        RuntimeError: when the installed litgpt's ``main`` takes other parameters than litgpt 0.5.13's.
    """
    return _finetune_full(checkpoint_dir, opt_level, mpx_kwargs, setup_kwargs, None)


def _finetune_full(checkpoint_dir: Path | str, opt_level: str, mpx_kwargs: dict[str, Any] | None,
                   setup_kwargs: dict[str, Any], argv: list[str] | None) -> Any:  # fmt: skip
    from litgpt.finetune import full

    check_main(full.main, FULL_MAIN_PARAMETERS)
    args, plugin, recorded = _arguments(full.setup, checkpoint_dir, opt_level, mpx_kwargs, setup_kwargs, argv)
    if args["resume"]:
        _refuse_resume_with_masters(plugin, args["resume"], opt_level, "finetune/full.py")
    checkpoint_dir, devices, out_dir = _prepare(args)
    config = full.Config.from_file(checkpoint_dir / "model_config.yaml")
    strategy: Any = "auto"
    if devices * args["num_nodes"] > 1:
        from lightning.fabric.strategies import FSDPStrategy

        strategy = FSDPStrategy(auto_wrap_policy={full.Block}, activation_checkpointing_policy={full.Block},
                                state_dict_type="full", limit_all_gathers=True, cpu_offload=False)  # fmt: skip
    fabric = _fabric(args, f"finetune-{config.name}", out_dir, devices, strategy, plugin, resume=bool(args["resume"]))
    fabric.launch(functools.partial(_with_litgpt_argv, recorded, full.main), devices, args["resume"], args["seed"],
                  config, args["data"], checkpoint_dir, out_dir, args["train"], args["eval"], args["optimizer"],
                  args["num_nodes"])  # fmt: skip
    return fabric


def pretrain(model_name: str | None = None, *, opt_level: str = "O2", mpx_kwargs: dict[str, Any] | None = None,
             **setup_kwargs: Any) -> Any:  # fmt: skip
    """litgpt's pretraining (``litgpt.pretrain.setup``, its arguments and defaults) at ``opt_level``.

    ``model_name`` may be left out when ``model_config=`` (a ``litgpt.Config``) is given. As :func:`finetune_full`:
    the ``Fabric`` gets the plugin in place of ``precision=``, litgpt's ``main`` builds, compiles and trains the model
    and saves ``final/lit_model.pth`` (``fabric.save`` of its state: the model's FP32 masters at O2, as
    ``"bf16-mixed"``'s FP32 weights). Returns the ``Fabric`` it ran.

    Raises:
        ValueError: for ``precision=``, a bad opt level, neither ``model_name`` nor ``model_config``, or ``resume=``
            that finds a checkpoint with FP32 masters (O2): litgpt's ``main`` loads the optimizer's state before the
            plugin meets the optimizer (docs/fabric.md, "Checkpoints at O2").
        TypeError: for an argument litgpt's ``setup`` does not take.
        RuntimeError: when the installed litgpt's ``main`` takes other parameters than litgpt 0.5.13's.
    """
    return _pretrain(model_name, opt_level, mpx_kwargs, setup_kwargs, None)


def _pretrain(model_name: str | None, opt_level: str, mpx_kwargs: dict[str, Any] | None,
              setup_kwargs: dict[str, Any], argv: list[str] | None) -> Any:  # fmt: skip
    from litgpt import pretrain as litgpt_pretrain
    from litgpt.utils import extend_checkpoint_dir, find_resume_path, init_out_dir, parse_devices

    check_main(litgpt_pretrain.main, PRETRAIN_MAIN_PARAMETERS)
    config = setup_kwargs.get("model_config")
    if model_name is None:
        if config is None:
            raise ValueError("model_name=None and model_config=None: pretrain needs one (a name in litgpt.config, "
                             "or a litgpt.Config)")  # fmt: skip
        model_name = config.name  # what hyperparameters.yaml records as litgpt's positional argument
    args = _bind(litgpt_pretrain.setup, model_name, setup_kwargs)
    plugin = _plugin(opt_level, mpx_kwargs)
    out_dir = init_out_dir(args["out_dir"])
    resume = args["resume"]
    if resume and find_resume_path(resume, out_dir) is not None:
        _refuse_resume_with_masters(plugin, resume, opt_level, "pretrain.py")
    recorded = argv if argv is not None else _recorded_argv(litgpt_pretrain.setup, args)
    for name in ("initial_checkpoint_dir", "tokenizer_dir"):
        if args[name] is not None:
            args[name] = extend_checkpoint_dir(Path(args[name]))
    if config is None:
        config = args["model_config"] = litgpt_pretrain.Config.from_name(model_name)
    hparams = {k: v if v is None or isinstance(v, (int, float, str, bool, Path)) else
               dataclasses.asdict(v) if dataclasses.is_dataclass(v) else str(v)
               for k, v in {**args, "opt_level": opt_level, "mpx_kwargs": mpx_kwargs}.items()}  # fmt: skip
    if args["data"] is None:
        args["data"] = litgpt_pretrain.TinyLlama()
    devices = parse_devices(args["devices"])
    tokenizer = litgpt_pretrain.Tokenizer(args["tokenizer_dir"]) if args["tokenizer_dir"] is not None else None
    strategy: Any = "auto"
    if devices * args["num_nodes"] > 1:
        strategy = litgpt_pretrain.FSDPStrategy(auto_wrap_policy={litgpt_pretrain.Block}, state_dict_type="full",
                                                sharding_strategy="HYBRID_SHARD")  # fmt: skip
    fabric = _fabric(args, f"pretrain-{config.name}", out_dir, devices, strategy, plugin, resume=bool(resume))
    fabric.launch(functools.partial(_launched_pretrain, recorded, hparams, args["logger_name"], litgpt_pretrain.main),
                  devices, args["seed"], args["initial_checkpoint_dir"], resume, config, args["data"], out_dir,
                  args["tokenizer_dir"], tokenizer, args["train"], args["eval"], args["optimizer"],
                  args["num_nodes"])  # fmt: skip
    return fabric


def _launched_pretrain(argv: list[str], hparams: dict[str, Any], logger_name: str, main: Callable[..., Any],
                       fabric: Any, *args: Any) -> Any:  # fmt: skip
    """What litgpt's pretraining ``setup`` does after ``fabric.launch()``: print (and log) the hyperparameters, then
    its ``main``, with ``sys.argv`` as litgpt's flags (its ``save_checkpoint`` records ``hyperparameters.yaml``)."""
    import pprint

    fabric.print(pprint.pformat(hparams))
    if logger_name in ("tensorboard", "wandb", "mlflow"):
        fabric.logger.log_hyperparams(hparams)
    return _with_litgpt_argv(argv, main, fabric, *args)


def log_mpx_metrics(logger: Any, plugin: FabricMixedPrecisionPlugin) -> None:
    """Have ``logger`` (a Fabric logger the entry point made) add ``plugin.metrics()`` (``mpx/loss_scale``,
    ``mpx/overflows``, ``mpx/skipped_steps``...) to each training record litgpt logs (a dict with ``"loss"``), at
    litgpt's own step, on rank 0. Nothing runs on an iteration litgpt does not log; its validation records are left
    as they are. The plugin is held weakly (the logger does not keep the engine alive)."""
    logger.log_metrics = _LogWithMpx(logger.log_metrics, plugin)


class _LogWithMpx:
    """A logger's ``log_metrics`` adding the plugin's metrics (:func:`log_mpx_metrics`). An object, not a closure, so
    the logger still pickles and deep-copies (the copy logs to its own files, as the logger did before the plugin:
    a weak reference to the plugin does not pickle)."""

    def __init__(self, log_metrics: Callable[..., Any], plugin: FabricMixedPrecisionPlugin) -> None:
        self.log_metrics = log_metrics
        self.plugin: weakref.ref[FabricMixedPrecisionPlugin] | None = weakref.ref(plugin)

    def __call__(self, metrics: dict[str, Any], step: int | None = None) -> Any:
        plugin = self.plugin() if self.plugin is not None else None
        if "loss" in metrics and plugin is not None and getattr(rank_zero_only, "rank", 0) == 0:
            metrics = {**metrics, **plugin.metrics()}
        return self.log_metrics(metrics, step)

    def __getstate__(self) -> dict[str, Any]:
        return {"log_metrics": self.log_metrics, "plugin": None}


def _arguments(setup: Any, checkpoint_dir: Path | str, opt_level: str, mpx_kwargs: dict[str, Any] | None,  # fmt: skip
               setup_kwargs: dict[str, Any], argv: list[str] | None) -> tuple[dict[str, Any], Any, list[str]]:
    """litgpt's ``setup`` arguments, the plugin (a bad opt level fails before any file) and the flags to record."""
    args = _bind(setup, checkpoint_dir, setup_kwargs)
    plugin = _plugin(opt_level, mpx_kwargs)
    return args, plugin, argv if argv is not None else _recorded_argv(setup, args)


def _plugin(opt_level: str, mpx_kwargs: dict[str, Any] | None) -> FabricMixedPrecisionPlugin:
    """The plugin of ``opt_level`` and ``mpx_kwargs`` (its keywords as a dict; Python's "argument after ** must be a
    mapping" before, naming no argument)."""
    if mpx_kwargs is not None and not isinstance(mpx_kwargs, dict):
        raise TypeError(f"mpx_kwargs={mpx_kwargs!r} must be a dict of FabricMixedPrecisionPlugin's keywords or None, "
                        "e.g. mpx_kwargs={'half_dtype': 'bfloat16'}")
    return FabricMixedPrecisionPlugin(opt_level, **(mpx_kwargs or {}))


def _refuse_resume_with_masters(plugin: Any, resume: Any, opt_level: str, script: str) -> None:
    """Refuse ``resume=`` where the plugin keeps FP32 masters (O2): litgpt's ``script`` ``main`` loads the optimizer's
    state with ``fabric.load`` before the plugin meets the optimizer (docs/fabric.md, "Checkpoints at O2")."""
    if plugin.amp.properties.master_weights:
        raise ValueError(f"resume={resume!r} at {opt_level}: {_resume_reason(script)}; resume at O1, or write the loop "
                         "by hand (examples/fabric_litgpt.py)")  # fmt: skip


def _resume_reason(script: str) -> str:
    return (f"litgpt's {script} main loads the optimizer's state before the plugin meets the optimizer (FP32 masters "
            "need plugin.setup_optimizers(optimizer) first)")  # fmt: skip


def _command_line_refusal(command: str, opt_level: str, plugin: Any, settings: dict[str, Any]) -> str | None:
    """What the command line refuses before litgpt runs (argparse's error in its words, where the Python API raises
    ``ValueError`` with a traceback): ``--resume`` where the plugin keeps FP32 masters (O2) and litgpt's ``main``
    would load a checkpoint (``finetune_full``: any ``--resume``; ``pretrain``: one that finds a checkpoint), and
    pretrain's ``--resume true`` that finds none (litgpt's own ``FileNotFoundError``)."""
    resume = settings.get("resume")
    if command not in ("finetune_full", "pretrain") or not resume:
        return None
    flag = f"--resume {str(resume).lower() if isinstance(resume, bool) else resume}"
    if command == "pretrain":
        from litgpt.utils import find_resume_path, init_out_dir

        out_dir = init_out_dir(settings["out_dir"])
        try:
            if find_resume_path(resume, out_dir) is None:
                return None  # --resume auto with no checkpoint yet: litgpt starts afresh
        except FileNotFoundError:
            return (f"{flag}: no checkpoint (step-*/*.pth) in --out_dir {out_dir}; pass the --out_dir of the run to "
                    "resume, or --resume auto to start afresh when there is none")  # fmt: skip
    if not plugin.amp.properties.master_weights:
        return None
    script = "pretrain.py" if command == "pretrain" else "finetune/full.py"
    return (f"{flag} with --opt_level {opt_level}: {_resume_reason(script)}; resume with --opt_level O1, or write the "
            "loop by hand (examples/fabric_litgpt.py)")  # fmt: skip


def _prepare(args: dict[str, Any]) -> tuple[Path, int, Path]:
    """What litgpt's ``setup`` does first: the checkpoint folder, the data's default, devices and the output folder."""
    from litgpt.utils import auto_download_checkpoint, check_valid_checkpoint_dir, init_out_dir, parse_devices

    checkpoint_dir = auto_download_checkpoint(model_name=args["checkpoint_dir"], access_token=args["access_token"])
    if args["data"] is None:
        from litgpt.data import Alpaca

        args["data"] = Alpaca()
    devices = parse_devices(args["devices"])
    out_dir = init_out_dir(args["out_dir"])
    check_valid_checkpoint_dir(checkpoint_dir)
    return checkpoint_dir, devices, out_dir


def _fabric(args: dict[str, Any], name: str, out_dir: Path, devices: int, strategy: Any, plugin: Any,
            **logger_kwargs: Any) -> Any:  # fmt: skip
    """litgpt's logger (adding the plugin's ``mpx/*`` metrics to litgpt's training logs) and ``Fabric``, with
    ``plugins=[plugin]`` in place of ``precision=``."""
    import lightning as L
    import torch
    from litgpt.utils import check_nvlink_connectivity, choose_logger

    logger = choose_logger(args["logger_name"], out_dir, name=name, log_interval=args["train"].log_interval,
                           log_args=dataclasses.asdict(args["log"]), **logger_kwargs)  # fmt: skip
    log_mpx_metrics(logger, plugin)
    fabric = L.Fabric(devices=devices, num_nodes=args["num_nodes"], strategy=strategy, loggers=logger,
                      plugins=[plugin])  # fmt: skip
    if torch.cuda.is_available() and devices > 1:
        check_nvlink_connectivity(fabric)
    return fabric


MPX_KWARGS_EXAMPLE = '{"half_dtype": "bfloat16"}'


def _mpx_kwargs(text: str) -> dict[str, Any]:
    """``--mpx_kwargs``'s value: a JSON object (the plugin's keywords), or argparse's error naming the value and an
    example (``json.loads`` alone says "invalid loads value", and a JSON list failed later at ``**``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not JSON ({error.msg}); pass FabricMixedPrecisionPlugin's keywords as a JSON object, "
            f"keys and strings in double quotes, e.g. --mpx_kwargs '{MPX_KWARGS_EXAMPLE}'"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a JSON {type(value).__name__}, not an object; pass FabricMixedPrecisionPlugin's keywords "
            f"as a JSON object, e.g. --mpx_kwargs '{MPX_KWARGS_EXAMPLE}'"
        )
    return value


def _opt_level(text: str) -> str:
    """``--opt_level``'s value, or argparse's error with the core's message (a traceback from the plugin before)."""
    try:
        _check_opt_level(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m lightning_mpx.litgpt finetune_lora <checkpoint_dir> --opt_level O2 [litgpt's flags]`` (or
    ``finetune_full``; ``pretrain <model_name>``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours = argparse.ArgumentParser(prog="python -m lightning_mpx.litgpt", add_help=False)
    ours.add_argument("command", choices=COMMANDS)
    ours.add_argument("--opt_level", "--opt-level", default="O2", type=_opt_level)
    ours.add_argument("--mpx_kwargs", "--mpx-kwargs", type=_mpx_kwargs, default=None,
                      help=f"FabricMixedPrecisionPlugin keywords as JSON, e.g. '{MPX_KWARGS_EXAMPLE}'")
    if not argv or argv[0] in ("-h", "--help"):
        ours.print_help()
        print("\nThen litgpt's own flags: python -m lightning_mpx.litgpt finetune_lora --help (or finetune_full, "
              "pretrain)")
        return
    known, rest = ours.parse_known_args(argv)
    try:  # the plugin's keywords checked before litgpt's parser (a traceback from the plugin before)
        plugin = _plugin(known.opt_level, known.mpx_kwargs)
    except (TypeError, ValueError) as error:
        ours.error(f"argument --mpx_kwargs/--mpx-kwargs: {json.dumps(known.mpx_kwargs)}: {error}")

    from jsonargparse import capture_parser
    from litgpt import pretrain as litgpt_pretrain
    from litgpt.finetune import full, lora
    from litgpt.utils import CLI

    setup, run = {"finetune_full": (full.setup, _finetune_full), "pretrain": (litgpt_pretrain.setup, _pretrain)}.get(
        known.command, (lora.setup, _finetune_lora))
    parser = capture_parser(lambda: CLI(setup))
    parser.prog = f"python -m lightning_mpx.litgpt {known.command} [--opt_level O2] [--mpx_kwargs JSON]"
    config = parser.parse_args(rest)
    settings = {k: v for k, v in vars(parser.instantiate_classes(config)).items() if k not in ("config", "__path__")}
    settings = {k: v for k, v in settings.items() if k not in ("precision", "quantize") or v is not None}
    for name in ("precision", "quantize"):
        if name in settings:  # argparse's error in the command line's words (a traceback naming precision= before)
            ours.error(f"--{name} {settings[name]} with --opt_level {known.opt_level}: the opt level sets the "
                       f"precision" + (" (litgpt refuses mixed precision with --quantize too); drop --quantize, or run "
                       f"litgpt's own `litgpt {known.command} --quantize` without --opt_level" if name == "quantize"
                       else f"; drop --precision (set the half dtype with --mpx_kwargs '{MPX_KWARGS_EXAMPLE}'); a "
                       "--config YAML's precision: counts too (litgpt's config_hub files set one): add --precision "
                       "null after --config"))
    refusal = _command_line_refusal(known.command, known.opt_level, plugin, settings)
    if refusal is not None:  # argparse's error (a traceback from the entry point before)
        ours.error(refusal)
    run(settings.pop(next(iter(inspect.signature(setup).parameters))), known.opt_level, known.mpx_kwargs, settings,
        rest)
