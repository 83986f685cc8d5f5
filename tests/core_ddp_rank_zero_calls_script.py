"""Ranks of tests/test_core_ddp_rank_zero_calls.py (gloo, ONE launch): the calls users guard with
``if accelerator.is_main_process``, ``if trainer.is_global_zero``, ``if fabric.global_rank == 0``, made on rank 0 ONLY
in the middle of a DDP run, then training continued on both ranks. Each rank writes ``$MPX_OUT/rank{r}.json``: per case
the guarded calls' outcomes on rank 0 (``"ok"``, or the exception), the final weights' fingerprint and the scale state,
the same for the run without the guarded calls.

Rank 0 makes each guarded call in a thread joined with a timeout while rank 1 waits in ``dist.monitored_barrier``: a
call that does a collective on rank 0 alone hangs there and is reported by name (the rank then writes its results
and leaves) instead of holding the launch until its timeout.
"""

from __future__ import annotations

import copy
import datetime
import os
import tempfile
import threading
import warnings
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.launch import case_error, end_ranks, write_rank_results

GUARD_S = 25.0  # a guarded call on rank 0 that takes longer is a hang (each takes well under a second; room for a
# loaded CI machine and a first call's lazy imports, within the launch's 120 s)
STEPS, GUARD_AFTER = 3, 1  # the guarded calls after the first step; two steps after them
FP16 = {"half_dtype": "float16", "init_scale": 2.0**8, "growth_interval": 1}
BF16 = {"half_dtype": "bfloat16"}
RESULTS: dict[str, Any] = {}


def guarded(calls: dict[str, Callable[[], Any]], log: dict[str, str]) -> None:
    """Each of ``calls`` on rank 0 only (in a thread, joined with :data:`GUARD_S`), its outcome in ``log``; every
    rank meets the other at a monitored barrier after each."""
    rank = dist.get_rank()
    for name, call in calls.items():
        if rank == 0:
            box: dict[str, str] = {}

            def run(call: Callable[[], Any] = call, box: dict[str, str] = box) -> None:
                try:
                    with warnings.catch_warnings(record=True) as seen:
                        warnings.simplefilter("always")
                        value = call()
                    warned = "".join(f" [warned: {str(w.message)[:60]}]" for w in seen
                                     if "lightning_mpx" in str(w.filename) or "O2" in str(w.message))
                    box["out"] = ("ok" if not isinstance(value, float) else f"ok={value}") + warned
                except Exception as error:  # noqa: BLE001 - reported by the test
                    box["out"] = f"{type(error).__name__}: {str(error)[:300]}"

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            thread.join(GUARD_S)
            if thread.is_alive():
                log[name] = "hang"
                write_rank_results(RESULTS)
                os._exit(3)
            log[name] = box["out"]
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=3 * GUARD_S))


def fingerprint(params: Any) -> list[float]:
    """The weights' sum and a position-weighted sum (FP64)."""
    flat = torch.cat([p.detach().double().flatten() for p in params])
    return [flat.sum().item(), (flat * torch.arange(flat.numel(), dtype=torch.float64)).sum().item()]


# -- Accelerate ------------------------------------------------------------------------------------------------------
def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def _peft() -> nn.Module:
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(_gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False))


def accelerate_case(kind: str, guard: bool, out: dict[str, Any], tmp: str) -> None:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    acc = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(
        **(FP16 if kind == "plain" else BF16))])  # fmt: skip
    net = _gpt2() if kind == "plain" else _peft()
    trained = [p for p in net.parameters() if p.requires_grad]
    model, opt = acc.prepare(net, torch.optim.AdamW(trained, lr=1e-2, fused=True))  # fused: skipped on the device
    rank = dist.get_rank()
    for step in range(STEPS):
        ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss * float("inf") if kind == "plain" and rank == 1 and step == 0 else loss)
        if guard and step == GUARD_AFTER:  # between the backward and the step
            guarded({"mpx_metrics (before the step)": acc.mpx_metrics,
                     "get_state_dict (before the step)": lambda: acc.get_state_dict(model)}, out["calls"])
        opt.step()
        opt.zero_grad()
        if guard and step == GUARD_AFTER - 1:
            first = next(p for p in acc.unwrap_model(model).parameters() if p.requires_grad)
            calls = {
                "save_model": lambda: acc.save_model(model, os.path.join(tmp, f"{kind}_save_model")),
                "get_state_dict": lambda: acc.get_state_dict(model),
                "mpx_metrics": acc.mpx_metrics,
                "deepcopy(optimizer).state_dict": lambda: copy.deepcopy(opt).state_dict(),
                "optimizer.state[p]": lambda: dict(opt.state[first]),
                "unwrap_model.save_pretrained": lambda: acc.unwrap_model(model).save_pretrained(
                    os.path.join(tmp, f"{kind}_pretrained")),
            }  # fmt: skip
            guarded(calls, out.setdefault("calls", {}))
    out["skipped"] = acc.mpx_metrics()["mpx/skipped_steps"]  # every rank: settles the ranks' records together
    out["weights"] = fingerprint(acc.unwrap_model(model).parameters())
    out["masters"] = fingerprint(acc.amp.master_of(p) for p in acc.unwrap_model(model).parameters() if p.requires_grad)
    out["scale"] = acc.mpx_metrics()["mpx/loss_scale"]


# -- Lightning Trainer -----------------------------------------------------------------------------------------------
class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.mse_loss(self.net(batch[0]).float(), batch[1])
        return loss * float("inf") if self.global_rank == 1 and batch_idx == 0 else loss  # rank 1's overflow

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)  # steps skipped on the device


