"""The engines follow the cast table through random sequences of what users do to it.

Two pieces of state are derived from a policy's table and must never go stale: O1's choice of engine (``torch.autocast``
alone while the table agrees with autocast, the Python mode as soon as a row differs) and O2's loss regions (the
submodules that run with the policy's mode off, found from the names of the table's functions). A user changes the
table at any time: registers their own ``@dispatchable`` function (FP32 or half), removes it again, or puts a new
table in place, between forward passes, before or after the model was prepared. Whatever the sequence, a call of a
registered function must come out in the dtype the table gives it *now*, in whichever submodule it is made, and the
blocks that call no registered function must stay free of the mode (the speed the engines exist for).

The reference is the table's own meaning, read at each forward: ``"float"`` gives FP32, ``"half"`` the half dtype, no
row leaves the input as it is (one function is called on a bfloat16 tensor, which tells ``"float"`` from no row, the
other on an FP32 tensor, which tells ``"half"`` from no row).
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch import nn

from lightning_mpx import Amp, CastTable, dispatchable
from tests.compile_helpers import HookCounter
from tests.stateful_helpers import stateful_settings


@dispatchable
def _first(t: torch.Tensor) -> torch.Tensor:
    return t * 2


@dispatchable
def _second(t: torch.Tensor) -> torch.Tensor:
    return t + 1


FUNCTIONS = {"first": _first, "second": _second}
#: The dtype each function's call gives per category of its row (None: no row): "first" is called on bfloat16,
#: "second" on FP32.
EXPECTED = {
    "first": {"float": torch.float32, "half": torch.bfloat16, None: torch.bfloat16},
    "second": {"float": torch.float32, "half": torch.bfloat16, None: torch.float32},
}


class _Caller(nn.Module):
    """Calls one user function (``_first`` on a bfloat16 tensor, ``_second`` on an FP32 one) and records the dtype
    it returned."""

    def __init__(self, which: str) -> None:
        super().__init__()
        self.fc, self.which, self.seen = nn.Linear(4, 4), which, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        if self.which == "first":
            self.seen.append(_first(out.detach().bfloat16()).dtype)
        else:
            self.seen.append(_second(out.detach().float()).dtype)
        return out


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.plain, self.first, self.second = _Plain(), _Caller("first"), _Caller("second")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(self.plain(x)))


class TableChanges(RuleBasedStateMachine):
    @initialize(level=st.sampled_from(["O1", "O2"]), prepare_first=st.booleans())
    def start(self, level: str, prepare_first: bool) -> None:
        # O1 on CPU autocast's own table (the engine O1 runs by default on CUDA); O2's forward policy.
        table = CastTable.autocast_aligned("cpu") if level == "O1" else None
        self.level = level
        self.amp = Amp(level, half_dtype="bfloat16", cast_table=table)
        self.rows: dict[str, str | None] = {"first": None, "second": None}
        self.model = None
        self.prepare_first = prepare_first
        if prepare_first:
            self._prepare()

    def _prepare(self) -> None:
        torch.manual_seed(0)
        self.model = self.amp.prepare_model(_Net())

    @rule(which=st.sampled_from(sorted(FUNCTIONS)), category=st.sampled_from(["float", "half"]))
    def register(self, which: str, category: str) -> None:
        self.amp.policy.table.register(FUNCTIONS[which], category)
        self.rows[which] = category

    @rule(which=st.sampled_from(sorted(FUNCTIONS)))
    def unregister(self, which: str) -> None:
        if self.rows[which] is not None:
            self.amp.policy.table.unregister(FUNCTIONS[which])
            self.rows[which] = None

    @rule()
    def put_a_copy_in_place(self) -> None:
        self.amp.policy.table = self.amp.policy.table.copy()

    @rule()
    def forward(self) -> None:
        if self.model is None:
            self._prepare()
        dtype = torch.float32 if self.level == "O1" else torch.bfloat16
        with self.amp.forward_context():
            self.model(torch.randn(2, 4, dtype=dtype))
        for which in FUNCTIONS:
            got = getattr(self.model, which).seen[-1]
            assert got == EXPECTED[which][self.rows[which]], (which, self.rows[which], got)

    @invariant()
    def blocks_without_registered_calls_stay_free(self) -> None:
        if self.model is None:
            return
        dtype = torch.float32 if self.level == "O1" else torch.bfloat16
        x = torch.randn(2, 4, dtype=dtype)
        with HookCounter() as counter, self.amp.forward_context():
            self.model.plain(x)
        if self.level == "O2" or not any(self.rows.values()):
            # O2: the plain block is a free region whatever the table holds; O1: autocast alone while the table
            # agrees with autocast (a user row makes the Python mode see every call, the documented cost).
            assert counter.calls == 0, (self.level, self.rows, counter.calls)
        if self.level == "O1":
            agrees = not any(self.rows.values())
            assert (self.amp.policy.engine_in_use == "autocast:cpu") == agrees


TableChanges.TestCase.settings = stateful_settings(max_examples=120, steps=12)
test_table_changes = TableChanges.TestCase
