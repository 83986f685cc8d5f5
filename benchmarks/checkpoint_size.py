"""How many bytes a Trainer checkpoint takes per parameter at O2, against Lightning's own precisions.

An MLP (``--width`` wide, three layers) trained two steps with ``Trainer(plugins=[MixedPrecisionPlugin("O2",
half_dtype=torch.bfloat16)])`` and with ``precision="bf16-mixed"`` / ``"bf16-true"``, then ``trainer.save_checkpoint``:
the file's size, its bytes per parameter (SGD without momentum: no optimizer state), and whether its ``state_dict`` is
FP32. At O2 the checkpoint's ``state_dict`` holds the FP32 masters and the plugin's own entry shares them, so each
master is written once (4 bytes a parameter, as ``"bf16-mixed"``'s FP32 weights).

    python benchmarks/checkpoint_size.py [--width 512] [--out PATH]
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--out", type=Path, default=_harness.default_out("checkpoint_size"))
    args = parser.parse_args(argv)
    rows = [_row(variant, args.width) for variant in ("bf16-mixed", "bf16-true", "O2")]
    table = _harness.markdown_table(
        ["variant", "parameters", "MB", "bytes / parameter", "state_dict dtypes"],
        [(r["variant"], f"{r['parameters']:,}", f"{r['bytes'] / 1e6:.2f}", f"{r['bytes_per_param']:.2f}",
          ", ".join(r["state_dict_dtypes"])) for r in rows],
    )  # fmt: skip
    print(table)
    result = {"benchmark": "checkpoint_size", "command": _harness.command(argv), **_harness.machine(), "rows": rows}
    _harness.save(args.out, result, {"": table})


if __name__ == "__main__":
    main()
