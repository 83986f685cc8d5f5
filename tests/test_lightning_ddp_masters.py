"""O2 masters under DDP, two CPU ranks (gloo), every multi-rank check in ONE launch
(tests/lightning_ddp_masters_script.py; stop 53 merged the launches of tests/test_ddp52.py, tests/test_exactddp52.py and
tests/test_attack2_52.py, 7-17 s of set-up each). Rank 1 builds most models with another seed; each rank is checked
against the other exactly and against a "32-true" DDP twin or a one-process run to a tolerance.

* Stop 51's surfaces under Lightning's and Fabric's DDP (``test_hostile_*``). Found and fixed at stop 52:
  ``release_masters(model)`` on rank 0 only, then a second stage on both: the ranks trained apart silently.
* Rank zero's exact FP32 weights for every rank's masters (``test_exact_*``). Found and fixed at stop 52: the masters
  started from the half weights DDP broadcasts (1e-3 off the FP32 model) where one process starts exactly.
* The agreement attacked (``test_attack_*``). Found and fixed at stop 52: a model that differs between the ranks
  aborted the process in gloo's broadcast; now a ValueError on every rank naming the parameter.
* Stop 53, found and fixed: ``trainer.validate`` before ``fit`` left rank 1 holding rank 0's *half* rounding in FP32
  (Lightning broadcasts the half weights for an evaluation), 9.7e-4 off rank 0's FP32 values; the Accelerate adapter's
  take-over of a model after ``free_memory()`` kept each rank's own masters (0.92 apart after a checkpoint loaded on
  rank 0 only, and the kept DDP wrapper never broadcast again): the ranks trained different weights.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_mpx import MixedPrecisionPlugin
from tests.launch import rank_results, run_script
from tests.lightning_ddp_masters_script import SETTINGS, EvalNet, Net, data, fabric_run, fit, flat, net
from tests.test_fp32_buffers import _HFRotaryEmbedding

# bfloat16 compute and masters started from the half rounding (9.7e-4 measured), against the FP32 DDP twin.
ATOL_FP32 = 3e-3
# The one-process run against the two-rank run on the same global batches: bfloat16 gradients summed in another
# order (DDP's all-reduce) move the weights by a few 1e-5 over the epoch; masters started from the half rounding are
# up to 1e-3 off.
ATOL_ONE = 1.5e-4
DIFFERS = "differs between the ranks of the process group"
EXPECTED_ERRORS = ("core_width", "fabric_frozen_on_one")  # models that differ between the ranks: a clear error


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp53")
    run_script("lightning_ddp_masters_script.py", out, timeout=180)
    got = rank_results(out)
    for rank in got:
        assert rank["world"] == 2
        for case, value in rank.items():
            if isinstance(value, dict) and case not in EXPECTED_ERRORS:
                assert "error" not in value, f"{case}: {value['error']}"
    return got


def _both(ranks: list[dict[str, Any]], *keys: str) -> torch.Tensor:
    """The value at ``keys`` on rank 0, asserted equal (exactly) to rank 1's."""
    values = []
    for rank in ranks:
        for key in keys:
            rank = rank[key]
        values.append(torch.tensor(rank))
    gap = (values[0] - values[1]).abs().max()
    assert torch.equal(values[0], values[1]), f"{'/'.join(keys)}: the ranks differ by {gap}"
    return values[0]


def _fp32_weights() -> torch.Tensor:
    """Rank zero's FP32 weights (seed 0), which bfloat16 does not represent."""
    weights = torch.tensor(flat(Net(seed=0).parameters()))
    assert not torch.equal(weights, weights.bfloat16().float())
    return weights


def _seed_net(seed: int, width: int = 16) -> list[torch.Tensor]:
    return list(net(seed, width).parameters())


# -- stop 51's surfaces under Lightning's and Fabric's DDP, each against its "32-true" DDP twin


