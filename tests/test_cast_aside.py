"""Cast modes set aside around a framework's own forward hooks (``lightning_mpx.casting.aside``), as ``shard_model``
does around FSDP2's gathers and frees: those hooks' torch calls reach torch directly, and everything else in the
forward pass (the forward itself, the user's hooks before and after, the casts) runs as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mpx import CastPolicy
from lightning_mpx.casting.aside import around_hooks
from lightning_mpx.casting.mode import _CastMode


def _cast_modes() -> int:
    return sum(type(m) is _CastMode for m in torch.overrides._get_current_function_mode_stack())


class Recorder(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)
        self.seen: list[tuple[str, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(("forward", _cast_modes()))
        return super().forward(x)


def _hook(module: Recorder, name: str, fail: bool = False):
    def hook(*_):
        module.seen.append((name, _cast_modes()))
        if fail:
            raise RuntimeError(f"{name} failed")

    return hook


def _framework_like(module: Recorder, fail: str | None = None):
    """What fully_shard registers: a forward pre-hook put first and a forward hook put last."""

    def register() -> None:
        module.register_forward_pre_hook(_hook(module, "framework pre", fail == "pre"), prepend=True)
        module.register_forward_hook(_hook(module, "framework post", fail == "post"))

    return register


def test_only_the_framework_hooks_run_without_the_cast_mode():
    module = Recorder()
    module.register_forward_pre_hook(_hook(module, "user pre, before"))
    module.register_forward_hook(_hook(module, "user post, before"))
    around_hooks(module, _framework_like(module))
    module.register_forward_pre_hook(_hook(module, "user pre, after"))
    module.register_forward_pre_hook(_hook(module, "user pre, after, first"), prepend=True)
    module.register_forward_hook(_hook(module, "user post, after"))
    policy = CastPolicy(half_dtype=torch.bfloat16)
    with policy.scope():
        out = module(torch.randn(2, 4))
        assert _cast_modes() == 1
    assert out.dtype == torch.bfloat16  # the forward's linear was cast
    assert module.seen == [
        ("user pre, after, first", 1),
        ("framework pre", 0),
        ("user pre, before", 1),
        ("user pre, after", 1),
        ("forward", 1),
        ("user post, before", 1),
        ("framework post", 0),
        ("user post, after", 1),
    ]
    assert _cast_modes() == 0


@pytest.mark.parametrize("fail", ["pre", "post", "forward"])
def test_the_modes_come_back_when_a_hook_or_the_forward_raises(fail):
    module = Recorder()
    around_hooks(module, _framework_like(module, fail))
    if fail == "forward":
        module.register_forward_pre_hook(_hook(module, "user pre", fail=True))
    policy = CastPolicy(half_dtype=torch.bfloat16)
    with policy.scope():
        with pytest.raises(RuntimeError, match="failed"):
            module(torch.randn(2, 4))
        assert _cast_modes() == 1  # back on the stack: the scope's casts go on
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.bfloat16
        module.seen.clear()
    assert _cast_modes() == 0


def test_another_mode_above_the_cast_mode_keeps_the_stack_as_it_is():
    from torch.overrides import TorchFunctionMode

    class Other(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    module = Recorder()
    around_hooks(module, _framework_like(module))
    with CastPolicy(half_dtype=torch.bfloat16).scope(), Other():
        module(torch.randn(2, 4))
    assert ("framework pre", 1) in module.seen and ("framework post", 1) in module.seen


def test_without_a_scope_nothing_changes():
    module = Recorder()
    around_hooks(module, _framework_like(module))
    out = module(torch.randn(2, 4))
    assert out.dtype == torch.float32
    assert [name for name, _ in module.seen] == ["framework pre", "forward", "framework post"]


# --- FSDP2, sharded elsewhere (Accelerate): the hooks moved between the set-aside hooks -----------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _sharded() -> Net:
    from torch.distributed.fsdp import fully_shard

    net = Net()
    for block in net.blocks:
        fully_shard(block)
    fully_shard(net)
    return net


def test_fsdp_gathers_run_without_the_cast_mode_and_the_results_stay(one_rank, monkeypatch):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from lightning_mpx.casting.aside import around_fsdp_hooks

    seen: list[int] = []
    for name in ("pre_forward", "post_forward"):
        original = getattr(FSDPParamGroup, name)

        def spy(self, *args, _original=original, **kwargs):
            seen.append(_cast_modes())
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(FSDPParamGroup, name, spy)
    x = torch.randn(3, 8)
    outputs, grads = [], []
    for moved in (False, True):
        net = _sharded()
        if moved:
            assert [around_fsdp_hooks(m) for m in net.modules()] == [True, False, True, True, False]
        policy = CastPolicy(half_dtype=torch.bfloat16)
        seen.clear()
        with policy.scope():
            out = net(x)
        assert out.dtype == torch.bfloat16 and len(seen) == 6
        assert set(seen) == ({0} if moved else {1})
        out.float().sum().backward()
        outputs.append(out)
        grads.append([p.grad.full_tensor() for p in net.parameters()])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fsdp_hooks_with_hooks_registered_around_them_are_left_where_they_are(one_rank):
    from lightning_mpx.casting.aside import around_fsdp_hooks

    net = _sharded()
    calls: list[str] = []
    net.head.register_forward_pre_hook(lambda *_: calls.append("first"), prepend=True)  # before FSDP's now
    net.blocks[0].register_forward_hook(lambda *_: calls.append("last"))  # after FSDP's now
    assert not around_fsdp_hooks(net.head) and not around_fsdp_hooks(net.blocks[0])
    assert around_fsdp_hooks(net.blocks[1])
    with CastPolicy(half_dtype=torch.bfloat16).scope():
        net(torch.randn(3, 8))
    assert calls == ["last", "first"]
