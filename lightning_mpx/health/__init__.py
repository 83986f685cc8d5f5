"""Precision health: overflow forensics, telemetry, scale promotion, the doctor and its plots."""
