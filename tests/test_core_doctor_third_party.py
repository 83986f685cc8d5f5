"""attack68c: a hostile user of real third-party models (transformers, peft, litgpt) and of what a run reports
(``mpx/*`` scalars, ``lightning-mpx doctor``), checked against the run's own facts and the framework's own
``"bf16-mixed"``."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: E402

from lightning_mpx import MixedPrecisionPlugin, doctor  # noqa: E402
from lightning_mpx.cli import main  # noqa: E402
from lightning_mpx.health.events import read_run  # noqa: E402
from lightning_mpx.scaling.scaler import LossScaleFloorError  # noqa: E402


# -- the doctor on a run killed at the floor after a few skipped steps ------------------------------------------------
class _Poisoned(pl.LightningModule):
    """Two linear layers; the loss of every micro-batch whose number (``global_step * 2 + batch_idx % 2``, two
    micro-batches a step) is in ``bad`` is inf: its step overflows."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.bad = nn.Linear(8, 8), nn.Linear(8, 1), bad

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.b(torch.relu(self.a(batch[0]))).float().square().mean()
        if self.trainer.global_step * 2 + batch_idx % 2 in self.bad:
            loss = loss * float("inf")
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _fit(root: Path, bad: set[int], steps: int, ckpt: str | None = None, save: str | None = None) -> None:
    """A float16 O1 run logging every 3 steps with 2 micro-batches a step, to TensorBoard and CSV at once, into
    ``root``'s ``version_0`` (a resume writes into the same folders)."""
    loggers = [TensorBoardLogger(str(root), name="", version=0), CSVLogger(str(root), name="csv", version=0)]
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=2.0**10, growth_interval=2)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=loggers, log_every_n_steps=3, accumulate_grad_batches=2,
        plugins=[plugin], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 8)), batch_size=2)
    trainer.fit(_Poisoned(bad), loader, ckpt_path=ckpt)
    if save:
        trainer.save_checkpoint(save)


