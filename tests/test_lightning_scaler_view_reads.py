"""A careless user of ``plugin.scaler`` (the read-only ``GradScalerView``): reads on rank 0 only under DDP, reads in
every Trainer hook and under accumulation, reads between a Fabric GAN's two optimizer steps, before ``fit`` and after
``validate`` only, ``num_losses=2``, ``copy.deepcopy(plugin)``; each against Lightning's/Fabric's own ``"16-mixed"``
(a ``torch.amp.GradScaler``) or the same code without the read.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.launch import rank_results, run_script
from tests.lightning_helpers import make_trainer

SCALING = {"init_scale": 256.0, "growth_interval": 2}
X = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))


def test_rank_zero_only_reads_under_ddp_neither_hang_nor_split_the_ranks_scales(tmp_path: Path) -> None:
    """One launch of ``tests/lightning_scaler_view_reads_script.py``: float16, overflows on rank 1 only, the scale read
    on rank 0 only (``if fabric.global_rank == 0``; a ``@rank_zero_only`` callback's ``on_before_optimizer_step`` and
    ``on_train_batch_end``), with and without ``skip_on_device``: no hang, rank 0 reads what ``"16-mixed"`` reads at
    the same points, and both ranks end with the same scale and weights."""
    run_script("lightning_scaler_view_reads_script.py", tmp_path, timeout=180)
    zero, one = rank_results(tmp_path)
    for front in ("fabric", "trainer"):
        native = zero[f"{front}-native"]
        assert len(native["seen"]) >= 7 and len(set(s for *_, s in map(_flat, native["seen"]))) > 1  # it moved
        for kind in ("plain", "skip_on_device"):
            ours, other = zero[f"{front}-{kind}"], one[f"{front}-{kind}"]
            assert ours["seen"] == native["seen"], (front, kind)
            assert other["seen"] == []
            assert ours["final"] == other["final"] == native["final"]
            assert ours["weights"] == other["weights"]
            assert abs(ours["weights"] - native["weights"]) < 1e-3


def _flat(item: Any) -> tuple[Any, ...]:
    return tuple(item) if isinstance(item, list) else (item,)


class _Reads(pl.LightningModule):
    """Reads ``trainer.precision_plugin.scaler.get_scale()`` in every hook a ``"16-mixed"`` module might."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        self.seen: list[tuple[str, float]] = []

    def _read(self, where: str) -> None:
        self.seen.append((where, self.trainer.precision_plugin.scaler.get_scale()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._read("training_step")
        loss = self.net(batch[0]).float().pow(2).mean()
        return loss * float("inf") if batch_idx in (2, 3) else loss

    def on_after_backward(self) -> None:
        self._read("on_after_backward")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self._read("on_before_optimizer_step")

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        self._read("configure_gradient_clipping")
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def on_train_batch_end(self, *args: Any) -> None:
        self.seen.append(("on_train_batch_end", self.trainer.scaler.get_scale()))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._read("validation_step")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _fit(plugin: Any, **kwargs: Any) -> tuple[_Reads, pl.Trainer]:
    model = _Reads()
    trainer = make_trainer(plugin, gradient_clip_val=1.0, **kwargs)
    trainer.fit(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X), batch_size=4))
    return model, trainer


