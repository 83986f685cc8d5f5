"""A new user copying docs/fabric.md's litgpt command line: a ``--mpx_kwargs`` that is not a JSON object is refused
by the parser with the value and an example, before litgpt is imported or anything is written."""

from __future__ import annotations

import pytest

from lightning_mpx.integrations.litgpt import main


@pytest.mark.parametrize(
    ("value", "says"),
    [("{half_dtype: bfloat16}", "is not JSON"), ('["half_dtype"]', "is a JSON list, not an object")],
)
def test_mpx_kwargs_that_is_not_a_json_object_names_the_value_and_an_example(value, says, capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["finetune_lora", str(tmp_path), "--mpx_kwargs", value])
    assert exit_.value.code == 2  # argparse's usage error, not a traceback from FabricMixedPrecisionPlugin(**value)
    err = capsys.readouterr().err
    assert "--mpx_kwargs" in err and repr(value) in err and says in err
    assert """--mpx_kwargs '{"half_dtype": "bfloat16"}'""" in err
    assert not any(tmp_path.iterdir())
