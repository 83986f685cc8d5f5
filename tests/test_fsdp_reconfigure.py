"""``shard_model`` called again on a model it sharded: Lightning calls ``configure_model`` at every stage, so the
README's FSDP2 pattern (``configure_model`` calling ``shard_model``) runs it once per ``fit``/``validate``/``test``.

Through a real Trainer with ``ModelParallelStrategy`` on two CPU processes (gloo, ``tests/fsdp_reconfigure_script.py``):
``fit`` then ``test`` and ``validate`` then ``fit``; in the same launch, the Trainer runs of
tests/test_hostile_root_gathered.py's subject (FSDP's default for the root, kept gathered after an evaluation); and in
one process (a gloo group of one) the arguments that conflict with the first call, each refused by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_mpx import MixedPrecisionSettings
from lightning_mpx.integrations.fsdp import mixed_precision_policy, shard_model
from tests.fsdp_reconfigure_script import GATHERED, STEPS, Block, Model, file_prefix
from tests.launch import one_process_group, rank_results, run_script

CASES = ["O2:fit_test", "O2:validate_fit"]
#: The root-kept-gathered runs (tests/hostile_root_gathered_script.py), in the same launch.
GATHERED_CASES = ["O2:val_each_epoch", "O2:fit_fit", "O2:predict_fit", "O2:resume", "O1:fit_fit", "O1:resume"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One two-process launch for the reconfigure and the root-kept-gathered runs (a launch costs seconds of
    start-up on two cores)."""
    out = tmp_path_factory.mktemp("fsdp_reconfigure")
    cases = [*CASES, *(GATHERED + case for case in GATHERED_CASES)]
    run_script("fsdp_reconfigure_script.py", out, timeout=420, MPX_CASES=",".join(cases))
    return {case: rank_results(out, prefix=file_prefix(case)) for case in cases}


@pytest.mark.parametrize("case", CASES)
def test_configure_model_sharding_at_every_stage_runs_both_stages(runs, case):
    """Both stages run on the model the first one sharded: ``configure_model`` ran twice, the model has one FSDP unit
    per block plus the root (not sharded twice), FSDP's FP32 shards are still what the optimizer steps, and the hook
    changed to another level between stages is refused naming the level."""
    level, order = case.split(":")
    for r in runs[case]:
        assert r["configure_calls"] == 2
        assert r["global_step"] == STEPS and len(r["train_losses"]) == STEPS
        assert r["units"] == ["", "blocks.0", "blocks.1"]
        assert r["param_dtypes"] == ["torch.float32"]
        assert "sharded by an earlier shard_model call with other arguments" in r["conflict"]
        assert f"opt_level: {level} (" in r["conflict"]
        if order == "fit_test":
            # The test stage sees the trained model: its first batch is the batch fit's last validation ran, on the
            # same weights, through the same evaluation path, so the loss is the same number.
            assert len(r["test_losses"]) == STEPS
            assert r["test_losses"][0] == r["val_losses"][-1]


def test_validate_first_trains_as_fit_alone(runs):
    """``validate`` before ``fit`` changes nothing of the training: FSDP's FP32 shards are the masters, so the same
    losses, bit for bit, as ``fit`` first (the same computation repeated from the same seed)."""
    for first, second in zip(runs["O2:fit_test"], runs["O2:validate_fit"]):
        assert second["train_losses"] == first["train_losses"]


# -- FSDP's default for the root (kept gathered after a forward with no backward), through the Trainer -----------
@pytest.mark.parametrize("case", GATHERED_CASES)
def test_trainer_stages_after_an_evaluation_train_as_the_root_resharded(runs, case):
    """No stage raises (no false "gathered" refusal), the losses and the final FP32 weights are those of
    ``reshard_after_forward=True`` bit for bit, and what the model stores is FP32 shards (O1/O2) once resharded."""
    for r in runs[GATHERED + case]:
        default, resharded = r["none"], r["true"]
        assert "error" not in default, default.get("error")
        assert "error" not in resharded, resharded.get("error")
        assert default["train_losses"] == resharded["train_losses"]
        assert default["weights"] == resharded["weights"]
        assert "DTensor:torch.float32" in default["stored_dtypes"]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_checkpoint_saved_after_validation_holds_fp32_shards_and_resumes_bit_for_bit(runs, level):
    """``ModelCheckpoint`` saves after each validation, when the root is gathered: the saved model state is FP32
    shards (``DTensor``), and a new Trainer resumed from the first epoch's checkpoint ends with the losses and weights
    of the uninterrupted run."""
    for r in runs[f"{GATHERED}{level}:resume"]:
        default = r["none"]
        assert default["saved"], "no checkpoint was saved"
        for saved in default["saved"]:
            assert {tuple(v) for v in saved["state"].values()} == {("DTensor", "torch.float32")}
        assert default["resumed_losses"] == default["train_losses"][-len(default["resumed_losses"]):]
        assert default["resumed_weights"] == default["weights"]


