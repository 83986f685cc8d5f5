"""How many bytes a Trainer checkpoint takes per parameter at O2, against Lightning's own precisions.

An MLP (``--width`` wide, three layers) trained two steps with ``Trainer(plugins=[MixedPrecisionPlugin("O2",
half_dtype=torch.bfloat16)])`` and with ``precision="bf16-mixed"`` / ``"bf16-true"``, then ``trainer.save_checkpoint``:
the file's size, its bytes per parameter (SGD without momentum: no optimizer state), and whether its ``state_dict`` is
FP32. At O2 the checkpoint's ``state_dict`` holds the FP32 masters and the plugin's own entry shares them, so each
master is written once (4 bytes a parameter, as ``"bf16-mixed"``'s FP32 weights).

Then each door's documented checkpoint (``--door-width`` MLP, AdamW, two steps, bfloat16) at O1, O2 and O3 against
the framework's own precision: the Trainer's ``save_checkpoint`` against ``"bf16-mixed"``, ``fabric.save`` of model,
optimizer and plugin against ``"bf16-mixed"``, Accelerate's ``save_state`` folder against ``"bf16"``, and
``torch.save({"model", "optimizer", "amp"})`` of the core ``Amp`` and of the Apex layer (README's checkpoints)
against ``torch.autocast`` on the FP32 model (no ``"amp"`` entry); and the ``transformers.Trainer`` door
(``mpx_trainer()``) on a 466,432-parameter GPT-2 from a config: its ``checkpoint-2`` folder against the Trainer's own
``bf16=True``.

    python benchmarks/checkpoint_size.py [--width 512] [--door-width 256] [--doors trainer ...] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _row(variant: str, width: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    from lightning_mpx import MixedPrecisionPlugin

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
                torch.nn.Linear(width, width),
            )  # fmt: skip

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, width)), batch_size=4)
    precision = {} if variant == "O2" else {"precision": variant}
    plugins = [MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16)] if variant == "O2" else []
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, plugins=plugins, **precision)
    model = Net()
    trainer.fit(model, data)
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "last.ckpt")
        trainer.save_checkpoint(path)
        size = os.path.getsize(path)
        state = torch.load(path, weights_only=False)["state_dict"]
    return {"variant": variant, "parameters": params, "bytes": size, "bytes_per_param": size / params,
            "state_dict_dtypes": sorted({str(t.dtype) for t in state.values()})}


def _net(width: int) -> Any:
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width), torch.nn.ReLU(), torch.nn.Linear(2 * width, 2 * width), torch.nn.ReLU(),
        torch.nn.Linear(2 * width, width),
    )  # fmt: skip


def _batches(width: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, width, generator=g) for _ in range(2)]


def _door_bytes(door: str, variant: str, width: int, folder: str) -> int:
    """The bytes on disk of ``door``'s documented checkpoint after two AdamW steps, at ``variant`` (an opt level, or
    the framework's own precision)."""
    import torch

    half = torch.bfloat16
    level = variant if variant in ("O1", "O2", "O3") else None
    path = os.path.join(folder, "ckpt")
    if door == "trainer":
        import lightning.pytorch as pl

        from lightning_mpx import MixedPrecisionPlugin

        class Net(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = _net(width)

            def training_step(self, batch: Any, index: int) -> torch.Tensor:
                return self.net(batch[0]).float().pow(2).mean()

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.AdamW(self.parameters(), lr=1e-3)

        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(_batches(width))), batch_size=4)
        extra = {"plugins": [MixedPrecisionPlugin(level, half_dtype=half)]} if level else {"precision": variant}
        trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, **extra)
        trainer.fit(Net(), data)
        trainer.save_checkpoint(path)
        return os.path.getsize(path)
    if door == "fabric":
        from lightning.fabric import Fabric

        from lightning_mpx import FabricMixedPrecisionPlugin

        mpx = FabricMixedPrecisionPlugin(level, half_dtype=half) if level else None
        fabric = Fabric(accelerator="cpu", devices=1, **({"plugins": [mpx]} if mpx else {"precision": variant}))
        model = _net(width)
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        for x in _batches(width):
            fabric.backward(model(x).float().pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        fabric.save(path, {"model": model, "optimizer": optimizer, **({"mpx": mpx} if mpx else {})})
        return os.path.getsize(path)
    if door == "accelerate":
        from accelerate.state import AcceleratorState, GradientState

        from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        kwargs = {"kwargs_handlers": [MixedPrecisionKwargs(half_dtype=half)]} if level else {}
        accelerator = Accelerator(mixed_precision=level or variant, cpu=True, **kwargs)
        model = _net(width)
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        for x in _batches(width):
            accelerator.backward(model(x).float().pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        accelerator.save_state(path)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
    if door == "hf_trainer":
        return _hf_trainer_bytes(level, folder)
    model = _net(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if door == "core" and level:
        from lightning_mpx import Amp

        amp = Amp(level, half_dtype=half)
        model = amp.prepare_model(model)
        optimizer = amp.prepare_optimizer(optimizer)
        for x in _batches(width):
            with amp.forward_context():
                loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().pow(2).mean()
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()
        state = amp.state_dict()
    elif door == "apex" and level:
        from lightning_mpx.apex import amp as apex_amp

        cast = {} if level == "O1" else {"cast_model_type": half}  # O1: the picked half dtype (bfloat16 on a CPU)
        model, optimizer = apex_amp.initialize(model, optimizer, opt_level=level, verbosity=0, **cast)
        for x in _batches(width):
            loss = model(x).float().pow(2).mean()
            with apex_amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        state = apex_amp.state_dict()
    else:  # torch.autocast on the FP32 model: the plain loop's own mixed precision
        for x in _batches(width):
            with torch.autocast("cpu", dtype=half):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        state = {}
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": state}, path)
    return os.path.getsize(path)


def _gpt2() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=512, n_positions=32, n_embd=128, n_layer=2,
                                                                n_head=2))  # fmt: skip


def _hf_trainer_bytes(level: str | None, folder: str) -> int:
    """The bytes of the Trainer's ``checkpoint-2`` folder of :func:`_gpt2` after two AdamW steps, at ``level`` (an
    opt level through ``mpx_trainer()``, or ``None``: transformers' own ``bf16=True``)."""
    import torch
    import transformers
    from accelerate.state import AcceleratorState, GradientState

    from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=folder, use_cpu=True, report_to=[], max_steps=2, save_steps=2,
                                          per_device_train_batch_size=4, save_strategy="steps", disable_tqdm=True,
                                          optim="adamw_torch", bf16=level is None)  # fmt: skip
    if level is None:
        trainer = transformers.Trainer(model=_gpt2(), args=args, train_dataset=data)
    else:
        trainer = mpx_trainer()(model=_gpt2(), args=args, train_dataset=data, opt_level=level,
                                mpx_kwargs=MixedPrecisionKwargs(half_dtype=torch.bfloat16))  # fmt: skip
    trainer.train()
    path = os.path.join(folder, "checkpoint-2")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