def test_reads_in_every_hook_under_accumulation_match_16_mixed_and_lose_no_step() -> None:
    """Reads in ``training_step``, ``on_after_backward``, ``on_before_optimizer_step``,
    ``configure_gradient_clipping`` and ``on_train_batch_end`` with ``accumulate_grad_batches=2`` (a read between two
    accumulated backwards ends nothing): Lightning's ``"16-mixed"``'s scales at each point, and its weights."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    ours, _ = _fit(MixedPrecisionPlugin("O2", half_dtype="float16", **SCALING), accumulate_grad_batches=2)
    native, _ = _fit(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SCALING)),
                     accumulate_grad_batches=2)
    assert len(native.seen) == 8 * 3 + 4 * 2 and len({s for _, s in native.seen}) > 1
    assert ours.seen == native.seen
    for mine, theirs in zip(ours.parameters(), native.parameters()):
        torch.testing.assert_close(mine.float(), theirs.float(), atol=2e-3, rtol=0)


def test_reads_before_fit_after_validate_only_with_two_losses_and_of_a_deep_copy() -> None:
    """Before ``trainer.fit`` (no engine connected): the configured scale, making no device state; after
    ``trainer.validate`` only: still the configured scale (no backward ran); ``num_losses=2``: loss 0's, as
    ``mpx/loss_scale/loss0``; a deep copy of the plugin reads its settings (a fresh engine, as its pickle)."""
    plugin = MixedPrecisionPlugin("O2", half_dtype="float16", **SCALING)
    assert plugin.scaler.get_scale() == 256.0 and plugin.scaler._scale is None
    model = _Reads()
    trainer = make_trainer(plugin)
    trainer.validate(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X), batch_size=4))
    assert trainer.scaler.get_scale() == 256.0 and model.seen[-1] == ("validation_step", 256.0)
    assert plugin.amp.scalers[0].device is None

    two = MixedPrecisionPlugin("O2", half_dtype="float16", num_losses=2, **SCALING)
    model, trainer = _fit(two, max_steps=8)
    assert trainer.scaler.get_scale() == two.metrics()["mpx/loss_scale/loss0"] == model.seen[-1][1] != 256.0
    copied = copy.deepcopy(two)
    assert copied.amp is not two.amp and copied.scaler.get_scale() == 256.0
    assert trainer.scaler.get_scale() == model.seen[-1][1]  # the copy took nothing from the original


def _gan(mpx: FabricMixedPrecisionPlugin | None, read: bool, register: bool = False) -> list[torch.Tensor]:
    """A Fabric GAN that runs both backwards, then D's step, a read of the scale, G's step (growth every
    iteration); ``mpx=None``: FP32."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx] if mpx is not None else None,
                    precision=None if mpx is not None else "32-true")
    torch.manual_seed(0)
    g_net, d_net = nn.Linear(4, 4), nn.Linear(4, 1)
    g, g_opt = fabric.setup(g_net, torch.optim.SGD(g_net.parameters(), lr=0.1))
    d, d_opt = fabric.setup(d_net, torch.optim.SGD(d_net.parameters(), lr=0.1))
    if register and mpx is not None:
        mpx.setup_optimizers(g_opt, d_opt)
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        fabric.backward(d(x).float().pow(2).mean())
        fabric.backward(g(x).float().pow(2).mean())
        d_opt.step()
        if read:
            fabric._precision.scaler.get_scale()
        g_opt.step()
        d_opt.zero_grad()
        g_opt.zero_grad()
    return [p.detach().float().clone() for p in (*g_net.parameters(), *d_net.parameters())]


def _max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want))


def _fp16() -> FabricMixedPrecisionPlugin:
    return FabricMixedPrecisionPlugin("O2", half_dtype="float16", init_scale=256.0, growth_interval=1)


def test_a_read_between_a_gans_steps_keeps_the_registered_generators_gradients() -> None:
    """With the optimizers known to the plugin (``mpx.setup_optimizers``), a read after D's step ends the
    iteration there, and G's step unscales its gradients with the scale they were computed with: the weights of
    the same loop without the read, and FP32's."""
    fp32 = _gan(None, read=False)
    with_read = _gan(_fp16(), read=True, register=True)
    assert _max_error(with_read, _gan(_fp16(), read=False, register=True)) < 1e-6
    assert _max_error(with_read, fp32) < 1e-3


# Without mpx.setup_optimizers (G met at its first step, after the read's update):
# tests/test_fabric_gan_scale_update.py.


