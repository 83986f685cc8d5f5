"""Ranks of tests/test_lightning_ddp_options.py: DDP's options with the plugins, two CPU processes (gloo); one launch
per front door (``DDPHABITS63_DOOR``: ``trainer`` runs the Trainer's and the Accelerate adapter's cases, ``fabric``
Fabric's). Each case of the plugin (O1, O2 bfloat16) runs against the framework's own ``"bf16-mixed"`` (Accelerate's
``"bf16"``) on the same options, code and data. Each rank writes ``$MPX_OUT/rank{r}.json``; a case that raises leaves
its traceback in its ``"error"``.

The model (``Net``): a conv, a batch norm, a head and a side branch. 22 samples, 4 a batch: each rank gets 11 from the
``DistributedSampler`` (batches of 4, 4 and an uneven last 3; Accelerate's ``even_batches`` completes its last one).
SGD with momentum, two epochs. Every case records ``"w"``: the parameters as ``state_dict()`` gives them (the FP32
masters at O2); the Trainer's cases also ``"w_steps"`` (after each batch), ``"scales"``, ``"norms"`` (the unscaled
gradients' norm before each step) and ``"start"`` (the masters, or the weights, at ``on_train_start``).

Trainer cases (``{case}/{level}``, level ``bf16-mixed``, ``O1``, ``O2``; ``TRAINER_CASES`` says which):

* ``trainer_unused``: ``DDPStrategy(find_unused_parameters=True)``, ``accumulate_grad_batches=2``; the side branch is
  skipped in the last batch (a window of its own) on rank 1 in epoch 0 and on both ranks in epoch 1.
* ``trainer_static``: ``DDPStrategy(static_graph=True, gradient_as_bucket_view=True)``, ``gradient_clip_val`` below
  the gradients' norm (the clipped gradients go back into the buckets' views).
* ``trainer_static_accumulate/{bf16-mixed,O2}``: ``static_graph=True`` with ``accumulate_grad_batches=2``, which
  torch's reducer refuses under every precision (pytorch/pytorch#143580): the error, the model as the failed fit
  leaves it.
* ``trainer_hook16``/``trainer_hookbf16``/``trainer_wrapped``: ``DDPStrategy(ddp_comm_hook=fp16_compress_hook)``,
  ``bf16_compress_hook`` (renamed: DDP refuses that name off NCCL; gloo reduces bfloat16), and
  ``ddp_comm_state=WORLD, ddp_comm_hook=allreduce_hook, ddp_comm_wrapper=fp16_compress_wrapper``. Lightning registers
  a strategy's hook on CUDA only: ``HookDDP`` registers it on the CPU the same way (``_register_ddp_comm_hook``).
* ``trainer_spike16``: fp16_compress_hook with rank 1's loss times ``SPIKE`` at step 1: its gradients (~1e5, finite in
  bfloat16) become inf in the hook's float16 cast. The plugin with ``on_floor="continue"``; ``O2_raise``: its default
  (bfloat16's static scale is at its floor: raise), the error and the weights it leaves.
* ``trainer_syncbn``: ``sync_batchnorm=True``: the model as DDP is about to wrap it (after Lightning's conversion and
  the plugin's ``convert_module``), DDP's refusal of ``SyncBatchNorm`` on CPU modules, the model as the failed fit
  leaves it, then (but at O1) a retry without ``sync_batchnorm``.
* ``trainer_fp16/{O2,16-mixed}``: O2 float16 with a dynamic scale against Lightning's ``MixedPrecision("16-mixed",
  "cpu")`` with a ``GradScaler`` of the same settings (``Trainer(precision="16-mixed")`` becomes ``"bf16-mixed"`` on a
  CPU), fp16_compress_hook, rank 1's loss times ``SPIKE`` at step 1: an overflow on ONE rank.
* ``accelerate/{bf16,O1,O2}``: ``DistributedDataParallelKwargs(find_unused_parameters=True,
  comm_hook=DDPCommunicationHookType.FP16)``, ``gradient_accumulation_steps=2`` with ``accelerator.accumulate``, the
  branch skipped as above.

Fabric cases (``ref`` = ``"bf16-mixed"``):

* ``fabric/{ref,O1,O2}``: ``DDPStrategy(find_unused_parameters=True, gradient_as_bucket_view=True)``, accumulation of
  2 under ``no_backward_sync``, the branch skipped as above.
* ``join_throw/{ref,O2}``, ``join/{ref,O2}``: uneven inputs (rank 0: 2 batches, rank 1: 3) under torch's ``Join`` on
  the DDP module inside Fabric's, with ``throw_on_early_termination=True`` and without (the joined rank shadows the
  others' collectives). ``join/O2`` runs last, after every result is written: it may end the process (see
  tests/test_lightning_ddp_options.py); then this rank leaves without the closing barrier.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from tests.launch import case_error, finish_cases, write_rank_results

LR = 0.1
CLIP = 0.05  # far below the gradients' norm (0.1 to 2 here): every step clips
N, BATCH = 22, 4
BF16 = {"half_dtype": "bfloat16"}
FP16 = {"half_dtype": "float16", "loss_scale": "dynamic", "init_scale": 2.0**8, "growth_interval": 100}
SPIKE = 1e7  # rank 1's loss at step 1 times this: gradients ~1e5 to 1e6, finite in bfloat16, inf in float16
SPIKE_STEP = 1
# The levels each Trainer case runs ("bf16-mixed" first): O1 where its FP32 gradients meet something of their own.
TRAINER_CASES = {
    "trainer_unused": ("bf16-mixed", "O1", "O2", "32-true"), "trainer_static": ("bf16-mixed", "O1", "O2"),
    "trainer_static_accumulate": ("bf16-mixed", "O2"), "trainer_hook16": ("bf16-mixed", "O1", "O2"),
    "trainer_hookbf16": ("bf16-mixed", "O2"), "trainer_wrapped": ("bf16-mixed", "O2"),
    "trainer_spike16": ("bf16-mixed", "O1", "O2"), "trainer_syncbn": ("bf16-mixed", "O1", "O2"),
}  # fmt: skip


def _bf16_hook(state: Any, bucket: Any) -> Any:
    return default_hooks.bf16_compress_hook(state, bucket)


# torch's bf16_compress_hook under another name (DDP refuses that name off NCCL/CUDA), with its signature
bf16_hook = functools.wraps(default_hooks.bf16_compress_hook)(_bf16_hook)
bf16_hook.__name__ = "bf16_hook"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 1)
        self.branch = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.bn(self.conv(x))).mean((2, 3))
        out = self.head(h)
        return out + self.branch(h) if branch else out


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 2, 4, 4, generator=g)
    return torch.utils.data.TensorDataset(x, x.mean((1, 2, 3)).unsqueeze(-1).tanh())


def flat(tensors: Any) -> list[float]:
    return torch.cat([t.detach().float().flatten() for t in tensors]).tolist()


def params(module: nn.Module) -> list[float]:
    """The parameters as the user reads them: ``state_dict()`` (the FP32 masters at O2), in parameter order."""
    state = module.state_dict()
    return flat(state[name] for name, _ in module.named_parameters())


def uses_branch(unused: bool, batch_idx: int, rank: int, epoch: int) -> bool:
    """The side branch is skipped in the last (uneven, and with accumulation of 2 a window of its own) batch: on rank 1
    only in epoch 0, on both ranks in epoch 1 (its gradients stay ``None``: DDP leaves a parameter no rank used)."""
    return not (unused and batch_idx == 2 and (rank == 1 or epoch == 1))


def layout(module: nn.Module) -> dict:
    bn = module.net.bn
    dtypes = sorted({str(t.dtype) for t in bn.state_dict().values() if t.is_floating_point()})
    return {"bn": type(bn).__name__, "bn_dtypes": dtypes, "conv": str(module.net.conv.weight.dtype)}


# -- the Trainer
def _hook_ddp() -> type:
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from lightning.pytorch.strategies import DDPStrategy

    class HookDDP(DDPStrategy):
        """``DDPStrategy`` registering its communication hook on the CPU too (Lightning's ``_register_ddp_hooks``
        registers it on CUDA only), the same way."""

        def _register_ddp_hooks(self) -> None:
            _register_ddp_comm_hook(
                model=self.model, ddp_comm_state=self._ddp_comm_state, ddp_comm_hook=self._ddp_comm_hook,
                ddp_comm_wrapper=self._ddp_comm_wrapper,
            )  # fmt: skip

    return HookDDP


def _layout_ddp(r: dict) -> type:
    from lightning.pytorch.strategies import DDPStrategy

    class LayoutDDP(DDPStrategy):
        """Records the model as DDP is about to wrap it: after Lightning's ``SyncBatchNorm`` conversion and the
        precision plugin's ``convert_module``."""

        def configure_ddp(self) -> None:
            r["layout"] = layout(self.lightning_module)
            super().configure_ddp()

    return LayoutDDP


