"""O2's master-gradient buffer (``lightning_mpx.masters.pairs.GradLayout``) under a demanding user's training loops.

Every run is compared bit for bit with the same run whose masters get gradients of their own (``GradLayout.of``
patched to ``None`` inside the test), and each test checks that the buffer was in use, so that it can fail; a few
are also held to an FP32 run. The loops change what is mastered mid-training, convert the model after it was
prepared, clip, accumulate, overflow, checkpoint and resume, and go through every front door.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import weakref
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.masters.pairs import GradLayout
from lightning_mpx.scaling.unscale import UnscaleWorkspace

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


# -- helpers -----------------------------------------------------------------------------------------------------------
class _Buffers:
    """Counts the buffers the steps make (``GradLayout.new``), for the duration of a test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made = 0
        self._monkeypatch = monkeypatch
        new = GradLayout.new

        def counting(layout: GradLayout) -> list[torch.Tensor]:
            self.made += 1
            return new(layout)

        monkeypatch.setattr(GradLayout, "new", counting)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Masters get gradients of their own: the reference every run is held to."""
        with self._monkeypatch.context() as patch:
            patch.setattr(GradLayout, "of", classmethod(lambda cls, masters: None))
            yield


@pytest.fixture
def buffers(monkeypatch: pytest.MonkeyPatch) -> _Buffers:
    return _Buffers(monkeypatch)


def _assert_same(got: Any, want: Any, path: str = "result") -> None:
    """Bit for bit, NaN where NaN, through nested dicts, lists and tuples."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan()), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for key in want:
            _assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for index, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f"{path}[{index}]")
    else:
        assert got == want, path


def _agree(buffers: _Buffers, run: Callable[[], Any]) -> Any:
    """``run()`` with the buffer and without: the same bits, and the buffer was used."""
    made = buffers.made
    got = run()
    assert buffers.made > made, "the buffer was never used: this run tests nothing"
    with buffers.disabled():
        want = run()
    _assert_same(got, want)
    return got


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def _result(amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    return (
        [p.detach().clone() for p in model.parameters()],
        [m.detach().clone() for m in amp.master_params(optimizer)],
        copy.deepcopy(optimizer.state_dict()),
        amp.state_dict(),
    )


_X = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).bfloat16()


def _loss(amp: Amp, model: nn.Module, x: torch.Tensor = _X) -> torch.Tensor:
    with amp.forward_context():  # bfloat16 inputs, FP32 ones for the FP32 reference (O0)
        return model(x.to(next(model.parameters()).dtype)).float().square().mean()


Hook = Callable[[int, Amp, nn.Module, torch.optim.Optimizer], None]


def _train(
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    before: Hook | None = None,
    after_backward: Hook | None = None,
    make_model: Callable[[], nn.Module] = _mlp,
    x: torch.Tensor = _X,
    steps: int = 5,
    level: str = "O2",
    **settings: Any,
) -> Callable[[], tuple[Any, ...]]:
    """A run of ``steps`` steps at ``level`` in bfloat16 (dynamic loss scale): ``before(step, ...)`` before each
    forward, ``after_backward(step, ...)`` between the backward and the step."""

    def run() -> tuple[Any, ...]:
        amp = Amp(level, half_dtype="bfloat16", loss_scale="dynamic", **settings)
        model = amp.prepare_model(make_model())
        optimizer = amp.prepare_optimizer(make_optimizer(model))
        for step in range(steps):
            if before is not None:
                before(step, amp, model, optimizer)
            amp.backward(_loss(amp, model, x))
            if after_backward is not None:
                after_backward(step, amp, model, optimizer)
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()
        return _result(amp, model, optimizer)

    return run


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)


