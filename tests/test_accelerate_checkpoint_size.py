"""Checkpoint bytes and round trips (stop 60): at O2 Accelerate's ``save_state`` writes each FP32 master once.

Measured (``python benchmarks/checkpoint_size.py``: a 525,568-parameter MLP, AdamW, two steps, bfloat16, CPU; the
checkpoint's bytes against the framework's own precision on the same model):

| door (AdamW, 2 steps) | own precision | own MB | O1 MB | O2 MB | O3 MB |
|---|---|---|---|---|---|
| Trainer ``save_checkpoint`` | bf16-mixed | 6.32 | 6.32 | 6.32 | 3.16 |
| Fabric ``fabric.save`` (model, optimizer, plugin) | bf16-mixed | 6.31 | 6.31 | 6.31 | 3.16 |
| Accelerate ``save_state`` | bf16 | 6.33 | 6.33 | 6.33 (8.44 before: masters twice) | 3.18 |
| core ``Amp``: model, optimizer, ``amp.state_dict()`` | autocast | 6.31 | 6.31 | 7.37 | 3.16 |
| Apex layer: model, optimizer, ``amp.state_dict()`` | autocast | 6.31 | 6.31 | 6.31 (8.42 before this stop) | 4.21 |

(docs/benchmarks.md, "Checkpoint sizes", says what the core and Apex rows keep twice and why). At O2 the model files
hold the FP32 masters (a prepared model's state dict gives them), so lightning_mpx_amp.bin names them instead of holding
them; ``load_state`` loads the model files after the engine's file, and they give the masters exactly. A file written
before (masters inside) still loads. Every resume is into new objects (a fresh Accelerator, model and optimizer: a new
process) and goes on bit for bit as the uninterrupted run (the same CPU kernels).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402
from lightning_mpx.integrations.accelerate_checkpoint import AMP_STATE_NAME, write_amp_state  # noqa: E402
from tests.accelerate_helpers import reset_accelerate_state  # noqa: E402

WIDTH = 64


def _prepared(seed: int, spec: str = "O2") -> tuple[Any, Any, Any]:
    from accelerate import Accelerator as Upstream

    reset_accelerate_state()
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH))
    if spec == "bf16":
        accelerator = Upstream(mixed_precision="bf16", cpu=True)
    else:
        kwargs = MixedPrecisionKwargs(half_dtype=torch.bfloat16, loss_scale="dynamic", init_scale=2.0**8)
        accelerator = Accelerator(mixed_precision=spec, cpu=True, kwargs_handlers=[kwargs])
    return (accelerator, *accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2)))


def _steps(accelerator: Any, model: nn.Module, optimizer: Any, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))
        loss = (model(x).float() - x.flip(1)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _trained(accelerator: Any, optimizer: Any) -> list[torch.Tensor]:
    amp = getattr(accelerator, "amp", None)
    inner = optimizer.optimizer
    params = amp.master_params(inner) if amp is not None else inner.param_groups[0]["params"]
    return [p.detach().clone() for p in params]


def _sizes(folder: Any) -> dict[str, int]:
    return {name: os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)}


@pytest.mark.parametrize("written_by", ["this release", "the release before"])
def test_accelerate_o2_save_state_writes_each_master_once_and_resumes_bit_for_bit_in_new_objects(
    tmp_path, fresh_accelerate_state, written_by
) -> None:
    """k steps, ``save_state``, a new Accelerator, model (another init) and optimizer, ``load_state``, n-k steps: the
    losses, masters and scale of n uninterrupted steps, bit for bit; the checkpoint no larger than Accelerate's own
    "bf16" one of the same model (it was larger by the masters' 4 bytes a parameter). "the release before": the
    engine's file as it wrote it (``write_amp_state`` of the engine's whole state, masters inside), which loads too."""
    accelerator, model, optimizer = _prepared(0)
    want = _steps(accelerator, model, optimizer, 0, 5)
    want_trained, want_scale = _trained(accelerator, optimizer), float(accelerator.amp.scalers[0].scale_tensor)

    accelerator, model, optimizer = _prepared(0)
    got = _steps(accelerator, model, optimizer, 0, 3)
    accelerator.save_state(str(tmp_path / "o2"))
    params = sum(p.numel() for p in model.parameters())
    engine_file = _sizes(tmp_path / "o2")[AMP_STATE_NAME]
    assert engine_file < params, f"{AMP_STATE_NAME}: {engine_file} bytes for {params} parameters (the masters twice)"
    if written_by == "the release before":
        write_amp_state(accelerator.amp.state_dict(), str(tmp_path / "o2"), accelerator.amp.scalers)
        assert _sizes(tmp_path / "o2")[AMP_STATE_NAME] > 4 * params  # the masters inside, as that release wrote them
    else:
        bf16, bf16_model, bf16_optimizer = _prepared(0, "bf16")
        _steps(bf16, bf16_model, bf16_optimizer, 0, 1)
        bf16.save_state(str(tmp_path / "bf16"))
        ours, theirs = sum(_sizes(tmp_path / "o2").values()), sum(_sizes(tmp_path / "bf16").values())
        assert ours <= theirs + 8192, (_sizes(tmp_path / "o2"), _sizes(tmp_path / "bf16"))

    accelerator, model, optimizer = _prepared(1)  # another init: nothing below comes from this run's weights
    accelerator.load_state(str(tmp_path / "o2"))
    got += _steps(accelerator, model, optimizer, 3, 2)
    assert got == want
    for g, w in zip(_trained(accelerator, optimizer), want_trained):
        assert torch.equal(g, w)
    assert float(accelerator.amp.scalers[0].scale_tensor) == want_scale


def test_accelerate_o2_save_state_loads_under_accelerate_bf16_and_back_into_o2(
    tmp_path, fresh_accelerate_state
) -> None:
    """The lean checkpoint switches precision: Accelerate's own "bf16" loads its FP32 weights (the masters) and AdamW
    moments; its checkpoint loaded back at O2 (the documented way: model then optimizer files) gives them exactly."""
    from safetensors.torch import load_file

    accelerator, model, optimizer = _prepared(0)
    _steps(accelerator, model, optimizer, 0, 2)
    accelerator.save_state(str(tmp_path / "o2"))
    want = _trained(accelerator, optimizer)
    moments = [s["exp_avg"].clone() for s in optimizer.optimizer.state.values()]

    bf16, model, optimizer = _prepared(1, "bf16")
    bf16.load_state(str(tmp_path / "o2"))
    for g, w in zip(_trained(bf16, optimizer), want):
        assert torch.equal(g, w)
    for g, w in zip([s["exp_avg"] for s in optimizer.optimizer.state.values()], moments):
        assert torch.equal(g, w)
    bf16.save_state(str(tmp_path / "bf16"))

    accelerator, model, optimizer = _prepared(2)
    accelerator.unwrap_model(model).load_state_dict(load_file(str(tmp_path / "bf16" / "model.safetensors")))
    optimizer.load_state_dict(torch.load(str(tmp_path / "bf16" / "optimizer.bin")))
    for g, w in zip(_trained(accelerator, optimizer), want):
        assert torch.equal(g, w)
    _steps(accelerator, model, optimizer, 2, 1)
