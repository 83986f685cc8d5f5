"""stop 66, fsdp1find66: Fabric's FSDP1 wrapper of a model found through the ``fabric.setup`` call that set it up, not
the garbage collector (blind to what ``gc.freeze()`` froze); ``torch.nn.DataParallel`` around a prepared model;
attack65b's limits.

The multi-rank cases: ``tests/fsdp1find66_script.py`` (one launch)."""

from __future__ import annotations

import pytest

from tests.launch import rank_results, run_script

pytest.importorskip("lightning.fabric")

from tests.fsdp1find66_script import INF_AT, STEPS  # noqa: E402

SKIPPED = [step == INF_AT for step in range(STEPS)]


# -- FSDP1 under Fabric, the heap frozen by the user (two ranks, one launch) -----------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One two-process launch for every multi-rank case of this file."""
    out = tmp_path_factory.mktemp("fsdp1find66")
    run_script("fsdp1find66_script.py", out, timeout=150, MPX_CASES="plain,frozen")
    return rank_results(out)


def _runs(ranks, case):
    for rank, result in enumerate(ranks):
        assert "error" not in result[case], f"{case}, rank {rank}:\n{result[case]['error']}"
    return [result[case] for result in ranks]


def test_a_heap_frozen_after_fabric_setup_leaves_the_fsdp1_model_sharded(ranks):
    """``gc.freeze()`` between ``fabric.setup_module`` (FSDPStrategy) and the first step, before the plugin's first
    call: the engine still takes Fabric's FSDP1 wrapper as the sharded model (it took the model for an unsharded one:
    the wrapper was looked for with ``gc.get_referrers``, which does not see frozen objects)."""
    for case in ("plain", "frozen"):
        for run in _runs(ranks, case):
            assert run["found_before_the_first_step"] is False  # looked for after the freeze
            assert run["sharded"] is True, case


def test_an_overflow_on_one_rank_skips_the_step_on_both_with_the_heap_frozen(ranks):
    """O1 float16, an inf in rank 0's own gradient shard only: both ranks skip that step, back off the scale, and end
    with the weights of the same run without the freeze (and the same clip norms and overflow record)."""
    plain, frozen = _runs(ranks, "plain"), _runs(ranks, "frozen")
    for mine, reference in zip(frozen, plain, strict=True):
        assert mine["skipped"] == reference["skipped"] == SKIPPED
        assert mine["scales"] == reference["scales"] == [1024.0] * INF_AT + [512.0] * (STEPS - INF_AT)
        assert mine["norms"] == reference["norms"]
        assert mine["weights"] == reference["weights"]
        assert mine["overflow"] == reference["overflow"] == [["0.weight"], [0]]
    assert frozen[0]["weights"] == frozen[1]["weights"]
