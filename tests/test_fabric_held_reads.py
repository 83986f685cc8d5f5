"""Fabric reads on rank 0 alone under DDP that hold the scale update back (``_begin_read``: gradients wait for a step
that may still come) show what the update will leave, as the same run on one process shows, and part no ranks.

Before: a body left requiring grad beside a head-only optimizer (and a GAN's G before the plugin met its optimizer)
held the update back at every read, and ``mpx.metrics()["mpx/loss_scale"]``, ``mpx.scaler.get_scale()`` and the
view's state showed the scale one update behind one process's (and ``"16-mixed"``'s), ``mpx/overflows`` an overflow
one read late. One 2-rank gloo launch of ``tests/fabric_held_reads_script.py``; the one-process runs here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fabric_held_reads_script import CASES, OVERFLOW_AT, SCALING, STEPS, run_case
from tests.launch import case_results


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("fabricread63")
    return case_results("fabric_held_reads_script.py", out, timeout=120)


@pytest.fixture(scope="module")
def alone() -> dict[str, dict[str, Any]]:
    """Each case's loop on one process (no group: every read ends the iteration)."""
    return {case: run_case(case, reads=True, devices=1) for case in CASES}


def test_rank_zero_reads_show_what_one_process_shows(launched: list[dict[str, Any]], alone: Any) -> None:
    """Every value read on rank 0 (the scale, ``mpx/overflows``, ``mpx/skipped_steps``, the view's ``get_scale()``,
    ``state_dict()`` and ``_scale``) equals the one-process run's at the same read, which ended the iteration there,
    where the read on rank 0 held the update back (every read, since stop 64); the scale grew
    and backed off on the injected overflow, which is counted once, at its own read."""
    zero = launched[0]
    for case in CASES:
        grouped, single = zero[f"{case}-True"], alone[case]
        assert grouped["records"] == single["records"], case
        assert not any(single["held"])
        # every read held the update back (since stop 64 a read under a group never ends the iteration:
        # tests/test_fabric_rank_zero_reads.py)
        assert grouped["held"] == [True] * STEPS, case
        overflows = [r["overflows"] for r in grouped["records"]]
        assert overflows[OVERFLOW_AT] == 1 and sum(overflows) == 1, case
        assert grouped["records"][OVERFLOW_AT]["skipped_steps"] == 1, case
    scales = [r["loss_scale"] for r in zero["body-True"]["records"]]
    assert scales == [256.0, 512.0, 256.0, 256.0, 512.0, 512.0]  # growth_interval=2; backed off at the overflow


def test_rank_zero_reads_part_no_ranks_and_change_nothing(launched: list[dict[str, Any]], alone: Any) -> None:
    """Both ranks end with the same weights and live scaler state (scale, trackers, overflow count, iteration, the
    update due), which are those of the same run without the reads; the weights are the one-process run's."""
    zero, one = launched
    for case in CASES:
        read, quiet = zero[f"{case}-True"], zero[f"{case}-False"]
        for rank in (zero, one):
            assert rank[f"{case}-True"]["weights"] == read["weights"] == quiet["weights"], case
            assert rank[f"{case}-True"]["live"] == read["live"] == rank[f"{case}-False"]["live"], case
        assert read["weights"] == pytest.approx(alone[case]["weights"], rel=1e-6), case


