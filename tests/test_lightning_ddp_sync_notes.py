"""attack67a: a hostile Lightning user (Trainer and Fabric) of stop 66's surfaces, against Lightning's own
``"bf16-mixed"``, FP32 and ``torch.amp.GradScaler``.

What held (the tests below pin a few; the rest ran as probes, listed in the report): a raw optimizer beside the
prepared one (a GAN's second optimizer never returned from ``configure_optimizers``, one made in
``on_train_start``) is refused naming the fix, and the correct habits (both optimizers given, a backbone unfrozen
mid-fit with ``add_param_group``, ``BackboneFinetuning``, ``StochasticWeightAveraging``, ``Tuner.lr_find`` and
``scale_batch_size``, ``model.zero_grad()`` beside a frozen part, a ``StepLR``) train as ``"bf16-mixed"``; writes
between accumulated backwards at O2 (noise injected into the weights, weight standardisation by hand, ``renorm_``,
a WGAN clamp, a shrink, a layer re-initialised, ``parametrize``/``weight_norm``, timm's Lookahead wrapper) are not
refused by ``stepped_along``; O2 loads and saves (``strict=False`` subsets, a second one over the first,
``assign=True`` refused with its fix, a checkpoint saved mid-accumulation, keys renamed or dropped by callbacks,
``on_load_checkpoint`` loads, weights-only checkpoints) end as ``"bf16-mixed"``; DDP habits around ``SyncNote`` /
``DdpWatch`` (tests/lightning_ddp_sync_notes_script.py, one launch) keep the ranks together.

Found: at O1 float16 a parameter held by two prepared optimizers (a head stepped by the whole model's optimizer
and by its own) had its gradient divided by the loss scale at each optimizer's unscale: the second step applied
it divided twice (as ``torch.amp.GradScaler``, which does the same), where FP32 steps it with its gradient twice.
Fixed by shared67 (tests/test_core_shared_params_o1.py); the test below now holds the library to FP32.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.launch import rank_results, run_script
from tests.test_lightning_ddp_no_sync import _final  # the ranks' equal final weights, read the same way


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    return torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)


def _fabric(precision: str, **kwargs: Any) -> Fabric:
    if precision.startswith("O"):
        plugin = FabricMixedPrecisionPlugin(precision, half_dtype="bfloat16")
        return Fabric(accelerator="cpu", devices=1, plugins=[plugin], **kwargs)
    return Fabric(accelerator="cpu", devices=1, precision=precision, **kwargs)


def _trained(fabric: Fabric, net: nn.Module) -> torch.Tensor:
    """The weights a run ends on (FP32: the masters at O2)."""
    amp = getattr(fabric._precision, "amp", None)
    values = amp.fp32_state_dict(net) if amp is not None else net.state_dict()
    return torch.cat([v.detach().float().flatten() for v in values.values()])


# -- stepped_along: writes between accumulated backwards at O2 that are no raw step ----------------------------------
def _habit(kind: str, net: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        if kind == "noise":  # noise injected into the weights
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 1e-2)
        elif kind == "standardise":  # weight standardisation by hand
            w = net[0].weight
            w.copy_((w - w.mean(1, keepdim=True)) / (w.std(1, keepdim=True) + 1e-5) * 0.3)
        elif kind == "renorm":  # a max-norm constraint
            net[0].weight.renorm_(2, 0, 0.5)
        elif kind == "shrink":
            for p in net.parameters():
                p.mul_(0.99)
        elif kind == "reinit" and step % 2 == 1:  # one layer re-initialised (seeded: half and FP32 draw alike)
            net[2].weight.copy_(torch.randn(net[2].weight.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("kind", ["noise", "standardise", "renorm", "shrink", "reinit"])
def test_o2_writes_between_accumulated_backwards_train_as_bf16_mixed(kind: str) -> None:
    """Fabric, two accumulated backwards a step, the write after the first: not refused as a raw step
    (``stepped_along``), and the run ends as ``"bf16-mixed"``'s."""

    def run(precision: str) -> torch.Tensor:
        fabric = _fabric(precision)
        net = _net()
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for step in range(3):
            for micro in range(2):
                x, y = _batch(2 * step + micro)
                fabric.backward(F.cross_entropy(model(x).float(), y) / 2)
                if micro == 0:
                    _habit(kind, net, step)
            opt.step()
            opt.zero_grad()
        return _trained(fabric, net)

    want = run("bf16-mixed")
    got = run("O2")
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)


