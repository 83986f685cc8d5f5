"""review66: what stop 66 merged, attacked as a user who must not be hurt.

rawhead66 (engine/beside_steps.py) refuses a raw optimizer stepped beside the prepared one in the same iteration. Its
check before the step took any write since the backward to the parameters no optimizer holds for a raw step: a weight
decay written by hand over every parameter before the step (Lightning's ``on_before_optimizer_step``), with a backbone
left requiring grad and out of the optimizer (a head fine-tuned), was refused, where the same write after the step
passed (a whole-model write: the registered optimizers' parameters written too). Now it passes before the step as well,
and trains as FP32 / Lightning's ``"bf16-mixed"`` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin
from tests.test_core_raw_head_beside import (  # the model and batches rawhead66 pinned the refusal with
    LEVELS,
    Net,
    _batch,
)


def _decay(model: nn.Module) -> None:
    """A decoupled weight decay written by hand over every parameter (the backbone's too)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 - 0.05 * 0.5)


def _loop(model: nn.Module, backward: Callable[[torch.Tensor], Any], step: Callable[[], Any], zero: Any) -> None:
    for i in range(3):
        x, y = _batch(i)
        backward(F.mse_loss(model(x), y))
        _decay(model)  # between the backward and the step
        step()
        zero()


@pytest.mark.parametrize(("opt_level", "half_dtype"), LEVELS)
def test_core_weight_decay_by_hand_before_the_step_with_a_backbone_out_of_the_optimizer_trains_as_fp32(
    opt_level: str, half_dtype: str
) -> None:
    ref = Net()
    ref_opt = torch.optim.SGD(ref.head.parameters(), lr=0.05)
    _loop(ref, lambda loss: loss.backward(), ref_opt.step, ref_opt.zero_grad)
    amp = Amp(opt_level=opt_level, half_dtype=half_dtype)
    model = amp.prepare_model(Net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.head.parameters(), lr=0.05))  # the trunk left requiring grad

    def step() -> None:
        amp.step(opt)
        amp.update()

    _loop(model, amp.backward, step, opt.zero_grad)  # was: RuntimeError 'trunk.weight', 'trunk.bias' ... written
    got, want = amp.fp32_state_dict(model), ref.state_dict()
    assert all(torch.allclose(got[k].float(), want[k], rtol=1e-2, atol=1e-3) for k in want), {
        k: (got[k].float() - want[k]).abs().max().item() for k in want
    }
    assert not torch.equal(want["trunk.weight"], Net().trunk.weight)  # the decay reached the trunk


def test_core_raw_head_before_the_step_is_still_refused_beside_a_decay_of_the_unheld_alone() -> None:
    """The true case stays refused: a write before the step to the unheld parameters alone (no registered optimizer's
    parameter written) is a raw step, as engine.beside_steps says."""
    amp = Amp(opt_level="O1", half_dtype="float16")
    model = amp.prepare_model(Net())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.trunk.parameters(), lr=0.05))
    head = torch.optim.SGD(model.head.parameters(), lr=0.05)  # never prepared
    x, y = _batch(0)
    amp.backward(F.mse_loss(model(x), y))
    head.step()
    with pytest.raises(RuntimeError, match=r"'head\.weight', 'head\.bias', which no optimizer prepared"):
        amp.step(opt)


def test_trainer_weight_decay_in_on_before_optimizer_step_trains_as_bf16_mixed(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    class Tune(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return F.mse_loss(self.net(batch[0]), batch[1])

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            _decay(self)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.net.head.parameters(), lr=0.05)  # the trunk left requiring grad

    def fit(**precision: Any) -> tuple[Tune, Any]:
        module = Tune()
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, **precision,
        )  # fmt: skip
        trainer.fit(module, torch.utils.data.DataLoader([_batch(i) for i in range(3)], batch_size=None))
        return module, trainer

    want, _ = fit(precision="bf16-mixed")
    module, trainer = fit(plugins=[MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16)])
    got = trainer.precision_plugin.amp.fp32_state_dict(module)
    assert all(torch.allclose(got[k].float(), v, rtol=1e-2, atol=1e-3) for k, v in want.state_dict().items())


def test_a_required_default_answers_protocol_probes_as_any_object(fresh_accelerate_state: Any) -> None:
    """fsdp1find66's ``keywords.Required`` (the default of ``accelerator.backward``'s ``loss``, of
    ``clip_grad_norm_``'s arguments) refused every attribute with its missing-argument ``TypeError``, a protocol
    probe too: ``copy.deepcopy`` of the signature's defaults and ``hasattr(default, "__array__")`` raised (hasattr
    only takes ``AttributeError``). Its use still names the argument, and a valid call is taken."""
    import copy

    from lightning_mpx.accelerate import Accelerator

    default = Accelerator.backward.__defaults__[0]  # type: ignore[index]
    assert copy.deepcopy(Accelerator.clip_grad_norm_.__defaults__) is not None
    assert not hasattr(default, "__array__")
    with pytest.raises(TypeError, match=r"accelerator\.backward\(\) missing 1 required argument: 'loss'"):
        default.grad  # noqa: B018
    accelerator = Accelerator(mixed_precision="O1", cpu=True)
    net = Net()
    model, _ = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"accelerator\.backward\(\) missing 1 required argument: 'loss'"):
        accelerator.backward()
    x, y = _batch(0)
    accelerator.backward(F.mse_loss(model(x), y))
    assert accelerator.clip_grad_norm_(model.parameters(), 1.0) > 0


def _watch_hooks(module: nn.Module) -> int:
    return sum(type(h).__name__ == "DdpWatch" for m in module.modules() for h in m._forward_pre_hooks.values())


