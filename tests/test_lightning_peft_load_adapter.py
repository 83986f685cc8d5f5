"""A hostile review of stop 61's first merged library changes, each against the framework's own precision on the same
code: peft's ``load_adapter`` into a model trained at O2 through the Lightning Trainer plugin and Fabric (stop 61
tested it through Accelerate only), ``low_cpu_mem_usage=True`` into the adapter being trained among them; the
Accelerate adapter's lean ``save_state`` of two models sharing a submodule (matched by parameter since stop 61).
Tiny GPT-2 built from a config (nothing downloaded), bfloat16, on CPU."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.test_accelerate_lean_checkpoints_two_models import ENGINE_FILE, _batch, _gap, _weights
from tests.test_accelerate_lean_checkpoints_two_models import _accelerator as _accelerate

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

HALF = torch.bfloat16
LR = 1e-2


def _lora(r: int = 4) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes on Conv1D's fan_in_fan_out and on the tied lm_head
        return peft.get_peft_model(GPT2LMHeadModel(config), peft.LoraConfig(r=r, target_modules=["c_attn"],
                                                                            init_lora_weights=False))  # fmt: skip


def _adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.float().clone() for k, v in model.state_dict().items() if ".lora_" in k}


def _trainable_held(model: nn.Module, optimizer: Any) -> bool:
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return all(id(p) in held for p in model.parameters() if p.requires_grad)


# -- peft's load_adapter through the Trainer plugin and Fabric ------------------------------------------------------
class _PeftModule(pl.LightningModule):
    """A LightningModule holding a PeftModel child: saves its adapter after epoch 0 and loads it back into the model
    (same adapter name) at the start of epoch 1, as a user restarting from a saved adapter mid-fit does."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.model = _lora()
        self.folder = folder
        self.held_after_load: bool | None = None

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss.float()

    def on_train_epoch_end(self) -> None:
        if self.current_epoch == 0:
            self.model.save_pretrained(self.folder)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            self.model.load_adapter(self.folder, "default", is_trainable=True)
            self.held_after_load = _trainable_held(self.model, self.trainer.optimizers[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=LR)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(_tokens().flatten(0, 1), batch_size=2)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 32, (4, 2, 8), generator=torch.Generator().manual_seed(1))


