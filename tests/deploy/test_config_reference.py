"""docs/configuration-reference.md is generated from the settings classes and must be current."""

from __future__ import annotations

import argparse

from deploy_checks import ROOT
from services.runtime.config_reference import REFERENCE_PATH, render, service_settings
from services.runtime.settings import ServiceSettings
from silod.cli.main import SERVICES, build_parser


def test_committed_reference_matches_the_settings_classes() -> None:
    assert REFERENCE_PATH == ROOT / "docs" / "configuration-reference.md"
    assert REFERENCE_PATH.read_text() == render(), (
        "docs/configuration-reference.md is stale; run `make config-docs`"
    )


def test_reference_names_every_option_of_every_service() -> None:
    text = render()
    common = text.split("## `silod", 1)[0]
    assert [name for name, _ in service_settings()][: len(SERVICES)] == list(SERVICES)
    for name, cls in service_settings():
        section = text.split(f"## `silod {name}`", 1)[1].split("\n## ", 1)[0]
        assert f"Settings class: `{cls.__module__}.{cls.__qualname__}`" in section
        for field in cls.model_fields:
            env = f"`SILOD_{field.upper()}`"
            # Common options are listed once, under "Every service"; the rest in the section.
            assert env in section or env in common, f"{name}: {field} missing"


def _subcommands() -> list[str]:
    parser = build_parser([])
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


def test_every_subcommand_with_settings_flags_is_in_the_reference() -> None:
    # Services get their flags from a settings class; a new subcommand configured that way
    # (recognised by the common --shutdown-grace-s flag) must be listed in OTHER_SETTINGS.
    documented = {name for name, _ in service_settings()}
    marker = "--" + "shutdown_grace_s".replace("_", "-")
    assert "shutdown_grace_s" in ServiceSettings.model_fields
    configured = set()
    for name in _subcommands():
        sub = build_parser([name])._subparsers._group_actions[0].choices[name]  # type: ignore[union-attr]
        if marker in sub._option_string_actions:
            configured.add(name)
    assert configured >= set(SERVICES)
    assert configured == documented, (
        f"subcommands with settings flags {sorted(configured)} != documented {sorted(documented)}: list new ones in "
        "OTHER_SETTINGS (services/runtime/config_reference.py) and run `make config-docs`"
    )
