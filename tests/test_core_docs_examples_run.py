"""A first-time user copies the docs' examples (stop 60): the runnable checks of the examples that had a finding.

- docs/unscale.md's block imports ``UnscaleWorkspace`` from ``lightning_mpx.unscale``, the kept import path, which
  had lost it when the modules moved into packages (ImportError).
- docs/lightning.md's ``MpxMetricsToCallbacks`` logged the integer ``mpx/overflows`` count, and Lightning warned at
  the first step that it converts it to float.
- ``MixedPrecisionPlugin("bf16-mixed")`` (Lightning's precision string as the opt level) named the valid levels but
  not what to pass for that precision.
- docs/master_weights.md said ``model.state_dict()`` holds the half values at O2 for every model but the Trainer
  plugin's; Fabric's set-up model gives the FP32 masters too (the core's and the Apex layer's submodules do not).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpx import Amp, FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from lightning_mpx.apex import amp as apex_amp
from lightning_mpx.fsdp import mixed_precision_policy
from tests.lightning_helpers import make_trainer
from tests.test_metric_readers import docs_recipe

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _block(page: str, marker: str) -> str:
    """The python code block of ``docs/<page>`` holding ``marker``, as written."""
    blocks = re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M)
    (code,) = [b for b in blocks if marker in b]
    return code


def test_unscale_doc_block_runs_from_the_kept_import_path():
    # The user's gradients, scaled by 4: the block unscales them in place, clips to norm 1 and returns the norm.
    grads = [torch.full((3,), 8.0), torch.full((2,), 4.0, dtype=torch.bfloat16)]
    space = {"grads": grads, "inv_scale": torch.tensor(0.25), "found_inf": torch.zeros(1)}
    exec(compile(_block("unscale.md", "UnscaleWorkspace"), "docs/unscale.md", "exec"), space)
    true = [torch.full((3,), 2.0), torch.full((2,), 1.0)]
    total = torch.cat(true).norm()
    torch.testing.assert_close(space["norm"], total)
    torch.testing.assert_close(grads[0], true[0] / total)
    torch.testing.assert_close(grads[1].float(), true[1] / total, atol=4e-3, rtol=0)  # bfloat16 rounding
    assert space["found_inf"].item() == 0.0


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x))).float().pow(2).mean()


def test_monitor_recipe_logs_float_values_without_lightning_warning(tmp_path):
    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Tiny()

        def training_step(self, batch, batch_idx):
            return self.net(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    best = ModelCheckpoint(dirpath=str(tmp_path), monitor="mpx/loss_scale", mode="max", every_n_train_steps=2)
    trainer = make_trainer(MixedPrecisionPlugin("O1", half_dtype="bfloat16"), max_steps=3, enable_checkpointing=True,
                           callbacks=[docs_recipe()(), best])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Module(), DataLoader(TensorDataset(torch.randn(6, 4)), batch_size=2))
    converted = [str(w.message) for w in caught if "needs to be floating" in str(w.message)]
    assert converted == [], converted
    assert trainer.callback_metrics["mpx/overflows"].dtype == torch.float32
    assert float(trainer.callback_metrics["mpx/loss_scale"]) == 1.0  # bfloat16's static scale
    assert float(best.best_model_score) == 1.0


def _stepped_dtypes(model: nn.Module) -> tuple[set[torch.dtype], set[torch.dtype]]:
    """The dtypes of the model's own ``state_dict()`` and of its ``body`` child's."""
    return {v.dtype for v in model.state_dict().values()}, {v.dtype for v in model.body.state_dict().values()}


def test_state_dict_dtypes_per_door_as_master_weights_md_says():
    x = torch.randn(2, 4)
    # The core Amp: the model's own half values, its children's too.
    amp = Amp("O2", half_dtype="bfloat16")
    core = amp.prepare_model(_Tiny())
    optimizer = amp.prepare_optimizer(torch.optim.SGD(core.parameters(), lr=0.1))
    with amp.forward_context():
        amp.backward(core(amp.cast_inputs(x)))
    amp.step(optimizer)
    amp.update()
    assert _stepped_dtypes(core) == ({torch.bfloat16}, {torch.bfloat16})
    # Fabric's set-up model: the FP32 masters, a child's state_dict too (what a child's save_pretrained reads).
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")])
    inner = _Tiny()
    model, optimizer = fabric.setup(inner, torch.optim.SGD(inner.parameters(), lr=0.1))
    fabric.backward(model(x))
    optimizer.step()
    assert _stepped_dtypes(inner) == ({torch.float32}, {torch.float32})
    assert inner.body.weight.dtype == torch.bfloat16
    # The Apex layer: the FP32 masters for the instance given to initialize only.
    model = _Tiny()
    model, optimizer = apex_amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                           cast_model_type=torch.bfloat16, verbosity=0)
    with apex_amp.scale_loss(model(x), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert _stepped_dtypes(model) == ({torch.float32}, {torch.bfloat16})
    apex_amp._amp_state.reset()


def test_fsdp_opt_level_string_takes_the_device_half_dtype():
    # lightning_mpx/integrations/fsdp.py's docstring said an opt-level string means float16.
    expected = torch.float16 if torch.cuda.is_available() else torch.bfloat16
    assert mixed_precision_policy("O2").param_dtype == expected


def test_a_framework_precision_string_as_opt_level_names_the_opt_level_and_dtype():
    # A Lightning user writes the precision they know into the plugin; a ported Apex/Accelerate one "fp16".
    with pytest.raises(ValueError, match=r"opt_level='bf16-mixed' is not an opt level; valid choices: 'O0', 'O1', "
                                         r"'O2', 'O3'\..*Lightning's precision=.*'O1'.*'O2'.*half_dtype='bfloat16'"):
        MixedPrecisionPlugin("bf16-mixed")
    with pytest.raises(ValueError, match=r"opt_level='fp16'.*half_dtype='float16'"):
        Amp("fp16")
    with pytest.raises(ValueError, match=r"opt_level='O4' is not an opt level; valid choices: 'O0', .*'O3'\.$"):
        FabricMixedPrecisionPlugin("O4")
