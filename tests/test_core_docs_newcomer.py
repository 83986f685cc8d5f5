"""A first-time user follows README.md and docs/ through every door (stop 58): the places where the text and the
library disagreed, or where an error a newcomer meets did not name the fix, checked as the user meets them.

- docs/accelerate.md: the import is the switch; Accelerate's own ``Accelerator(mixed_precision="O2")`` refuses the
  level with its own message, which the page quotes, and the adapter's refusal of ``"o2"`` says ``"O2"``.
- docs/core.md: the opt-level overrides are keywords a ``LightningCLI`` config sets (it said jsonargparse could not).
- ``MpxTrainerMixin(opt_level="o2")`` said only "not valid": now the core's message with "did you mean 'O2'?", as
  every other door; ``mpx_kwargs={...}`` names the call that builds one.
- README.md:106 and docs/accelerate.md:14 showed ``growth_interval`` beside ``half_dtype="bfloat16"``, whose static
  scale ignores it: a copied example warned "growth_interval=... is ignored". Their settings are now all read.
- docs/apex.md's block with ``amp.initialize`` left out (a newcomer's first edit of an Apex script): ``scale_loss``
  yielded the loss unscaled and training ran on without a word; Apex raised, naming ``initialize``, and so does it now.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def _prose(doc: str) -> str:
    """The page's text with its line breaks folded, as a reader reads a sentence."""
    return re.sub(r"\s*\n\s*", " ", (ROOT / doc).read_text())