def test_hostile_o2_regression_with_float_targets_skips_rank_1s_overflow_on_both_ranks_as_the_fp32_run(ranks):
    """Trainer DDP at O2 (``find_unused_parameters=True``, accumulation under ``no_sync``, rank-zero-only and synced
    logging): the loss inside the forward takes the exact float targets on both ranks (near 300, which bfloat16
    rounds by up to 1), the inf on rank 1 only skips that step on both (the scale halved once on both), and the
    masters end as the FP32 DDP run, which skips the same step, equal on both ranks. At O3 the same on both ranks.
    A rotary module's inverse frequencies stay FP32 and exact on both ranks."""
    for case in ("o2", "o3"):
        for rank in ranks:
            assert rank[case]["exact"] < 1e-6 and rank[case]["scale"] == 2.0**9, case
        _both(ranks, case, "w")
    _both(ranks, "o2", "loss")  # sync_dist=True
    exact = _HFRotaryEmbedding().inv_freq.tolist()
    for case in ("o2", "o3"):  # a rotary module's FP32 frequencies, through DDP's buffer broadcasts
        assert [rank[case]["inv_freq"] for rank in ranks] == [["torch.float32", exact]] * 2, case
    assert ranks[0]["o3"]["dtype"] == "torch.bfloat16"
    torch.testing.assert_close(_both(ranks, "o2", "w"), _both(ranks, "ref", "w"), rtol=0, atol=ATOL_FP32)


def test_hostile_a_checkpoint_saved_before_the_first_step_resumes_as_the_uninterrupted_run(ranks) -> None:
    torch.testing.assert_close(_both(ranks, "resume", "w"), _both(ranks, "o2", "w"), rtol=0, atol=1e-6)


def test_hostile_a_second_fit_with_a_new_plugin_trains_as_fp32_and_the_first_plugin_refuses_its_masters(ranks):
    assert [rank["stages"]["refused"] for rank in ranks] == [True, True]
    want = _both(ranks, "stages_ref", "w")
    torch.testing.assert_close(_both(ranks, "stages", "w"), want, rtol=0, atol=ATOL_FP32)


def test_hostile_release_masters_on_rank_0_only_then_a_second_stage_keeps_the_ranks_equal(ranks) -> None:
    """After an export on rank 0 (``release_masters``) a second Trainer stage trains the same weights on both ranks,
    from rank zero's half weights together (rank zero holds no FP32 value), as the stage without the export (which
    starts from rank zero's exact FP32 masters) to the half rounding, not to 1e-6."""
    released = _both(ranks, "released", "w")
    torch.testing.assert_close(released, _both(ranks, "stages", "w"), rtol=0, atol=ATOL_FP32)


def test_hostile_fabric_ddp_stages_around_a_rank_0_release_masters_train_as_fp32_on_both_ranks(ranks) -> None:
    """Fabric DDP at O2 (``labels=`` keyword targets, ``no_backward_sync`` accumulation, rank 1's inf), then
    ``release_masters`` on rank 0 and a second Fabric with a new plugin: both stages equal on both ranks, as FP32."""
    for stage in ("first", "second"):
        got, want = _both(ranks, "fabric_stages", stage, "w"), _both(ranks, "fabric_stages_ref", stage, "w")
        torch.testing.assert_close(got, want, rtol=0, atol=2 * ATOL_FP32)
        assert [rank["fabric_stages"][stage]["exact"] < 1e-6 for rank in ranks] == [True, True]  # labels= keyword
        assert [rank["fabric_stages"][stage]["scale"] for rank in ranks] == [2.0**9] * 2  # rank 1's inf: skipped


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_hostile_complex_parameters_under_trainer_ddp_train_as_the_fp32_run(ranks, level: str) -> None:
    """A complex parameter under Trainer DDP (DDP all-reduces its gradient as real pairs): complex64 at every level,
    the same on both ranks, as the FP32 DDP run."""
    assert [rank[f"complex/{level}"]["dtype"] for rank in ranks] == ["torch.complex64"] * 2
    got, want = _both(ranks, f"complex/{level}", "w"), _both(ranks, "complex/32", "w")
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL_FP32)


# -- rank zero's exact FP32 weights for every rank's masters, against one process


