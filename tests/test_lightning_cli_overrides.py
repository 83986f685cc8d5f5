"""``LightningCLI`` configs set the opt-level overrides (Apex's ``loss_scale``, ``keep_batchnorm_fp32``...): they came
through ``**overrides``, which jsonargparse cannot fill, so a config naming one was refused ("Key ... is not expected").
Reference: the same plugin built in Python (bit-equal on a CPU)."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from lightning_mpx.settings import OPT_LEVEL_OVERRIDES
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

TRAINER = dict(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False)


class _NormClassifier(Classifier):
    """The helpers' classifier with a batch norm, so that ``keep_batchnorm_fp32`` shows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


class _Data(pl.LightningDataModule):
    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return loader(classification_data(n=48))


def _cli(tmp_path: Path, init_args: dict[str, Any], run: bool = True) -> Any:
    from lightning.pytorch.cli import LightningCLI

    plugin = {"class_path": "lightning_mpx.MixedPrecisionPlugin", "init_args": {"opt_level": "O2", **init_args}}
    config = {"seed_everything": 0, "trainer": {**TRAINER, "default_root_dir": str(tmp_path), "plugins": [plugin]}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    args = (["fit"] if run else []) + ["--config", str(path)]
    return LightningCLI(_NormClassifier, _Data, args=args, save_config_callback=None, run=run)


def _weights(trainer: pl.Trainer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in trainer.lightning_module.state_dict().values()]


def test_a_cli_config_with_apex_overrides_trains_as_the_plugin_built_in_python(tmp_path: Path) -> None:
    settings = {"half_dtype": "bfloat16", "loss_scale": "dynamic", "keep_batchnorm_fp32": True, "init_scale": 1024.0}
    cli = _cli(tmp_path, settings)
    plugin = cli.trainer.precision_plugin
    assert plugin.amp.properties.loss_scale == "dynamic" and plugin.amp.scalers[0].dynamic  # bf16's preset: static
    assert plugin.amp.scalers[0].get_scale() == 1024.0
    norm = cli.trainer.lightning_module.net[1]
    assert norm.weight.dtype == torch.float32 and cli.trainer.lightning_module.net[0].weight.dtype == torch.bfloat16
    torch.manual_seed(0)
    python = make_trainer(MixedPrecisionPlugin("O2", **settings), max_steps=3)
    python.fit(_NormClassifier(), loader(classification_data(n=48)))
    assert cli.trainer.global_step == python.global_step == 3
    assert all(torch.equal(a, b) for a, b in zip(_weights(cli.trainer), _weights(python)))


def test_null_overrides_in_a_config_keep_the_level_and_false_overrides_it(tmp_path: Path) -> None:
    """jsonargparse passes every keyword of the signature: an override's ``null`` (its default) is "not given"."""
    overrides = {"cast_model_type": None, "patch_torch_functions": None, "master_weights": None, "loss_scale": None,
                 "keep_batchnorm_fp32": False}
    cli = _cli(tmp_path, {"half_dtype": "bfloat16", **overrides}, run=False)
    props = cli.trainer.precision_plugin.amp.properties
    expected = MixedPrecisionPlugin("O2", half_dtype="bfloat16", keep_batchnorm_fp32=False).amp.properties
    assert props == expected and props.keep_batchnorm_fp32 is False and props.cast_model_type == torch.bfloat16


def test_an_invalid_override_in_a_config_names_the_key_the_value_and_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"loss_scale='fast' is not valid; valid choices: 'dynamic' or a positive"):
        _cli(tmp_path, {"half_dtype": "bfloat16", "loss_scale": "fast"}, run=False)


def test_the_front_doors_show_each_override_as_a_keyword_whose_none_is_the_levels_value() -> None:
    for front in (Amp, MixedPrecisionPlugin, FabricMixedPrecisionPlugin):
        params = inspect.signature(front).parameters
        assert all(params[name].kind is params[name].KEYWORD_ONLY and params[name].default is None
                   for name in OPT_LEVEL_OVERRIDES), front
        assert type(None) in typing.get_args(params["loss_scale"].annotation)
    given_none = Amp("O2", half_dtype="bfloat16", **dict.fromkeys(OPT_LEVEL_OVERRIDES)).properties
    assert given_none == Amp("O2", half_dtype="bfloat16").properties


def test_apex_initialize_with_cast_model_type_false_still_leaves_the_model_as_given() -> None:
    """Apex's ``cast_model_type=False`` resolves to the properties' ``None`` (leave the model), which the front doors'
    keywords now read as "not given": the Apex layer must keep it."""
    from lightning_mpx.apex import amp
    from lightning_mpx.apex._state import _amp_state

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", cast_model_type=False, verbosity=0)
    props = _amp_state.opt_properties
    assert props.cast_model_type is None and props.keep_batchnorm_fp32 is None and not props.master_weights
    assert all(p.dtype == torch.float32 for p in model.parameters())