#: Each door, the framework's own precision it is measured against, and the opt levels it takes.
DOORS = {
    "trainer": ("bf16-mixed", ("O1", "O2", "O3")),
    "fabric": ("bf16-mixed", ("O1", "O2", "O3")),
    "accelerate": ("bf16", ("O1", "O2", "O3")),
    "core": ("autocast", ("O1", "O2", "O3")),
    "apex": ("autocast", ("O1", "O2", "O3")),
    "hf_trainer": ("bf16", ("O1", "O2", "O3")),
}


def _door_row(door: str, width: int) -> dict[str, Any]:
    own, levels = DOORS[door]
    model = _gpt2() if door == "hf_trainer" else _net(width)
    row: dict[str, Any] = {"door": door, "own": own, "parameters": sum(p.numel() for p in model.parameters())}
    for variant in (own, *levels):
        with tempfile.TemporaryDirectory() as folder:
            try:
                row[variant if variant in levels else "own_bytes"] = _door_bytes(door, variant, width, folder)
            except (ValueError, TypeError, RuntimeError) as error:  # a level the door refuses
                row[variant] = f"refused: {str(error)[:80]}"
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--door-width", type=int, default=256, help="the doors' MLP: 525,568 parameters at 256")
    parser.add_argument("--doors", nargs="*", default=list(DOORS), choices=list(DOORS))
    parser.add_argument("--out", type=Path, default=_harness.default_out("checkpoint_size"))
    args = parser.parse_args(argv)
    rows = [_row(variant, args.width) for variant in ("bf16-mixed", "bf16-true", "O2")]
    door_rows = [_door_row(door, args.door_width) for door in args.doors]
    table = _harness.markdown_table(
        ["variant", "parameters", "MB", "bytes / parameter", "state_dict dtypes"],
        [(r["variant"], f"{r['parameters']:,}", f"{r['bytes'] / 1e6:.2f}", f"{r['bytes_per_param']:.2f}",
          ", ".join(r["state_dict_dtypes"])) for r in rows],
    )  # fmt: skip
    def _mb(value: Any) -> str:
        return f"{value / 1e6:.2f}" if isinstance(value, int) else str(value)

    doors_table = _harness.markdown_table(
        ["door (AdamW, 2 steps)", "parameters", "own precision", "own MB", "O1 MB", "O2 MB", "O3 MB"],
        [(r["door"], f"{r['parameters']:,}", r["own"], _mb(r.get("own_bytes")), _mb(r.get("O1")), _mb(r.get("O2")),
          _mb(r.get("O3"))) for r in door_rows],
    )  # fmt: skip
    print(table)
    print()
    print(doors_table)
    result = {"benchmark": "checkpoint_size", "command": _harness.command(argv), **_harness.machine(), "rows": rows,
              "doors": door_rows}
    _harness.save(args.out, result, {"": table + "\n\n" + doors_table})


if __name__ == "__main__":
    main()
