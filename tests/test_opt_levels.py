"""Opt-level presets, overrides and their validation."""

import pytest
import torch

from lightning_mpx import DESCRIPTIONS, OPT_LEVELS, resolve_properties

# (opt level, half dtype) -> expected fields: Apex's presets, with bfloat16 defaulting to a static scale of 1.0.
PRESETS = [
    ("O0", "float16", torch.float32, False, None, False, 1.0),
    ("O1", "float16", None, True, None, False, "dynamic"),
    ("O2", "float16", torch.float16, False, True, True, "dynamic"),
    ("O3", "float16", torch.float16, False, False, False, 1.0),
    ("O0", "bfloat16", torch.float32, False, None, False, 1.0),
    ("O1", "bfloat16", None, True, None, False, 1.0),
    ("O2", "bfloat16", torch.bfloat16, False, True, True, 1.0),
    ("O3", "bfloat16", torch.bfloat16, False, False, False, 1.0),
]


@pytest.mark.parametrize(
    "level,half,cast,patch,keep_bn,masters,scale", PRESETS, ids=[f"{p[0]}-{p[1]}" for p in PRESETS]
)
def test_presets_have_apex_semantics(level, half, cast, patch, keep_bn, masters, scale):
    props = resolve_properties(level, half_dtype=half)
    assert props.opt_level == level
    assert props.cast_model_type == cast
    assert props.patch_torch_functions is patch
    assert props.keep_batchnorm_fp32 == keep_bn
    assert props.master_weights is masters
    assert props.loss_scale == scale
    assert props.half_dtype == getattr(torch, half)


def test_each_preset_has_a_one_line_description():
    for level in OPT_LEVELS:
        text = resolve_properties(level).description
        assert text.startswith(DESCRIPTIONS[level]) and text and "\n" not in text
        assert ("Half dtype: float16." in text) is (level != "O0") and "Overrides" not in text


def test_properties_are_frozen():
    props = resolve_properties("O2")
    with pytest.raises(AttributeError):
        props.loss_scale = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "level,overrides,field,value",
    [
        ("O2", {"keep_batchnorm_fp32": False}, "keep_batchnorm_fp32", False),
        ("O2", {"loss_scale": 128.0}, "loss_scale", 128.0),
        ("O2", {"master_weights": False}, "master_weights", False),
        ("O3", {"loss_scale": "dynamic"}, "loss_scale", "dynamic"),
        ("O3", {"keep_batchnorm_fp32": True}, "keep_batchnorm_fp32", True),
        ("O1", {"loss_scale": 512}, "loss_scale", 512),
        ("O0", {"patch_torch_functions": True, "cast_model_type": None}, "patch_torch_functions", True),
        ("O2", {"cast_model_type": "half"}, "cast_model_type", torch.float16),
    ],
)
def test_valid_overrides_apply(level, overrides, field, value):
    assert getattr(resolve_properties(level, **overrides), field) == value


def test_bfloat16_scale_can_still_be_dynamic_when_asked():
    assert resolve_properties("O1", half_dtype="bf16", loss_scale="dynamic").loss_scale == "dynamic"


@pytest.mark.parametrize(
    "value,expected",
    [
        ("O4", r"opt_level='O4' is not an opt level; valid choices: 'O0', 'O1', 'O2', 'O3'"),
        ("o1", r"opt_level='o1'.*valid choices: 'O0', 'O1', 'O2', 'O3'.*capital letter O.*'O1'"),
        ("01", r"opt_level='01'.*valid choices.*The prefix is the letter O, not the digit zero.*'O1'"),
        ("", r"opt_level=''.*valid choices"),
        (1, r"opt_level=1.*valid choices"),
    ],
)
def test_bad_opt_level_messages(value, expected):
    with pytest.raises(ValueError, match=expected):
        resolve_properties(value)


@pytest.mark.parametrize("value", ["float8", "fp32", "float32", "int8", torch.float32])
def test_unknown_half_dtype_is_refused_with_choices(value):
    with pytest.raises(ValueError, match=r"half_dtype=.*valid choices: .*'float16'.*'bfloat16'"):
        resolve_properties("O1", half_dtype=value)


@pytest.mark.parametrize("value", [0, 0.0, -1.0, -128, float("inf"), float("nan"), "dynamc", True])
def test_bad_loss_scale_is_refused(value):
    with pytest.raises(ValueError, match=r"loss_scale=.*(valid choices|positive)"):
        resolve_properties("O2", loss_scale=value)


@pytest.mark.parametrize(
    "level,overrides,why",
    [
        ("O1", {"master_weights": True}, r"master_weights=True needs a model cast to half"),
        ("O0", {"master_weights": True}, r"master_weights=True needs a model cast to half"),
        ("O1", {"keep_batchnorm_fp32": True}, r"keep_batchnorm_fp32=True only applies when the model is cast.*FP32"),
        ("O0", {"keep_batchnorm_fp32": False}, r"keep_batchnorm_fp32=False only applies"),
        ("O2", {"cast_model_type": torch.float32}, r"master_weights=True needs a model cast to half"),
    ],
)
def test_inconsistent_overrides_are_refused_with_a_reason(level, overrides, why):
    with pytest.raises(ValueError, match=why):
        resolve_properties(level, **overrides)


def test_cast_model_type_must_match_half_dtype():
    with pytest.raises(ValueError, match=r"cast_model_type=torch.float16 is not valid with half_dtype=torch.bfloat16"):
        resolve_properties("O2", half_dtype="bfloat16", cast_model_type=torch.float16)


def test_unknown_override_lists_valid_names():
    with pytest.raises(TypeError, match=r"'keep_bn_fp32'.*valid choices: cast_model_type, patch_torch_functions"):
        resolve_properties("O2", keep_bn_fp32=True)


def test_non_bool_flags_are_refused():
    with pytest.raises(TypeError, match=r"master_weights='yes' must be True or False"):
        resolve_properties("O2", master_weights="yes")


def test_loss_scale_beyond_fp32_range_is_refused():
    with pytest.raises(ValueError, match=r"loss_scale=1e\+39 must be a positive finite number"):
        resolve_properties("O1", loss_scale=1e39)


def test_description_states_the_loss_scaling_in_use():
    assert "dynamic loss scaling" in resolve_properties("O1").description
    bf16 = resolve_properties("O1", half_dtype="bfloat16").description
    assert "static loss scale 1.0" in bf16 and "dynamic" not in bf16
    assert "static loss scale 128.0" in resolve_properties("O2", loss_scale=128.0).description
    assert "dynamic loss scaling" in resolve_properties("O3", loss_scale="dynamic").description


def test_description_names_the_half_dtype_and_the_overrides():
    # What a run prints as its settings (examples/train_core.py, accelerate_train.py) is what the run does.
    text = resolve_properties("O2", half_dtype="bfloat16", keep_batchnorm_fp32=False, loss_scale="dynamic").description
    assert "dynamic loss scaling" in text and "Half dtype: bfloat16." in text
    assert text.endswith("Overrides: keep_batchnorm_fp32=False.")
    o1 = resolve_properties("O1", half_dtype="bf16", patch_torch_functions=False).description
    assert "Half dtype: bfloat16." in o1 and "Overrides: patch_torch_functions=False." in o1
    assert "Half dtype" not in resolve_properties("O0", half_dtype="bfloat16").description
