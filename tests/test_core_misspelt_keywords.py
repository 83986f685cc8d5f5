"""Unhelpful errors and small gaps left by stop 62, from the user's side (stop 63):

1. a misspelt keyword of a config object or entry point (``MixedPrecisionKwargs(init_scaler=3)``, ``Accelerator``,
   Apex's ``initialize``/``init``, the FSDP helpers) names the valid keywords and the closest, where Python's own
   ``TypeError`` named none; ``MixedPrecisionKwargs`` stays a plain dataclass (``replace``, pickling, ``to_kwargs``);
2. the litgpt command line refuses ``--resume`` at O2 (and a bad ``--mpx_kwargs``) with argparse's error and exit
   status 2, where it printed a traceback;
3. Apex's ``amp.initialize`` checks every argument before it touches ``_amp_state``: a failed call leaves the earlier
   calls' scope, engines, loss scales and wrappers exactly as they were;
4. ``.ci/other_torch``'s venv is pinned to the versions the dev extra resolved here (``.ci/dev_pins.py``);
5. a failed multi-rank launch (``tests/launch.py``) quotes each rank's stderr from its first error and its end.

``FIXED`` were answered without the valid choices (or not at all) before this stop; ``GOOD`` were already right and
are held so (tests/test_core_bad_input_entry_points.py's table style).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import importlib.util
import inspect
import pickle
import re
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import lightning_mpx as mpx
from lightning_mpx.apex import amp as apex_amp
from lightning_mpx.apex._state import AmpState, _amp_state
from tests.error_tables import Row, cases, fresh_apex_state, refused  # noqa: F401 (fresh_apex_state: autouse)
from tests.launch import ROOT, run_script

HAS_LITGPT = importlib.util.find_spec("litgpt") is not None


def _mpk(**kwargs: Any) -> Any:
    from lightning_mpx.accelerate import MixedPrecisionKwargs

    return MixedPrecisionKwargs(**kwargs)


def _accelerator(*args: Any, **kwargs: Any) -> Any:
    from lightning_mpx.accelerate import Accelerator

    return Accelerator(*args, **kwargs)


def _fsdp(name: str, *args: Any, **kwargs: Any) -> Any:
    from lightning_mpx import fsdp

    return getattr(fsdp, name)(*args, **kwargs)


# -- 1. misspelt keywords -------------------------------------------------------------------------------------------
VALID_KWARGS = r"valid choices: half_dtype, num_losses, .*, log_metrics, telemetry_every_n_steps, fsdp_gather\."
FIXED: list[Row] = [
    (
        "MixedPrecisionKwargs(init_scaler=)",
        lambda: _mpk(init_scaler=3),
        TypeError,
        rf"MixedPrecisionKwargs\(\) got an unexpected keyword argument 'init_scaler'; {VALID_KWARGS} "
        r"Did you mean init_scale=\?",
    ),
    (
        "MixedPrecisionKwargs(halfdtype=)",
        lambda: _mpk(halfdtype="bfloat16"),
        TypeError,
        r"unexpected keyword argument 'halfdtype'; valid choices: .* Did you mean half_dtype=\?",
    ),
    (
        "Accelerator(init_scaler=)",
        lambda: _accelerator(mixed_precision="O2", init_scaler=3),
        TypeError,
        r"Accelerator\(\) got an unexpected keyword argument 'init_scaler': did you mean 'init_scale'\? It is a "
        r"setting of the opt level; pass it as kwargs_handlers=\[MixedPrecisionKwargs\(init_scale=\.\.\.\)\]",
    ),
    (
        "Accelerator(half_dtype=)",
        lambda: _accelerator(mixed_precision="O2", half_dtype="bfloat16"),
        TypeError,
        r"'half_dtype' is a setting of the opt level; pass it as kwargs_handlers=\[MixedPrecisionKwargs\(half_dtype=",
    ),
    (
        "Accelerator(gradient_accumulation_step=)",
        lambda: _accelerator(mixed_precision="bf16", gradient_accumulation_step=2),
        TypeError,
        r"Accelerator\(\) got an unexpected keyword argument 'gradient_accumulation_step'; valid choices: "
        r"device_placement, .*gradient_accumulation_steps.* Did you mean gradient_accumulation_steps=\?",
    ),
    (
        "apex initialize(init_scaler=)",
        lambda: apex_amp.initialize(nn.Linear(4, 4), init_scaler=3),
        TypeError,
        r"amp\.initialize\(\) got an unexpected keyword argument 'init_scaler'; valid choices: models, optimizers, "
        r"enabled, opt_level, .*max_loss_scale\.",
    ),
    (
        "apex initialize(opt_levle=)",
        lambda: apex_amp.initialize(nn.Linear(4, 4), opt_levle="O2"),
        TypeError,
        r"'opt_levle'; valid choices: .* Did you mean opt_level=\?",
    ),
    (
        "apex init(loss_scales=)",
        lambda: apex_amp.init(loss_scales=128),
        TypeError,
        r"amp\.init\(\) got an unexpected keyword argument 'loss_scales'; valid choices: enabled, loss_scale, "
        r"enable_caching, verbose, allow_banned\. Did you mean loss_scale=\?",
    ),
    (
        "shard_model(block=)",
        lambda: _fsdp("shard_model", nn.Linear(4, 4), "O1", block=nn.Linear),
        TypeError,
        r"shard_model\(\) got an unexpected keyword argument 'block'; valid choices: module, precision, mesh, blocks, "
        r"reshard_after_forward, gather\. Did you mean blocks=\?",
    ),
    (
        "mixed_precision_policy(roles=)",
        lambda: _fsdp("mixed_precision_policy", "O1", roles="root"),
        TypeError,
        r"mixed_precision_policy\(\) got an unexpected keyword argument 'roles'; valid choices: precision, role, "
        r"gather\. Did you mean role=\?",
    ),
    (
        "fsdp1_mixed_precision(gathers=)",
        lambda: _fsdp("fsdp1_mixed_precision", "O1", gathers="half"),
        TypeError,
        r"'gathers'; valid choices: precision, gather\. Did you mean gather=\?",
    ),
    (
        "LossScaler(init_scaler=)",
        lambda: mpx.LossScaler(init_scaler=2.0),
        TypeError,
        r"LossScaler\(\) got an unexpected keyword argument 'init_scaler'; valid choices: .* "
        r"Did you mean init_scale=\?",
    ),
]

GOOD: list[Row] = [
    (
        "Amp(init_scaler=)",
        lambda: mpx.Amp("O2", init_scaler=3),
        TypeError,
        r"unknown opt-level override\(s\) 'init_scaler'; valid choices: .* Did you mean init_scale=\?",
    ),
    (
        "MixedPrecisionPlugin(init_scaler=)",
        lambda: mpx.MixedPrecisionPlugin("O2", init_scaler=3),
        TypeError,
        r"'init_scaler'; valid choices: .* Did you mean init_scale=\?",
    ),
    (
        "FabricMixedPrecisionPlugin(init_scaler=)",
        lambda: mpx.FabricMixedPrecisionPlugin("O2", init_scaler=3),
        TypeError,
        r"'init_scaler'; valid choices: .* Did you mean init_scale=\?",
    ),
    (
        "MixedPrecisionSettings.from_kwargs(init_scaler=)",
        lambda: mpx.MixedPrecisionSettings.from_kwargs("O2", init_scaler=3),
        TypeError,
        r"Did you mean init_scale=\?",
    ),
]


@cases(FIXED)
def test_a_misspelt_keyword_names_the_valid_ones(call: Callable[[], Any], error: type[Exception], pattern: str) -> None:
    refused(call, error, pattern)


@cases(GOOD)
def test_a_misspelt_keyword_already_named_stays_so(call: Callable[[], Any], error: type[Exception], pattern: str):
    refused(call, error, pattern)


def test_mixed_precision_kwargs_stays_a_plain_dataclass() -> None:
    """The keyword check wraps the dataclass's ``__init__`` only: its signature, ``replace``, copies, pickling and
    Accelerate's ``to_kwargs`` (which builds a default instance) behave as before, and the Accelerator reads it."""
    kwargs = _mpk(half_dtype="bfloat16", loss_scale="dynamic", init_scale=8.0)
    assert kwargs.to_kwargs() == {"half_dtype": "bfloat16", "loss_scale": "dynamic", "init_scale": 8.0}
    assert pickle.loads(pickle.dumps(kwargs)) == kwargs == copy.deepcopy(kwargs) == copy.copy(kwargs)
    replaced = dataclasses.replace(kwargs, growth_interval=5)
    assert replaced.to_kwargs() == {**kwargs.to_kwargs(), "growth_interval": 5}
    with pytest.raises(TypeError, match=r"'growth_intervals'.*Did you mean growth_interval=\?"):
        dataclasses.replace(kwargs, growth_intervals=5)
    parameters = inspect.signature(type(kwargs)).parameters
    assert list(parameters)[:2] == ["half_dtype", "num_losses"] and "fsdp_gather" in parameters
    assert type(kwargs)("bfloat16").half_dtype == "bfloat16"  # positional, as the dataclass takes it
    accelerator = _accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[pickle.loads(pickle.dumps(replaced))])
    assert accelerator.amp.settings.scaler.growth_interval == 5 and accelerator.amp.scalers[0].get_scale() == 8.0


