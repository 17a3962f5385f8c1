"""Settings shared by every service, read from (highest first) command-line flags,
``SILOD_*`` environment variables, a YAML or TOML config file, and defaults.

Each service subclasses :class:`ServiceSettings`; its fields become ``--flags`` of its
``silod`` subcommand and ``SILOD_<FIELD>`` environment variables, so every option is
described once, in the field's ``description``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the setting and its source."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SILOD_", extra="forbid")

    listen: str = Field("127.0.0.1:0", description="HOST:PORT the gRPC server binds; port 0 picks a free one")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="TCP port of the Prometheus /metrics endpoint; 0 disables it"
    )
    metrics_host: str = Field("127.0.0.1", description="Host the Prometheus endpoint binds")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest log level written")
    log_format: Literal["json", "text"] = Field("json", description="json: one JSON object per line; text: for humans")
    auth_token: str = Field(
        "",
        description="The cluster's own bearer token (an admin); when set, every call except health checks "
        "must send 'authorization: Bearer <token>' with it or a credential (`silod admin credential`), "
        "and the access table of docs/api.md decides what each may call",
    )
    credential_cache_s: float = Field(
        5.0, ge=0, le=300,
        description="Seconds a service other than the metadata service trusts a credential the metadata "
        "service resolved before asking again: how long a revoked credential keeps working there",
    )
    tls_cert_file: str = Field("", description="PEM server certificate; with tls_key_file enables TLS")
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file")
    tls_client_ca_file: str = Field(
        "", description="PEM CA that signs client certificates; when set (with TLS on) every client must present "
        "one, and a call without a bearer token is the principal its Common Name names: admin:<label>, "
        "user:<name> or node:<name>")
    tls_client_cert_file: str = Field(
        "", description="PEM client certificate this process presents on its TLS channels to other services "
        "(those with tls_client_ca_file require one)")
    tls_client_key_file: str = Field("", description="PEM private key of tls_client_cert_file")
    shutdown_grace_s: float = Field(
        10.0, ge=0, description="Seconds in-flight calls get to finish after SIGTERM/SIGINT"
    )
    gc_young_threshold: int = Field(
        50_000, ge=0,
        description="Once serving, what start-up made is frozen out of garbage collection and the youngest "
        "generation is collected after this many net allocations (CPython's default is 700): collections "
        "of a big heap become rarer (docs/sizing.md); 0 leaves CPython's settings. Time spent: "
        "silod_gc_pause_seconds",
    )
    @field_validator("listen")
    @classmethod
    def _listen_is_host_port(cls, value: str) -> str:
        try:
            split_host_port(value)
        except ConfigError as exc:  # pydantic prefixes the field name itself
            raise ValueError(exc.detail) from None
        return value

    @staticmethod
    def _identifier(value: str, rule: Any) -> str:
        """An identifier setting (a node name): silod/rpc/identifiers.py's rule; "" = the default."""
        problem = rule.problem(value) if value else None
        if problem is not None:
            raise ValueError(problem)
        return value

    ready_file: str = Field(
        "",
        description="If set, the bound address (HOST:PORT) is written to this file once serving; "
        "lets launchers use port 0",
    )


S = TypeVar("S", bound=ServiceSettings)


def load_settings(cls: type[S], config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> S:
    """Build ``cls`` from overrides (flags), the environment, ``config_file`` and defaults.

    ``config_file`` may also come from ``SILOD_CONFIG``. Raises :class:`ConfigError` with a
    message naming each bad setting.
    """
    config_file = config_file or os.environ.get("SILOD_CONFIG") or None
    file_sources: list[type[PydanticBaseSettingsSource]] = []
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config: file {str(path)!r} does not exist")
        suffix = path.suffix.lower()
        if suffix in (".yaml", ".yml"):
            source = lambda s: YamlConfigSettingsSource(s, yaml_file=path)  # noqa: E731
        elif suffix == ".toml":
            source = lambda s: TomlConfigSettingsSource(s, toml_file=path)  # noqa: E731
        else:
            raise ConfigError(f"config: {str(path)!r} must end in .yaml, .yml or .toml")
    else:
        source = None

    class _Loaded(cls):  # type: ignore[valid-type, misc]
        @classmethod
        def settings_customise_sources(
            cls_,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources = [init_settings, env_settings]
            if source is not None:
                sources.append(source(settings_cls))
            return tuple(sources)

    _Loaded.__name__ = cls.__name__
    _Loaded.__qualname__ = cls.__qualname__
    try:
        return _Loaded(**overrides)
    except ValidationError as exc:
        # A rule between settings (a model validator, no loc) names its settings itself.
        problems = "; ".join(
            (f"{'.'.join(str(p) for p in err['loc'])}: " if err["loc"] else "") + err["msg"].removeprefix("Value error, ")
            for err in exc.errors()
        )
        raise ConfigError(problems) from None
    except Exception as exc:  # malformed YAML/TOML
        raise ConfigError(f"config: cannot read {config_file}: {exc}") from None


def at_least(settings: Any, larger: str, factor: float, smaller: str, why: str) -> str:
    """A rule between two settings: ``larger`` >= ``factor`` x ``smaller``. The problem, naming
    both settings, their values and the rule ("" when it holds), e.g. "node_timeout_s (5) must be
    at least 3x heartbeat_s (2): ...". Model validators join their problems and raise them as one
    ValueError, which :func:`load_settings` passes on as the ConfigError's message."""
    a, b = getattr(settings, larger), getattr(settings, smaller)
    if a >= factor * b:
        return ""
    times = "" if factor == 1 else f"{factor:g}x "
    return f"{larger} ({a:g}) must be at least {times}{smaller} ({b:g}): {why}"


def refuse(problems: list[str]) -> None:
    """Raise the rules broken (from :func:`at_least`) as one ValueError, if any."""
    problems = [p for p in problems if p]
    if problems:
        raise ValueError("; ".join(problems))


def split_host_port(address: str, *, field: str = "listen") -> tuple[str, int]:
    """Parse ``HOST:PORT`` (IPv6 as ``[::1]:PORT``); raise ConfigError naming ``field``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        detail = f"expected HOST:PORT, got {address!r}"
        raise ConfigError(f"{field}: {detail}", detail)
    return host.strip("[]"), int(port)