def test_exact_trainer_ddp_masters_start_from_rank_zeros_fp32_weights_and_end_as_one_process(ranks) -> None:
    """Before the first step both ranks' masters are rank zero's FP32 weights exactly (rank 1's own differ); at the
    end they are the one-process run's on the same global batches."""
    fp32 = _fp32_weights()
    assert torch.equal(_both(ranks, "trainer", "start"), fp32)
    start, end = fit(Net(seed=0), MixedPrecisionPlugin("O2", **SETTINGS), devices=1)
    assert torch.equal(torch.tensor(start), fp32)  # one process: exact, as before
    torch.testing.assert_close(_both(ranks, "trainer", "end"), torch.tensor(end), rtol=0, atol=ATOL_ONE)


def test_exact_a_second_trainer_stage_under_ddp_starts_from_the_first_stages_masters_exactly(ranks) -> None:
    """A second ``fit`` with a new plugin: both ranks start from the masters the first stage ended with (not their
    rounding), and end as the one-process second stage."""
    assert torch.equal(_both(ranks, "trainer", "stage2_start"), _both(ranks, "trainer", "end"))
    module = Net(seed=0)
    fit(module, MixedPrecisionPlugin("O2", **SETTINGS), devices=1)
    _, end = fit(module, MixedPrecisionPlugin("O2", **SETTINGS), devices=1)
    torch.testing.assert_close(_both(ranks, "trainer", "stage2_end"), torch.tensor(end), rtol=0, atol=2 * ATOL_ONE)


def test_exact_a_model_made_half_before_fit_on_rank_zero_only_falls_back_to_its_half_weights_on_both_ranks(ranks):
    """Rank zero holds no FP32 value (its model was made bfloat16 before ``fit``), rank 1 its own FP32 weights (rank
    zero's a few ulps off, the same rounding): both start from rank zero's half weights, together (rank 1 does not
    keep its own FP32 values), and train the same weights."""
    half = _fp32_weights().bfloat16().float()
    assert torch.equal(_both(ranks, "half_on_rank0", "start"), half)
    _both(ranks, "half_on_rank0", "end")


def test_exact_the_core_amp_under_a_process_group_broadcasts_only_when_asked(ranks) -> None:
    """``Amp.prepare_model`` alone makes no collective: each rank's masters are its own half weights (DDP would then
    broadcast rank zero's); with ``rank_zero_fp32=True`` both ranks start from rank zero's FP32 weights exactly."""
    for rank, got in enumerate(ranks):
        own = torch.tensor(flat(Net(seed=rank).parameters()))
        assert torch.equal(torch.tensor(got["core"]["own"]), own.bfloat16().float())
    assert torch.equal(_both(ranks, "core", "agreed"), _fp32_weights())


@pytest.fixture(scope="module")
def fabric_one_process() -> torch.Tensor:
    """The masters a one-process Fabric run at O2 ends with (the same global batches)."""
    start, end = fabric_run(Net(seed=0), devices=1)
    assert torch.equal(torch.tensor(start), _fp32_weights())
    return torch.tensor(end)


def test_exact_fabric_ddp_masters_start_from_rank_zeros_fp32_weights_and_end_as_one_process(ranks, fabric_one_process):
    assert torch.equal(_both(ranks, "fabric_exact", "start"), _fp32_weights())
    torch.testing.assert_close(_both(ranks, "fabric_exact", "end"), fabric_one_process, rtol=0, atol=ATOL_ONE)


def test_exact_accelerate_ddp_masters_start_from_rank_zeros_fp32_weights_and_end_as_one_process(
    ranks, fabric_one_process
):
    """The Accelerate adapter's ``prepare`` under DDP (the same loop, each rank its half of every global batch)."""
    assert torch.equal(_both(ranks, "accelerate", "start"), _fp32_weights())
    torch.testing.assert_close(_both(ranks, "accelerate", "end"), fabric_one_process, rtol=0, atol=ATOL_ONE)


# -- the agreement attacked


