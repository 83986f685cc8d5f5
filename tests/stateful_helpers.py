"""The settings every stateful (hypothesis ``RuleBasedStateMachine``) test of the suite runs with."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def stateful_settings(max_examples: int, steps: int) -> settings:
    """``max_examples`` sequences of up to ``steps`` rules each; no deadline (a rule trains a model), and models
    built in a rule are slow by hypothesis' measure. The profile (derandomized by default) comes from
    tests/conftest.py."""
    return settings(max_examples=max_examples, stateful_step_count=steps, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
