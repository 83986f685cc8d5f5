"""attack67c: what a run reports (TensorBoard scalars, ``lightning-mpx doctor``/``plot``) attacked from the user's
side, against the run's own facts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard")
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.loggers import TensorBoardLogger as FabricTensorBoardLogger  # noqa: E402

from lightning_mpx import FabricMixedPrecisionPlugin  # noqa: E402
from lightning_mpx.cli import main  # noqa: E402
from lightning_mpx.health.plot import read_scalars  # noqa: E402


# -- the doctor on a folder whose run started again from step 0 -------------------------------------------------------
def _fabric_run(root: Path, version: int, steps: int, overflow: bool, first: int = 0) -> list[float]:
    """A Fabric loop logging ``mpx.metrics()`` at its own step count (docs/fabric.md's loop), from step ``first`` (a
    resumed loop's count), into ``root/run/version_<version>``; with ``overflow`` every loss is inf (the scale falls to
    its floor, every step is skipped). Returns the skipped-step counts it logged (the run's facts)."""
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", init_scale=4.0, on_floor="continue")
    logger = FabricTensorBoardLogger(str(root), name="run", version=version)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx], loggers=[logger])
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Linear(4, 2))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    skipped = []
    for step in range(steps):
        loss = model(torch.randn(2, 4)).square().mean()
        fabric.backward(loss * (float("inf") if overflow else 1.0))
        optimizer.step()
        optimizer.zero_grad()
        metrics = mpx.metrics()
        skipped.append(metrics["mpx/skipped_steps"])
        fabric.log_dict({"loss": loss.item(), **metrics}, step=first + step)
    logger.finalize("success")
    return skipped


