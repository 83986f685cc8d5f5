"""Bad input and misuse on the entry points that arrived since stop 54's audit (tests/test_core_bad_input.py): the
litgpt entry points and their command line, the HF Trainer mixin, ``plugin.scaler``, the plugins' keywords, the
Accelerate adapter's handlers and the Apex layer (stop 62). Each answers with an error that names the argument (or the
calls), the value and what is valid: never a bare AttributeError/KeyError/AssertionError from inside, never silent
acceptance.

``FIXED`` were answered by a bare error before this stop; ``GOOD`` were already right and are held so.
"""

from __future__ import annotations

import importlib.util
import math
import re
from typing import Any, Callable

import pytest
import torch
from torch import nn

import lightning_mpx as mpx
from lightning_mpx.apex import amp as apex_amp
from lightning_mpx.apex._state import _amp_state
from tests.error_tables import Row, cases, fresh_apex_state, refused  # noqa: F401 (fresh_apex_state: autouse)

BF16 = {"half_dtype": "bfloat16"}
PLUGINS = {"Trainer": mpx.MixedPrecisionPlugin, "Fabric": mpx.FabricMixedPrecisionPlugin}


def _linear() -> nn.Module:
    return nn.Linear(4, 4)


def _sgd(module: nn.Module | None = None) -> torch.optim.Optimizer:
    return torch.optim.SGD((module or _linear()).parameters(), lr=0.1)


