"""litgpt's own LoRA fine-tuning entry point at an opt level (``lightning_mpx.litgpt.finetune_lora``, and
``python -m lightning_mpx.litgpt finetune_lora``) against litgpt's own ``setup(precision="bf16-mixed")`` on the same
tiny checkpoint folder (model config, FP32 base, a WordLevel tokenizer built here, a JSON data set): the saved LoRA
file is FP32 and follows bf16-mixed's, the merged ``lit_model.pth`` loads into a ``litgpt.GPT``, the CSV logs and
``hyperparameters.yaml`` are written, and misuse is refused before anything is written."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytest.importorskip("litgpt")
pytest.importorskip("lightning")

import lightning.fabric  # noqa: E402
import litgpt  # noqa: E402
from litgpt.args import EvalArgs, TrainArgs  # noqa: E402
from litgpt.data import JSON  # noqa: E402
from litgpt.finetune import full as litgpt_full  # noqa: E402
from litgpt.finetune import lora as litgpt_lora  # noqa: E402

from lightning_mpx import FabricMixedPrecisionPlugin  # noqa: E402
from lightning_mpx.litgpt import finetune_full, finetune_lora, main  # noqa: E402

WORDS = [f"w{i}" for i in range(60)]
SETTINGS: dict[str, Any] = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_key=True, lora_mlp=True)


def _checkpoint(folder: Path) -> Path:
    """A litgpt checkpoint folder: model_config.yaml, an FP32 lit_model.pth, a tokenizer litgpt loads offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True)
    config = litgpt.Config(name="tiny", n_layer=2, n_embd=32, n_head=2, vocab_size=64, padded_vocab_size=64,
                           block_size=32, bias=False)  # fmt: skip
    (folder / "model_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(config)))
    torch.manual_seed(0)
    torch.save(litgpt.GPT(config).state_dict(), folder / "lit_model.pth")
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "tokenizer_class": "Fast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(special))
    return folder


def _data(path: Path) -> Path:
    rows = [{"instruction": " ".join(WORDS[i:i + 4]), "input": "", "output": " ".join(WORDS[i + 4:i + 7])}
            for i in range(0, 48, 3)]  # fmt: skip
    path.write_text(json.dumps(rows))
    return path


def _kwargs(out: Path, data: Path) -> dict[str, Any]:
    return dict(out_dir=out, devices=1, data=JSON(data, val_split_fraction=0.25, prompt_style="alpaca", num_workers=0),
                train=TrainArgs(save_interval=None, log_interval=1, global_batch_size=2, micro_batch_size=1,
                                lr_warmup_steps=1, epochs=100, max_steps=3),
                eval=EvalArgs(interval=100, max_new_tokens=2, max_iters=1, final_validation=False),
                optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 1.0}}, seed=3, **SETTINGS)  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One litgpt ``bf16-mixed`` run and one O2 bfloat16 run (the Python API) of the same fine-tune."""
    tmp = tmp_path_factory.mktemp("litgptcli")
    checkpoint, data = _checkpoint(tmp / "checkpoint"), _data(tmp / "data.json")
    saved = sys.argv
    sys.argv = ["litgpt", "finetune_lora", str(checkpoint), *[f"--{k}={v}" for k, v in SETTINGS.items()]]
    try:  # litgpt's save_hyperparameters parses sys.argv: litgpt's own run needs its command line
        litgpt_lora.setup(checkpoint, precision="bf16-mixed", **_kwargs(tmp / "theirs", data))
    finally:
        sys.argv = saved
    launched: list[list[str]] = []  # sys.argv when Fabric's launcher runs (its subprocess launcher reads it)
    launch = lightning.fabric.Fabric._wrap_and_launch

    def spy(self, *args: Any, **kwargs: Any) -> Any:
        launched.append(list(sys.argv))
        return launch(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lightning.fabric.Fabric, "_wrap_and_launch", spy)
        fabric = finetune_lora(checkpoint, opt_level="O2", mpx_kwargs={"half_dtype": "bfloat16"},
                               **_kwargs(tmp / "ours", data))  # fmt: skip
    assert sys.argv is saved
    return {"checkpoint": checkpoint, "data": data, "theirs": tmp / "theirs", "ours": tmp / "ours", "fabric": fabric,
            "launched": launched, "argv": list(saved)}


def test_fabric_launches_from_the_processs_own_command_line(runs):
    """Fabric's subprocess launcher (DDP/FSDP on several GPUs) starts the other ranks from ``sys.argv``: at
    ``fabric.launch`` it must be this process's command line, not the litgpt flags ``main`` records (which would
    start ``python <checkpoint_dir> --lora_r=...`` on every other rank)."""
    assert runs["launched"] == [runs["argv"]]


def test_o2_lora_file_is_fp32_and_follows_bf16_mixed(runs):
    """The LoRA file holds the FP32 masters (values off bfloat16's grid), trained (B moved from its zero init), within
    bfloat16's tolerance of litgpt's bf16-mixed run."""
    plugin = runs["fabric"].strategy.precision
    assert isinstance(plugin, FabricMixedPrecisionPlugin) and plugin.amp.properties.opt_level == "O2"
    assert plugin.amp.properties.half_dtype == torch.bfloat16
    ours = torch.load(runs["ours"] / "final" / "lit_model.pth.lora")["model"]
    theirs = torch.load(runs["theirs"] / "final" / "lit_model.pth.lora")["model"]
    assert sorted(ours) == sorted(theirs) and any("lora_B" in k for k in ours)
    for name, value in ours.items():
        assert value.dtype == torch.float32, name
        torch.testing.assert_close(value, theirs[name], atol=2e-2, rtol=2e-2, msg=name)
    moved = torch.cat([v.flatten() for k, v in ours.items() if "lora_B" in k])
    assert moved.abs().max() > 1e-3
    assert not torch.equal(moved, moved.bfloat16().float())


def test_merged_checkpoint_is_fp32_and_loads(runs):
    """The merged ``lit_model.pth`` is FP32 and loads into litgpt's GPT; it matches bf16-mixed's merge."""
    final = runs["ours"] / "final"
    merged = torch.load(final / "lit_model.pth")
    assert {v.dtype for v in merged.values()} == {torch.float32}
    model = litgpt.GPT(litgpt.Config.from_file(final / "model_config.yaml"))
    model.load_state_dict(merged)
    theirs = torch.load(runs["theirs"] / "final" / "lit_model.pth")
    base = torch.load(runs["checkpoint"] / "lit_model.pth")
    for name, value in merged.items():  # the merged LoRA delta B @ A carries bfloat16's error of both factors
        torch.testing.assert_close(value, theirs[name], atol=1e-2, rtol=2e-2, msg=name)
    assert (merged["transformer.h.1.attn.qkv.weight"] - base["transformer.h.1.attn.qkv.weight"]).abs().max() > 0.1
    hparams = yaml.safe_load((final / "hyperparameters.yaml").read_text())
    assert hparams["lora_r"] == 4 and hparams["lora_mlp"] is True and hparams["train"]["max_steps"] == 3
    assert Path(hparams["checkpoint_dir"]) == runs["checkpoint"]


def test_csv_logs_are_written(runs):
    (metrics,) = (runs["ours"] / "logs" / "csv").rglob("metrics.csv")
    assert "loss" in metrics.read_text().splitlines()[0]


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(opt_level="O7"), "O7"),
    (dict(quantize="bnb.nf4"), "quantize='bnb.nf4'"),
    (dict(precision="bf16-mixed"), "precision='bf16-mixed'"),
], ids=["opt-level", "quantize", "precision"])  # fmt: skip
def test_misuse_is_refused_before_anything_is_written(runs, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        finetune_lora(runs["checkpoint"], out_dir=tmp_path / "out", **kwargs)
    with pytest.raises(TypeError, match="lora_rank"):
        finetune_lora(runs["checkpoint"], out_dir=tmp_path / "out", lora_rank=4)
    assert not (tmp_path / "out").exists()


def test_a_litgpt_whose_main_changed_is_named(monkeypatch):
    from lightning_mpx.integrations import litgpt as ours

    monkeypatch.setattr(ours, "LORA_MAIN_PARAMETERS", (*ours.LORA_MAIN_PARAMETERS, "resume"))
    with pytest.raises(RuntimeError, match=r"litgpt 0\.\d+.*main takes"):
        finetune_lora("unused")


def test_hyperparameters_keep_the_lora_settings_when_data_cannot_be_recorded(runs):
    """A data module litgpt's parser cannot read back: a warning, and the flags merge_lora needs are still recorded."""
    from jsonargparse import capture_parser
    from litgpt.utils import CLI

    from lightning_mpx.integrations.litgpt import _bind, _recorded_argv

    args = _bind(litgpt_lora.setup, runs["checkpoint"], dict(lora_r=2, data=object()))
    with pytest.warns(UserWarning, match="hyperparameters.yaml records litgpt's defaults"):
        argv = _recorded_argv(litgpt_lora.setup, args)
    recorded = capture_parser(lambda: CLI(litgpt_lora.setup)).parse_args(argv)
    assert recorded.lora_r == 2 and Path(recorded.checkpoint_dir) == runs["checkpoint"]


def test_full_finetune_at_o2_saves_fp32_weights_that_follow_bf16_mixed(runs, tmp_path, monkeypatch):
    """``finetune_full`` at O2 against litgpt's ``finetune/full.py`` ``setup(precision="bf16-mixed")``: the final
    ``lit_model.pth`` is FP32 (the masters), trained, within bfloat16's tolerance, and loads into a ``litgpt.GPT``."""
    kwargs = {k: v for k, v in _kwargs(tmp_path / "x", runs["data"]).items() if not k.startswith("lora_")}
    kwargs["optimizer"] = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5}}
    monkeypatch.setattr(sys, "argv", ["litgpt", "finetune_full", str(runs["checkpoint"])])
    litgpt_full.setup(runs["checkpoint"], precision="bf16-mixed", **{**kwargs, "out_dir": tmp_path / "theirs"})
    fabric = finetune_full(runs["checkpoint"], opt_level="O2", mpx_kwargs={"half_dtype": "bfloat16"},
                           **{**kwargs, "out_dir": tmp_path / "ours"})  # fmt: skip
    assert isinstance(fabric.strategy.precision, FabricMixedPrecisionPlugin)
    ours = torch.load(tmp_path / "ours" / "final" / "lit_model.pth")["model"]
    theirs = torch.load(tmp_path / "theirs" / "final" / "lit_model.pth")["model"]
    base = torch.load(runs["checkpoint"] / "lit_model.pth")
    assert {v.dtype for v in ours.values()} == {torch.float32}
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], atol=1e-2, rtol=2e-2, msg=name)
    moved = ours["transformer.h.1.attn.qkv.weight"] - base["transformer.h.1.attn.qkv.weight"]
    head = ours["lm_head.weight"]
    assert moved.abs().max() > 1e-2 and not torch.equal(head, head.bfloat16().float())  # the masters, not half values
    litgpt.GPT(litgpt.Config.from_file(tmp_path / "ours" / "final" / "model_config.yaml")).load_state_dict(ours)
    hparams = yaml.safe_load((tmp_path / "ours" / "final" / "hyperparameters.yaml").read_text())
    assert hparams["train"]["max_steps"] == 3 and hparams["checkpoint_dir"] == str(runs["checkpoint"])
    with pytest.raises(ValueError, match="resume=True at O2"):
        finetune_full(runs["checkpoint"], opt_level="O2", resume=True, out_dir=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_command_line_reads_litgpt_flags_and_config(runs, tmp_path):
    """``python -m lightning_mpx.litgpt finetune_lora``'s parsing: litgpt's flags and a ``--config`` YAML reach the
    same setup (run in-process for two steps, the run itself checked above)."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"lora_r": 4, "lora_alpha": 8, "train": {"max_steps": 2, "epochs": 100,
                                      "global_batch_size": 1, "micro_batch_size": 1, "lr_warmup_steps": 1,
                                      "save_interval": None}}))  # fmt: skip
    data = {"class_path": "litgpt.data.JSON", "init_args": {"json_path": str(runs["data"]), "val_split_fraction": 0.25,
            "prompt_style": "alpaca", "num_workers": 0}}  # fmt: skip
    main(["finetune_lora", str(runs["checkpoint"]), "--opt_level", "O2", "--mpx_kwargs", '{"half_dtype": "bfloat16"}',
          "--config", str(config), "--out_dir", str(tmp_path / "out"), "--data", json.dumps(data),
          "--eval.final_validation=false", "--eval.max_iters=1", "--lora_dropout=0.0"])  # fmt: skip
    lora_file = torch.load(tmp_path / "out" / "final" / "lit_model.pth.lora")["model"]
    assert lora_file["transformer.h.0.attn.qkv.lora_A"].shape[0] == 4 * 2  # r x (query, value): litgpt's default
    hparams = yaml.safe_load((tmp_path / "out" / "final" / "hyperparameters.yaml").read_text())
    assert hparams["lora_r"] == 4 and "opt_level" not in hparams
