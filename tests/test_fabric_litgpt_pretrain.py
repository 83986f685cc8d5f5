"""litgpt's pretraining entry point at an opt level (``lightning_mpx.litgpt.pretrain``, and ``python -m
lightning_mpx.litgpt pretrain``) against litgpt's own ``pretrain.setup(precision="bf16-mixed")`` on the same tiny
``model_config`` and an in-memory data module (no download): the final checkpoint is FP32 and follows bf16-mixed's,
litgpt's CSV log carries the plugin's ``mpx/*`` metrics at litgpt's own steps, and misuse is refused."""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytest.importorskip("litgpt")
pytest.importorskip("lightning")

import litgpt  # noqa: E402
from litgpt import pretrain as litgpt_pretrain  # noqa: E402
from litgpt.args import EvalArgs, TrainArgs  # noqa: E402
from litgpt.data import DataModule  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_mpx import FabricMixedPrecisionPlugin  # noqa: E402
from lightning_mpx.litgpt import main, pretrain  # noqa: E402

CONFIG = litgpt.Config(name="tiny", n_layer=2, n_embd=32, n_head=2, vocab_size=128, padded_vocab_size=128,
                       block_size=32, bias=False)  # fmt: skip


@dataclass
class Counting(DataModule):
    """Rows of consecutive token ids (a pattern a model learns), made in memory: nothing to download or tokenize."""

    rows: int = 16

    def __post_init__(self) -> None:
        super().__init__()

    def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int = -1, **kwargs: Any) -> None:
        self.batch_size, self.length = batch_size, max_seq_length + 1

    def _loader(self, offset: int) -> DataLoader:
        starts = torch.arange(self.rows).unsqueeze(1) * 7 + offset
        return DataLoader((starts + torch.arange(self.length)) % 128, batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader(0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(3)


def _kwargs(out: Path, iters: int = 4) -> dict[str, Any]:
    """``iters`` micro-batches of 2 x 32 tokens, two per optimizer step; SGD (its step follows bfloat16 closely)."""
    return dict(model_config=CONFIG, out_dir=out, devices=1, data=Counting(), logger_name="csv", seed=3,
                train=TrainArgs(save_interval=None, log_interval=1, global_batch_size=4, micro_batch_size=2,
                                lr_warmup_steps=1, max_tokens=iters * 2 * 32, max_norm=1.0, min_lr=0.0),
                eval=EvalArgs(interval=100, max_iters=1, final_validation=False),
                optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 2.0}})  # fmt: skip


_compile = torch.compile


def _eager_compile(*args: Any, **kwargs: Any) -> Any:
    """litgpt's main compiles the model: traced by dynamo as on a GPU, run eagerly (no inductor build on a CPU)."""
    return _compile(*args, **{**kwargs, "backend": "eager"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    """One litgpt ``bf16-mixed`` pretraining run and one O2 bfloat16 run of the same model and data."""
    tmp = tmp_path_factory.mktemp("pretrain")
    saved = sys.argv
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "compile", _eager_compile)
        patch.setattr(sys, "argv", ["litgpt", "pretrain", "tiny"])  # litgpt's save_hyperparameters parses it
        litgpt_pretrain.setup("tiny", precision="bf16-mixed", **_kwargs(tmp / "theirs"))
        patch.setattr(sys, "argv", saved)
        fabric = pretrain(opt_level="O2", mpx_kwargs={"half_dtype": "bfloat16"}, **_kwargs(tmp / "ours"))
        assert sys.argv is saved
    return {"theirs": tmp / "theirs", "ours": tmp / "ours", "fabric": fabric}


def test_o2_pretraining_saves_fp32_weights_that_follow_bf16_mixed(runs):
    """``final/lit_model.pth`` holds the FP32 masters (off bfloat16's grid), trained, within bfloat16's tolerance of
    litgpt's own bf16-mixed run, and loads into a ``litgpt.GPT``."""
    plugin = runs["fabric"].strategy.precision
    assert isinstance(plugin, FabricMixedPrecisionPlugin) and plugin.amp.properties.half_dtype == torch.bfloat16
    ours = torch.load(runs["ours"] / "final" / "lit_model.pth", weights_only=False)
    theirs = torch.load(runs["theirs"] / "final" / "lit_model.pth", weights_only=False)
    assert ours["iter_num"] == theirs["iter_num"] == 4 and ours["step_count"] == 2
    ours, theirs = ours["model"], theirs["model"]
    assert sorted(ours) == sorted(theirs)
    assert {v.dtype for v in ours.values()} == {torch.float32}
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], atol=1e-2, rtol=2e-2, msg=name)
    head = ours["lm_head.weight"]
    assert not torch.equal(head, head.bfloat16().float())  # the masters, not half values
    model = litgpt.GPT(litgpt.Config.from_file(runs["ours"] / "final" / "model_config.yaml"))
    model.load_state_dict(ours)
    hparams = yaml.safe_load((runs["ours"] / "final" / "hyperparameters.yaml").read_text())
    assert hparams["train"]["max_tokens"] == 256 and hparams["model_config"]["n_embd"] == 32