def test_attack_a_model_that_differs_between_ranks_is_a_clear_error_on_every_rank_not_an_abort(ranks) -> None:
    """Rank 0's first layer 16 wide, rank 1's 8 (the core ``Amp``); a bias frozen on rank 1 only (Fabric's
    ``setup``): both ranks raise the ValueError naming the parameter and its shapes, and the group still works."""
    width = [rank["core_width"].get("error", "") for rank in ranks]
    for error in width:
        assert "ValueError" in error and DIFFERS in error, error
        assert "('0.weight', (16, 4)) on rank 0, ('0.weight', (8, 4)) on rank 1" in error, error
    frozen = [rank["fabric_frozen_on_one"].get("error", "") for rank in ranks]
    for error in frozen:
        assert "ValueError" in error and "rank 0: 4, rank 1: 3" in error and "('0.bias', (16,)) on rank 0" in error
    assert [rank["after"]["sum"] for rank in ranks] == [2.0, 2.0]


def test_attack_fabric_optimizer_set_up_apart_frozen_parameters_and_two_models_start_from_rank_zeros_fp32(ranks):
    """``setup_module`` then ``setup_optimizers``; a frozen bias (no master, rank zero's value all the same); a second
    model set up after the first: every master is rank zero's FP32 weight exactly (rank 1's own differ)."""
    zero = _seed_net(0)
    assert torch.equal(_both(ranks, "fabric_apart", "start"), torch.tensor(flat(zero)))
    trainable = [p for name, p in zip(("0.weight", "0.bias", "2.weight", "2.bias"), zero) if name != "0.bias"]
    assert torch.equal(_both(ranks, "fabric_frozen", "start"), torch.tensor(flat(trainable)))
    assert torch.equal(_both(ranks, "fabric_frozen", "other"), torch.tensor(flat(_seed_net(10))))
    assert not torch.equal(torch.tensor(flat(zero)), torch.tensor(flat(_seed_net(1))))


def test_attack_accelerate_two_models_prepared_apart_start_from_rank_zeros_fp32(ranks) -> None:
    assert torch.equal(_both(ranks, "accelerate_two", "first"), torch.tensor(flat(_seed_net(0))))
    assert torch.equal(_both(ranks, "accelerate_two", "second"), torch.tensor(flat(_seed_net(10))))


def test_attack_trainer_ddp_validate_before_fit_then_fit_starts_from_rank_zeros_fp32(ranks) -> None:
    """A baseline ``trainer.validate`` under DDP before ``fit``: the model is FP32 again between the stages, and the
    fit's masters start from rank zero's exact FP32 weights on both ranks."""
    assert [rank["trainer_validate_fit"]["dtypes"] for rank in ranks] == [["torch.float32"]] * 2
    assert torch.equal(_both(ranks, "trainer_validate_fit", "start"), torch.tensor(flat(Net(seed=0).parameters())))


def test_validate_under_ddp_leaves_every_rank_with_rank_zeros_exact_fp32_weights_as_one_process(ranks) -> None:
    """Stop 53's fix: after ``trainer.validate`` at O2 under DDP (before any ``fit``) both ranks hold rank zero's
    exact FP32 weights (rank 1 held rank zero's bfloat16 rounding, 9.7e-4 off), as a one-process validate leaves its
    model's: a save or a comparison of the ranks after an evaluation sees the same FP32 model."""
    module = EvalNet(seed=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[MixedPrecisionPlugin("O2", **SETTINGS)],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.validate(module, data(1), verbose=False)
    one_process = torch.tensor(flat(module.parameters()))
    assert torch.equal(one_process, _fp32_weights())
    assert torch.equal(_both(ranks, "trainer_validate_fit", "after_validate"), one_process)


def test_accelerate_take_over_after_free_memory_starts_every_rank_from_rank_zeros_fp32_masters(ranks) -> None:
    """Stop 53's fix: a model prepared, ``free_memory()``, FP32 weights loaded on rank 0 only, the kept (DDP-wrapped)
    model prepared again: both ranks' new masters are rank zero's loaded FP32 weights exactly (as one process takes
    its own) and their half weights the same (rank 1 kept its own masters, 0.92 off, which DDP never overwrote)."""
    loaded = torch.tensor(flat(_seed_net(20)))
    assert torch.equal(_both(ranks, "accelerate_take_over", "start"), loaded)
    assert torch.equal(_both(ranks, "accelerate_take_over", "half"), loaded.bfloat16().float())