class _Lookahead(torch.optim.Optimizer):
    """timm's ``Lookahead`` (abridged): slow weights kept in the base optimizer's state, the fast ones pulled to them
    every ``k`` steps."""

    def __init__(self, base: torch.optim.Optimizer, alpha: float = 0.5, k: int = 2) -> None:
        super().__init__(base.param_groups, base.defaults)
        self._base_optimizer = base
        self.param_groups = base.param_groups
        for group in self.param_groups:
            group.setdefault("lookahead_alpha", alpha)
            group.setdefault("lookahead_k", k)
            group.setdefault("lookahead_step", 0)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._base_optimizer.step(closure)
        for group in self.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"]:
                continue
            for fast in group["params"]:
                if fast.grad is None:
                    continue
                state = self._base_optimizer.state[fast]
                if "lookahead_slow_buff" not in state:
                    state["lookahead_slow_buff"] = fast.detach().clone()
                slow = state["lookahead_slow_buff"]
                slow.add_(fast - slow, alpha=group["lookahead_alpha"])
                fast.copy_(slow)
        return loss

    def state_dict(self) -> dict[str, Any]:
        return self._base_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._base_optimizer.load_state_dict(state_dict)
        self.param_groups = self._base_optimizer.param_groups


class _Lit(pl.LightningModule):
    def __init__(self, kind: str = "plain") -> None:
        super().__init__()
        self.kind = kind
        self.net = _net()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return F.cross_entropy(self.net(batch[0]).float(), batch[1])

    def configure_optimizers(self) -> Any:
        if self.kind == "lookahead":
            return _Lookahead(torch.optim.AdamW(self.parameters(), lr=0.01))
        if self.kind == "unfreeze":
            return torch.optim.SGD(self.net[2].parameters(), lr=0.1)
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_fit_start(self) -> None:
        if self.kind == "unfreeze":
            self.net[0].requires_grad_(False)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.kind == "unfreeze" and self.global_step == 2 and not self.net[0].weight.requires_grad:
            self.net[0].requires_grad_(True)  # a backbone unfrozen mid-fit, given to the optimizer
            self.trainer.optimizers[0].add_param_group({"params": list(self.net[0].parameters()), "lr": 0.05})


def _loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader([_batch(i) for i in range(8)], batch_size=None)


def _fit(kind: str, precision: str, tmp_path: Path, **trainer: Any) -> torch.Tensor:
    chosen = dict(plugins=[MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16)]) if precision == "O2" else {}
    module = _Lit(kind)
    t = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=tmp_path, **(chosen or {"precision": precision}), **trainer,
    )  # fmt: skip
    t.fit(module, _loader())
    amp = getattr(t.precision_plugin, "amp", None)
    values = amp.fp32_state_dict(module) if amp is not None else module.state_dict()
    return torch.cat([v.detach().float().flatten() for v in values.values()])


@pytest.mark.parametrize(("kind", "accumulate"), [("lookahead", 2), ("unfreeze", 1)])
def test_trainer_o2_lookahead_and_a_backbone_unfrozen_mid_fit_train_as_bf16_mixed(
    kind: str, accumulate: int, tmp_path: Path
) -> None:
    """timm's Lookahead returned from ``configure_optimizers`` under ``accumulate_grad_batches=2`` (its pull to the
    slow weights is the prepared optimizer's step, on the masters), and a backbone frozen before the fit and unfrozen
    at step 2 with ``trainer.optimizers[0].add_param_group``: as ``"bf16-mixed"``."""
    want = _fit(kind, "bf16-mixed", tmp_path, accumulate_grad_batches=accumulate)
    got = _fit(kind, "O2", tmp_path, accumulate_grad_batches=accumulate)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


# -- a parameter held by two prepared optimizers at O1 float16 ------------------------------------------------------
def _shared_run(opt_level: str | None) -> list[torch.Tensor]:
    """A head held by the whole model's optimizer and by its own, both stepped after one backward."""
    net = _net()
    whole = torch.optim.SGD(net.parameters(), lr=0.05)
    head = torch.optim.SGD(net[2].parameters(), lr=0.05)
    amp = None
    if opt_level is not None:
        amp = Amp(opt_level=opt_level, half_dtype="float16")
        net = amp.prepare_model(net)
        whole, head = amp.prepare_optimizer(whole), amp.prepare_optimizer(head)
    for i in range(3):
        x, y = _batch(i)
        whole.zero_grad()
        head.zero_grad()
        if amp is None:
            F.cross_entropy(net(x), y).backward()
            whole.step()
            head.step()
            continue
        with amp.forward_context():
            loss = F.cross_entropy(net(amp.cast_inputs(x)).float(), y)
        amp.backward(loss)
        amp.step(whole)
        amp.step(head)
        amp.update()
    return [p.detach().float().clone() for p in net.parameters()]


