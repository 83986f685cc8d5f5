"""Hostile review of stop 61's carried scales (engine.carried_scales) under DDP: a Fabric DDP GAN at O2 float16 whose
generator's optimizer the plugin meets at its first step, with a read of the scale between D's and G's first steps
on both ranks or on rank 0 only, D's first loss overflowing on rank 1; against the registered-up-front loop, FP32 and
Fabric's ``"16-mixed"``. One launch of ``tests/fabric_gan_carried_scales_script.py`` serves both tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.launch import rank_results, run_script


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    out = tmp_path_factory.mktemp("gan61")
    # the script's faulthandler ends a hang at 100 s
    run_script("fabric_gan_carried_scales_script.py", out, timeout=150)
    zero, one = rank_results(out)
    for name in zero:
        assert "error" not in zero[name] and "error" not in one[name], (name, zero[name].get("error"),
                                                                        one[name].get("error"))  # fmt: skip
    return zero, one


def _max_error(got: Any, want: Any) -> float:
    return max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y))


def test_a_ddp_gans_read_on_every_rank_between_its_first_steps(ranks: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """The read on both ranks (SGD; fused AdamW with and without ``skip_on_device``): no hang, the ranks end with the
    same weights and scale, G's first update is the registered-up-front loop's and FP32's (D's skip on rank 1's
    overflow leaves G alone) and G's weights stay near FP32's; ``"16-mixed"``'s ranks agree alongside."""
    zero, one = ranks
    for optim in ("sgd", "adamw"):
        fp32, registered = zero[f"{optim}-fp32-none-late"], zero[f"{optim}-O2-none-registered"]
        assert zero[f"{optim}-native-both-late"]["final"] == one[f"{optim}-native-both-late"]["final"]
        for kind in ("O2", "skip_on_device") if optim == "adamw" else ("O2",):
            name = f"{optim}-{kind}-both-late"
            ours, other = zero[name], one[name]
            assert ours["weights"] == other["weights"] and ours["final"] == other["final"], name
            assert _max_error(ours["first"], registered["first"]) < 1e-6, name
            assert _max_error(ours["first"], fp32["first"]) < 1e-3, name
            assert _max_error(ours["weights"][:2], fp32["weights"][:2]) < 1e-2, name


def test_a_ddp_gans_read_on_rank_zero_only_between_its_first_steps(
    ranks: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """The read on rank 0 only (``if fabric.global_rank == 0``), G not met yet by the plugin: the ranks end with the
    same scale and weights, G's first update the registered loop's; with ``skip_on_device`` no hang. The read does
    not end the iteration on the reading rank alone while G's gradients wait for an optimizer
    (integrations/fabric_bookkeeping.py ``_begin_read``): before, the ranks' scales parted (1024 against 512, weights
    0.07 apart) and with ``skip_on_device`` rank 1's next step hung in the device check's all-reduce."""
    zero, one = ranks
    for optim, kind in (("sgd", "O2"), ("adamw", "O2"), ("adamw", "skip_on_device")):
        name = f"{optim}-{kind}-rank0-late"
        assert _max_error(zero[name]["first"], zero[f"{optim}-O2-none-registered"]["first"]) < 1e-6, name
        assert zero[name]["final"] == one[name]["final"], name
        assert zero[name]["weights"] == one[name]["weights"], name