@pytest.mark.parametrize("again", ["same_folder", "next_version"])
def test_a_run_started_again_from_step_zero_is_judged_on_its_own_points(tmp_path, capsys, again):
    # The first run collapses (14 steps, all skipped); the user fixes it and runs again from step 0 for 6 healthy
    # steps, into the same folder (a fixed version) or TensorBoardLogger's next version. Read by step alone, the
    # second run's steps 0-5 were spliced onto the first run's 6-13: "persistent overflow", exit 1, about a run that
    # is no more.
    _fabric_run(tmp_path, 0, 14, overflow=True)
    facts = _fabric_run(tmp_path, 0 if again == "same_folder" else 1, 6, overflow=False)
    run_dir = tmp_path / "run" / ("version_0" if again == "same_folder" else "")
    assert main(["doctor", str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["healthy"] and report["steps"] == [0, 5]
    assert any("went back from 13 to 0" in note for note in report["notes"])
    scalars = read_scalars(run_dir)  # what the plot draws: the latest run's curve
    assert [v for _, v in scalars["mpx/skipped_steps"]] == facts == [0.0] * 6
    assert [s for s, _ in scalars["mpx/loss_scale"]] == list(range(6))


def test_a_run_killed_mid_write_is_diagnosed_from_what_was_written(tmp_path, capsys):
    facts = _fabric_run(tmp_path, 0, 14, overflow=True)
    (events,) = (tmp_path / "run" / "version_0").glob("events.out.tfevents.*")
    events.write_bytes(events.read_bytes()[:-5])  # the last record cut mid-write
    assert main(["doctor", str(events.parent), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (finding,) = [f for f in report["findings"] if f["problem"]]
    assert finding["kind"] == "persistent_overflow"
    # The points before the cut are the run's: every step skipped, as its own counts said.
    assert read_scalars(events.parent)["mpx/skipped_steps"][-1][1] in (facts[-1], facts[-2])


@pytest.mark.parametrize("overflow", [True, False])
def test_a_resumed_runs_first_point_counts_its_own_steps_not_every_step_since_zero(tmp_path, capsys, overflow):
    # A resumed run in its own folder (TensorBoardLogger's next version) logs from step 100 on, every step. Its first
    # point was taken to cover steps 0-100: "0 overflow steps in 114" for 14 steps, and a run skipping every step
    # "since step 101", "13 of the 13 steps".
    facts = _fabric_run(tmp_path, 1, 14, overflow=overflow, first=100)
    assert main(["doctor", str(tmp_path / "run" / "version_1"), "--json"]) == int(overflow)
    (finding,) = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["kind"] != "constant_scale"]
    if overflow:
        assert finding["since_step"] == 100 and facts[-1] == 14.0
        assert finding["evidence"][0].startswith("14 of the 14 steps 100-113 overflowed")
    else:
        assert "0 overflow steps in 14 (0.0%), 0 skipped in all" in finding["evidence"][0]


# -- DDP: rank 1 overflows alone, a logger on rank 0 only --------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    from tests.launch import rank_results, run_script

    out = tmp_path_factory.mktemp("attack67c_ddp")
    run_script("lightning_ddp_overflow_logging_script.py", out, timeout=150)
    return rank_results(out)


def _grad_scaler_scales(overflow_steps: set[int], steps: int) -> list[float]:
    """``torch.amp.GradScaler``'s scale after each step's update (its defaults), gradients inf at ``overflow_steps``."""
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu")
    scales = []
    for step in range(steps):
        scaler.scale(param.sum()).backward()
        if step in overflow_steps:
            param.grad[0] = float("inf")
        scaler.step(optimizer)
        optimizer.zero_grad()
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_ddp_rank_one_overflow_logged_by_a_rank_zero_only_logger_is_the_truth(ddp):
    # Facts: both ranks skipped step 1 (rank 1's NaN batch) and step 3 (rank 1's gradient explosion), the same on both
    # ranks; the fused AdamW took 5 - 2 steps on each (its own step count).
    rank0, rank1 = ddp[0]["device"], ddp[1]["device"]
    assert rank0["skipped_steps"] == rank1["skipped_steps"] == [2]
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == [3]
    assert rank0["weights_equal_finite"] and rank1["weights_equal_finite"]
    assert rank1["logged"] == []  # rank 1 has no logger: nothing asked of it, and no rank hung
    logged = dict((step, metrics) for step, metrics in rank0["logged"])
    assert sorted(logged) == list(range(5))  # one point per step, none twice
    assert [logged[s]["mpx/loss_scale"] for s in range(5)] == _grad_scaler_scales({1, 3}, 5)
    assert [logged[s]["mpx/overflows"] for s in range(5)] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert [logged[s]["mpx/skipped_steps"] for s in range(5)] == [0.0, 1.0, 1.0, 2.0, 2.0]
    # The layer is rank 1's, told on rank 0: its forward's first non-finite module at step 1, and at step 3 (a finite
    # forward) the modules whose synchronised gradients are non-finite by the model's own reference (taken after each
    # backward, independently of lightning_mpx): explode's always; out's weight gradient is near float16's maximum
    # here (past it in one CI run, not in local runs), so whether it overflowed is read from the reference, not assumed.
    assert logged[1]["mpx/overflow_first/net.inp"] == 1.0
    nonfinite = {name.split(".")[1] for name in rank0["grad_kinds"][3]}
    assert "explode" in nonfinite and not nonfinite & {"inp", "blow"}
    assert {m: logged[3][f"mpx/overflow/net.{m}"] for m in ("inp", "blow", "explode", "out")} == {
        m: float(m in nonfinite) for m in ("inp", "blow", "explode", "out")
    }


# -- litgpt: finetune/full.py's loop through Fabric, saved and resumed -------------------------------------------------
_GPT = dict(block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=1, n_head=2, n_embd=32, n_query_groups=2,
            rotary_percentage=1.0, bias=False)  # fmt: skip


def _litgpt_full(base: Path, precision: str, steps: int, load: Path | None = None, save: Path | None = None) -> Any:
    """litgpt's ``finetune/full.py`` loop, written out: the model built under ``fabric.init_module(empty_init=True)``,
    set up, then ``fabric.load_raw`` of the FP32 base; its optimizer and ``get_lr_scheduler`` in a state with
    ``iter_num``/``step_count`` (and the plugin) that ``fabric.save``/``fabric.load`` carry; 2 micro-batches per step
    under ``no_backward_sync``; ``chunked_cross_entropy`` on chunked logits. Returns the losses and the weights."""
    litgpt = pytest.importorskip("litgpt")
    from litgpt.finetune.full import get_lr_scheduler
    from litgpt.utils import chunked_cross_entropy

    mpx = FabricMixedPrecisionPlugin(precision, half_dtype="bfloat16") if precision.startswith("O") else None
    fabric = Fabric(accelerator="cpu", devices=1, **({"plugins": [mpx]} if mpx else {"precision": precision}))
    with fabric.init_module(empty_init=True):
        model = litgpt.GPT(litgpt.Config(**_GPT))
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    fabric.load_raw(str(base), model)
    scheduler = get_lr_scheduler(optimizer, warmup_steps=2, max_steps=8)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 0, "step_count": 0}
    if mpx is not None:
        state["mpx"] = mpx
    if load is not None:
        if mpx is not None:
            mpx.setup_optimizers(optimizer)  # O2: before fabric.load (docs/fabric.md), else refused by name
        fabric.load(str(load), state)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 64, (2, 17), generator=g) for _ in range(2 * steps)]
    losses = []
    while state["step_count"] < steps:
        batch = data[state["iter_num"]]
        state["iter_num"] += 1
        accumulating = state["iter_num"] % 2 != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            logits = model(batch[:, :-1], lm_head_chunk_size=8)
            loss = chunked_cross_entropy(logits, batch[:, 1:])
            fabric.backward(loss / 2)
        if not accumulating:
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            state["step_count"] += 1
            losses.append(loss.item())
    if save is not None:
        fabric.save(str(save), state)
    return losses, {k: v.float().clone() for k, v in model.state_dict().items()}


def test_litgpt_full_finetune_at_o2_resumes_bit_for_bit_and_tracks_bf16_mixed(tmp_path):
    litgpt = pytest.importorskip("litgpt")
    torch.manual_seed(0)
    torch.save(litgpt.GPT(litgpt.Config(**_GPT)).state_dict(), tmp_path / "base.pth")
    ref_losses, ref_weights = _litgpt_full(tmp_path / "base.pth", "bf16-mixed", 4)
    losses, weights = _litgpt_full(tmp_path / "base.pth", "O2", 4)
    first, _ = _litgpt_full(tmp_path / "base.pth", "O2", 2, save=tmp_path / "c.ckpt")
    rest, resumed = _litgpt_full(tmp_path / "base.pth", "O2", 4, load=tmp_path / "c.ckpt")
    assert first + rest == losses  # the schedule, iter_num, masters and AdamW state came back
    assert all(torch.equal(resumed[k], weights[k]) for k in weights)
    assert losses == pytest.approx(ref_losses, abs=2e-3)  # FP32 masters vs bf16-mixed's FP32 weights
    assert max((weights[k] - ref_weights[k]).abs().max().item() for k in weights) < 2e-2
    assert all(v.dtype == torch.float32 for v in weights.values())