def test_a_run_killed_at_the_floor_after_nine_skipped_steps_is_not_called_healthy(tmp_path, capsys):
    # Every step overflows: from 2^10 the scale reaches its floor (1) at the 11th step and on_floor="raise" stops the
    # run; the logged points (steps 2, 5, 8) show 9 skipped steps of 9 and an inf loss. Before: "healthy" (exit 0),
    # the streak shorter than PERSISTENT_MIN_STEPS read as a scale backing off from a high start.
    with pytest.raises(LossScaleFloorError):
        _fit(tmp_path, set(range(48)), 12)
    assert read_run(tmp_path).series["mpx/skipped_steps"] == [(2, 3.0), (5, 6.0), (8, 9.0)]
    capsys.readouterr()
    assert main(["doctor", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["healthy"]
    (finding,) = [f for f in report["findings"] if f["problem"]]
    assert finding["kind"] == "persistent_overflow" and finding["since_step"] == 0
    assert finding["evidence"][0].startswith("9 of the 9 steps 0-8 overflowed")
    # The scale's first logged point is after three halvings (128 at step 2), not "before step 0".
    assert "loss scale falling: 128 (2^7) at step 2, 2 (2^1) at step 8" in finding["evidence"][1]
    assert any("the logged loss is inf since step 2" in line for line in finding["evidence"])


@pytest.mark.parametrize("finite", [True, False])
def test_a_short_overflow_streak_at_the_end_is_a_problem_only_when_the_loss_went_non_finite(finite):
    # 100 clean steps, then 6 overflowing ones to the end: a short burst (healthy) unless the logged loss is not
    # finite there (the forward overflows: no scale backing off makes the loss inf).
    series = {tag: points[:106] for tag, points in _dynamic_scale(set(range(100, 106))).items()}
    series["loss"] = [(s, 3.0 if finite or s < 100 else math.nan) for s in range(106)]
    diagnosis = doctor.diagnose_scalars(series)
    assert diagnosis.exit_status == (0 if finite else 1)
    if not finite:
        assert diagnosis.findings[0].kind == "persistent_overflow" and diagnosis.findings[0].since_step == 100


def _dynamic_scale(overflow_steps: set[int], start: float = 2.0**10) -> dict[str, list[tuple[int, float]]]:
    scale, skipped = start, 0
    series: dict[str, list[tuple[int, float]]] = {"mpx/loss_scale": [], "mpx/overflows": [], "mpx/skipped_steps": []}
    for step in range(200):
        if step in overflow_steps:
            scale, skipped = max(1.0, scale / 2), skipped + 1
        series["mpx/loss_scale"].append((step, scale))
        series["mpx/overflows"].append((step, float(step in overflow_steps)))
        series["mpx/skipped_steps"].append((step, float(skipped)))
    return series


def test_accumulated_steps_logged_every_three_and_resumed_into_the_same_version_report_the_facts(tmp_path):
    # Micro-batches 0, 5, 9, 13, 14, 17 overflow: steps 0, 2, 4, 6, 7, 8 are skipped (one skip per step, whichever
    # micro-batch). Logged at steps 2, 5, 8, 11, each count covering the three steps since the previous log; the scale
    # halves on a skip and doubles after two clean steps from 2^10.
    bad = {0, 5, 9, 13, 14, 17}
    _fit(tmp_path / "whole", bad, 12)
    _fit(tmp_path / "resumed", bad, 6, save=str(tmp_path / "half.ckpt"))
    _fit(tmp_path / "resumed", bad, 12, ckpt=str(tmp_path / "half.ckpt"))
    facts = {
        "mpx/loss_scale": [(2, 256.0), (5, 128.0), (8, 16.0), (11, 32.0)],
        "mpx/overflows": [(2, 2.0), (5, 1.0), (8, 3.0), (11, 0.0)],
        "mpx/skipped_steps": [(2, 2.0), (5, 3.0), (8, 6.0), (11, 6.0)],
    }
    for run in ("whole", "resumed"):
        read = read_run(tmp_path / run)
        assert read.restarts == ()
        assert {tag: read.series[tag] for tag in facts} == facts
        assert read.series["mpx/overflow/a"] == facts["mpx/overflows"]
    # The CSV logger's rows of the whole run (a resume into its version_0 deletes the earlier rows: Lightning's).
    with open(tmp_path / "whole" / "csv" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row["mpx/overflows"]]
    assert [(int(r["step"]), float(r["mpx/loss_scale"]), float(r["mpx/overflows"])) for r in rows] == [
        (step, scale, count) for (step, scale), (_, count) in zip(facts["mpx/loss_scale"], facts["mpx/overflows"])
    ]
    assert doctor.diagnose(str(tmp_path / "resumed")).exit_status == 0


# -- tied input/output embeddings at O2 -------------------------------------------------------------------------------
def _tied_gpt2_losses(tmp_path: Path, precision: str, first: int = 0, load: bool = False, save: bool = False):
    """A tied GPT-2 (one Parameter for ``wte`` and ``lm_head``) trained by Fabric from step ``first`` to 6;
    ``tie_weights()`` called again at step 2 (after set-up); ``load``/``save`` the Fabric checkpoint of step 3."""
    from lightning.fabric import Fabric
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_mpx import FabricMixedPrecisionPlugin

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, tie_word_embeddings=True)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    net = GPT2LMHeadModel(config)
    mpx = FabricMixedPrecisionPlugin(precision, half_dtype="bfloat16") if precision.startswith("O") else None
    fabric = Fabric(accelerator="cpu", devices=1, **({"plugins": [mpx]} if mpx else {"precision": precision}))
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, **({"mpx": mpx} if mpx else {})}
    if load:
        fabric.load(tmp_path / "tied.ckpt", state)
    torch.manual_seed(1)
    data = torch.randint(0, 64, (6, 4, 8))
    losses = []
    for step in range(first, 6):
        if step == 2:
            net.tie_weights()
        if step == 3 and save:
            fabric.save(tmp_path / "tied.ckpt", state)
        loss = model(input_ids=data[step], labels=data[step]).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert net.lm_head.weight is net.transformer.wte.weight
    return losses, net, mpx