def test_o1_float16_shared_parameter_two_optimizers_trains_as_fp32() -> None:
    """Each gradient is unscaled once per backward (shared67), so the head held by both optimizers ends as FP32's;
    ``torch.amp.GradScaler`` (each ``step`` unscales its optimizer's gradients in place) still divides the shared one
    twice and ends far from it: "compare with FP32" is the rule here."""
    net = _net()
    whole = torch.optim.SGD(net.parameters(), lr=0.05)
    head = torch.optim.SGD(net[2].parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    for i in range(3):
        x, y = _batch(i)
        whole.zero_grad()
        head.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(net(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(whole)
        scaler.step(head)
        scaler.update()
    fp32 = _shared_run(None)
    for got, want in zip(_shared_run("O1"), fp32, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
    assert (net[2].weight.detach().float() - fp32[2]).abs().max() > 1e-2  # GradScaler's second step: divided twice


# -- a user's nn.DataParallel given to fabric.setup, its replicas on worker threads (CPU stand-in) ------------------
@pytest.fixture
def two_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    """``nn.DataParallel.forward`` over two devices on the CPU: torch's ``replicate`` (its CUDA broadcast replaced by
    views), one worker thread per replica carrying grad mode and autocast's on/off (``parallel_apply``), the outputs
    concatenated (as tests/test_core_data_parallel_threads.py)."""
    from torch.nn.parallel import replicate

    def broadcast(tensors: list[torch.Tensor], devices: list[int], detach: bool = False) -> list[list[torch.Tensor]]:
        with torch._C.DisableTorchFunction():
            return [[t.detach() if detach else t.view_as(t) for t in tensors] for _ in devices]

    def forward(self: nn.DataParallel, x: torch.Tensor) -> torch.Tensor:
        copies = replicate(self.module, [0, 1], not torch.is_grad_enabled())
        results: dict[int, torch.Tensor] = {}
        grad, autocast = torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")

        def work(i: int, replica: nn.Module, chunk: torch.Tensor) -> None:
            torch.set_grad_enabled(grad)
            with torch.autocast("cpu", enabled=autocast):
                results[i] = replica(chunk)

        threads = [threading.Thread(target=work, args=a) for a in zip(range(2), copies, x.chunk(2))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return torch.cat([results[0], results[1]])

    monkeypatch.setattr(sys.modules["torch.nn.parallel.replicate"], "_broadcast_coalesced_reshape", broadcast)
    monkeypatch.setattr(nn.DataParallel, "forward", forward)


@pytest.mark.usefixtures("two_replicas")
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fabric_setup_of_a_users_data_parallel_computes_in_half_in_the_replicas(level: str) -> None:
    """``fabric.setup(nn.DataParallel(net), optimizer)``: the replicas' layers compute in bfloat16 (O1's scope
    entered in the worker threads) and the run ends as ``"bf16-mixed"``'s (the gradient summed over two half
    batches: to a tolerance)."""

    def run(precision: str) -> tuple[torch.Tensor, set[torch.dtype]]:
        fabric = _fabric(precision)
        net = _net()
        seen: set[torch.dtype] = set()
        net[0].register_forward_hook(lambda module, args, out: seen.add(out.dtype))
        model, opt = fabric.setup(nn.DataParallel(net), torch.optim.SGD(net.parameters(), lr=0.1))
        for i in range(3):
            x, y = _batch(i)
            fabric.backward(F.cross_entropy(model(x).float(), y))
            opt.step()
            opt.zero_grad()
        return _trained(fabric, net), seen

    want, _ = run("bf16-mixed")
    got, seen = run(level)
    assert seen == {torch.bfloat16}
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


# -- DDP (tests/lightning_ddp_sync_notes_script.py, one launch) --------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("attack67a")
    run_script("lightning_ddp_sync_notes_script.py", out, timeout=150)
    return rank_results(out)


def test_ddp_alternating_no_backward_sync_trains_as_bf16_mixed(ranks: list[dict[str, Any]]) -> None:
    """``fabric.no_backward_sync(model, enabled=step % 2 == 0)``, a step every second backward, the model's first
    forward inside ``torch.inference_mode()``, rank 0 alone looking at a sample under ``torch.no_grad()`` inside each
    window: no refusal, no hang, the ranks equal, as ``"bf16-mixed"``."""
    got, want = _final(ranks, "fabric_alternate/O2"), _final(ranks, "fabric_alternate/bf16-mixed")
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


def test_ddp_two_models_with_interleaved_no_sync_windows_keep_the_ranks_together(ranks: list[dict[str, Any]]) -> None:
    """Two models whose ``no_sync`` windows interleave (one synchronises where the other does not): no refusal, no
    hang, the ranks equal."""
    _final(ranks, "fabric_interleaved/O2")
    assert all(r["after"] == {"sum": 2.0} for r in ranks)


def test_ddp_raw_step_inside_an_alternating_window_is_refused_on_both_ranks(ranks: list[dict[str, Any]]) -> None:
    """A raw SGD stepped inside the ``no_sync`` window: every rank refuses it (at the step, where they meet) and the
    ranks still meet afterwards."""
    for r in ranks:
        assert "were written and their gradients cleared" in r["fabric_alternate_raw/O2"].get("error", "")
        assert r["after"] == {"sum": 2.0}
