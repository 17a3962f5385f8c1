"""Scheduling policies, one module each; each registers itself in :mod:`scheduler.registry`."""