def _momentum(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# -- the masters' gradients of a changed shape (the fix) ---------------------------------------------------------------
def _new_bias_shape(shape: tuple[int, ...], refresh: bool) -> Hook:
    def hook(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if step == 2:  # the last layer's bias replaced through .data by one that broadcasts the same way
            model[4].bias.data = torch.full(shape, 0.25, dtype=torch.bfloat16)
            if refresh:
                amp.refresh_masters()

    return hook


@pytest.mark.parametrize("shape", [(1,), (1, 3)])
def test_a_master_reshaped_by_refresh_masters_gets_a_buffer_of_its_new_shape(buffers, shape):
    """A parameter given a new shape through ``.data`` and taken into its master by ``refresh_masters()``: the
    buffer laid out for the old shapes is made again. Before, the half gradient was broadcast into the old view (or
    the copy raised) and the master's ``.grad`` assignment raised, where gradients of their own trained on."""
    sgd = _train(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), before=_new_bias_shape(shape, refresh=True))
    made = buffers.made
    weights, masters, _, _ = _agree(buffers, sgd)
    assert buffers.made - made == 5  # every step, the ones after the new shape included
    assert weights[-1].shape == masters[-1].shape == shape


def test_a_reshaped_parameter_its_master_never_took_is_taken_with_or_without_the_buffer(buffers):
    """Without ``refresh_masters()`` a parameter given a new shape through ``.data`` (Hugging Face's
    ``resize_token_embeddings`` does this) is taken into its master before its gradient goes there (stop 54; before,
    the gradient's assignment raised naming both sizes): the same run as with ``refresh_masters()``, on the buffer's
    path and on the path of gradients of their own."""
    runs = []
    for refresh in (False, True):
        run = _train(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), before=_new_bias_shape((1,), refresh=refresh))
        runs.append(run())
        with buffers.disabled():
            runs.append(run())
    assert runs[0][0][-1].shape == runs[0][1][-1].shape == (1,)
    for other in runs[1:]:  # weights and masters: the same run on both paths, taken or refreshed
        for a, b in zip(runs[0][:2], other[:2]):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y)


# -- the set of mastered parameters changes mid-training ---------------------------------------------------------------
def _unfreeze_first_at_2(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if step == 0:
        model[0].requires_grad_(False)
    if step == 2:
        model[0].requires_grad_(True)  # in place: its master is made at its first gradient


def _freeze_middle_for_a_while(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model[2].requires_grad_(step not in (1, 2))


def _add_group_at_2(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if step == 2:
        optimizer.add_param_group({"params": list(model[0].parameters()), "lr": 0.05})


def _replace_lists(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if step == 1:  # the first layer dropped, then back in another order
        optimizer.param_groups[0]["params"] = [*model[2].parameters(), *model[4].parameters()]
    if step == 3:
        optimizer.param_groups[0]["params"] = list(model.parameters())[::-1]


class _Branches(nn.Module):
    """A branch used on some steps only: its parameters then have no gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.main, self.side = nn.Linear(6, 3), nn.Linear(6, 3)
        self.use_side = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x) + self.side(x) if self.use_side else self.main(x)


def _side_on_odd_steps(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model.use_side = step % 2 == 1


_HEAD_ONLY: Callable[[nn.Module], torch.optim.Optimizer] = lambda m: torch.optim.Adam(  # noqa: E731
    [*m[2].parameters(), *m[4].parameters()], lr=1e-2
)


@pytest.mark.parametrize(
    "make_optimizer, before, make_model",
    [
        (_adam, _unfreeze_first_at_2, _mlp),
        (_momentum, _freeze_middle_for_a_while, _mlp),
        (_HEAD_ONLY, _add_group_at_2, _mlp),
        (_momentum, _replace_lists, _mlp),
        (_adam, _side_on_odd_steps, _Branches),
    ],
    ids=["unfreeze-in-place", "freeze-then-unfreeze", "add_param_group", "replace-params-lists", "unused-branch"],
)
def test_the_mastered_set_changing_mid_training_agrees_with_gradients_of_their_own(
    buffers, make_optimizer, before, make_model
):
    _agree(buffers, _train(make_optimizer, before=before, make_model=make_model, steps=5))


# -- layouts, devices and dtypes, sizes --------------------------------------------------------------------------------
def _convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3), nn.Flatten(), nn.Linear(8, 3)
    )


_IMAGES = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(2)).bfloat16()


def _channels_last_at_2(part: str) -> Hook:
    def hook(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if step == 2:
            (model if part == "all" else model[3]).to(memory_format=torch.channels_last)

    return hook


class _Odd(nn.Module):
    """0-element, 1-element and 0-d parameters next to a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 3)
        self.empty = nn.Parameter(torch.zeros(0, 3))
        self.one = nn.Parameter(torch.ones(1))
        self.scalar = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.one * self.scalar + self.empty.sum()


def _fused_adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)


@pytest.mark.parametrize(
    "make_optimizer, make_model, x, before",
    [
        (_adam, _convnet, _IMAGES, _channels_last_at_2("all")),
        (_momentum, _convnet, _IMAGES, _channels_last_at_2("one")),
        (_fused_adam, _Odd, _X, None),
        (_momentum, _Odd, _X, None),
    ],
    ids=["channels_last-after-prepare", "one-conv-channels_last-after-prepare", "odd-sizes-fused-adam", "odd-sizes"],
)
def test_layouts_and_sizes_agree_with_gradients_of_their_own(buffers, make_optimizer, make_model, x, before):
    """A conv net with an FP32 BatchNorm (its own master) converted to channels-last after it was prepared (its
    masters stay contiguous, its gradients do not), and 0-element, 1-element and 0-d parameters."""
    _agree(buffers, _train(make_optimizer, make_model=make_model, x=x, before=before, steps=4))


def test_a_single_mastered_parameter_or_a_mixed_layout_keeps_gradients_of_its_own(buffers):
    """One mastered parameter, or one channels-last convolution among contiguous masters: no buffer (nothing to
    share, layouts that differ), gradients of their own of the master's layout."""

    def lone() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 3, bias=False))

    def mixed() -> nn.Module:
        model = _convnet()
        model[0].to(memory_format=torch.channels_last)
        return model

    for make_model, x in ((lone, _X), (mixed, _IMAGES)):
        made = buffers.made
        got = _train(_fused_adam, make_model=make_model, x=x, steps=3)()
        assert buffers.made == made
        with buffers.disabled():
            _assert_same(got, _train(_fused_adam, make_model=make_model, x=x, steps=3)())


