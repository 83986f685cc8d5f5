"""``fp32_modules`` pinned on a model run under ``torch.compile``: the pinned modules run in FP32 as in the same run
uncompiled. The figure: ``_Net``'s ``boom`` (weight x3e5) passes float16's maximum, not FP32's, so a pinned ``boom`` run
in half makes every loss NaN. ``backend="eager"`` runs the graph's torch calls as they are, where a cast mode left on
the stack meets them (aot_eager and inductor run aten calls the mode never sees)."""

from __future__ import annotations

import pytest
import torch

from lightning_mpx import Amp, FabricMixedPrecisionPlugin
from tests.test_compile_floor_promotion import _Net  # enc, boom (pinned), norm, head


def _pinned_losses(door: str, backend: str | None) -> list[float]:
    """Three O1 float16 steps of ``_Net`` with ``fp32_modules=["boom"]`` (boom's weight x3e5: its output passes
    float16's maximum, not FP32's), compiled by ``backend`` before it is handed to ``door`` (None: eager): the
    losses."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = _Net()
    with torch.no_grad():
        net.boom.weight.mul_(3e5)
    compiled = torch.compile(net, backend=backend) if backend else net
    settings = {"half_dtype": "float16", "init_scale": 4.0, "fp32_modules": ["boom"]}
    generator = torch.Generator().manual_seed(0)
    losses = []
    if door == "fabric":
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O1", **settings)])
        model, optimizer = fabric.setup(compiled, torch.optim.SGD(net.parameters(), lr=1e-3))
        for _ in range(3):
            loss = model(torch.randn(4, 8, generator=generator)).float().square().mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses
    amp = Amp("O1", on_floor="continue", **settings)
    if door == "core_after":  # compiled after the prepare instead
        model = amp.prepare_model(net)
        model = torch.compile(model, backend=backend) if backend else model
    else:
        model = amp.prepare_model(compiled)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    for _ in range(3):
        with amp.forward_context():
            out = amp.cast_outputs(model(amp.cast_inputs(torch.randn(4, 8, generator=generator))))
            loss = out.float().square().mean()
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("door", ["core", "fabric"])
def test_a_pinned_fp32_module_of_a_compiled_model_runs_in_fp32_from_the_first_step(door):
    # fp32_modules=["boom"] on a model torch.compile'd before Amp.prepare_model / fabric.setup, under a backend that
    # runs the graph's torch calls as they are ("eager"): the cast mode left on the stack while the graph ran cast
    # boom's FP32 matmul to half again (its hooks raised the FP32 count of the mode traced, not of that one), and every
    # loss was NaN ([nan, nan, nan]) where the same model uncompiled trains ([0.320, 0.751, 0.791]).
    eager = _pinned_losses(door, None)
    assert all(torch.isfinite(torch.tensor(eager)))  # the reference trains
    assert _pinned_losses(door, "eager") == pytest.approx(eager, rel=1e-3)



# A strict xfail until stop 73's O1 marker (losses [nan, nan, nan]): the traced calls carry autocast turned off, so
# the cast mode meeting them again while the graph runs leaves them as traced.
def test_a_pinned_fp32_module_of_a_model_compiled_after_the_prepare_runs_in_fp32():
    eager = _pinned_losses("core_after", None)
    assert all(torch.isfinite(torch.tensor(eager)))
    assert _pinned_losses("core_after", "eager") == pytest.approx(eager, rel=1e-3)


def _trainer_losses(compiled: bool) -> list[float]:
    """Two O1 float16 steps of the Trainer plugin with ``fp32_modules=["boom"]``, the LightningModule
    ``torch.compile``'d (backend eager) before ``trainer.fit`` when ``compiled``; its ``training_step`` reads the loss
    (``.item()``, as logging code does: a graph break)."""
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin

    torch._dynamo.reset()
    losses: list[float] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = _Net()
            with torch.no_grad():
                self.net.boom.weight.mul_(3e5)

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            loss = self.net(batch[0]).float().square().mean()
            losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=4.0, fp32_modules=["boom"])
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, plugins=[plugin], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    trainer.fit(torch.compile(module, backend="eager") if compiled else module,
                torch.utils.data.DataLoader(data, batch_size=4))
    return losses


# A strict xfail until stop 73's O1 marker (losses [nan, nan] with a graph break in training_step), as above.
def test_a_pinned_fp32_module_of_a_lightning_module_compiled_before_fit_runs_in_fp32():
    eager = _trainer_losses(compiled=False)
    assert all(torch.isfinite(torch.tensor(eager)))
    assert _trainer_losses(compiled=True) == pytest.approx(eager, rel=1e-3)