# -- in one process: what counts as the same arguments -------------------------------------------------------------
@pytest.fixture(scope="module")
def process_group():
    """A gloo group of one process for the module's tests, destroyed after them."""
    with one_process_group():
        yield


def _units(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _model() -> Model:
    torch.manual_seed(0)
    return Model()


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_the_same_arguments_again_return_the_model_unchanged(process_group, level):
    """The same level through another settings object (a new plugin at each stage), the blocks named by class then by
    instance: the model comes back as it is (at O3 not cast again), and its forward and backward run."""
    model = _model()
    first = MixedPrecisionSettings(level, "bfloat16")
    assert shard_model(model, first, blocks=Block) is model
    params = [(p, p.to_local().clone()) for p in model.parameters()]
    again = MixedPrecisionSettings.from_kwargs(level, half_dtype="bfloat16", loss_scale=128.0)  # not a sharding matter
    assert shard_model(model, again, blocks=[model.blocks[1], model.blocks[0]]) is model
    assert _units(model) == ["", "blocks.0", "blocks.1"]
    assert all(p.to_local().dtype == before.dtype and torch.equal(p.to_local(), before) for p, before in params)
    if level != "O1":  # (O1's forward needs the cast table, which Amp runs: the root casts nothing)
        model(torch.randn(4, 16)).sum().backward()
        assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    ("again", "named"),
    [
        (dict(precision=MixedPrecisionSettings("O1", "bfloat16")), "opt_level: O2 (FP32 shards as the master weights) "
         "then, O1 (FP32 shards gathered for the cast table) now"),
        (dict(precision=MixedPrecisionSettings("O2", "float16")), "half_dtype: bfloat16 then, float16 now"),
        (dict(blocks=None), "blocks: ('blocks.0', 'blocks.1') then, () now"),
        (dict(reshard_after_forward=False), "reshard_after_forward: None then, False now"),
        # True == 1 in Python; fully_shard reads 1 as "reshard to a world of one", not as True
        (dict(reshard_after_forward=1), "reshard_after_forward: None then, 1 now"),
        (dict(precision=MixedPrecisionSettings.from_kwargs("O2", half_dtype="bfloat16", fp32_modules=["out"])),
         "FP32 islands (batch norm, fp32_modules): () then, ('out',) now"),
    ],
    ids=["level", "half_dtype", "blocks", "reshard", "reshard_int", "fp32_modules"],
)
def test_conflicting_arguments_are_refused_by_name(process_group, again, named):
    model = _model()
    shard_model(model, MixedPrecisionSettings("O2", "bfloat16"), blocks=Block)
    kwargs: dict[str, Any] = dict(precision=MixedPrecisionSettings("O2", "bfloat16"), blocks=Block)
    kwargs.update(again)
    with pytest.raises(ValueError, match="sharded by an earlier shard_model call with other arguments") as error:
        shard_model(model, **kwargs)
    assert named in str(error.value)
    assert "Call shard_model with the same arguments at every stage" in str(error.value)
    assert _units(model) == ["", "blocks.0", "blocks.1"]


def test_gather_conflict_at_o1_is_named(process_group):
    model = _model()
    shard_model(model, "O1")
    with pytest.raises(ValueError, match="gather: half then, fp32 now"):
        shard_model(model, "O1", gather="fp32")


def test_a_model_sharded_by_hand_is_still_refused(process_group):
    """``shard_model`` cannot know the policies of a model sharded by ``fully_shard`` (nor of one whose submodule it
    sharded): refused, pointing to ``check_sharded_model``."""
    model = _model()
    fully_shard(model, mp_policy=mixed_precision_policy("O2", role="root"))
    with pytest.raises(ValueError, match=r"already sharded.*not by a shard_model call on it.*check_sharded_model"):
        shard_model(model, "O2")
    outer = nn.Sequential(_model())
    shard_model(outer[0], "O2")
    with pytest.raises(ValueError, match="not by a shard_model call on it"):
        shard_model(outer, "O2")