def test_training_moved_the_weights_as_bf16_mixed_did(runs):
    """The two runs' updates agree (the weights moved well past the tolerance above, the same way)."""
    ours = torch.load(runs["ours"] / "final" / "lit_model.pth", weights_only=False)["model"]
    theirs = torch.load(runs["theirs"] / "final" / "lit_model.pth", weights_only=False)["model"]
    # litgpt seeds the init: the initial weights are the same; rebuilt as litgpt's main does
    name = "transformer.h.1.attn.qkv.weight"
    delta_ours, delta_theirs = ours[name] - _initial(name), theirs[name] - _initial(name)
    assert delta_theirs.abs().max() > 5e-2
    assert torch.nn.functional.cosine_similarity(delta_ours.flatten(), delta_theirs.flatten(), dim=0) > 0.99


def _initial(name: str) -> torch.Tensor:
    import lightning as L

    fabric = L.Fabric(devices=1, accelerator="cpu")
    fabric.seed_everything(3)
    model = litgpt.GPT(CONFIG)
    litgpt_pretrain.initialize_weights(fabric, model, n_layer=CONFIG.n_layer, n_embd=CONFIG.n_embd)
    return model.state_dict()[name]


def test_csv_log_carries_the_mpx_metrics_at_litgpts_steps(runs):
    """litgpt's training records (``loss`` at ``step=iter_num - 1``, every ``log_interval`` optimizer steps: every
    second micro-batch here) carry ``mpx/loss_scale`` and ``mpx/skipped_steps``; its validation records get none."""
    (path,) = (runs["ours"] / "logs" / "csv").rglob("metrics.csv")
    rows = list(csv.DictReader(path.read_text().splitlines()))
    trained = [row for row in rows if row.get("loss")]
    assert [int(row["step"]) for row in trained] == [1, 3]
    assert all(float(row["mpx/loss_scale"]) == 1.0 and float(row["mpx/skipped_steps"]) == 0 for row in trained)
    assert all(not row.get("mpx/loss_scale") for row in rows if not row.get("loss"))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(opt_level="O7"), ValueError, "O7"),
    (dict(precision="bf16-mixed"), ValueError, "precision='bf16-mixed'"),
    (dict(model_config=None), ValueError, "model_name=None and model_config=None"),
    (dict(max_tokens=4), TypeError, "max_tokens"),
], ids=["opt-level", "precision", "no-model", "unknown-argument"])  # fmt: skip
def test_misuse_is_refused_before_anything_is_written(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        pretrain(**{**_kwargs(tmp_path / "out"), **kwargs})
    assert not (tmp_path / "out").exists()


def test_resume_of_an_o2_checkpoint_is_refused(runs, tmp_path):
    """litgpt's main loads the optimizer's state before the plugin meets it: refused at O2 when there is a
    checkpoint to resume from; ``resume="auto"`` with none starts fresh."""
    step = tmp_path / "out" / "step-00000002"
    step.mkdir(parents=True)
    (step / "lit_model.pth").write_bytes((runs["ours"] / "final" / "lit_model.pth").read_bytes())
    with pytest.raises(ValueError, match="resume=True at O2"):
        pretrain(**{**_kwargs(tmp_path / "out"), "resume": True}, opt_level="O2")
    with pytest.raises(ValueError, match="resume='auto' at O2"):
        pretrain(**{**_kwargs(tmp_path / "out"), "resume": "auto"}, opt_level="O2")


def test_a_litgpt_whose_pretrain_main_changed_is_named(monkeypatch):
    from lightning_mpx.integrations import litgpt as ours

    monkeypatch.setattr(ours, "PRETRAIN_MAIN_PARAMETERS", ours.PRETRAIN_MAIN_PARAMETERS[:-1])
    with pytest.raises(RuntimeError, match=r"litgpt .*pretrain\.main takes"):
        pretrain("tiny")


def test_command_line_reads_litgpts_pretrain_flags(tmp_path, monkeypatch):
    """``python -m lightning_mpx.litgpt pretrain``: litgpt's own parser for ``litgpt pretrain`` (``--model_config``,
    ``--data`` class paths, ``--train.*``) with ``--opt_level``/``--mpx_kwargs``, handed to the entry point (the run
    itself is the one tested above)."""
    from lightning_mpx.integrations import litgpt as ours

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(ours, "_pretrain", lambda *args: calls.append(args))
    data = {"class_path": f"{__name__}.Counting", "init_args": {"rows": 8}}
    model_config = {k: getattr(CONFIG, k) for k in ("name", "n_layer", "n_embd", "n_head", "vocab_size",
                                                    "padded_vocab_size", "block_size", "bias")}  # fmt: skip
    argv = ["tiny", "--model_config", json.dumps(model_config), "--out_dir", str(tmp_path / "out"), "--data",
            json.dumps(data), "--train.max_tokens", "128", "--train.max_norm", "1.0"]  # fmt: skip
    main(["pretrain", "--opt_level", "O3", "--mpx_kwargs", '{"half_dtype": "bfloat16"}', *argv])
    ((model_name, opt_level, mpx_kwargs, settings, recorded),) = calls
    assert (model_name, opt_level, mpx_kwargs, recorded) == ("tiny", "O3", {"half_dtype": "bfloat16"}, argv)
    assert isinstance(settings["model_config"], litgpt.Config) and settings["model_config"].n_embd == 32
    assert isinstance(settings["data"], Counting) and settings["data"].rows == 8
    assert settings["train"].max_tokens == 128 and "precision" not in settings