def test_a_tied_gpt2_at_o2_keeps_one_weight_through_retie_resume_and_save_pretrained(tmp_path):
    from transformers import GPT2LMHeadModel

    reference, _, _ = _tied_gpt2_losses(tmp_path, "bf16-mixed")
    losses, net, mpx = _tied_gpt2_losses(tmp_path, "O2", save=True)
    assert losses == pytest.approx(reference, abs=5e-3)
    resumed, again, mpx_again = _tied_gpt2_losses(tmp_path, "O2", first=3, load=True)
    assert resumed == losses[3:]  # bit for bit
    masters = mpx.amp.fp32_state_dict(net)
    assert torch.equal(mpx_again.amp.fp32_state_dict(again)["lm_head.weight"], masters["lm_head.weight"])
    net.save_pretrained(tmp_path / "hf")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight and loaded.dtype == torch.float32
    assert torch.equal(loaded.lm_head.weight, masters["transformer.wte.weight"])


# -- the underflow groups of a wrapped Hugging Face model --------------------------------------------------------------
class _Holder(nn.Module):
    """A user's wrapper whose one child is the Hugging Face model (a LightningModule's ``self.net``)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("lora", [False, True])
def test_a_wrapped_tied_gpt2s_underflow_groups_are_its_modules_not_the_whole_model(lora):
    # Tied, every parameter sits under net.transformer (lm_head's weight is wte's): the groups stopped at the first
    # lone wrapper, one group, "net.transformer" (with peft "net.base_model", adapters and all), for the whole model,
    # and the doctor could never name the module with heavy underflow. They are the modules below the wrappers.
    import peft
    from lightning.fabric import Fabric
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_mpx import FabricMixedPrecisionPlugin

    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    if lora:  # the adapters and a trained copy of the position embedding (modules_to_save)
        config = peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, modules_to_save=["wpe"])
        net = peft.get_peft_model(net, config)
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    model = fabric.setup_module(_Holder(net))
    optimizer = fabric.setup_optimizers(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    mpx.request_telemetry()
    fabric.backward(model(torch.randint(0, 64, (2, 8))))
    optimizer.step()
    groups = {key.split("/", 2)[2] for key in mpx.metrics() if key.startswith("mpx/underflow/")}
    body = "net.base_model.model.transformer" if lora else "net.transformer"
    expected = {f"{body}.h", f"{body}.wpe"} if lora else {f"{body}.{m}" for m in ("h", "wte", "wpe", "ln_f")}
    assert groups == expected


# -- two TensorBoard loggers of one run into one RUN_DIR -------------------------------------------------------------
def test_two_tensorboard_loggers_written_at_once_are_not_a_restart(tmp_path):
    # Before: folders of one version number were read whole, by their first point's time: the second logger's step 2
    # after the first's step 8 read as a restart ("the steps went back from 8 to 2"). Written at once, they interleave.
    from torch.utils.tensorboard import SummaryWriter

    writers = [SummaryWriter(str(tmp_path / "version_0")), SummaryWriter(str(tmp_path / "second" / "version_0"))]
    for step, scale in ((2, 256.0), (5, 128.0), (8, 512.0)):
        for writer in writers:  # Lightning logs each step to every logger in turn
            writer.add_scalar("mpx/loss_scale", scale, step)
            writer.add_scalar("mpx/overflows", 1.0, step)
            writer.flush()
    for writer in writers:
        writer.close()
    read = read_run(tmp_path)
    assert read.series["mpx/overflows"] == [(2, 1.0), (5, 1.0), (8, 1.0)]
    assert read.restarts == ()