def test_body_reads_match_16_mixed() -> None:
    """The one-process body loop reads what Fabric's own ``"16-mixed"`` ``GradScaler`` shows after each step (so the
    rank-0 reads, equal to it above, do too)."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision
    from torch import nn

    from tests.fabric_held_reads_script import _batch

    scaler = torch.amp.GradScaler("cpu", init_scale=SCALING["init_scale"], growth_interval=SCALING["growth_interval"])
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model, opt = fabric.setup(model, torch.optim.SGD(model[2].parameters(), lr=0.1))
    native = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(_batch(step)).float().pow(2).mean()
        fabric.backward(loss * float("inf") if step == OVERFLOW_AT else loss)
        opt.step()
        native.append(scaler.get_scale())
    ours = run_case("body", reads=True, devices=1)["records"]
    assert [r["get_scale"] for r in ours] == [r["loss_scale"] for r in ours] == native


def _body_reads(grouped: bool) -> tuple[list[list[float]], int]:
    """A float16 O1 body loop (the optimizer holds the head; growth_interval=1), overflowing at iteration 1, read
    four ways after each step: ``mpx.metrics()`` twice, ``mpx.scaler.get_scale()``, and the engine's own
    ``mpx.amp.metrics()``. ``grouped``: the found-inf reducer a group of two or more ranks gets, installed by hand in a
    group of one (the reads hold the update back). The reads' overflows and scales, and the live overflow count."""
    from lightning.fabric import Fabric
    from torch import nn

    from lightning_mpx import FabricMixedPrecisionPlugin
    from lightning_mpx.integrations.collectives import all_reduce_max

    torch.manual_seed(0)
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", init_scale=256.0, growth_interval=1)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=mpx)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model, opt = fabric.setup(model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    if grouped:
        mpx.amp.found_inf_reducer = all_reduce_max
    g = torch.Generator().manual_seed(1)
    reads = []
    for it in range(4):
        opt.zero_grad()
        loss = model(torch.randn(3, 4, generator=g)).float().pow(2).mean()
        fabric.backward(loss * (float("inf") if it == 1 else 1.0))
        opt.step()
        first, second = mpx.metrics(), mpx.metrics()
        engine = {k: float(v) for k, v in mpx.amp.metrics().items()}
        assert mpx.amp.iteration.update_pending == grouped  # held back only under the group
        reads.append([first["mpx/loss_scale"], first["mpx/overflows"], second["mpx/loss_scale"],
                      second["mpx/overflows"], mpx.scaler.get_scale(), engine["mpx/overflows"]])  # fmt: skip
    mpx.amp.end_iteration()
    return reads, int(mpx.amp.scalers[0].overflow_count)


def test_repeated_reads_and_the_engines_own_read_count_each_overflow_once(one_rank: None) -> None:
    """Under a group a held read counts the pending iteration's overflow, a second read in the same iteration counts
    nothing more, and ``mpx.amp.metrics()`` between the held read and the update shows the live count without going
    below zero; after the update nothing is counted twice: read for read what one process reads."""
    grouped, total = _body_reads(grouped=True)
    alone, alone_total = _body_reads(grouped=False)
    assert grouped == alone
    assert [r[0] for r in grouped] == [512.0, 256.0, 512.0, 1024.0]  # grown, backed off, grown: the updated scale
    assert [r[1] for r in grouped] == [0.0, 1.0, 0.0, 0.0] and total == alone_total == 1
    assert all(r[3] == r[5] == 0.0 for r in grouped)  # counted at the first read only


def test_an_overflow_after_a_held_read_in_the_same_iteration_is_counted_once(one_rank: None) -> None:
    """A read between two optimizers' steps (under a group: held back, G's gradients wait) shows the update as the
    steps so far leave it; G's step then overflows in the same iteration: the next read counts that overflow, once."""
    from lightning.fabric import Fabric
    from torch import nn

    from lightning_mpx import FabricMixedPrecisionPlugin
    from lightning_mpx.integrations.collectives import all_reduce_max

    torch.manual_seed(0)
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", init_scale=256.0, growth_interval=1)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=mpx)
    gen, disc = fabric.setup(nn.Linear(4, 4)), fabric.setup(nn.Linear(4, 1))
    opt_d, opt_g = torch.optim.SGD(disc.parameters(), lr=0.1), torch.optim.SGD(gen.parameters(), lr=0.1)
    opt_d, opt_g = fabric.setup_optimizers(opt_d, opt_g)
    mpx.amp.found_inf_reducer = all_reduce_max
    g = torch.Generator().manual_seed(1)
    reads = []
    for it in range(3):
        opt_d.zero_grad()
        opt_g.zero_grad()
        fabric.backward(disc(torch.randn(3, 4, generator=g)).float().pow(2).mean())
        fabric.backward(gen(torch.randn(3, 4, generator=g)).float().pow(2).mean() * (float("inf") if it == 1 else 1))
        opt_d.step()
        m = mpx.metrics()
        assert mpx.amp.iteration.update_pending  # held: G's gradients wait for its step
        reads.append((m["mpx/loss_scale"], m["mpx/overflows"]))
        opt_g.step()
    mpx.amp.end_iteration()
    assert reads == [(512.0, 0.0), (1024.0, 0.0), (512.0, 1.0)]  # iteration 1's read came before G's overflow
    assert mpx.metrics()["mpx/overflows"] == 0.0 and int(mpx.amp.scalers[0].overflow_count) == 1


def test_after_update_must_be_a_bool() -> None:
    """``Amp.metrics(after_update=...)`` names the argument and its type when given anything but a bool."""
    from lightning_mpx import Amp

    with pytest.raises(TypeError, match=r"after_update='yes' must be a bool"):
        Amp("O1", half_dtype=torch.float16).metrics(after_update="yes")  # type: ignore[arg-type]