def _apex_load(state: Any) -> None:
    apex_amp.initialize(_linear(), _sgd(), opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
    apex_amp.load_state_dict(state)


def _apex_scale_loss_of_another_optimizer() -> None:
    model, _ = apex_amp.initialize(_linear(), _sgd(), opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
    with apex_amp.scale_loss(model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum(), _sgd(model)):
        pass


def _accelerator(**kwargs: Any) -> Any:
    from lightning_mpx.accelerate import Accelerator

    return Accelerator(**kwargs)


def _mpk(**kwargs: Any) -> Any:
    from lightning_mpx.integrations.accelerate import MixedPrecisionKwargs

    return MixedPrecisionKwargs(**kwargs)


def _scaler_call(door: str, name: str, *args: Any) -> Any:
    scaler = PLUGINS[door]("O2", half_dtype="float16").scaler  # dynamic: a view (None for a static scale)
    return getattr(scaler, name)(*args)


def _litgpt(entry: str, *args: Any, **kwargs: Any) -> Any:
    if importlib.util.find_spec("litgpt") is None:
        pytest.skip("litgpt is not installed (.ci/other_torch's venvs): the entry points import it before they check")
    from lightning_mpx import litgpt

    return getattr(litgpt, entry)(*args, **kwargs)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, labels: Any = None) -> dict[str, torch.Tensor]:
        return {"loss": self.linear(x).sum()}


def _hf_trainer(*, opt_level: Any = "O2", mpx_kwargs: Any = None, **args: Any) -> Any:
    from transformers import TrainingArguments

    from lightning_mpx.integrations.hf_trainer import mpx_trainer

    # A folder under the test's tmp_path (the working directory, _in_tmp_path): a tempfile.mkdtemp() here was left in
    # /tmp by every run.
    targs = TrainingArguments("hf-trainer", use_cpu=True, report_to=[], **args)
    kwargs = _mpk(**BF16) if mpx_kwargs is None else mpx_kwargs
    return mpx_trainer()(model=_Model(), args=targs, opt_level=opt_level, mpx_kwargs=kwargs)


FIXED: list[Row] = [
    ("apex load_state_dict({'loss_scaler0': {}})", lambda: _apex_load({"loss_scaler0": {}}), ValueError,
     r"state\['loss_scaler0'\]=\{\} is not an Apex loss scaler's entry; valid: a dict \{'loss_scale'.*'unskipped'"),
    ("apex load_state_dict({'loss_scaler0': 3})", lambda: _apex_load({"loss_scaler0": 3}), ValueError,
     r"state\['loss_scaler0'\]=3 is not an Apex loss scaler's entry"),
    ("apex load_state_dict(loss_scale='x')", lambda: _apex_load({"loss_scaler0": {"loss_scale": "x", "unskipped": 0}}),
     ValueError, r"state\['loss_scaler0'\]=\{'loss_scale': 'x'.* is not an Apex loss scaler's entry"),
    ("apex load_state_dict(loss_scaler1 of num_losses=1)",
     lambda: _apex_load({"loss_scaler1": {"loss_scale": 1.0, "unskipped": 0}}), ValueError,
     r"state has keys \['loss_scaler1'\]; valid keys: loss_scaler0 to loss_scaler0 \(num_losses=1\)"),
    ("Accelerator(kwargs_handlers=[dict])", lambda: _accelerator(mixed_precision="O2", kwargs_handlers=[BF16]),
     TypeError, r"kwargs_handlers holds \{'half_dtype': 'bfloat16'\} \(dict\); valid choices: lightning_mpx's "
     r"MixedPrecisionKwargs\(\.\.\.\) or one of Accelerate's handlers.*MixedPrecisionKwargs\(\*\*d\)"),
    ("Accelerator('bf16', kwargs_handlers=[3])", lambda: _accelerator(mixed_precision="bf16", kwargs_handlers=[3]),
     TypeError, r"kwargs_handlers holds 3 \(int\); valid choices"),
    ("Trainer plugin.scaler.set_growth_factor", lambda: _scaler_call("Trainer", "set_growth_factor", 4.0),
     RuntimeError, r"plugin\.scaler\.set_growth_factor\(\) was called, but plugin\.scaler is a read-only view.*"
     r"pass it to the plugin, MixedPrecisionPlugin\(opt_level, growth_factor=\.\.\.\)"),
    ("Trainer plugin.scaler.set_backoff_factor", lambda: _scaler_call("Trainer", "set_backoff_factor", 0.25),
     RuntimeError, r"set_backoff_factor\(\).*MixedPrecisionPlugin\(opt_level, backoff_factor=\.\.\.\)"),
    ("Fabric plugin.scaler.set_growth_interval", lambda: _scaler_call("Fabric", "set_growth_interval", 10),
     RuntimeError, r"set_growth_interval\(\).*FabricMixedPrecisionPlugin\(opt_level, growth_interval=\.\.\.\)"),
    ("finetune_lora(mpx_kwargs=list)", lambda: _litgpt("finetune_lora", "ckpt", mpx_kwargs=["x"]), TypeError,
     r"mpx_kwargs=\['x'\] must be a dict of FabricMixedPrecisionPlugin's keywords or None"),
    ("pretrain(mpx_kwargs=JSON text)", lambda: _litgpt("pretrain", "pythia-14m", mpx_kwargs='{"half_dtype": "bf16"}'),
     TypeError, r"mpx_kwargs='\{\"half_dtype\": \"bf16\"\}' must be a dict"),
]

GOOD: list[Row] = [
    ("finetune_lora(opt_level='O5')", lambda: _litgpt("finetune_lora", "ckpt", opt_level="O5"), ValueError,
     r"opt_level='O5' is not an opt level; valid choices: 'O0', 'O1', 'O2', 'O3'"),
    ("finetune_full(precision=)", lambda: _litgpt("finetune_full", "ckpt", precision="bf16-true"), ValueError,
     r"precision='bf16-true' with an opt level.*pass opt_level= \(and mpx_kwargs=\) instead of precision="),
    ("pretrain(precision=)", lambda: _litgpt("pretrain", "pythia-14m", precision="16-mixed"), ValueError,
     r"precision='16-mixed' with an opt level"),
    ("pretrain(no model)", lambda: _litgpt("pretrain"), ValueError, r"model_name=None and model_config=None"),
    ("finetune_full(bogus=)", lambda: _litgpt("finetune_full", "ckpt", bogus=1), TypeError,
     r"unexpected keyword argument 'bogus': it takes litgpt\.finetune\.full\.setup's arguments"),
    ("HF mixin opt_level='O5'", lambda: _hf_trainer(opt_level="O5"), ValueError, r"opt_level='O5' is not an opt level"),
    ("HF mixin TrainingArguments(bf16=True)", lambda: _hf_trainer(bf16=True), ValueError,
     r"TrainingArguments\(bf16=True\) turns on the Trainer's own mixed precision, and opt_level='O2'.*use one"),
    ("HF mixin TrainingArguments(fp16=True)", lambda: _hf_trainer(fp16=True), ValueError,
     r"TrainingArguments\(fp16=True\) turns on"),
    ("HF mixin mpx_kwargs=dict", lambda: _hf_trainer(mpx_kwargs=BF16),
     TypeError, r"mpx_kwargs=dict is not a MixedPrecisionKwargs.*MixedPrecisionKwargs\(\*\*d\)"),
    ("MixedPrecisionKwargs(half_dtype='fp8')", lambda: _mpk(half_dtype="fp8"), ValueError,
     r"half_dtype='fp8' is not a half-precision dtype; valid choices: 'float16'"),
    ("Accelerator(mixed_precision='O5')", lambda: _accelerator(mixed_precision="O5"), ValueError,
     r"mixed_precision='O5' is not valid; valid choices: Accelerate's 'no'.*'O2', 'O3'"),
    ("Fabric plugin.scaler.update", lambda: _scaler_call("Fabric", "update", 2.0), RuntimeError,
     r"plugin\.scaler\.update\(\) was called.*updates the scale once per iteration"),
    ("Trainer plugin.scaler.load_state_dict", lambda: _scaler_call("Trainer", "load_state_dict", {}), RuntimeError,
     r"load_state_dict\(\) was called.*trainer\.fit\(model, ckpt_path=\.\.\.\) restores it"),
    ("Trainer plugin.scaler.unscale_", lambda: _scaler_call("Trainer", "unscale_", _sgd()), RuntimeError,
     r"unscale_\(\) was called.*unscales the gradients once at each optimizer step"),
    ("Amp.prepare_model(keep_frozen_fp32='yes')",
     lambda: mpx.Amp("O2", **BF16).prepare_model(_linear(), keep_frozen_fp32="yes"), TypeError,
     r"keep_frozen_fp32='yes' must be True or False"),
    ("apex initialize(loss_scale=-1)", lambda: apex_amp.initialize(_linear(), opt_level="O2", loss_scale=-1),
     ValueError, r"loss_scale=-1 must be a positive finite number; valid choices: 'dynamic'"),
    ("apex initialize(loss_scale=0)", lambda: apex_amp.initialize(_linear(), opt_level="O2", loss_scale=0),
     ValueError, r"loss_scale=0 must be a positive finite number"),
    ("apex initialize(loss_scale='dyn')", lambda: apex_amp.initialize(_linear(), opt_level="O2", loss_scale="dyn"),
     ValueError, r"loss_scale='dyn' is not valid; valid choices: 'dynamic' or a positive number"),
    ("apex initialize(cast_model_type='fp8')",
     lambda: apex_amp.initialize(_linear(), opt_level="O2", cast_model_type="fp8"), ValueError,
     r"cast_model_type='fp8' is not valid with half_dtype=torch\.float16; valid choices"),
    ("apex scale_loss(optimizer not initialized)", _apex_scale_loss_of_another_optimizer, ValueError,
     r"optimizers=SGD .* was not passed to amp\.initialize\(\)"),
    ("apex load_state_dict(GradScaler state)", lambda: _apex_load(torch.amp.GradScaler("cpu").state_dict()),
     ValueError, r"state has unexpected keys \['_growth_tracker'.*valid keys: loss_scaler0 to loss_scaler0"),
]

# Every keyword of the Trainer and Fabric plugins: a wrong type, a wrong value, None where not allowed, a string for a
# number. Each answer names the keyword and the value (and what is valid).
_BAD_KEYWORDS: dict[str, list[Any]] = {
    "half_dtype": ["fp8", torch.float32], "num_losses": [0, "2", None, 1.5], "allow_banned": ["yes", None],
    "unscale_backend": ["cuda", None], "overflow_log_interval": [-1, "10", None], "model_writes": ["nope", None],
    "diagnose_overflows": ["no", None], "fp32_modules": [3, None, ["lm_head", 3]], "skip_on_device": ["True", 1],
    "init_scale": ["1024", 0, None, math.inf], "growth_factor": ["2", 0.5, None], "backoff_factor": ["0.5", 1, None],
    "growth_interval": ["10", 0, None, True], "hysteresis": [0, "2", None], "consecutive_hysteresis": ["yes", None],
    "min_loss_scale": [-1, "1", math.nan], "max_loss_scale": [0, "1", None], "on_floor": ["bad", None],
    "cast_model_type": ["fp8", torch.float64], "patch_torch_functions": ["yes", 1], "keep_batchnorm_fp32": ["False", 1],
    "master_weights": ["yes", 1], "loss_scale": ["dyn", -1, "1024", math.inf, True], "cast_table": ["default"],
}
KEYWORDS = [(door, name, value) for door in PLUGINS for name, values in _BAD_KEYWORDS.items() for value in values]


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Each test runs in its tmp_path: the HF Trainer's ``output_dir`` (``"hf-trainer"``) is relative to it."""
    monkeypatch.chdir(tmp_path)


@cases(FIXED)
def test_bad_input_fixed_this_stop_is_named(call: Callable[[], Any], error: type[Exception], pattern: str) -> None:
    refused(call, error, pattern)


@cases(GOOD)
def test_bad_input_already_named_stays_so(call: Callable[[], Any], error: type[Exception], pattern: str) -> None:
    refused(call, error, pattern)


def test_every_plugin_keyword_names_a_bad_value() -> None:
    """One test for the whole matrix (each plugin is cheap to build): every refusal is a ValueError/TypeError naming
    ``keyword=value``."""
    for door, name, value in KEYWORDS:
        with pytest.raises((ValueError, TypeError)) as caught:
            PLUGINS[door]("O2", **{**BF16, name: value})
        message = str(caught.value)
        shown = f"{name}={value!r}" if not isinstance(value, list) else f"{name} holds 3"
        named = shown in message or f"{name}={type(value).__name__}" in message
        assert named and re.search(r"must|not valid|valid choices|is not a", message), (door, name, value, message)


LITGPT_CLI = [
    # (argv, pattern of argparse's error on stderr); exit status 2, no traceback
    (["finetune_loraa", "ckpt"], r"argument command: invalid choice: 'finetune_loraa'"),  # GOOD
    (["finetune_lora", "ckpt", "--opt_level", "O5"],
     r"argument --opt_level/--opt-level: opt_level='O5' is not an opt level; valid choices: 'O0'"),  # FIXED
    (["pretrain", "pythia-14m", "--opt_level", "o2"], r"opt_level='o2' is not an opt level.*did you mean 'O2'\?"),
    (["finetune_lora", "ckpt", "--precision", "bf16-true"],
     r"error: --precision bf16-true with --opt_level O2: the opt level sets the precision; drop --precision "
     r"\(set the half dtype with --mpx_kwargs"),  # FIXED (a traceback naming precision= before)
    (["finetune_full", "ckpt", "--opt_level", "O1", "--precision", "16-mixed"],
     r"error: --precision 16-mixed with --opt_level O1"),
    (["finetune_lora", "ckpt", "--quantize", "bnb.nf4"], r"error: --quantize bnb\.nf4 with --opt_level O2.*drop "
     r"--quantize, or run litgpt's own `litgpt finetune_lora --quantize` without --opt_level"),
    (["finetune_lora", "ckpt", "--mpx_kwargs", "[1]"], r"'\[1\]' is a JSON list, not an object"),  # GOOD
]


@pytest.mark.parametrize(("argv", "pattern"), LITGPT_CLI, ids=[" ".join(c[0]) for c in LITGPT_CLI])
def test_litgpt_command_line_refuses_with_argparse_errors(argv: list[str], pattern: str, capsys) -> None:
    from lightning_mpx.litgpt import main

    if ("--precision" in argv or "--quantize" in argv) and importlib.util.find_spec("litgpt") is None:
        pytest.skip("litgpt is not installed (.ci/other_torch's venvs): these refusals come after main imports it")
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and re.search(pattern, err) and "Traceback" not in err, err


def test_apex_cast_model_type_by_name_is_that_dtype() -> None:
    """``cast_model_type="bfloat16"`` (or ``"bf16"``) is ``torch.bfloat16``: a bfloat16 model and its static scale
    (a ValueError before, whose valid choices named float16 only)."""
    results = []
    for cast in (torch.bfloat16, "bfloat16", "bf16"):
        _amp_state.reset()
        model, _ = apex_amp.initialize(_linear(), _sgd(), opt_level="O2", cast_model_type=cast, verbosity=0)
        results.append((model.weight.dtype, _amp_state.amp.properties))
    assert results[0][0] == torch.bfloat16 and results[1] == results[0] and results[2] == results[0]


@pytest.mark.parametrize("half_dtype", ["bfloat16", None])
def test_fabric_plugin_repr_shows_half_dtype_as_the_trainer_plugins(half_dtype: str | None) -> None:
    trainer = repr(mpx.MixedPrecisionPlugin("O2", half_dtype=half_dtype))
    fabric = repr(mpx.FabricMixedPrecisionPlugin("O2", half_dtype=half_dtype))
    assert fabric == f"FabricMixedPrecisionPlugin('O2', half_dtype={half_dtype!r})" == f"Fabric{trainer}"


def test_demo_progress_bar_counts_its_epochs(tmp_path, capsys) -> None:
    """``lightning-mpx demo``'s progress bar said "Epoch 0/-2": Lightning's ``max_epochs`` is -1 (no limit) for a
    ``max_steps`` run unless given; the demo gives the epochs its steps take."""
    from lightning_mpx.cli import main

    tiny = ["--steps", "3", "--dim", "16", "--layers", "1", "--batch-size", "4", "--seq-len", "16"]
    assert main(["demo", *tiny, "--half-dtype", "bfloat16", "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr()
    bars = set(re.findall(r"Epoch -?\d+/-?\d+", out.out + out.err))
    assert bars == {"Epoch 0/0"}, bars