class _GuardedCalls(pl.Callback):
    def __init__(self, log: dict[str, str], path: str) -> None:
        self.calls, self.path = log, path

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: Any, optimizer: Any) -> None:
        if trainer.global_step == GUARD_AFTER:  # between the backward and the step
            calls = {"scaler.get_scale (before the step)": lambda: trainer.scaler.get_scale()}
            calls["precision_plugin.state_dict (before the step)"] = trainer.precision_plugin.state_dict
            if hasattr(trainer.precision_plugin, "amp"):
                calls["precision_plugin.amp.metrics (before the step)"] = trainer.precision_plugin.amp.metrics
            guarded(calls, self.calls)

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if idx != GUARD_AFTER - 1:
            return
        plugin = trainer.precision_plugin
        calls = {
            "scaler.get_scale": lambda: trainer.scaler.get_scale(),
            "scaler.state_dict": lambda: trainer.scaler.state_dict(),
            "precision_plugin.state_dict": plugin.state_dict,
            # trainer.save_checkpoint minus its barrier (Lightning's contract: save_checkpoint on every rank; its
            # barrier hangs "16-mixed" too): what it writes, on rank 0 alone
            "dump_checkpoint": lambda: trainer._checkpoint_connector.dump_checkpoint(),
        }
        if hasattr(plugin, "amp"):
            calls["precision_plugin.amp.metrics"] = lambda: plugin.amp.metrics()
        guarded(calls, self.calls)  # on rank 0 only, as under `if trainer.is_global_zero:`


def trainer_case(plugin: Any, guard: bool, out: dict[str, Any], tmp: str) -> None:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4 * STEPS, 4, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    module = _Module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, plugins=[plugin], use_distributed_sampler=False,
        callbacks=[_GuardedCalls(out.setdefault("calls", {}), tmp)] if guard else [],
    )  # fmt: skip
    trainer.fit(module, loader)
    out["weights"] = fingerprint(module.parameters())
    scaler = trainer.scaler
    out["scale"] = None if scaler is None else scaler.get_scale()
    # Lightning's contract: save_checkpoint on every rank (its barrier); ours writes it as "16-mixed"'s does
    trainer.save_checkpoint(os.path.join(tmp, f"trainer_{len(os.listdir(tmp))}.ckpt"))
    out["save_checkpoint_all_ranks"] = "ok"


# -- Fabric ----------------------------------------------------------------------------------------------------------
def fabric_case(skip_on_device: bool, guard: bool, out: dict[str, Any]) -> None:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = FabricMixedPrecisionPlugin("O2", skip_on_device=skip_on_device, **FP16)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin])
    fabric.launch()
    rank = fabric.global_rank
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)), nn.Linear(4, 1)
    gen, opt_g = fabric.setup(gen, torch.optim.AdamW(gen.parameters(), lr=1e-2, fused=True))
    disc, opt_d = fabric.setup(disc, torch.optim.AdamW(disc.parameters(), lr=1e-2, fused=True))
    for step in range(STEPS):
        z = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = disc(gen(z)).float().pow(2).mean()
        if rank == 1 and step == 0:
            loss = loss * float("inf")  # an overflow on rank 1 only: the scale is the point
        fabric.backward(loss)
        opt_d.step()  # D steps first: G's gradients wait, unheld (the plugin meets opt_g at its step)
        if guard and step == GUARD_AFTER:  # between the two steps again, both optimizers met
            guarded({"plugin.state_dict (between the steps)": plugin.state_dict,
                     "mpx.metrics (between the steps)": plugin.metrics}, out["calls"])
        if guard and step == GUARD_AFTER - 1:
            guarded({
                "mpx.metrics (G unheld)": plugin.metrics,
                "plugin.scaler.get_scale (G unheld)": lambda: plugin.scaler.get_scale(),
                "plugin.state_dict (G unheld)": plugin.state_dict,
            }, out.setdefault("calls", {}))  # fmt: skip
        opt_g.step()
        opt_d.zero_grad()
        opt_g.zero_grad()
        if guard and step == GUARD_AFTER - 1:
            guarded({"mpx.metrics": plugin.metrics, "plugin.scaler.get_scale": lambda: plugin.scaler.get_scale(),
                 "plugin.state_dict": plugin.state_dict}, out["calls"])
    out["weights"] = fingerprint([*gen.parameters(), *disc.parameters()])
    out["scale"] = plugin.scaler.get_scale()
    out["skipped"] = plugin.metrics()["mpx/skipped_steps"]  # every rank: settles the ranks' records together


def main() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_mpx import MixedPrecisionPlugin

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = os.path.join(os.environ["MPX_OUT"], "files") if dist.get_rank() == 0 else tmp
        os.makedirs(tmp, exist_ok=True)
        for kind in ("plain", "peft"):
            for guard in (True, False):
                with case_error(RESULTS.setdefault(f"accelerate-{kind}-{guard}", {})) as out:
                    accelerate_case(kind, guard, out, tmp)
        for guard in (True, False):
            with case_error(RESULTS.setdefault(f"trainer-O2-{guard}", {})) as out:
                trainer_case(MixedPrecisionPlugin("O2", **FP16), guard, out, tmp)
        for name in ("16-mixed", "bf16-mixed"):
            with case_error(RESULTS.setdefault(f"trainer-{name}-True", {})) as out:
                scaler = None if name == "bf16-mixed" else torch.amp.GradScaler("cpu", init_scale=2.0**8,
                                                                                 growth_interval=1)
                trainer_case(MixedPrecision(name, "cpu", scaler=scaler), True, out, tmp)
        for skip in (False, True):
            for guard in (True, False):
                with case_error(RESULTS.setdefault(f"fabric-{skip}-{guard}", {})) as out:
                    fabric_case(skip, guard, out)
        write_rank_results(RESULTS)
        end_ranks()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