def test_trainer_load_adapter_in_on_train_epoch_start_trains_on_as_under_bf16_mixed(tmp_path: Path) -> None:
    """``self.model.load_adapter(path, "default", is_trainable=True)`` in ``on_train_epoch_start`` of a fit at O2: the
    adapters stay the optimizer's parameters and train on to ``"bf16-mixed"``'s weights (the plugin installs the
    peft model's ``load_adapter`` of its own at setup, as Accelerate's ``prepare`` does)."""
    results = {}
    for name, kwargs in (("bf16", {"precision": "bf16-mixed"}),
                         ("O2", {"plugins": [MixedPrecisionPlugin("O2", half_dtype=HALF)]})):  # fmt: skip
        module = _PeftModule(tmp_path / name)
        trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, **kwargs)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' loss_type note
            trainer.fit(module)
        assert module.held_after_load is True, name
        results[name] = _adapters(module.model)
    assert results["O2"].keys() == results["bf16"].keys() and results["O2"]
    assert all((results["O2"][k] - v).abs().max() <= 3 * LR for k, v in results["bf16"].items())


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True], ids=["plain", "low_cpu_mem_usage"])
def test_fabric_load_adapter_on_the_set_up_model_trains_on_from_the_files_values(
    tmp_path: Path, low_cpu_mem_usage: bool
) -> None:
    """``model.load_adapter(path, "default", is_trainable=True, low_cpu_mem_usage=...)`` on what ``fabric.setup``
    returned, mid-training at O2: the adapters stay the optimizer's and train on from the file's values to what
    ``"bf16-mixed"`` gives with a plain load. With ``low_cpu_mem_usage=True`` (peft then loads an existing adapter
    with ``assign=True``) the O2 load was refused with an error about ``load_state_dict(..., assign=True)``, which
    the user never called; under ``"bf16-mixed"`` the same call silently replaces the parameters the optimizer holds
    (they stop training: not the reference). An adapter of another rank is refused by peft's size check."""
    results = {}
    for name in ("bf16", "O2"):
        from lightning.fabric import Fabric

        kwargs: dict[str, Any] = {"precision": "bf16-mixed"} if name == "bf16" else {
            "plugins": [FabricMixedPrecisionPlugin("O2", half_dtype=HALF)]}  # fmt: skip
        fabric = Fabric(accelerator="cpu", devices=1, **kwargs)
        inner = _lora()
        model, optimizer = fabric.setup(inner, torch.optim.AdamW([p for p in inner.parameters() if p.requires_grad],
                                                                 lr=LR))  # fmt: skip
        for step, batch in enumerate(_tokens()):
            if step == 2:
                model.save_pretrained(tmp_path / name)
                saved = _adapters(inner)
                low = low_cpu_mem_usage and name == "O2"
                if name == "O2":  # an adapter of another rank: peft's size mismatch, not swallowed; nothing changed
                    _lora(r=8).save_pretrained(tmp_path / "r8")
                    with pytest.raises(RuntimeError, match="size mismatch"):
                        model.load_adapter(tmp_path / "r8", "default", is_trainable=True, low_cpu_mem_usage=low)
                    assert all(torch.equal(v, _adapters(inner)[k]) for k, v in saved.items())
                model.load_adapter(tmp_path / name, "default", is_trainable=True, low_cpu_mem_usage=low)
                assert _trainable_held(inner, optimizer), name
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # transformers' loss_type note
                fabric.backward(model(input_ids=batch, labels=batch).loss.float())
            optimizer.step()
            optimizer.zero_grad()
        results[name] = _adapters(inner)
        assert all(LR < (results[name][k] - v).abs().max() <= 4 * LR for k, v in saved.items()), name
    assert all((results["O2"][k] - v).abs().max() <= 3 * LR for k, v in results["bf16"].items())


# -- Accelerate's lean save_state, matched by parameter ------------------------------------------------------------
def _shared(seed: int) -> tuple[Any, ...]:
    accelerator = _accelerate("O2")
    torch.manual_seed(seed)
    encoder = nn.Linear(8, 16)  # tied: both models hold it
    a, b = (nn.Sequential(encoder, nn.Tanh(), nn.Linear(16, 4)) for _ in range(2))
    params = list({id(p): p for p in (*a.parameters(), *b.parameters())}.values())
    return (accelerator, *accelerator.prepare(a, b, torch.optim.AdamW(params, lr=LR)))


def _train_shared(accelerator: Any, a: Any, b: Any, optimizer: Any, steps: range) -> None:
    for step in steps:
        x, y = _batch(step)
        accelerator.backward(F.cross_entropy(a(x).float() + b(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_save_state_of_two_models_sharing_an_encoder_is_lean_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    """Two models prepared in one accelerator sharing their encoder (one optimizer over both): the engine file names
    every master (the shared encoder's once, under the first model) and holds none; a fresh accelerator with other
    weights resumes to the uninterrupted run's weights bit for bit."""
    accelerator, *run = _shared(0)
    _train_shared(accelerator, *run, range(3))
    accelerator.save_state(str(tmp_path))
    engine = torch.load(tmp_path / ENGINE_FILE, weights_only=True)
    assert [len(names) for names in engine["masters_in_state_dict"]] == [4, 2]
    assert [dict(m) for m in engine["master_weights"]] == [{}, {}]
    _train_shared(accelerator, *run, range(3, 6))
    straight = _weights(accelerator, *run[:2])
    fresh, *again = _shared(5)
    fresh.load_state(str(tmp_path))
    _train_shared(fresh, *again, range(3, 6))
    assert _gap(_weights(fresh, *again[:2]), straight) == 0.0
