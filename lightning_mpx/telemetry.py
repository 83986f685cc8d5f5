"""Kept import path: the code lives in :mod:`lightning_mpx.health.telemetry`."""

from lightning_mpx.health.telemetry import (  # noqa: F401
    GradTelemetry,
    module_groups,
)

__all__ = ['GradTelemetry', 'module_groups']
