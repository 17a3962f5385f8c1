"""The ``silod`` command line: one subcommand per service plus client tools."""

from silod.cli.main import main

__all__ = ["main"]
