"""A hostile user of stop 52's own changes: what the masters start from.

* Stop 52 stopped taking handed-over FP32 values under a process group (ranks may disagree). A group of ONE rank
  (``Trainer(strategy="ddp", devices=1)``, ``torchrun --nproc_per_node=1``) counted as one too, and so did the
  older rule that a first stage's masters start from the model's half rounding: such a run trained from weights
  rounded to bfloat16, where the same run without the group (and ``bf16-mixed``) keeps its FP32 weights. Now a group
  of one rank is a single process.
* The Accelerate adapter now picks bfloat16 on a CPU. A user who loads the model in float16 (``model.half()``,
  ``torch_dtype=torch.float16``) got masters made from the bfloat16 rounding of the float16 weights (only an FP32
  model's values were kept through the cast). Now any other floating dtype's values are kept, in FP32 (exact from
  float16).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("lightning.pytorch")

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402
from tests.launch import one_process_group  # noqa: E402
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer  # noqa: E402


def _stages(strategy: str) -> list[dict[str, torch.Tensor]]:
    """Two fits with a new plugin each (stop 52's handover); the FP32 masters after each, cloned."""
    model, data, out = Classifier(), loader(classification_data(n=32, seed=3), batch_size=8), []
    for _ in range(2):
        trainer = make_trainer(MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16), strategy=strategy, max_steps=2,
                               use_distributed_sampler=False)
        trainer.fit(model, data)
        out.append({k: v.detach().clone() for k, v in trainer.precision_plugin.amp.fp32_state_dict(model).items()})
    return out


def test_a_one_rank_ddp_trainer_at_o2_trains_as_the_single_process_run() -> None:
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already set up in this process")
    single = _stages("auto")  # no process group
    with one_process_group():  # a group of one rank, as a torchrun --nproc_per_node=1 script has
        ddp = _stages("ddp")  # (Lightning joins the group there is)
        assert torch.distributed.get_world_size() == 1
    for stage, (want, got) in enumerate(zip(single, ddp)):
        for name, value in want.items():
            # Rounded to bfloat16 at the start (first stage) or at the handover (second): ~1e-3 apart.
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=f"stage {stage}: {name}")


def _accelerate_run(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Three O2 steps of the Accelerate adapter on the CPU (no half_dtype: bfloat16), masters before and after."""
    from lightning_mpx.accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="O2", cpu=True)
    assert accelerator.mpx_kwargs.half_dtype == "bfloat16"
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    start = {k: v.clone() for k, v in accelerator.get_state_dict(model, unwrap=False).items()}
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(8, 8, generator=g)
        accelerator.backward(model(x).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    return start, {k: v.clone() for k, v in accelerator.get_state_dict(model, unwrap=False).items()}


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_o2_on_a_cpu_trains_a_float16_loaded_model_from_its_float16_values() -> None:
    torch.manual_seed(0)
    loaded = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).half()  # as the user loaded it
    values = {k: v.float() for k, v in loaded.state_dict().items()}
    same_in_fp32 = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    same_in_fp32.load_state_dict(values)  # the reference: the same weights, exactly, loaded in FP32
    want_start, want_end = _accelerate_run(same_in_fp32)
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()  # a second Accelerator in the process, as a new script would have
    got_start, got_end = _accelerate_run(loaded)
    for name, value in values.items():
        assert got_start[name].dtype == torch.float32, name
        assert torch.equal(got_start[name], value), name  # was their bfloat16 rounding
        assert torch.equal(want_start[name], value), name
        torch.testing.assert_close(got_end[name], want_end[name], rtol=0, atol=0, msg=name)


def test_an_ema_checkpoint_at_o2_holds_the_average_bf16_mixed_holds(tmp_path: Any) -> None:
    """``EMAWeightAveraging`` + ``ModelCheckpoint`` with a validation loop: the checkpoint's ``state_dict`` is the
    average (what ``load_from_checkpoint`` gives). At O2 it averaged the half weights: as far from ``"bf16-mixed"``'s
    average as their rounding (5e-4), where the trained weights themselves (``current_model_state``) agree."""
    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint

    saved = {}
    for precision in ("O2", "bf16-mixed"):
        kwargs: dict[str, Any] = dict(
            max_epochs=2,
            enable_checkpointing=True,
            callbacks=[EMAWeightAveraging(decay=0.9), ModelCheckpoint(dirpath=tmp_path / precision, save_top_k=-1)],
        )
        if precision == "O2":
            trainer = make_trainer(MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16), **kwargs)
        else:
            trainer = make_trainer(precision=precision, **kwargs)
        data = loader(classification_data(n=32, seed=1), batch_size=8)
        trainer.fit(Classifier(), data, loader(classification_data(n=8, seed=2), batch_size=8))
        saved[precision] = [torch.load(p, weights_only=False) for p in sorted((tmp_path / precision).iterdir())]
    assert len(saved["O2"]) == len(saved["bf16-mixed"]) == 2
    for ours, theirs in zip(saved["O2"], saved["bf16-mixed"]):
        for key in ("current_model_state", "state_dict"):
            for name, value in theirs[key].items():
                assert ours[key][name].dtype == torch.float32, name
                torch.testing.assert_close(ours[key][name], value, rtol=0, atol=2e-5, msg=f"{key}: {name}")


def test_stochastic_weight_averaging_at_o2_averages_the_masters_as_bf16_mixed_its_weights() -> None:
    """``StochasticWeightAveraging`` writes its average into the model at the end of ``fit`` (the masters take it):
    it averaged the half weights, 6e-4 from ``"bf16-mixed"``'s average."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    final = {}
    for precision in ("O2", "bf16-mixed"):
        averaging = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
        kwargs: dict[str, Any] = dict(max_epochs=3, callbacks=[averaging])
        model, data = Classifier(), loader(classification_data(n=32, seed=1), batch_size=8)
        if precision == "O2":
            trainer = make_trainer(MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16), **kwargs)
            trainer.fit(model, data)
            final[precision] = trainer.precision_plugin.amp.fp32_state_dict(model)
        else:
            make_trainer(precision=precision, **kwargs).fit(model, data)
            final[precision] = model.state_dict()
    for name, value in final["bf16-mixed"].items():
        torch.testing.assert_close(final["O2"][name], value, rtol=0, atol=2e-5, msg=name)
