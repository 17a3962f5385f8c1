"""Turn a settings class into argparse flags, so each option is described once (its field)."""

from __future__ import annotations

import argparse
from typing import Any

# Settings classes are pydantic-settings models (the server's); typed loosely here because the
# client commands import this module too, in installs without pydantic.
BaseSettings = Any


def add_settings_flags(parser: argparse.ArgumentParser, settings_cls: type[BaseSettings]) -> None:
    """Add ``--field-name`` for every field; unset flags stay absent so env/config apply."""
    for name, field in settings_cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = field.default if field.default is not None else ""
        help_text = f"{field.description or ''} (env SILOD_{name.upper()}; default {default!r})"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, metavar=name.upper(), help=help_text)


def settings_overrides(args: argparse.Namespace, settings_cls: type[BaseSettings]) -> dict[str, Any]:
    """The flags the user actually gave, to pass as the highest-priority source."""
    return {name: getattr(args, name) for name in settings_cls.model_fields if hasattr(args, name)}