# -- user code around the step -----------------------------------------------------------------------------------------
def _clip_masters_with_torch(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.01)  # unscales first (a master's .grad read)


def _amp_clips(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    amp.clip_grad_norm_(optimizer, 0.05) if step % 2 else amp.clip_grad_value_(optimizer, 1e-3)


def _unscale_show_and_zero(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    amp.unscale_(optimizer)
    amp.show_unscaled_on_model(optimizer)
    if step == 2:
        optimizer.zero_grad(set_to_none=False)  # the unscaled copies must not outlive the gradients they came from


def _unscale_then_accumulate(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    amp.unscale_(optimizer)  # read, then another backward: the masters' gradients carried back to the model's
    amp.backward(_loss(amp, model, _X[:2]))


def _overflow_at_1(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if step == 1:
        model[2].weight.grad[0, 0] = float("inf")
    if step == 3:
        model[4].bias.grad[0] = float("nan")


@pytest.mark.parametrize(
    "make_optimizer, after_backward",
    [
        (_adam, _clip_masters_with_torch),
        (_momentum, _amp_clips),
        (_adam, _unscale_show_and_zero),
        (_momentum, _unscale_then_accumulate),
        (_adam, _overflow_at_1),
        (_fused_adam, _overflow_at_1),
    ],
    ids=["torch-clip-masters", "amp-clips", "show_unscaled-zero", "unscale-backward", "overflow", "overflow-fused"],
)
def test_user_code_between_backward_and_step_agrees_with_gradients_of_their_own(
    buffers, make_optimizer, after_backward
):
    _agree(buffers, _train(make_optimizer, after_backward=after_backward, steps=5))


def test_accumulation_two_optimizers_and_a_resumed_checkpoint_agree_with_gradients_of_their_own(buffers):
    """Three backwards per step, ``zero_grad(set_to_none=False)``, two optimizers over disjoint parts (one of them
    overflowing once), and the amp, optimizer and model state saved, trained past, loaded back and trained on."""

    def run() -> tuple[Any, ...]:
        amp = Amp("O2", half_dtype="bfloat16", loss_scale="dynamic")
        model = amp.prepare_model(_mlp())
        body = amp.prepare_optimizer(torch.optim.AdamW([*model[0].parameters(), *model[2].parameters()], lr=1e-2))
        head = amp.prepare_optimizer(torch.optim.SGD(model[4].parameters(), lr=0.1, momentum=0.9))
        saved = None
        for step in range(6):
            for part in range(3):
                amp.backward(_loss(amp, model, _X[part : part + 2]))
            if step == 1:
                model[4].weight.grad[0, 0] = float("inf")
            amp.step(body)
            amp.step(head)
            amp.update()
            body.zero_grad(set_to_none=False)
            head.zero_grad(set_to_none=False)
            if step == 2:
                saved = copy.deepcopy((amp.state_dict(), body.state_dict(), head.state_dict(), model.state_dict()))
            if step == 4:
                assert saved is not None
                amp.load_state_dict(saved[0])
                body.load_state_dict(saved[1])
                head.load_state_dict(saved[2])
                model.load_state_dict(saved[3])
        return _result(amp, model, body), _result(amp, model, head)

    _agree(buffers, run)


def test_a_kept_master_gradient_keeps_its_values_and_the_buffer_is_freed_with_its_last_view():
    """A user who keeps ``master.grad`` past the step keeps its values (the next step writes a new buffer, never
    the old one); once nothing holds a view, the buffer is freed: after a step, a skipped step, and an unscale
    carried back into the model's gradients by another backward."""
    amp = Amp("O2", half_dtype="bfloat16", loss_scale="dynamic")
    model = amp.prepare_model(_mlp())
    optimizer = amp.prepare_optimizer(_adam(model))
    kept: list[torch.Tensor] = []
    for step in range(4):
        amp.backward(_loss(amp, model))
        if step == 1:
            model[0].weight.grad[0, 0] = float("inf")  # skipped
        amp.unscale_(optimizer)
        grads = [m.grad for m in amp.master_params(optimizer)]
        # one buffer (views of it; after unscale_, handed out by master_params as tensors of their own over it,
        # engine.master_writes), freed with the last tensor over it
        assert (
            len({g.untyped_storage().data_ptr() for g in grads}) == 1
            and grads[0].numel() < grads[0].untyped_storage().nbytes() // 4
        )
        buffer = weakref.ref(grads[0].untyped_storage())
        if step == 0:
            kept = grads
            values = [g.clone() for g in grads]
        if step == 3:
            amp.backward(_loss(amp, model))  # the unscaled gradients go back into the model's, the masters' freed
        del grads
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
        assert all(m.grad is None for m in amp.master_params(optimizer))
        gc.collect()
        assert (buffer() is not None) == (step == 0), step  # the kept one lives on, no other
    assert all(torch.equal(g, v) for g, v in zip(kept, values))


def _interpreting() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from lightning_mpx.scaling import triton_unscale

    return triton_unscale.interpreting()


@pytest.mark.skipif(not _interpreting(), reason="the fused kernels on CPU tensors need triton's interpreter")
def test_the_fused_unscale_writes_every_view_of_the_uninitialized_buffer(buffers):
    """``unscale_backend="triton"``: the fused kernels read the half gradients and write the masters' views of a
    buffer that is not zeroed (a clipped step, then an overflowing one): the same bits as gradients of their own,
    and the values of torch's kernels (to the order of the norm's sum)."""

    def clip_then_overflow(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if step == 0:  # chunks of 16 (blocks of 8): the interpreter's cost is per block, 16 to a default chunk
            amp._state(optimizer).workspace = UnscaleWorkspace(chunk_size=16, block_size=8, num_warps=1)
        if step == 1:
            model[2].weight.grad[0, 0] = float("inf")
        amp.clip_grad_norm_(optimizer, 0.05)

    got = _agree(buffers, _train(_adam, after_backward=clip_then_overflow, steps=2, unscale_backend="triton"))
    want = _train(_adam, after_backward=clip_then_overflow, steps=2, unscale_backend="foreach")()
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)


def test_a_mastered_set_changing_mid_training_tracks_an_fp32_run():
    """The buffer's steps against FP32 (O0) steps of the same loop: a layer frozen and unfrozen in place, a group
    added, clips. The weights agree to bfloat16's precision."""

    def before(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        _freeze_middle_for_a_while(step, amp, model, optimizer)
        if step == 3:
            optimizer.add_param_group({"params": list(model[0].parameters()), "lr": 0.05})

    def clip(step: int, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        amp.clip_grad_norm_(optimizer, 0.5)

    def head(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam([*model[2].parameters(), *model[4].parameters()], lr=1e-2)

    got = _train(head, before=before, after_backward=clip, steps=6)()
    want = _train(head, before=before, after_backward=clip, steps=6, level="O0")()
    assert len(got[1]) == len(want[1]) == 6
    for master, fp32 in zip(got[1], want[1]):  # in the optimizer's order
        torch.testing.assert_close(master, fp32, rtol=0.05, atol=2e-3)
    for weight, fp32 in zip(got[0], want[0]):  # in the model's order: the model holds the masters' rounding
        torch.testing.assert_close(weight, fp32.bfloat16(), rtol=0.05, atol=4e-3)


# -- front doors -------------------------------------------------------------------------------------------------------
def test_the_apex_layer_clipping_its_master_params_agrees_with_gradients_of_their_own(buffers):
    from lightning_mpx.apex import amp as apex_amp

    def run() -> tuple[Any, ...]:
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = apex_amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
        dtype = next(model.parameters()).dtype
        for _ in range(4):
            loss = model(_X.to(dtype)).float().square().mean()
            with apex_amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            torch.nn.utils.clip_grad_norm_(apex_amp.master_params(optimizer), 0.05)
            optimizer.step()
            optimizer.zero_grad()
        return (
            [p.detach().clone() for p in model.parameters()],
            [p.detach().clone() for p in apex_amp.master_params(optimizer)],
            copy.deepcopy(optimizer.state_dict()),
        )

    _agree(buffers, run)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_accelerate_adapter_with_batchnorm_and_clipping_agrees_with_gradients_of_their_own(buffers):
    from lightning_mpx.accelerate import Accelerator
    from tests.accelerate_helpers import accelerate_state_reset

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=generator), torch.randint(0, 3, (16,), generator=generator)

    def run() -> tuple[Any, ...]:
        accelerate_state_reset()
        accelerator = Accelerator(mixed_precision="O2")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for _ in range(4):
            accelerator.backward(F.cross_entropy(model(x), y))
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict())

    _agree(buffers, run)


def test_fabric_and_the_trainer_agree_with_gradients_of_their_own(buffers):
    """Fabric with ``clip_gradients``; the Trainer with ``gradient_clip_val`` and ``accumulate_grad_batches``."""
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
    from tests.lightning_helpers import classification_data, loader, make_trainer

    data = classification_data(n=32)

    def fabric_run() -> tuple[Any, ...]:
        plugin = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        x, y = data.tensors
        for step in range(4):
            fabric.backward(F.cross_entropy(model(x[step * 8 : step * 8 + 8]), y[step * 8 : step * 8 + 8]))
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict())

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def trainer_run() -> tuple[Any, ...]:
        module = Module()
        plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
        trainer = make_trainer(plugin, gradient_clip_val=0.5, accumulate_grad_batches=2)
        trainer.fit(module, loader(data, batch_size=8))
        return [p.detach().clone() for p in module.parameters()], copy.deepcopy(trainer.optimizers[0].state_dict())

    _agree(buffers, fabric_run)
    _agree(buffers, trainer_run)


# -- LoRA ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("held", ["adapters", "all"])
def test_peft_lora_with_a_frozen_base_agrees_with_gradients_of_their_own(buffers, held):
    """A peft LoRA GPT-2 (built from a config) whose optimizer holds its adapters, or every parameter as users write
    it (``AdamW(model.parameters())``): the frozen base has no gradients and no masters. The adapters' gradients
    share the buffer either way; before, one parameter without a gradient (the whole frozen base) sent every step to
    gradients of their own."""
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, n_inner=32, use_cache=False)

    def run() -> tuple[Any, ...]:
        torch.manual_seed(0)
        lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
        amp = Amp("O2", half_dtype="bfloat16")
        model = amp.prepare_model(peft.get_peft_model(GPT2LMHeadModel(config), lora))
        params = model.parameters() if held == "all" else [p for p in model.parameters() if p.requires_grad]
        optimizer = amp.prepare_optimizer(torch.optim.AdamW(params, lr=1e-2))
        for _ in range(3):
            with amp.forward_context():
                loss = model(input_ids=ids, labels=ids).loss
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()
        return _result(amp, model, optimizer)

    made = buffers.made
    _agree(buffers, run)
    assert buffers.made - made == 3  # every step
