"""Hostile review of stop 60's first merged changes.

1. ``convert_module`` swaps a tensor-parallel ``DTensor`` parameter whole (``torch.utils.swap_tensors``, as
   ``nn.Module.to`` does). ``shard_model`` at O3 with an ``fp32_modules`` unit then made that unit FP32 again with
   ``.data =`` (``_module_to_fp32``, ``restore_fp32_tensors``): the DTensor said float32, its local shard stayed
   bfloat16, and ``fully_shard`` sharded the bfloat16 shard: the FP32 unit was silently half, its exact values lost.
   Every in-place dtype change of a parameter now goes through ``common.dtypes.set_param_data``. A swap torch refuses
   (a weak reference to the parameter) names the parameter. As with ``nn.Module.to``, hooks and attributes set on a
   DTensor parameter before the cast do not survive it (not asserted: torch's behaviour).
2. Accelerate ``save_state`` at O2 leaves each FP32 master to the model files. A ``register_save_state_pre_hook``
   registered by the user ran after the engine's, so a hook that casts the weights to bfloat16 (a lean model file)
   left the checkpoint without its masters: the resume took their rounding. The engine's hook now stays last, sees
   the cast weights and keeps the masters in its file (the fallback, untested before). GPT-2's tied
   ``wte``/``lm_head`` (safetensors keeps one name), a missing model file and a level switch held.
"""

from __future__ import annotations

import os
import weakref

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402
from lightning_mpx.integrations.accelerate_checkpoint import AMP_STATE_NAME  # noqa: E402
from tests.accelerate_helpers import reset_accelerate_state  # noqa: E402
from tests.test_accelerate_checkpoint_size import _prepared, _steps, _trained  # noqa: E402


@pytest.fixture
def mesh(tmp_path):
    """A (data 1 x tensor 1) mesh of a real one-process gloo group."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    finally:
        torch.distributed.destroy_process_group()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


def _tp_net(mesh) -> _Net:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    return parallelize_module(_Net(), mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel()})


def test_shard_model_o3_fp32_unit_of_a_tensor_parallel_model_stays_fp32_with_its_exact_values(mesh) -> None:
    """O3, ``fp32_modules=["b"]`` (b rowwise-parallel): b's parameters FP32 (the DTensor and its local shard) with
    the values they had, the rest bfloat16; a step runs."""
    from lightning_mpx import MixedPrecisionSettings
    from lightning_mpx.integrations.fsdp import shard_model

    model = _tp_net(mesh)
    before = {n: p.full_tensor().clone() for n, p in model.b.named_parameters()}
    settings = MixedPrecisionSettings("O3", half_dtype=torch.bfloat16, fp32_modules=["b"])
    shard_model(model, settings, mesh=mesh["dp"])
    for name, param in model.named_parameters():
        assert param.dtype == param.to_local().dtype, f"{name}: {param.dtype}, its local shard {param.to_local().dtype}"
        assert param.dtype == (torch.float32 if name.startswith("b.") else torch.bfloat16), (name, param.dtype)
    for name, param in model.b.named_parameters():
        assert torch.equal(param.full_tensor(), before[name]), name
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8).bfloat16()).float().pow(2).mean().backward()
    optimizer.step()


def test_convert_module_names_a_tensor_parallel_parameter_torch_cannot_swap(mesh) -> None:
    """A weak reference to a tensor-parallel parameter: torch refuses the swap (as it refuses ``model.to``); the
    error names the parameter and the cause."""
    from lightning_mpx.masters.weights import convert_module

    model = _tp_net(mesh)
    ref = weakref.ref(model.a.weight)
    with pytest.raises(RuntimeError, match=r"Linear parameter \(DTensor\).*weak reference"):
        convert_module(model, torch.bfloat16)
    assert ref() is model.a.weight


def test_accelerate_o2_save_hook_casting_weights_keeps_the_masters_and_resumes_exactly(
    tmp_path, fresh_accelerate_state
) -> None:
    """A save hook that writes a bfloat16 model file: the engine's file keeps the FP32 masters, and a new
    Accelerator's ``load_state`` resumes on them exactly (before: the masters were the bfloat16 rounding)."""
    accelerator, model, optimizer = _prepared(0)
    _steps(accelerator, model, optimizer, 0, 2)
    want = _trained(accelerator, optimizer)

    def lean_model_file(models, weights, output_dir):
        for values in weights:
            for key in list(values):
                values[key] = values[key].to(torch.bfloat16)

    accelerator.register_save_state_pre_hook(lean_model_file)
    accelerator.save_state(str(tmp_path))
    params = sum(p.numel() for p in model.parameters())
    assert os.path.getsize(tmp_path / AMP_STATE_NAME) > 4 * params  # the masters, once, in the engine's file
    accelerator, model, optimizer = _prepared(1)
    accelerator.load_state(str(tmp_path))
    for got, w in zip(_trained(accelerator, optimizer), want):
        assert torch.equal(got, w)


class _TiedLM(nn.Module):
    """GPT-2's layout: ``lm_head.weight`` is ``wte.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.mid = nn.Embedding(50, 16), nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 50, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mid(self.wte(x))))


def _tied(seed: int, spec: str = "O2"):
    reset_accelerate_state()
    torch.manual_seed(seed)
    kwargs = MixedPrecisionKwargs(half_dtype=torch.bfloat16, loss_scale="dynamic", init_scale=2.0**8)
    accelerator = Accelerator(mixed_precision=spec, cpu=True, kwargs_handlers=[kwargs])
    net = _TiedLM()
    return (accelerator, *accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2)))


def _lm_steps(accelerator, model, optimizer, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        x = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(step))
        loss = model(x).float().logsumexp(-1).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_accelerate_o2_tied_embedding_checkpoint_is_lean_and_resumes_bit_for_bit_and_at_o1(
    tmp_path, fresh_accelerate_state
) -> None:
    """safetensors keeps one name of the tied pair (``wte.weight``): the engine's file still names no master twice,
    a new Accelerator at O2 goes on as the uninterrupted run, one at O1 (a level switch) loads the exact masters, and
    without the model file ``load_state`` fails rather than training on the fresh model's weights."""
    accelerator, model, optimizer = _tied(0)
    want = _lm_steps(accelerator, model, optimizer, 0, 4)
    accelerator, model, optimizer = _tied(0)
    got = _lm_steps(accelerator, model, optimizer, 0, 2)
    accelerator.save_state(str(tmp_path))
    masters = _trained(accelerator, optimizer)
    params = sum(p.numel() for p in model.parameters())
    assert os.path.getsize(tmp_path / AMP_STATE_NAME) < 4 * params  # no master in the engine's file (4 bytes each)
    accelerator, model, optimizer = _tied(1)
    accelerator.load_state(str(tmp_path))
    assert got + _lm_steps(accelerator, model, optimizer, 2, 2) == want
    accelerator, model, optimizer = _tied(1, "O1")
    accelerator.load_state(str(tmp_path))
    for g, w in zip(_trained(accelerator, optimizer), masters):
        assert torch.equal(g, w)
    os.remove(tmp_path / "model.safetensors")
    accelerator, model, optimizer = _tied(1)
    with pytest.raises(FileNotFoundError, match=r"model\.(safetensors|bin)"):
        accelerator.load_state(str(tmp_path))
