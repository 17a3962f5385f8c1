"""Render docs/configuration-reference.md from the settings classes.

Every service's options are declared once, as fields of its ``Settings`` class (a
:class:`~services.runtime.settings.ServiceSettings` subclass); the CLI flags and the
``SILOD_*`` environment variables are derived from those fields, and so is this reference.
``make config-docs`` rewrites the file; tests/deploy/test_config_reference.py fails when the
committed copy is stale.

    python -m services.runtime.config_reference            # print the reference
    python -m services.runtime.config_reference --write    # rewrite docs/configuration-reference.md
"""

from __future__ import annotations

import argparse
import importlib
import sys
import typing
from pathlib import Path
from typing import Any

import annotated_types
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from services.runtime.settings import ServiceSettings

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration-reference.md"

HEADER = """\
# Configuration reference

<!-- Generated from the settings classes by `make config-docs`
     (services/runtime/config_reference.py); do not edit by hand. -->

Every option of every `silod` service, generated from the settings classes the services
read, so it lists exactly what the code accepts. Each option can be given as a flag, as an
environment variable or as a key of the `--config` file (YAML or TOML; the key is the
option's name, e.g. `metrics_port: 9100`). Flags beat environment variables, which beat the
config file, which beats the default; see [configuration.md](configuration.md).

Boolean options take `--name` / `--no-name` on the command line and `true`/`false` in the
environment or the config file. Sizes are in bytes and durations in seconds.
"""


# Subcommands outside silod.cli.main.SERVICES that also take ServiceSettings flags:
# subcommand -> module exposing ``Settings``. tests/deploy/test_config_reference.py fails if a
# subcommand with settings flags is missing here.
OTHER_SETTINGS = {"dashboard": "services.dashboard.app"}


def service_settings() -> list[tuple[str, type[ServiceSettings]]]:
    """(subcommand, Settings class) of every gRPC service in ``silod --help`` order, then the
    other subcommands configured the same way."""
    from silod.cli.main import SERVICES

    modules = {name: cmd.module for name, cmd in SERVICES.items()} | OTHER_SETTINGS
    return [(name, importlib.import_module(module).Settings) for name, module in modules.items()]


def _flag(name: str, field: FieldInfo) -> str:
    flag = "--" + name.replace("_", "-")
    if field.annotation is bool:
        return f"`{flag}` / `--no-{name.replace('_', '-')}`"
    return f"`{flag}`"


def _default(field: FieldInfo) -> str:
    value = field.default
    if value is PydanticUndefined or value is None:
        return "(required)"
    if value == "":
        return "(empty)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def _allowed(field: FieldInfo) -> str:
    """Choices of a Literal, or the numeric bounds the field enforces."""
    if typing.get_origin(field.annotation) is typing.Literal:
        return ", ".join(f"`{choice}`" for choice in typing.get_args(field.annotation))
    bounds = []
    for constraint in field.metadata:
        for cls, symbol in ((annotated_types.Ge, ">="), (annotated_types.Gt, ">"),
                            (annotated_types.Le, "<="), (annotated_types.Lt, "<")):
            if isinstance(constraint, cls):
                bound: Any = getattr(constraint, {">=": "ge", ">": "gt", "<=": "le", "<": "lt"}[symbol])
                bounds.append(f"{symbol} {bound}")
    return ", ".join(bounds)


def _differs(a: FieldInfo, b: FieldInfo) -> bool:
    # FieldInfo has no value equality; compare what the reference shows.
    return (a.annotation, a.default, a.description, a.metadata) != (b.annotation, b.default, b.description, b.metadata)


def _cell(text: str) -> str:
    # A literal | would end the Markdown table cell.
    return text.replace("|", "\\|").replace("\n", " ")


def _table(fields: dict[str, FieldInfo]) -> list[str]:
    lines = ["| flag | environment | default | allowed | description |", "|---|---|---|---|---|"]
    for name, field in fields.items():
        lines.append(
            f"| {_flag(name, field)} | `SILOD_{name.upper()}` | {_cell(_default(field))} | "
            f"{_cell(_allowed(field))} | {_cell(field.description or '')} |"
        )
    return lines


def render() -> str:
    common = ServiceSettings.model_fields
    out = [HEADER, "## Every service", "",
           "The settings of the service runtime (`services/runtime/settings.py`): every "
           "`silod <service>` has them.", ""]
    out += _table(common)
    for name, cls in service_settings():
        own = {k: v for k, v in cls.model_fields.items() if k not in common}
        # A service that redeclares a common option (a different default, say) lists it too.
        own.update({k: v for k, v in cls.model_fields.items() if k in common and _differs(v, common[k])})
        out += ["", f"## `silod {name}`", "", f"Settings class: `{cls.__module__}.{cls.__qualname__}`.", ""]
        out += _table(own) if own else ["No options beyond those of every service."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {REFERENCE_PATH} instead of printing")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        REFERENCE_PATH.write_text(text)
        print(f"wrote {REFERENCE_PATH}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
