"""A real third-party model under FSDP: a Hugging Face GPT-2 (tied embeddings, its own attention and loss) sharded by
``shard_model`` in a Lightning ``configure_model`` trains like the same plugin in one process."""

from __future__ import annotations

import json
import math

import pytest

from tests.launch import run_script

pytest.importorskip("transformers")
LEVELS = ("O1", "O2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_gpt2")
    levels = ",".join(LEVELS)
    run_script("fsdp_gpt2_script.py", out, timeout=300, MPX_LEVELS=levels)
    from tests.fsdp_gpt2_script import fit

    # The reference, one process on the whole batch: in this one (a second launch costs a process start's imports).
    return {level: {**{name: json.loads((out / f"{name}_{level}.json").read_text()) for name in ("rank0", "rank1")},
                    "single": fit(level, single=True)[1]} for level in LEVELS}  # fmt: skip


@pytest.mark.parametrize("level", LEVELS)
def test_sharded_gpt2_trains_like_one_process(runs, level):
    rank0, rank1, single = runs[level]["rank0"], runs[level]["rank1"], runs[level]["single"]
    assert rank0["sharded"] and rank0["masters"] == 0 and not single["sharded"]
    assert rank0["losses"] == rank1["losses"] and rank0["norms"] == rank1["norms"]  # one global answer per step
    assert rank0["skipped"] == single["skipped"] == 0
    assert len(rank0["losses"]) == len(single["losses"]) == 6
    for mine, ref in zip(rank0["losses"], single["losses"]):
        assert mine == pytest.approx(ref, rel=1e-2)  # bfloat16 rounding, two half batches against one batch
    for mine, ref in zip(rank0["norms"], single["norms"]):
        assert math.isfinite(mine) and mine == pytest.approx(ref, rel=5e-2)  # the global norm, not a rank's