# -- the HF Trainer's checkpoints at O2 -------------------------------------------------------------------------------
def test_hf_trainer_o2_best_model_rotation_and_mid_training_export(tmp_path: Path) -> None:
    """``save_total_limit=1`` with ``load_best_model_at_end`` (``metric_for_best_model="eval_loss"``), accumulation
    with ``max_grad_norm``, a callback that calls ``trainer.save_model`` mid-training, then ``save_model`` at the end
    (a resume from the latest held too, and is tested in tests/test_hf_trainer.py): the weights track transformers'
    ``bf16=True`` run; each export loads with ``from_pretrained`` as FP32 with the masters' values."""
    transformers = pytest.importorskip("transformers")
    from lightning_mpx.accelerate import mpx_trainer
    from tests.accelerate_helpers import accelerate_state_reset
    from tests.test_hf_trainer import GPT2, SCALED, lm_data

    class SaveMid(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1:
                made.save_model(str(tmp_path / f"mid-{level}"))

    def run(max_steps: int) -> tuple[dict[str, torch.Tensor], Any]:
        torch.manual_seed(0)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(level)), use_cpu=True, report_to=[], max_steps=max_steps,
            per_device_train_batch_size=4, learning_rate=1e-3, disable_tqdm=True, optim="adamw_torch",
            save_strategy="steps", save_steps=1, save_total_limit=1, eval_strategy="steps", eval_steps=1,
            load_best_model_at_end=True, metric_for_best_model="eval_loss", gradient_accumulation_steps=2,
            max_grad_norm=0.5, bf16=level is None, logging_steps=1,
        )  # fmt: skip
        kwargs: dict[str, Any] = dict(model=transformers.GPT2LMHeadModel(GPT2), args=args, train_dataset=lm_data(),
                                      eval_dataset=lm_data(8), callbacks=[SaveMid()])
        trainer = (transformers.Trainer(**kwargs) if level is None
                   else mpx_trainer()(**kwargs, opt_level=level, mpx_kwargs=SCALED))
        nonlocal made
        made = trainer
        trainer.train()
        if level is not None:
            trainer.save_model(str(tmp_path / "final"))  # inside its Accelerate state
        amp = None if level is None else trainer.accelerator.amp
        weights = trainer.model.state_dict() if amp is None else amp.fp32_state_dict(trainer.model)
        return {k: v.float().clone() for k, v in weights.items()}, trainer

    made: Any = None
    results = {}
    for level in (None, "O2"):
        with accelerate_state_reset():
            results[level] = run(2)
    ours, trainer = results["O2"]
    assert max((ours[k] - results[None][0][k]).abs().max().item() for k in ours) < 1e-2
    assert trainer.state.best_model_checkpoint is not None
    assert len(list((tmp_path / "O2").glob("checkpoint-*"))) <= 2  # the best and the latest at most
    for exported, values in ((tmp_path / "final", ours), (tmp_path / "mid-O2", None)):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(exported))
        assert loaded.config.torch_dtype == torch.float32 and loaded.dtype == torch.float32
        if values is not None:
            state = loaded.state_dict()
            assert max((state[k] - values[k]).abs().max().item() for k in values if k in state) == 0.0


# -- Fabric's generate at O2 ------------------------------------------------------------------------------------------
def test_fabric_o2_whisper_generate_marked_sampled_in_inference_mode_and_after_load_as_bf16_mixed(tmp_path) -> None:
    """A set-up Whisper's ``generate`` (float ``input_features``) marked or not, greedy and sampled, under
    ``torch.inference_mode()``, after ``eval()``/``train()``, its scores' dtype, and a fresh set-up model after
    ``fabric.load`` of the checkpoint: the tokens of Fabric's ``"bf16-mixed"``."""
    pytest.importorskip("transformers")
    import warnings

    from tests.test_core_step_returns_save_pretrained import _fabric, _whisper

    features = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))

    def generate(model: Any, sample: bool = False, inference: bool = False) -> torch.Tensor:
        if sample:
            torch.manual_seed(5)
        with torch.inference_mode() if inference else torch.enable_grad():
            out = model.generate(input_features=features, max_new_tokens=3, do_sample=sample,
                                 return_dict_in_generate=True, output_scores=True)
        assert out.scores[0].dtype == torch.float32
        return out.sequences

    def run(precision: str) -> list[torch.Tensor]:
        fabric = _fabric(precision)
        net = _whisper()
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        got = [generate(model, inference=True), generate(model.eval(), sample=True)]
        model.mark_forward_method("generate")
        got += [generate(model.train(), sample=True, inference=True)]
        fabric.save(tmp_path / f"{precision}.ckpt", {"model": model, "optimizer": optimizer})
        fresh = _fabric(precision)
        other = _whisper()
        with torch.no_grad():
            for p in other.parameters():
                p.mul_(0.5)
        model2, optimizer2 = fresh.setup(other, torch.optim.SGD(other.parameters(), lr=0.1))
        fresh.load(tmp_path / f"{precision}.ckpt", {"model": model2, "optimizer": optimizer2})
        return got + [generate(model2.train(), inference=True)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, theirs = run("O2"), run("bf16-mixed")
    for mine, want in zip(ours, theirs):
        assert torch.equal(mine, want)