def _lit(r: dict, unused: bool, spike: bool) -> Any:
    import lightning.pytorch as pl

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def on_train_start(self) -> None:
            amp = getattr(self.trainer.precision_plugin, "amp", None)
            start = amp.master_params(self.trainer.optimizers[0]) if amp is not None else self.parameters()
            r["start"] = flat(start)
            r["hook"] = self.trainer.model._get_ddp_logging_data().get("comm_hook")

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            branch = uses_branch(unused, batch_idx, self.global_rank, self.current_epoch)
            loss = F.mse_loss(self.net(x, branch).float(), y)
            if spike and self.global_step == SPIKE_STEP and self.global_rank == 1:
                loss = loss * SPIKE
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # unscaled, before the clip
            grads = torch.cat([p.grad.float().flatten() for p in self.parameters() if p.grad is not None])
            r.setdefault("norms", []).append(torch.linalg.vector_norm(grads).item())

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            r.setdefault("w_steps", []).append(params(self.net))
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)
            r.setdefault("scales", []).append(None if scaler is None else scaler.get_scale())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    return Lit()


def _trainer_for(level: str, strategy: Any, settings: dict, **kwargs: Any) -> tuple[Any, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_mpx import MixedPrecisionPlugin

    plugin = None
    if level in ("O1", "O2"):
        plugin = MixedPrecisionPlugin(level, **settings)
        kwargs["plugins"] = [plugin]
    elif level == "16-mixed":  # Lightning's own plugin: Trainer(precision="16-mixed") runs "bf16-mixed" on a CPU
        scaler = torch.amp.GradScaler("cpu", init_scale=FP16["init_scale"], growth_interval=FP16["growth_interval"])
        kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    else:
        kwargs["precision"] = level
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip
    return trainer, plugin


def _strategy(case: str, r: dict, kwargs: dict) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    hook_ddp = _hook_ddp()
    if case == "trainer_unused":
        kwargs["accumulate_grad_batches"] = 2
        return DDPStrategy(find_unused_parameters=True)
    if case == "trainer_static":  # the clipped gradients go back into the buckets' views
        kwargs["gradient_clip_val"] = CLIP
        return DDPStrategy(static_graph=True, gradient_as_bucket_view=True)
    if case == "trainer_static_accumulate":
        kwargs["accumulate_grad_batches"] = 2
        return DDPStrategy(static_graph=True)
    if case in ("trainer_hook16", "trainer_spike16", "trainer_fp16"):
        return hook_ddp(ddp_comm_hook=default_hooks.fp16_compress_hook)
    if case == "trainer_hookbf16":
        return hook_ddp(ddp_comm_hook=bf16_hook)
    if case == "trainer_wrapped":  # the default hooks' state is their process group
        return hook_ddp(
            ddp_comm_state=dist.group.WORLD, ddp_comm_hook=default_hooks.allreduce_hook,
            ddp_comm_wrapper=default_hooks.fp16_compress_wrapper,
        )  # fmt: skip
    assert case == "trainer_syncbn", case
    kwargs["sync_batchnorm"] = True
    return _layout_ddp(r)()


def _trainer_case(case: str, level: str, r: dict, raises: bool = False) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    module = _lit(r, unused=case == "trainer_unused", spike=case in ("trainer_spike16", "trainer_fp16"))
    kwargs: dict[str, Any] = {}
    strategy = _strategy(case, r, kwargs)
    settings = FP16 if case == "trainer_fp16" else BF16
    if case == "trainer_spike16" and not raises:
        settings = dict(BF16, on_floor="continue")  # bfloat16's static scale is at its floor: skip and go on
    trainer, plugin = _trainer_for(level, strategy, settings, **kwargs)
    data = torch.utils.data.DataLoader(dataset(), batch_size=BATCH)
    if case in ("trainer_syncbn", "trainer_static_accumulate") or raises:
        # A fit that fails (under every precision, or the plugin's raise): its error, the model as it leaves it, then
        # (sync_batchnorm) the user's retry without the option (a new Trainer and plugin, the same model).
        try:
            trainer.fit(module, data)
            r["fit_error"] = None
        except Exception as e:  # noqa: BLE001 - read by the test
            r["fit_error"] = f"{type(e).__name__}: {e}"
        r["after_error"], r["w_error"] = layout(module), params(module.net)
        if case != "trainer_syncbn" or level == "O1":
            return
        r.pop("w_steps", None)
        trainer, plugin = _trainer_for(level, DDPStrategy(), settings)
    trainer.fit(module, data)
    r["w"] = params(module.net)
    r["after"] = layout(module)
    if plugin is not None:
        r["scale"] = plugin.amp.scalers[0].get_scale()


# -- Accelerate
def _accelerate_case(level: str, r: dict) -> None:
    from accelerate import Accelerator as NativeAccelerator
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import accelerate_state_reset

    ddp = DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook=DDPCommunicationHookType.FP16)
    with accelerate_state_reset():
        if level == "bf16":
            accelerator = NativeAccelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[ddp],
                                            gradient_accumulation_steps=2)  # fmt: skip
        else:
            accelerator = Accelerator(mixed_precision=level, cpu=True, gradient_accumulation_steps=2,
                                      kwargs_handlers=[ddp, MixedPrecisionKwargs(**BF16)])  # fmt: skip
        rank = accelerator.process_index
        module = Net()
        optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
        model, optimizer, loader = accelerator.prepare(
            module, optimizer, torch.utils.data.DataLoader(dataset(), batch_size=BATCH)
        )
        r["hook"] = model._get_ddp_logging_data().get("comm_hook")
        for epoch in range(2):
            for i, (x, y) in enumerate(loader):
                with accelerator.accumulate(model):
                    accelerator.backward(F.mse_loss(model(x, uses_branch(True, i, rank, epoch)).float(), y))
                    optimizer.step()
                    optimizer.zero_grad()
        r["w"] = params(module)


