"""Client-side subcommands of ``silod`` (talk to running services)."""

from __future__ import annotations

import argparse


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add the client subcommands to the ``silod`` parser."""
