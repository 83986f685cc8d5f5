"""Stop 52's rank-zero agreement of O2 masters under DDP, attacked from the user's side (two CPU ranks, gloo, one
launch: tests/attack2_52_script.py; rank 1 builds its models with another seed).

Found and fixed: a model that differs between the ranks (a layer built with another width on one rank, a parameter
frozen on one rank only) reached the agreement's one FP32 broadcast with a buffer of another size on each rank: gloo
aborted the process ("terminate called ... Received data size doesn't match expected size"; no Python exception, no
name of the parameter), NCCL would hang or read past the values. Now the ranks first compare their lists of trainable
parameters (one small all-gather of count, size and a digest of the shapes) and, where they differ, raise the same
ValueError on every rank naming the first parameter that differs, its shape on each rank; the group still works.

Held (no change): Fabric's optimizer set up apart from its model, a frozen parameter, two models set up apart, the
Accelerate adapter preparing two models one by one, and a Trainer ``validate`` before ``fit``: every rank's masters
start from rank zero's exact FP32 weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.exactddp52_script import Net, flat
from tests.launch import rank_results, run_script

DIFFERS = "differs between the ranks of the process group"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("attack2_52")
    run_script("attack2_52_script.py", out, timeout=120)
    got = rank_results(out)
    assert all(rank["world"] == 2 for rank in got)
    return got


def _both(ranks: list[dict[str, Any]], case: str, key: str) -> torch.Tensor:
    """``ranks[r][case][key]``, asserted equal on both ranks (exactly)."""
    for rank in ranks:
        assert "error" not in rank[case], f"{case}: {rank[case]['error']}"
    zero, one = (torch.tensor(rank[case][key]) for rank in ranks)
    assert torch.equal(zero, one), f"{case}/{key}: the ranks differ by {(zero - one).abs().max()}"
    return zero


def _seed_net(seed: int, width: int = 16) -> list[torch.Tensor]:
    from tests.attack2_52_script import net

    return list(net(seed, width).parameters())


def test_a_model_that_differs_between_ranks_is_a_clear_error_on_every_rank_not_an_abort(ranks) -> None:
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


def test_fabric_optimizer_set_up_apart_frozen_parameters_and_two_models_start_from_rank_zeros_fp32(ranks) -> None:
    """``setup_module`` then ``setup_optimizers``; a frozen bias (no master, rank zero's value all the same); a second
    model set up after the first: every master is rank zero's FP32 weight exactly (rank 1's own differ)."""
    zero = _seed_net(0)
    assert torch.equal(_both(ranks, "fabric_apart", "start"), torch.tensor(flat(zero)))
    trainable = [p for name, p in zip(("0.weight", "0.bias", "2.weight", "2.bias"), zero) if name != "0.bias"]
    assert torch.equal(_both(ranks, "fabric_frozen", "start"), torch.tensor(flat(trainable)))
    assert torch.equal(_both(ranks, "fabric_frozen", "other"), torch.tensor(flat(_seed_net(10))))
    assert not torch.equal(torch.tensor(flat(zero)), torch.tensor(flat(_seed_net(1))))


def test_accelerate_two_models_prepared_apart_start_from_rank_zeros_fp32(ranks) -> None:
    assert torch.equal(_both(ranks, "accelerate_two", "first"), torch.tensor(flat(_seed_net(0))))
    assert torch.equal(_both(ranks, "accelerate_two", "second"), torch.tensor(flat(_seed_net(10))))


def test_trainer_ddp_validate_before_fit_then_fit_starts_from_rank_zeros_fp32(ranks) -> None:
    """A baseline ``trainer.validate`` under DDP before ``fit``: the model is FP32 again between the stages, and the
    fit's masters start from rank zero's exact FP32 weights on both ranks."""
    assert all("error" not in rank["trainer_validate_fit"] for rank in ranks), ranks[0]["trainer_validate_fit"]
    assert [rank["trainer_validate_fit"]["dtypes"] for rank in ranks] == [["torch.float32"]] * 2
    assert torch.equal(_both(ranks, "trainer_validate_fit", "start"), torch.tensor(flat(Net(seed=0).parameters())))