# -- the sweep: wrong types, values and orders a user plausibly passes ------------------------------------------------
def _amp_run() -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    amp = mpx.Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.prepare_optimizer(optimizer)
    return amp, model, optimizer


def _clip_parameters() -> Any:
    amp, model, _ = _amp_run()
    return amp.clip_grad_norm_(model.parameters(), 1.0)  # torch's habit: clip_grad_norm_(parameters, max_norm)


def _apex_delay_unscale(value: Any) -> None:
    model, optimizer = apex_amp.initialize(*_run(), opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
    with apex_amp.scale_loss(model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum(), optimizer,
                             delay_unscale=value) as scaled:  # fmt: skip
        scaled.backward()


SWEEP_FIXED: list[Row] = [
    (
        "Amp.step(model)",
        lambda: _amp_run()[0].step(nn.Linear(4, 4)),
        TypeError,
        r"optimizer=Linear is not a torch\.optim\.Optimizer: pass the optimizer itself",
    ),  # "not registered" before
    (
        "Amp.clip_grad_norm_(model.parameters(), 1.0)",
        _clip_parameters,
        TypeError,
        r"optimizer=generator is not a torch\.optim\.Optimizer: pass the optimizer itself .*not a model or its "
        r"parameters",
    ),
    (
        "Accelerator('O2') positional",
        lambda: _accelerator("O2"),
        TypeError,
        r"Accelerator\('O2'\): the first positional argument is Accelerate's device_placement.*"
        r"Accelerator\(mixed_precision='O2'\)",
    ),  # silently no mixed precision before
    (
        "convert_module(keep_batchnorm_fp32='False')",
        lambda: mpx.convert_module(nn.BatchNorm1d(4), torch.bfloat16, keep_batchnorm_fp32="False"),
        TypeError,
        r"keep_batchnorm_fp32='False' must be True or False",
    ),  # taken as true before
    (
        "apex scale_loss(delay_unscale='False')",
        lambda: _apex_delay_unscale("False"),
        TypeError,
        r"delay_unscale='False' must be True or False",
    ),  # taken as true before: the gradients left scaled
    (
        "unscale_grads_(inv_scale=0.5)",
        lambda: mpx.unscale_grads_([torch.ones(2)], 0.5, torch.zeros(1)),
        TypeError,
        r"inv_scale=0\.5 must be a one-element FP32 torch\.Tensor",
    ),  # AttributeError 'float' ... 'device' before
    (
        "apex register_half_function('torch', 'matmul')",
        lambda: apex_amp.register_half_function("torch", "matmul"),
        TypeError,
        r"module='torch' must be the module or class that holds the function.*"
        r"amp\.register_half_function\(torch, 'matmul'\)",
    ),  # "'torch' has no attribute 'matmul'" before
    (
        "CastTable.for_device('gpu')",
        lambda: mpx.CastTable.for_device("gpu"),
        ValueError,
        r"device_type='gpu' is not a torch device type; valid choices: 'cuda', 'cpu'",
    ),  # the CPU's table before
]


@cases(SWEEP_FIXED)
def test_sweep_bad_input_is_named(call: Callable[[], Any], error: type[Exception], pattern: str) -> None:
    refused(call, error, pattern)


def test_cast_table_for_a_numbered_cuda_device_is_cudas() -> None:
    """``CastTable.for_device("cuda:0")`` (a device's ``str``) is CUDA's table (autocast's rows), not the default
    one that any other device gets (it was, silently)."""
    cuda = mpx.CastTable.for_device("cuda")
    numbered = mpx.CastTable.for_device("cuda:0")
    assert cuda.autocast_differences("cuda") == numbered.autocast_differences("cuda") == {}
    assert mpx.CastTable.for_device("cpu").autocast_differences("cuda") != {}


# -- 2. the litgpt command line ---------------------------------------------------------------------------------------
LITGPT_CLI = [
    # (argv with {tmp} for a folder, pattern of argparse's error on stderr); exit status 2, no traceback. FIXED.
    (
        ["finetune_full", "ckpt", "--resume", "true"],
        r"error: --resume true with --opt_level O2: litgpt's finetune/full\.py main loads the optimizer's state before "
        r"the plugin meets the optimizer .*; resume with --opt_level O1, or write the loop by hand",
    ),
    (["finetune_full", "ckpt", "--opt_level", "O2", "--resume", "auto"], r"error: --resume auto with --opt_level O2"),
    (
        ["pretrain", "pythia-14m", "--resume", "auto", "--out_dir", "{tmp}/run"],
        r"error: --resume auto with --opt_level O2: litgpt's pretrain\.py main loads",
    ),
    (
        ["pretrain", "pythia-14m", "--resume", "{tmp}/run/step-00000004/lit_model.pth"],
        r"error: --resume \S+/run/step-00000004/lit_model\.pth with --opt_level O2",
    ),
    (
        ["pretrain", "pythia-14m", "--opt_level", "O1", "--resume", "true", "--out_dir", "{tmp}/empty"],
        r"error: --resume true: no checkpoint \(step-\*/\*\.pth\) in --out_dir \S+/empty; pass the --out_dir of the "
        r"run to resume, or --resume auto",
    ),
    (
        ["finetune_lora", "ckpt", "--mpx_kwargs", '{"half_dtyp": "bf16"}'],
        r"error: argument --mpx_kwargs/--mpx-kwargs: \{\"half_dtyp\": \"bf16\"\}: unknown opt-level override\(s\) "
        r"'half_dtyp'; valid choices: .* Did you mean half_dtype=\?",
    ),
    (
        ["finetune_full", "ckpt", "--opt_level", "O1", "--mpx_kwargs", '{"half_dtype": "fp8"}'],
        r"error: argument --mpx_kwargs/--mpx-kwargs: .*half_dtype='fp8' is not a half-precision dtype; valid choices",
    ),
]


@pytest.mark.skipif(not HAS_LITGPT, reason="litgpt is not installed (.ci/other_torch's venvs)")
@pytest.mark.parametrize(("argv", "pattern"), LITGPT_CLI, ids=[" ".join(c[0][:4]) for c in LITGPT_CLI])
def test_litgpt_command_line_refuses_resume_and_plugin_keywords_with_argparse_errors(argv, pattern, tmp_path, capsys):
    from lightning_mpx.litgpt import main

    checkpoint = tmp_path / "run" / "step-00000004" / "lit_model.pth"  # what litgpt's find_resume_path looks for
    checkpoint.parent.mkdir(parents=True)
    checkpoint.touch()
    with pytest.raises(SystemExit) as exited:
        main([arg.replace("{tmp}", str(tmp_path)) for arg in argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and re.search(pattern, err) and "Traceback" not in err, err
    assert not Path("ckpt").exists() and not (tmp_path / "empty").exists()


@pytest.mark.skipif(not HAS_LITGPT, reason="litgpt is not installed (.ci/other_torch's venvs)")
def test_litgpt_python_api_still_raises_value_error_for_resume_at_o2(tmp_path) -> None:
    """The Python entry point keeps its ``ValueError`` (a caller catches it); only the command line speaks flags."""
    from lightning_mpx.litgpt import finetune_full

    with pytest.raises(ValueError, match=r"resume='auto' at O2: litgpt's finetune/full\.py main loads"):
        finetune_full("ckpt", resume="auto", out_dir=tmp_path / "out")


# -- 3. Apex's initialize checks before it touches _amp_state ---------------------------------------------------------
def _canon(value: Any) -> Any:
    """A comparable picture of ``value``: containers by content, objects by identity."""
    if isinstance(value, (weakref.WeakKeyDictionary, weakref.WeakValueDictionary, dict)):
        return {(k if isinstance(k, (int, str)) else id(k)): _canon(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return id(value)


def _snapshot() -> dict[str, Any]:
    """``_amp_state`` field by field, the loss scalers' states of every engine it knows, the torch-function mode
    stack (O1's scope) and the hooks on the models."""
    state = {f.name: _canon(getattr(_amp_state, f.name)) for f in dataclasses.fields(AmpState)}
    engines = {id(w._engine): w._engine for w in _amp_state.optimizers.values()}
    state["scalers"] = {key: [s.state_dict() for s in engine.scalers] for key, engine in engines.items()}
    state["modes"] = [id(mode) for mode in torch.overrides._get_current_function_mode_stack()]
    state["hooked"] = {id(m): (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in _amp_state.hooks.keys()}
    return state


BAD_INITIALIZE: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("enabled='yes'", {"enabled": "yes"}, TypeError, r"enabled='yes' must be True or False"),
    ("verbosity='1'", {"verbosity": "1"}, TypeError, r"verbosity='1' must be an integer"),
    ("verbosity=True", {"verbosity": True}, TypeError, r"verbosity=True must be an integer"),
    (
        "cast_model_outputs=int8",
        {"cast_model_outputs": torch.int8},
        ValueError,
        r"cast_model_outputs=torch\.int8 is not valid; valid choices",
    ),
    ("cast_model_type='fp8'", {"cast_model_type": "fp8"}, ValueError, r"cast_model_type='fp8' is not valid"),
    (
        "keep_batchnorm_fp32='maybe'",
        {"keep_batchnorm_fp32": "maybe"},
        ValueError,
        r"keep_batchnorm_fp32='maybe' is not valid",
    ),
    ("loss_scale='dyn'", {"loss_scale": "dyn"}, ValueError, r"loss_scale='dyn' is not valid"),
    ("loss_scale=-1", {"loss_scale": -1}, ValueError, r"loss_scale=-1 must be a positive finite number"),
    ("opt_level='O5'", {"opt_level": "O5"}, ValueError, r"opt_level='O5' is not an opt level"),
    ("num_losses=0", {"num_losses": 0}, ValueError, r"num_losses=0"),
    ("min_loss_scale=-1", {"min_loss_scale": -1.0}, ValueError, r"min_loss_scale=-1\.0"),
    ("max_loss_scale=0", {"max_loss_scale": 0}, ValueError, r"max_loss_scale=0"),
    ("master_weights='yes'", {"master_weights": "yes"}, TypeError, r"master_weights='yes'"),
]


def _run() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_failed_initialize_leaves_the_earlier_call_exactly_as_it_was() -> None:
    """An O1 run (its cast scope entered, its scale set to 4): each bad call, given the run's own model and optimizer
    again (a script retrying with a fix) or new ones, raises its error and leaves ``_amp_state``, the run's scale,
    hooks and scope as they were. Before, ``enabled``/``verbosity`` were checked after the earlier call's scope was
    left and its hooks and wrappers dropped, and a bad scaler setting after the earlier engines' scales were reset."""
    model, optimizer = _run()
    model, optimizer = apex_amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    _amp_state.loss_scalers[0]._loss_scale = 4.0
    before = _snapshot()
    for _, kwargs, error, pattern in BAD_INITIALIZE:
        for again in (True, False):
            target = (model, optimizer.optimizer) if again else _run()
            with pytest.raises(error, match=pattern):
                apex_amp.initialize(*target, **{"opt_level": "O2", "verbosity": 0, **kwargs})
            assert _snapshot() == before, (kwargs, again)
    with pytest.raises(ValueError, match="an optimizer returned by a previous amp.initialize"):
        apex_amp.initialize(model, optimizer, opt_level="O2")
    with pytest.raises(ValueError, match=r"loss_scale='dyn' is not valid"):
        apex_amp.init(loss_scale="dyn")
    assert _snapshot() == before and _amp_state.loss_scalers[0].loss_scale() == 4.0
    x = torch.randn(2, 4)
    assert (x @ x.T).dtype == torch.float16  # the run's O1 scope is still entered on this thread
    with apex_amp.scale_loss(model(x).float().sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()  # the run goes on with its own engine and scale
    assert model.weight.grad is not None and _amp_state.loss_scalers[0].loss_scale() == 4.0


def _train(model: nn.Module, optimizer: Any) -> tuple[list[torch.Tensor], float]:
    """Three Apex iterations, the second overflowing (skipped, the scale backs off)."""
    for step in range(3):
        x = (
            torch.full((2, 4), float("inf"))
            if step == 1
            else torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        )
        with apex_amp.scale_loss(model(x.half()).float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
    masters = [p.detach().clone() for p in apex_amp.master_params(optimizer)]
    return masters, _amp_state.loss_scalers[0].loss_scale()


@pytest.mark.parametrize("bad", [b[1] for b in BAD_INITIALIZE[:4] + BAD_INITIALIZE[-4:]],
                         ids=[b[0] for b in BAD_INITIALIZE[:4] + BAD_INITIALIZE[-4:]])  # fmt: skip
def test_a_correct_initialize_after_a_failed_one_behaves_as_a_first_one(bad: dict[str, Any]) -> None:
    """From a fresh state: a failed call leaves ``_amp_state`` as a new one, and the correct call after it trains
    (O2, float16, dynamic scale, one overflow) exactly as a first call does."""
    first = _train(*apex_amp.initialize(*_run(), opt_level="O2", verbosity=0))
    _amp_state.reset()
    fresh = _snapshot()
    model, optimizer = _run()
    with pytest.raises((TypeError, ValueError)):
        apex_amp.initialize(model, optimizer, **{"opt_level": "O2", "verbosity": 0, **bad})
    assert _snapshot() == fresh and model.weight.dtype == torch.float32
    masters, scale = _train(*apex_amp.initialize(model, optimizer, opt_level="O2", verbosity=0))
    assert scale == first[1] == 2.0**15
    for got, want in zip(masters, first[0]):
        assert torch.equal(got, want)


# -- 4. .ci/other_torch's pins ----------------------------------------------------------------------------------------
def test_other_torch_pins_the_dev_extras_versions_and_the_torch_asked() -> None:
    """``.ci/dev_pins.py`` (what ``.ci/other_torch`` passes to pip with ``-c``): the asked torch, and every package
    the dev extra resolved here at its installed version (transformers 5.3.0 here, not the newest), through their own
    requirements; never what a torch wheel pins for itself, nor a package named to leave unpinned. (.ci/dev_pins.py
    reads them with packaging, which pytest itself requires.)"""
    run = subprocess.run([sys.executable, str(ROOT / ".ci" / "dev_pins.py"), "2.11.0", "numpy"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stdout.split()
    pins = dict(line.split("==") for line in lines)
    assert lines[0] == "torch==2.11.0" and len(pins) == len(lines)
    for name in ("pytest", "hypothesis", "lightning", "accelerate", "transformers", "peft", "huggingface-hub"):
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not resolved here: not pinned
        assert pins.get(name) == installed, (name, pins.get(name), installed)
    for name, version in pins.items():
        if name != "torch":
            assert importlib.metadata.version(name) == version, name
    assert not {"triton", "setuptools", "numpy"} & set(pins) and not any(n.startswith("nvidia-") for n in pins)


# -- 5. a failed launch quotes each rank's first error ----------------------------------------------------------------
def test_a_failed_launch_shows_each_ranks_first_error_and_end_bounded(tmp_path) -> None:
    """Rank 1 raises early, prints 2000 lines, then fails again; rank 0 ends cleanly. The failure names both errors
    of rank 1 and rank 0's short stderr, in a bounded message (before: the last 8000 characters of the interleaved
    stderr, so rank 1's first error was cut off)."""
    with pytest.raises(AssertionError) as failed:
        run_script("core_failing_launch_script.py", tmp_path, timeout=120)
    message = str(failed.value)
    assert "core_failing_launch_script.py: exit code 1" in message
    assert "rank 1: a warning before anything fails" in message  # the start of its stderr
    assert "ValueError: the first error of rank 1 (cut off before)" in message
    assert "RuntimeError: the last error of rank 1" in message
    assert "rank 0's stderr (" in message and "rank 0: done" in message
    assert re.search(r"\[\.\.\. \d+ characters left out \.\.\.\]", message)
    assert len(message) < 12_000, len(message)
