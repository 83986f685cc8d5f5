"""Transformers' rotary embeddings (LLaMA, Mistral, Qwen2: ``maybe_autocast(device_type, enabled=False)`` around
``inv_freq.float() @ positions.float()``) at O1 through the Lightning Trainer and the Apex front, on the CPU (the
Python cast policy): the cos table the model trains with is FP32's, as under Lightning's own ``"bf16-mixed"``
(``torch.autocast``). Before the O1 scope's marker (casting.scopes.policy_scope) the policy ignored the block: the
rotary angles (position times frequency, up to 255 here) ran in bfloat16. Apex's O1 table leaves the rotary
``Tensor.__matmul__`` alone (that test guards it); its ``torch.mm`` in a disabled block was cast to float16. Tiny models
from configs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pl = pytest.importorskip("lightning.pytorch")

from lightning_mpx.apex import _amp_state, amp  # noqa: E402
from lightning_mpx.integrations.lightning import MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import make_trainer  # noqa: E402

transformers.logging.set_verbosity_error()
POSITIONS = 256
SIZES = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
             vocab_size=32, max_position_embeddings=2 * POSITIONS)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SIZES),
    "mistral": lambda: transformers.MistralConfig(**SIZES, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**SIZES),
}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())


def _ids() -> torch.Tensor:
    return torch.randint(0, 32, (2, POSITIONS), generator=torch.Generator().manual_seed(0))


def _fp32_cos(name: str) -> torch.Tensor:
    """The cos table of the model's rotary embedding computed outside any scope: FP32's."""
    model = _model(name)
    positions = torch.arange(POSITIONS)[None]
    return model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)[0]


class _LM(pl.LightningModule):
    """One optimizer step on a causal LM, recording the rotary table its forward made and the loss."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.lm = _model(name)
        self.cos: list[torch.Tensor] = []
        self.losses: list[float] = []
        self.lm.model.rotary_emb.register_forward_hook(lambda module, args, out: self.cos.append(out[0].float()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.lm(input_ids=batch[0], labels=batch[0]).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer_run(name: str, precision: str) -> _LM:
    module = _LM(name)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_ids()), batch_size=2)
    plugin = MixedPrecisionPlugin("O1", half_dtype="bfloat16") if precision == "O1" else None
    trainer = make_trainer(plugin, max_steps=1, **({} if plugin else {"precision": precision}))
    trainer.fit(module, loader)
    return module


def test_trainer_bf16_mixed_trains_with_fp32s_rotary_table() -> None:
    """The reference: Lightning's own "bf16-mixed" gives FP32's table exactly."""
    torch.testing.assert_close(_trainer_run("llama", "bf16-mixed").cos[0], _fp32_cos("llama"), atol=0, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_trainer_o1_trains_with_bf16_mixeds_rotary_table(name: str) -> None:
    module = _trainer_run(name, "O1")
    torch.testing.assert_close(module.cos[0], _fp32_cos(name), atol=0, rtol=0)


@pytest.fixture
def apex_state() -> Any:
    """Apex's process-wide state (as Apex keeps it), reset after the test."""
    yield
    _amp_state.reset()
    _amp_state.registrations.clear()


@pytest.mark.usefixtures("apex_state")
def test_apex_o1_front_runs_the_rotary_block_in_fp32() -> None:
    model = _model("llama")
    seen: list[torch.Tensor] = []
    model.model.rotary_emb.register_forward_hook(lambda module, args, out: seen.append(out[0].float()))
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                                      verbosity=0)
    loss = model(input_ids=_ids(), labels=_ids()).loss
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    torch.testing.assert_close(seen[0], _fp32_cos("llama"), atol=0, rtol=0)
    assert torch.isfinite(loss)


class _Angles(torch.nn.Module):
    """Rotary angles as users write them with ``torch.mm`` (a function on Apex's O1 half list) in an FP32 block."""

    def __init__(self) -> None:
        super().__init__()
        self.freq = torch.nn.Parameter(torch.full((1, 4), 0.9999))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return torch.mm(positions.float(), self.freq.float())


@pytest.mark.usefixtures("apex_state")
def test_apex_o1_front_keeps_a_user_autocast_off_block_in_fp32() -> None:
    """Apex's O1 front (float16): ``torch.mm`` in the user's disabled block stays FP32 (it came back float16, whose
    spacing is 2 above 2048)."""
    model = _Angles()
    positions = torch.arange(4096.0)[:, None]
    expected = model(positions)
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                                      verbosity=0)
    out = model(positions)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