def test_ddp_watch_leaves_no_hook_on_a_copy_nor_on_a_model_evaluated_through_its_wrapper_after_training() -> None:
    """attack66a kept the DDP watch (engine/unsynced.py) alive while a prepared model had not run its forward (``b``,
    evaluated only after training): a copy made before the first backward (an ``AveragedModel`` of the trained model)
    then kept its shared hooks for good, a Python call per submodule at each of its forwards (before, they took
    themselves off at its first forward once the watch settled), and ``b``'s stayed through its forwards after the
    last backward. Now a copy's hook takes itself off at its first call, and a model's hooks go at its forward through
    its DDP wrapper. One process, a fake process group of two ranks (torch's testing store: no collectives run)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        amp = Amp("O1", half_dtype="bfloat16")
        a = amp.prepare_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
        b = amp.prepare_model(nn.Linear(4, 1))  # evaluated after training only
        opt = amp.prepare_optimizer(torch.optim.SGD(a.parameters(), lr=0.1))
        averaged = torch.optim.swa_utils.AveragedModel(a)  # a copy made before the first backward: shares the hooks
        assert (_watch_hooks(a), _watch_hooks(b), _watch_hooks(averaged)) == (2, 1, 2)  # watched
        x = torch.randn(2, 4)
        for _ in range(2):
            amp.backward(a(x).float().pow(2).mean())
            amp.step(opt)
            amp.update()
            opt.zero_grad()
            averaged.update_parameters(a)
        averaged(x)
        assert (_watch_hooks(a), _watch_hooks(averaged)) == (0, 0)  # the copy's: 2 for good (attack66a)
        with torch.no_grad():
            DistributedDataParallel(b)(x)
        assert _watch_hooks(b) == 0  # 1 for good (attack66a)
    finally:
        dist.destroy_process_group()


def test_fabric_setup_in_a_function_of_the_users_lets_its_temporaries_go_when_it_returns() -> None:
    """fsdp1find66 kept each ``fabric.setup`` frame until the plugin's next call, to find an FSDP1 wrapper among its
    locals, under every strategy: the frame holds its caller's, so what a function of the user's that set up the model
    had made (a checkpoint loaded to initialise it) stayed alive after it returned, until the first forward. Kept
    under ``FSDPStrategy`` only now (FSDP1 is covered by tests/test_fabric_fsdp1_frozen_heap.py)."""
    import weakref

    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    fabric = Fabric(accelerator="cpu", devices=1, plugins=FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16"))

    def build() -> tuple[Any, Any, Any]:
        loaded = {k: v.clone() for k, v in Net().state_dict().items()}  # a checkpoint's tensors
        net = Net()
        net.load_state_dict(loaded)
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        return model, optimizer, weakref.ref(loaded["trunk.weight"])

    model, _, temporary = build()
    assert temporary() is None  # alive until model's first forward (fsdp1find66)
    x, _ = _batch(0)
    assert torch.isfinite(model(x)).all()


def test_trainer_o2_in_place_edit_of_the_last_checkpoints_state_dict_ends_as_bf16_mixed(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    class Tune(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Halve(pl.Callback):
        def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
            for value in checkpoint["state_dict"].values():
                value.mul_(0.5)

    def fit(**precision: Any) -> dict[str, torch.Tensor]:
        module = Tune()
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path, callbacks=[Halve()], **precision,
        )  # fmt: skip
        trainer.fit(module, torch.utils.data.DataLoader([_batch(i) for i in range(2)], batch_size=None))
        amp = getattr(trainer.precision_plugin, "amp", None)
        return amp.fp32_state_dict(module) if amp is not None else module.state_dict()

    want = fit(precision="bf16-mixed")
    got = fit(plugins=[MixedPrecisionPlugin("O2", half_dtype=torch.bfloat16)])
    assert all(torch.allclose(got[k].float(), v, rtol=1e-2, atol=1e-3) for k, v in want.items())


def test_apex_o1_clip_after_a_zero_loss_delayed_block_keeps_the_earlier_blocks_gradients() -> None:
    from lightning_mpx.apex import _amp_state, amp

    def run(apex: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        if apex:
            net, opt = amp.initialize(net, opt, opt_level="O1", loss_scale=128.0, verbosity=0)
        for i, (scale, delay) in enumerate([(1.0, False), (0.0, True)]):
            x, y = _batch(i)
            loss = F.mse_loss(net(x), y) * scale
            if apex:
                with amp.scale_loss(loss, opt, delay_unscale=delay) as scaled:
                    scaled.backward()
            else:
                loss.backward()
        torch.nn.utils.clip_grad_norm_(list(net.parameters()), 10.0)
        opt.step()
        return [p.detach().float().clone() for p in net.parameters()]

    want = run(apex=False)
    _amp_state.reset()
    try:
        got = run(apex=True)
    finally:
        _amp_state.reset()
    assert all(torch.allclose(g, w, atol=1e-4) for g, w in zip(got, want))


def test_o2_weight_decay_by_hand_between_accumulated_backwards_with_an_l2_penalty_trains_on() -> None:
    torch.manual_seed(0)
    amp = Amp(opt_level="O2", half_dtype="bfloat16")
    model = amp.prepare_model(nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)))
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)
        penalty = sum(p.float().pow(2).sum() for p in model.parameters())
        amp.backward(F.mse_loss(model(x.bfloat16()).float(), y) + penalty)
        _decay(model)  # after each micro-batch's backward
        if i % 2:
            amp.step(opt)
            amp.update()
            opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())
