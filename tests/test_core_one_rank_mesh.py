"""``shard_model`` given a one-rank mesh in a world of several ranks (``ModelParallelStrategy()``'s default
``"data_parallel"`` mesh: every device tensor-parallel) shards nothing and reduces no gradient, so the ranks' weights
drift apart silently: it warns on rank zero, naming the strategy sizes that make the devices data-parallel. (A group
of one rank standing for two: its world size reads 2.)"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_mpx import MixedPrecisionSettings
from lightning_mpx.integrations.fsdp import shard_model
from lightning_mpx.integrations.fsdp_mesh import warn_one_rank_mesh

_SETTINGS = MixedPrecisionSettings("O2", half_dtype=torch.bfloat16)
_FIX = r"ModelParallelStrategy\(data_parallel_size=2, tensor_parallel_size=1\)"


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Any]:
    """A one-rank ``"data_parallel"`` mesh of a real (one-process) gloo group."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    finally:
        torch.distributed.destroy_process_group()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_a_one_rank_mesh_in_a_world_of_two_warns_on_rank_zero_once(mesh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """World size 2, the one-rank mesh: rank zero is warned once (a second ``shard_model`` of the sharded model, as
    Lightning's ``configure_model`` at a later stage, does not warn again), naming the fix; another rank is not."""
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    model = _net()
    with pytest.warns(UserWarning, match=_FIX):
        shard_model(model, _SETTINGS, mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shard_model(model, _SETTINGS, mesh=mesh)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
        assert warn_one_rank_mesh(_net(), mesh)  # every rank knows; rank zero says it


def test_a_mesh_of_every_rank_and_a_world_of_one_do_not_warn(mesh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual data-parallel path (``data_parallel_size=2``: a two-rank mesh in a world of two), no mesh (FSDP's
    default: the world), and one process with its one-rank mesh: no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shard_model(_net(), _SETTINGS, mesh=mesh)  # a world of one
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)

        class TwoRanks:
            mesh_dim_names = ("data_parallel",)

            def size(self, mesh_dim: int | None = None) -> int:
                return 2

        assert not warn_one_rank_mesh(_net(), TwoRanks())
        assert not warn_one_rank_mesh(_net(), None)
