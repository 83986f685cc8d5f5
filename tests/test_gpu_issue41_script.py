"""benchmarks/gpu_issue41.sh, the next GPU session's two commands: every gpu_suite.py call in it parses with the
suite's own parser and names variants the suite has, the script is valid bash, and a call without a part says how
to call it. (Nothing here runs a part: ``tests/test_gpu_suite.py`` runs every part in ``--check`` mode.)"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_issue41.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402


def _calls() -> list[list[str]]:
    lines = [line.strip() for line in SCRIPT.read_text().splitlines()]
    return [shlex.split(line)[2:] for line in lines if re.match(r'part "\$stamp-[a-z-]+" ', line)]


def test_every_call_parses_with_the_suites_parser_and_names_known_variants():
    calls = _calls()
    assert len(calls) == 3
    parser = gpu_suite.build_parser()
    parts = []
    for argv in calls:
        args = parser.parse_args([*argv, "--out", "/tmp/unused"])
        parts.append(args.part)
        assert args.budget and args.budget <= 300  # two fsdp parts in one call stay under 10 minutes
        for variant in args.variants or ():
            assert variant in gpu_suite.STEP_ORDER, variant
    assert parts == ["fsdp", "fsdp", "step"]
    assert "--fsdp-fused" in calls[1] and "--fsdp-fused" not in calls[0]


def test_the_script_is_valid_bash_and_refuses_a_missing_part(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    env = {"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "usage: bash benchmarks/gpu_issue41.sh fsdp|resnet" in done.stderr


def test_the_device_tests_name_test_files_that_exist():
    """The resnet call ends with the tests that have CUDA cases: a renamed file would pass here unnoticed and fail
    only on the next GPU, whose minutes are counted."""
    text = SCRIPT.read_text()
    named = re.findall(r"tests/[^\s\"]+\.py", text)
    assert len(named) >= 4 and "tests/test_hostile_autocast_switch.py" in named
    assert [name for name in named if not (ROOT / name).is_file()] == []