def test_accelerate_md_quotes_the_errors_of_a_forgotten_import_and_of_a_lower_case_level() -> None:
    accelerate = pytest.importorskip("accelerate")
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    text = _prose("docs/accelerate.md")
    quoted = r"raises its own `ValueError: (Unknown mixed_precision mode: O2\. Choose between [^`]*)`"
    upstream = re.search(quoted, text)
    assert upstream, "docs/accelerate.md no longer quotes Accelerate's refusal of mixed_precision='O2'"
    with pytest.raises(ValueError) as raised:
        accelerate.Accelerator(mixed_precision="O2")  # the import not swapped: Accelerate's own class
    assert str(raised.value) == upstream.group(1)
    assert "a `MixedPrecisionKwargs` in Accelerate's own `kwargs_handlers` fails there with a bare `KeyError" in text
    with pytest.raises(KeyError, match="MixedPrecisionKwargs"):
        accelerate.Accelerator(kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")], cpu=True)
    with pytest.raises(ValueError, match=r"mixed_precision='o2' is not valid; valid choices: .* did you mean 'O2'\?"):
        Accelerator(mixed_precision="o2")


def test_core_md_config_sets_the_opt_level_overrides_through_lightning_cli() -> None:
    """jsonargparse, which ``LightningCLI`` reads its configs with, on the plugin's ``init_args`` as core.md shows them
    (tests/test_lightning_cli_overrides.py trains a whole ``LightningCLI`` run from such a config)."""
    from jsonargparse import ArgumentParser

    from lightning_mpx import MixedPrecisionPlugin

    text = _prose("docs/core.md")
    found = re.search(r"so a config sets them as well \(`init_args: (\{[^`]*\})`", text)
    assert found, "docs/core.md no longer shows a config that sets an opt-level override"
    init_args = yaml.safe_load(found.group(1))
    assert set(init_args) >= {"loss_scale", "keep_batchnorm_fp32"}
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--plugin", type=MixedPrecisionPlugin)
    config = {"class_path": "lightning_mpx.MixedPrecisionPlugin", "init_args": {**init_args, "half_dtype": "bfloat16"}}
    plugin = parser.instantiate_classes(parser.parse_object({"plugin": config})).plugin
    props = plugin.amp.properties
    assert props.loss_scale == "dynamic" and props.keep_batchnorm_fp32 is True  # bfloat16's preset: static 1.0


def test_hf_trainer_mixin_refuses_a_lower_case_level_and_a_dict_naming_the_fix(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from lightning_mpx.accelerate import MpxTrainerMixin

    class MpxTrainer(MpxTrainerMixin, transformers.Trainer):  # docs/accelerate.md, "transformers.Trainer"
        pass

    with pytest.raises(ValueError, match=r"opt_level='o2' is not an opt level; valid choices: 'O0', 'O1', 'O2', "
                                         r"'O3'\. .*did you mean 'O2'\?"):  # fmt: skip
        MpxTrainer(model=None, args=None, opt_level="o2")
    with pytest.raises(ValueError, match=r"opt_level='02' .*not the digit zero: did you mean 'O2'\?"):
        MpxTrainer(model=None, args=None, opt_level="02")
    with pytest.raises(TypeError, match=r"mpx_kwargs=dict is not a MixedPrecisionKwargs: pass .*MixedPrecisionKwargs\("
                                        r"\*\*d\)"):  # fmt: skip
        MpxTrainer(model=None, args=None, opt_level="O2", mpx_kwargs={"half_dtype": "bfloat16"})


def test_apex_md_block_without_initialize_is_refused_naming_it_and_runs_with_it() -> None:
    from lightning_mpx.apex import _amp_state

    text = (ROOT / "docs/apex.md").read_text()
    code = re.search(r"^```python\n(.*?)^```", text, re.S | re.M).group(1)
    assert "amp.initialize(model, optimizer" in code
    skipped = code.replace('model, optimizer = amp.initialize(model, optimizer, opt_level="O2")', "")

    def user() -> dict:  # only what the block leaves to the user: a model, an optimizer, a batch, a loss
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "x": torch.randn(3, 4),
                "y": torch.randn(3, 2), "loss_fn": nn.functional.mse_loss}

    _amp_state.reset()
    try:
        with pytest.raises(RuntimeError, match=r"amp\.initialize\(\) has not been called: call model, optimizer = "
                                               r"amp\.initialize\(model, optimizer, opt_level=\.\.\.\)"):  # fmt: skip
            exec(compile(skipped, "docs/apex.md", "exec"), user())  # noqa: S102 - the documented block under test
        ns = user()
        exec(compile(code, "docs/apex.md", "exec"), ns)  # noqa: S102 - float16, Apex's, on a 4x2 layer: quick
        assert "loss_scale" in ns["checkpoint"]["amp"]["loss_scaler0"]  # Apex's entry
    finally:
        _amp_state.reset()


def test_the_settings_the_readme_and_accelerate_md_show_are_all_read() -> None:
    """A keyword that the level's loss scale ignores makes the engine warn: an example should not show one."""
    from lightning_mpx import MixedPrecisionPlugin
    from lightning_mpx.accelerate import MixedPrecisionKwargs
    from lightning_mpx.settings import ignored_level_settings, ignored_scaler_settings

    readme = re.search(r"\(`(MixedPrecisionPlugin\(\"O2\", half_dtype=[^`]*growth_interval=[^`]*\))`\)",
                       _prose("README.md"))  # fmt: skip
    assert readme, "README.md no longer shows the plugin's keywords"
    accelerate_md = (ROOT / "docs/accelerate.md").read_text()
    kwargs = re.search(r"kwargs_handlers=\[(MixedPrecisionKwargs\([^)]*\))\]", accelerate_md)
    assert kwargs, "docs/accelerate.md no longer shows MixedPrecisionKwargs"
    names = {"MixedPrecisionPlugin": MixedPrecisionPlugin, "MixedPrecisionKwargs": MixedPrecisionKwargs}
    shown = {"README.md": eval(readme.group(1), names).settings,  # noqa: S307 - the documented call
             "docs/accelerate.md": eval(kwargs.group(1), names).settings("O2")}  # noqa: S307
    for doc, settings in shown.items():
        assert not ignored_scaler_settings(settings) and not ignored_level_settings(settings), doc
