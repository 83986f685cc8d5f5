"""The README's and docs' examples as a new user copies them: each code block runs (on CPU, tiny models, bfloat16
where the block leaves the dtype open), what its comments claim holds, and every API name the docs spell exists.

Blocks are found by a line they contain, so an edit that breaks one fails here, and one that removes it fails too.
The test fills in only what the text asks the user to supply (a model, a loader, a loss) and shrinks sizes; each
substitution is spelled out where it is made."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_mpx
from lightning_mpx import Amp, FabricMixedPrecisionPlugin, MixedPrecisionPlugin, StepOutcome

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md"] + [f"docs/{name}.md" for name in (
    "lightning", "fabric", "accelerate", "apex", "core", "fsdp", "master_weights", "loss_scaling", "precision_health",
    "cast_table", "compile", "unscale")]  # fmt: skip


def block(doc: str, contains: str, lang: str = "python") -> str:
    """The one fenced ``lang`` block of ``doc`` that contains ``contains``."""
    text = (ROOT / doc).read_text()
    found = [m.group(1) for m in re.finditer(rf"^```{lang}\n(.*?)^```", text, re.S | re.M) if contains in m.group(1)]
    assert len(found) == 1, f"{doc}: {len(found)} {lang} blocks contain {contains!r}"
    return found[0]


def substitute(code: str, old: str, new: str) -> str:
    assert old in code, f"the block no longer contains {old!r}"
    return code.replace(old, new)


def run(code: str, where: str, **user: object) -> dict:
    """Run ``code`` with only what the user supplies in its namespace (no imports: the block brings its own)."""
    namespace = dict(user)
    exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the documented example is the code under test
    return namespace


def classifier() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def loader(batches: int = 3) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4 * batches, 8, generator=g), torch.randint(0, 4, (4 * batches,)))
    return torch.utils.data.DataLoader(data, batch_size=4)


def scalar_names(run_dir: Path) -> set[str]:
    from lightning_mpx.health.plot import read_scalars

    return set(read_scalars(run_dir))


# -- the core engine ---------------------------------------------------------------------------------------------------


def test_core_loop_runs_and_logs_the_metrics_it_names():
    torch.manual_seed(0)
    code = block("docs/core.md", "amp = Amp(\"O2\")")
    code = substitute(code, 'Amp("O2")', 'Amp("O2", half_dtype="bfloat16")')  # bfloat16 on a CPU
    ns = run(code, "docs/core.md", model=classifier(), loader=loader())
    assert set(ns["metrics"]) >= {"mpx/loss_scale", "mpx/overflows", "mpx/skipped_steps", "mpx/grad_norm"}
    assert set(ns["checkpoint"]["amp"]) >= {"scalers", "master_weights"}
    assert next(ns["model"].parameters()).dtype == torch.bfloat16  # O2: half model


def test_engine_module_docstring_loop_runs():
    code = literal_blocks("lightning_mpx/engine/amp.py")["<module>"]
    code = substitute(code, 'Amp("O2")', 'Amp("O2", half_dtype="bfloat16")')
    ns = run(code, "engine/amp.py", Amp=Amp, torch=torch, model=classifier(), data=loader(), loss_fn=F.cross_entropy)
    assert ns["amp"].scalers[0].get_scale() == 1.0  # bfloat16: a static scale


def test_opt_levels_block_and_the_errors_core_md_quotes():
    ns = run(block("docs/core.md", "resolve_properties(\"O2\""), "docs/core.md")
    props = ns["props"]
    assert props.half_dtype == torch.bfloat16 and props.keep_batchnorm_fp32 is False and props.master_weights
    with pytest.raises(ValueError, match="master_weights=True needs a model cast to half"):
        lightning_mpx.resolve_properties("O1", master_weights=True)
    for bad in ("O4", "o1", "01"):
        with pytest.raises(ValueError, match="opt_level") as err:
            lightning_mpx.resolve_properties(bad)
        assert "O0" in str(err.value) and "O3" in str(err.value)  # names the valid choices
    with pytest.raises(ValueError, match="letter O"):
        lightning_mpx.resolve_properties("01")


def test_one_settings_object_block_and_its_claimed_equalities():
    from lightning_mpx.accelerate import MixedPrecisionKwargs

    ns = run(block("docs/core.md", "MixedPrecisionSettings.from_kwargs"), "docs/core.md")
    settings = ns["settings"]
    assert MixedPrecisionKwargs(half_dtype="float16", growth_interval=500).settings("O2") == settings
    assert ns["amp"].settings == Amp("O2", half_dtype="float16", growth_interval=500).settings
    assert ns["plugin"].amp.settings == ns["fabric_plugin"].amp.settings == settings
    settings_doc = literal_blocks("lightning_mpx/settings.py")["<module>"]
    run(settings_doc, "settings.py", MixedPrecisionSettings=lightning_mpx.MixedPrecisionSettings, Amp=Amp,
        MixedPrecisionPlugin=MixedPrecisionPlugin)  # fmt: skip


def test_cast_table_block_registers_what_it_says():
    ns = run(block("docs/cast_table.md", "CastTable.default()"), "docs/cast_table.md")
    table = ns["amp"].policy.table
    assert table.category_of(torch.outer) == "half"
    assert table.category_of(torch.nn.functional.silu) == "float"
    assert table.category_of(ns["fused_op"]) == "half"
    table_doc = literal_blocks("lightning_mpx/casting/table.py")["<module>"]
    run(table_doc, "casting/table.py", CastTable=lightning_mpx.CastTable, torch=torch)


def test_fused_adamw_block_returns_a_step_outcome():
    code = block("docs/loss_scaling.md", "fused=True))")
    code = substitute(code, "amp.step(optimizer)  ", "outcome = amp.step(optimizer)")
    ns = run(code, "docs/loss_scaling.md", model=classifier(), x=torch.randn(4, 8), y=torch.randint(0, 4, (4,)))
    assert isinstance(ns["outcome"], StepOutcome) and bool(ns["outcome"])


# -- the front doors ---------------------------------------------------------------------------------------------------


def lightning_module():
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = classifier()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train/loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val/loss", F.cross_entropy(self(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Classifier()


@pytest.mark.parametrize("doc", ["README.md", "docs/lightning.md"])
def test_lightning_quick_example_trains_and_logs_the_mpx_metrics(doc, tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("tensorboard")  # the Trainer's default logger
    code = block(doc, "trainer.fit(model, train_loader, val_loader)")
    trainer_args = f"max_steps=3, log_every_n_steps=1, default_root_dir={str(tmp_path)!r}, enable_progress_bar=False"
    code = substitute(code, "max_steps=10_000", trainer_args)
    code = substitute(code, 'MixedPrecisionPlugin("O1")', 'MixedPrecisionPlugin("O1", half_dtype="bfloat16")')
    ns = run(code, doc, model=lightning_module(), train_loader=loader(), val_loader=loader(2))
    assert ns["trainer"].global_step == 3
    # lightning.md "Metrics": these go to the Trainer's loggers; mpx/grad_norm because gradient_clip_val clips by norm.
    logged = scalar_names(tmp_path)
    assert logged >= {"mpx/loss_scale", "mpx/overflows", "mpx/skipped_steps", "mpx/grad_norm", "train/loss"}, logged


def test_readme_accelerate_loop_runs():
    pytest.importorskip("accelerate")
    model = classifier()
    code = block("README.md", "from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs")
    ns = run(code, "README.md", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loader=loader())
    assert ns["optimizer"].step_was_skipped is False
    assert next(ns["model"].parameters()).dtype == torch.bfloat16


def test_accelerate_doc_loop_logs_the_mpx_metrics_and_saves_the_engine(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    model = classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    run(block("docs/accelerate.md", "accelerator.init_trackers"), "docs/accelerate.md", model=model,
        optimizer=optimizer, loader=loader(), scheduler=scheduler)  # fmt: skip
    assert scalar_names(tmp_path / "runs") >= {"loss", "mpx/loss_scale", "mpx/overflows", "mpx/skipped_steps"}
    assert (tmp_path / "runs/my_run/checkpoint/lightning_mpx_amp.bin").exists()


def test_accelerate_module_docstring_loop_runs():
    pytest.importorskip("accelerate")
    code = literal_blocks("lightning_mpx/integrations/accelerate.py")["<module>"]
    model = classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run(code, "integrations/accelerate.py", model=model, optimizer=optimizer, loader=loader(), F=F,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1))  # fmt: skip


def fabric_on_one_cpu(code: str) -> str:
    """The GPU/DDP line of a Fabric block, on one CPU device (the test cannot start two processes cheaply)."""
    return substitute(code, 'accelerator="cuda", devices=2, strategy="ddp"', 'accelerator="cpu", devices=1')


def test_readme_fabric_loop_runs_and_saves_the_plugin(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    monkeypatch.chdir(tmp_path)
    code = block("README.md", "from lightning_mpx import FabricMixedPrecisionPlugin")
    # Fabric refuses setup() on several devices before launch(): the block must call it (it runs on one device here).
    assert code.index("fabric.launch()") < code.index("fabric.setup(")
    code = substitute(fabric_on_one_cpu(code), 'half_dtype="float16"', 'half_dtype="bfloat16"')
    model = classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ns = run(code, "README.md", model=model, optimizer=optimizer, loader=loader(),
             scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1))  # fmt: skip
    assert "mpx/loss_scale" in ns["mpx"].metrics()
    assert "mpx" in torch.load(tmp_path / "last.ckpt", weights_only=False)


def test_fabric_doc_loop_logs_the_mpx_metrics(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    code = block("docs/fabric.md", "mpx.request_telemetry()")
    assert code.index("fabric.launch()") < code.index("fabric.setup(")
    code = substitute(fabric_on_one_cpu(code), 'half_dtype="float16"', 'half_dtype="bfloat16"')
    model = classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run(code, "docs/fabric.md", model=model, optimizer=optimizer, loader=loader(),
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1))  # fmt: skip
    assert scalar_names(tmp_path / "runs") >= {"loss", "mpx/loss_scale", "mpx/overflows", "mpx/skipped_steps"}
    assert (tmp_path / "runs/last.ckpt").exists()
    module_doc = literal_blocks("lightning_mpx/integrations/fabric.py")["<module>"]
    assert module_doc.index("fabric.launch()") < module_doc.index("fabric.setup(")


@pytest.mark.parametrize("doc", ["README.md", "docs/apex.md"])
def test_apex_block_runs_and_saves_apex_state(doc):
    model = classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ns = run(block(doc, "amp.initialize(model, optimizer"), doc, model=model, optimizer=optimizer,
             loss_fn=F.cross_entropy, x=torch.randn(4, 8), y=torch.randint(0, 4, (4,)))  # fmt: skip
    state = ns["amp"].state_dict()
    assert set(state["loss_scaler0"]) == {"loss_scale", "unskipped"}  # apex.md: Apex's format
    ns["amp"]._amp_state.reset()


def test_fsdp_blocks_build_their_trainers_and_accelerator():
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            return self.linear(x)

    code = block("README.md", "from lightning_mpx.fsdp import shard_model")
    if not torch.cuda.is_available():  # Lightning's FSDP1 strategy needs a GPU accelerator
        code = substitute(code, 'trainer = pl.Trainer(strategy="fsdp"', '# trainer = pl.Trainer(strategy="fsdp"')
    run(code, "README.md", Block=Block)
    run(block("docs/fsdp.md", "class LitModel(pl.LightningModule)"), "docs/fsdp.md", TransformerBlock=Block)
    ns = run(block("docs/fsdp.md", "fsdp1_mixed_precision(plugin)"), "docs/fsdp.md", TransformerBlock=Block,
             plugin=MixedPrecisionPlugin("O2"))  # fmt: skip
    assert ns["strategy"].mixed_precision_config is not None
    model = nn.Sequential(Block())  # one process: Accelerate keeps the plugin and prepares the model whole
    run(block("README.md", "FullyShardedDataParallelPlugin(fsdp_version=2"), "README.md", model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # fmt: skip


# -- names the prose spells --------------------------------------------------------------------------------------------


def backticked(pattern: str) -> dict[str, str]:
    names: dict[str, str] = {}
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for span in re.finditer(r"`([^`\n]+)`|^```python\n(.*?)^```", text, re.S | re.M):
            for name in re.findall(pattern, span.group(1) or span.group(2)):
                names.setdefault(name, f"{doc}:{text[: span.start()].count(chr(10)) + 1}")
    return names


def test_every_dotted_lightning_mpx_name_in_the_docs_resolves():
    names = backticked(r"\blightning_mpx(?:\.\w+)+")
    assert len(names) > 10
    missing = []
    for name, where in names.items():
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ModuleNotFoundError:
                continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            missing.append(f"{name} ({where})")
    assert not missing, missing


def test_attributes_the_docs_name_exist():
    """``amp.x``, ``plugin.amp.x``, ``accelerator.x``, ``mpx.x``... in prose and code blocks exist on the real
    objects (instance attributes included)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("lightning")
    from lightning_mpx.accelerate import Accelerator
    from lightning_mpx.apex import amp as apex_amp
    from lightning_mpx.health.forensics import OverflowRecord

    amp = Amp("O1", half_dtype="bfloat16")
    amp.prepare_optimizer(torch.optim.SGD(amp.prepare_model(nn.Linear(4, 4)).parameters(), lr=0.1))
    accelerator = Accelerator(mixed_precision="O1", cpu=True)
    model = nn.Linear(4, 4)
    _, prepared = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    apex_model = nn.Linear(4, 4)
    apex_amp.initialize(apex_model, torch.optim.SGD(apex_model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    try:
        owners = {
            "amp": [amp, apex_amp], "Amp": [Amp], "plugin.amp": [amp], "accelerator.amp": [amp], "mpx.amp": [amp],
            "amp.iteration": [amp.iteration], "amp.policy": [amp.policy], "policy": [amp.policy],
            "amp.policy.table": [amp.policy.table], "table": [amp.policy.table], "CastTable": [lightning_mpx.CastTable],
            "CastPolicy": [amp.policy], "accelerator": [accelerator], "optimizer": [prepared],
            "mpx": [FabricMixedPrecisionPlugin("O1")], "plugin": [MixedPrecisionPlugin("O1")],
            "trainer.precision_plugin": [MixedPrecisionPlugin("O1")], "_amp_state": [apex_amp._amp_state],
            "record": [OverflowRecord], "last_overflow": [OverflowRecord],
            "MixedPrecisionSettings": [lightning_mpx.MixedPrecisionSettings],
        }  # fmt: skip
        prefixes = sorted(owners, key=len, reverse=True)
        names = backticked(rf"(?<![\w.])((?:{'|'.join(re.escape(p) for p in prefixes)})\.\w+)")
        assert len(names) > 50
        missing = []
        for name, where in names.items():
            owner, attr = name.rsplit(".", 1)
            if name == "amp.GradScaler":  # torch.amp.GradScaler
                continue
            if not any(hasattr(obj, attr) for obj in owners[owner]):
                missing.append(f"{name} ({where})")
        assert not missing, missing
    finally:
        apex_amp._amp_state.reset()


FRONT_DOORS = r"(?<![\w.])(Amp|MixedPrecisionPlugin|FabricMixedPrecisionPlugin|MixedPrecisionKwargs|from_kwargs|" \
    r"resolve_properties|CastPolicy|shard_model|mixed_precision_policy|fsdp1_mixed_precision|initialize)\("


def documented_keywords() -> list[tuple[str, str, str]]:
    """``(front door, keyword, where)`` for every ``name=`` at the top level of a front door's call in the docs."""
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for m in re.finditer(FRONT_DOORS, text):
            depth, i = 1, m.end()
            while depth and i < len(text) and i - m.end() < 600:
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            args = text[m.end() : i - 1]
            flat = re.sub(r"\([^()]*\)|\[[^\[\]]*\]|\{[^{}]*\}|\"[^\"]*\"", "", args)
            for kw in re.findall(r"(?:^|[,(\s])(\w+)=(?!=)", flat):
                out.append((m.group(1), kw, f"{doc}:{text[: m.start()].count(chr(10)) + 1}"))
    return out


def test_keywords_documented_for_the_front_doors_exist():
    pytest.importorskip("accelerate")
    from lightning_mpx import fsdp
    from lightning_mpx.accelerate import MixedPrecisionKwargs
    from lightning_mpx.apex import amp as apex_amp
    from lightning_mpx.settings import SettingsKeywords

    settings = set(SettingsKeywords.__annotations__)
    accepted = {
        "Amp": settings, "MixedPrecisionPlugin": settings, "FabricMixedPrecisionPlugin": settings,
        "from_kwargs": settings, "resolve_properties": settings,  # the opt-level overrides and half_dtype
        "MixedPrecisionKwargs": {f.name for f in dataclasses.fields(MixedPrecisionKwargs)},
        "CastPolicy": set(inspect.signature(lightning_mpx.CastPolicy).parameters),
        "shard_model": set(inspect.signature(fsdp.shard_model).parameters),
        "mixed_precision_policy": set(inspect.signature(fsdp.mixed_precision_policy).parameters),
        "fsdp1_mixed_precision": set(inspect.signature(fsdp.fsdp1_mixed_precision).parameters),
        "initialize": set(inspect.signature(apex_amp.initialize).parameters),
    }  # fmt: skip
    found = documented_keywords()
    assert len(found) > 30
    unknown = [f"{door}({kw}=...) at {where}" for door, kw, where in found if kw not in accepted[door]]
    assert not unknown, unknown


def test_documented_scaler_defaults_are_the_real_ones():
    """loss_scaling.md opens with ``Amp(...)``'s loss-scaler defaults."""
    text = (ROOT / "docs/loss_scaling.md").read_text()
    call = re.search(r"`Amp\(\.\.\., (.*?)\)`", text, re.S).group(1)
    defaults = {k: v.default for k, v in inspect.signature(Amp).parameters.items()}
    for kw, value in re.findall(r"(\w+)=([^,]+)", call):
        assert defaults[kw] == eval(value, {}), kw  # noqa: S307 - numbers and strings from the docs
    accelerate_md = (ROOT / "docs/accelerate.md").read_text()
    listed = re.search(r"`MixedPrecisionKwargs` takes `Amp`'s settings(.*?)\nAn unknown", accelerate_md, re.S).group(1)
    from lightning_mpx.accelerate import MixedPrecisionKwargs

    fields = {f.name for f in dataclasses.fields(MixedPrecisionKwargs)}
    listed_names = {name for name in re.findall(r"`(\w+)`", listed) if name not in ("Amp", "None")}
    assert listed_names <= fields, listed_names - fields
    scaler = {f.name for f in dataclasses.fields(lightning_mpx.settings.ScalerSettings)}
    assert fields - scaler - listed_names == set(), "MixedPrecisionKwargs fields docs/accelerate.md does not list"


# -- commands ----------------------------------------------------------------------------------------------------------


def test_documented_command_flags_exist():
    """Every ``--flag`` of a ``lightning-mpx`` or ``python examples/...`` command in the docs and the examples'
    docstrings is one the command's parser declares."""
    commands = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for m in re.finditer(r"^```(?:bash|text)\n(.*?)^```", text, re.S | re.M):
            commands += [(line, doc) for line in m.group(1).splitlines()]
        commands += [(c, doc) for c in re.findall(r"`((?:lightning-mpx|python examples/)[^`]*)`", text)]
    for path in sorted((ROOT / "examples").glob("*.py")):
        commands += [(line, path.name) for line in (ast.get_docstring(ast.parse(path.read_text())) or "").splitlines()]
    checked = 0
    for line, where in commands:
        line = line.split("#")[0].lstrip("$ ")
        m = re.search(r"python (examples/\w+\.py)|lightning-mpx (\w+)", line)
        if not m:
            continue
        flags = re.findall(r"(?<=\s)(--[\w-]+)", line[m.end() :])
        if m.group(1):
            source = (ROOT / m.group(1)).read_text()
            missing = [f for f in flags if f'"{f}"' not in source]
        else:
            help_text = cli_help(m.group(2))
            missing = [f for f in flags if f not in help_text]
        assert not missing, f"{where}: {line.strip()!r} uses flags the command does not declare: {missing}"
        checked += 1
    assert checked > 10


def cli_help(sub: str) -> str:
    import contextlib
    import io

    from lightning_mpx import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([sub, "--help"])
    return out.getvalue()


# -- docstring examples ------------------------------------------------------------------------------------------------


def literal_blocks(module_path: str) -> dict[str, str]:
    """The ``::`` literal blocks of a module's docstrings, by the name of the module, class or function holding them."""
    tree = ast.parse((ROOT / module_path).read_text())
    blocks: dict[str, str] = {}
    for node in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef)))]:
        lines = (ast.get_docstring(node) or "").splitlines()
        for i, line in enumerate(lines):
            if not line.rstrip().endswith("::") or ".. " in line:
                continue
            j = i + 1
            body = []
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith(" ")):
                body.append(lines[j])
                j += 1
            blocks.setdefault(getattr(node, "name", "<module>"), textwrap.dedent("\n".join(body)).strip())
    return blocks


def test_doctests_in_the_package_pass():
    import doctest

    for name in ("lightning_mpx.opt_levels", "lightning_mpx.casting.policy", "lightning_mpx.casting.table",
                 "lightning_mpx.casting.checkpointing"):  # fmt: skip
        result = doctest.testmod(importlib.import_module(name))
        assert result.attempted and not result.failed, name


def test_a_first_run_of_the_examples_takes_bfloat16_on_a_cpu(monkeypatch, capsys):
    """``--half-dtype auto``, the examples' default (as the demo's): bfloat16 on a CPU, where float16 matmuls are
    often emulated (train_core took 78 s in float16 here, 4 s in bfloat16), float16 on a GPU. The script runs as
    ``python examples/train_core.py`` runs it (``__main__``, its argv), in this process."""
    import runpy
    import sys

    if torch.cuda.is_available():
        pytest.skip("a GPU takes float16: the CPU default is the point here")
    script = str(ROOT / "examples" / "train_core.py")
    monkeypatch.setattr(sys, "argv", [script, "--steps", "5"])
    runpy.run_path(script, run_name="__main__")
    out = capsys.readouterr().out
    assert "O1 bfloat16" in out, out