# -- Fabric
def _fabric(level: str, **ddp: Any) -> Any:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = None if level == "ref" else FabricMixedPrecisionPlugin(level, **BF16)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(**ddp), plugins=plugin,
                    precision="bf16-mixed" if plugin is None else None)  # fmt: skip
    fabric.launch()  # the ranks are forked already: no process is started
    return fabric


def _fabric_case(level: str, r: dict) -> None:
    fabric = _fabric(level, find_unused_parameters=True, gradient_as_bucket_view=True)
    rank = fabric.global_rank
    module = Net()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset(), batch_size=BATCH))
    for epoch in range(2):
        for i, (x, y) in enumerate(loader):
            last = i == len(loader) - 1
            alone = last and i % 2 == 0  # the last batch, a window of its own
            step = i % 2 == 1 or last
            with fabric.no_backward_sync(model, enabled=not step):
                loss = F.mse_loss(model(x, uses_branch(True, i, rank, epoch)).float(), y)
                fabric.backward(loss if alone else loss / 2)
            if step:
                optimizer.step()
                optimizer.zero_grad()
    r["w"] = params(module)


def _fabric_join(level: str, throw: bool, r: dict) -> None:
    """Uneven inputs under torch's ``Join``: rank 0 has 2 batches, rank 1 has 3. ``throw``:
    ``throw_on_early_termination=True`` (every rank raises once one runs out); else the joined rank shadows the others'
    collectives until they finish."""
    from torch.distributed.algorithms.join import Join

    fabric = _fabric(level)
    rank = fabric.global_rank
    module = Net()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9))
    x, y = dataset().tensors
    r.update(steps=0, raised=None)
    try:
        with Join([model._forward_module], throw_on_early_termination=throw):  # the DDP module inside Fabric's
            for i in range(2 + rank):
                rows = slice(BATCH * (2 * i + rank), BATCH * (2 * i + rank + 1))
                fabric.backward(F.mse_loss(model(x[rows]).float(), y[rows]))
                optimizer.step()
                optimizer.zero_grad()
                r["steps"] += 1
    except RuntimeError as e:
        if not throw:
            raise
        r["raised"] = str(e)
    r["w"] = params(module)


