"""O1 and a ``torch.autocast(device, enabled=False)`` block inside the model's forward: the FP32 region that
transformers' rotary embeddings (LLaMA, Mistral, Qwen, Gemma: ``maybe_autocast(device_type, enabled=False)`` around
``inv_freq.float() @ positions.float()``) and users' own code write to keep a computation out of the half dtype.
Under Accelerate's own ``"bf16"`` (``torch.autocast``) that block runs in FP32. At O1 with the Python cast policy
(the default table on the CPU, and any table not aligned with autocast on a GPU) the policy ignored the block and cast
the matmul to bfloat16: the rotary angles (position times frequency, up to 512 here) lost all but 8 bits, and the cos
table was off by up to 1.27. The scope now turns torch.autocast on as a marker (casting.scopes.policy_scope), so the
block turns it off and runs as given. The earlier ways out still hold: ``fp32_modules=["*rotary_emb"]``, or the
autocast-aligned table (``CastTable.autocast_aligned(device)``, the GPU's default). Tiny LLaMA from a config, CPU,
bfloat16."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from lightning_mpx import Amp  # noqa: E402
from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402
from lightning_mpx.casting.table import CastTable  # noqa: E402
from tests.accelerate_helpers import reset_accelerate_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")
transformers.logging.set_verbosity_error()

POSITIONS = 512


def _rotary_cos(mixed_precision: str, **kwargs: Any) -> torch.Tensor:
    """The cos table LLaMA's rotary embedding gives inside a prepared model's forward (read by a hook)."""
    reset_accelerate_state()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=2 * POSITIONS,
    )  # fmt: skip
    handlers = [MixedPrecisionKwargs(half_dtype="bfloat16", **kwargs)] if mixed_precision.startswith("O") else []
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=True, kwargs_handlers=handlers)
    model = accelerator.prepare(transformers.LlamaForCausalLM(config))
    seen: dict[str, torch.Tensor] = {}
    rotary = accelerator.unwrap_model(model).model.rotary_emb
    rotary.register_forward_hook(lambda module, args, out: seen.update(cos=out[0].float()))
    ids = torch.randint(0, 64, (1, POSITIONS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)
    return seen["cos"]


def test_bf16_runs_the_rotary_block_in_fp32() -> None:
    """The reference: Accelerate's own ``"bf16"`` gives FP32's cos table exactly."""
    torch.testing.assert_close(_rotary_cos("bf16"), _rotary_cos("no"), atol=0, rtol=0)


def test_o1_runs_the_rotary_block_in_fp32() -> None:
    assert (_rotary_cos("O1") - _rotary_cos("no")).abs().max().item() <= 2**-8


@pytest.mark.parametrize(
    "kwargs",
    [{"fp32_modules": ["*rotary_emb"]}, {"cast_table": CastTable.autocast_aligned("cpu")}],
    ids=["fp32_modules", "autocast_aligned"],
)
def test_o1_ways_out_give_fp32s_rotary_table(kwargs: dict[str, Any]) -> None:
    torch.testing.assert_close(_rotary_cos("O1", **kwargs), _rotary_cos("no"), atol=0, rtol=0)


class _Fp32Block(torch.nn.Module):
    """A user's FP32 region, written as transformers writes it."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return a.float() @ b.float()


def test_core_o1_keeps_a_user_autocast_off_block_in_fp32() -> None:
    amp = Amp("O1", half_dtype="bfloat16")
    block = amp.prepare_model(_Fp32Block())
    a, b = torch.arange(4096.0)[:, None], torch.full((1, 4), 0.9999)
    with amp.forward_context():
        out = block(a, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, a @ b)