# -- the launch
@contextlib.contextmanager
def _timed(r: dict) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        r["s"] = round(time.perf_counter() - start, 2)


def _run(results: dict, name: str, fn: Callable[..., None], *args: Any) -> bool:
    """``fn(*args, r)`` with ``r = results[name]``; whether it ran without an error."""
    with case_error(results.setdefault(name, {})) as r, _timed(r):
        fn(*args, r)
    return "error" not in r


def _trainer_door(results: dict) -> None:
    for case, levels in TRAINER_CASES.items():
        for level in levels:
            _run(results, f"{case}/{level}", _trainer_case, case, level)
    _run(results, "trainer_spike16/O2_raise", lambda r: _trainer_case("trainer_spike16", "O2", r, raises=True))
    for level in ("16-mixed", "O2"):
        _run(results, f"trainer_fp16/{level}", _trainer_case, "trainer_fp16", level)
    for level in ("bf16", "O1", "O2"):
        _run(results, f"accelerate/{level}", _accelerate_case, level)


def _fabric_door(results: dict) -> None:
    for level in ("ref", "O1", "O2"):
        _run(results, f"fabric/{level}", _fabric_case, level)
    for level in ("ref", "O2"):
        _run(results, f"join_throw/{level}", _fabric_join, level, True)
    _run(results, "join/ref", _fabric_join, "ref", False)
    write_rank_results(results)  # before the last case, which may end this process
    if not _run(results, "join/O2", _fabric_join, "O2", False):
        write_rank_results(results)
        os._exit(0)  # no closing barrier: the other rank may be gone


def main() -> None:
    # A short timeout: a collective left waiting fails here instead of after 30 minutes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    torch.set_num_threads(1)
    results: dict = {"world": dist.get_world_size()}
    {"trainer": _trainer_door, "fabric": _fabric_door}[os.environ["DDPHABITS63_DOOR"]](results)
    finish_cases(results)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    main()
