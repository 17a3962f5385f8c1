"""`silod admin credential|tenant` against a metadata service, `silod login` and where every
client command takes its token from (flag, env, stored login, config file)."""

from __future__ import annotations

import argparse
import io
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.metadata.service import Settings
from silod.cli import locate
from silod.cli.main import main
from tests.metadata.metadata_harness import InProcessServer


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user with no silod configuration at all, in an empty working directory."""
    for name in ("SILOD_AUTH_TOKEN", "SILOD_CLIENT_CONFIG", locate.LOGIN_FILE_ENV, "SILOD_METADATA_ADDR",
                 "SILOD_STATE_DIR", "SILOD_TLS_CA_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def metadata(home: Path) -> Iterator[str]:
    with InProcessServer(Settings(db=f"sqlite:///{home / 'meta.db'}", log_level="warning")) as server:
        yield server.address


def silod(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_admin_commands(metadata: str, capsys: pytest.CaptureFixture[str]) -> None:
    at = ("--metadata", metadata)
    assert silod(capsys, "admin", "tenant", "create", "vision", "alice", *at)[0] == 0
    code, out, _ = silod(capsys, "admin", "tenant", "members", "vision", "--add", "bob", "--remove", "alice", *at)
    assert code == 0 and out.split() == ["vision", "bob"]
    code, out, _ = silod(capsys, "admin", "tenant", "list", *at)
    assert out.splitlines()[1].split() == ["vision", "bob"]

    code, token, err = silod(capsys, "admin", "credential", "create", "user", "bob", "--ttl", "3600", *at)
    assert code == 0 and token.startswith("silod_") and "shown this once" in err
    credential_id = token.split("_")[1]
    code, out, _ = silod(capsys, "admin", "credential", "list", "--kind", "user", *at)
    assert credential_id in out and token.strip() not in out

    code, rotated, _ = silod(capsys, "admin", "credential", "rotate", credential_id, *at)
    assert code == 0 and rotated != token
    assert credential_id not in silod(capsys, "admin", "credential", "list", *at)[1]
    assert credential_id in silod(capsys, "admin", "credential", "list", "--all", *at)[1]
    new_id = rotated.split("_")[1]
    assert silod(capsys, "admin", "credential", "revoke", new_id, *at)[0] == 0

    code, _, err = silod(capsys, "admin", "tenant", "create", "vision", *at)
    assert code == 1 and "ALREADY_EXISTS" in err and "name" in err
    code, _, err = silod(capsys, "admin", "credential", "create", "node", "bad/name", *at)
    assert code == 1 and "INVALID_ARGUMENT" in err and "name:" in err


def test_login_stores_the_token_privately_and_commands_use_it(home: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    token_file = home / "given"
    token_file.write_text("silod_0123456789abcdef_" + "ab" * 32 + "\n")
    assert silod(capsys, "login", "--token-file", str(token_file))[0] == 0
    stored = home / "config" / "silod" / "token"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    args = argparse.Namespace(token="", tls_ca_file="")
    assert locate.credentials(args)[0] == token_file.read_text().strip()

    monkeypatch.setattr("sys.stdin", io.StringIO("second-token\n"))
    assert silod(capsys, "login")[0] == 0
    assert locate.credentials(args)[0] == "second-token", "a new login takes effect at the next command"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600

    monkeypatch.setattr("sys.stdin", io.StringIO("two words"))
    assert silod(capsys, "login")[0] == 1
    assert locate.credentials(args)[0] == "second-token"


def test_token_order_flag_env_login_config(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = home / "config" / "silod" / "client.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("token: from-config\n")
    assert locate.credentials(argparse.Namespace(token="", tls_ca_file=""))[0] == "from-config"
    locate.login_path().write_text("from-login\n")
    assert locate.credentials(argparse.Namespace(token="", tls_ca_file=""))[0] == "from-login"
    monkeypatch.setenv("SILOD_AUTH_TOKEN", "from-env")
    assert locate.credentials(argparse.Namespace(token="", tls_ca_file=""))[0] == "from-env"
    assert locate.credentials(argparse.Namespace(token="from-flag", tls_ca_file=""))[0] == "from-flag"
    monkeypatch.delenv("SILOD_AUTH_TOKEN")
    assert silod_logout() == 0
    assert locate.credentials(argparse.Namespace(token="", tls_ca_file=""))[0] == "from-config"


def silod_logout() -> int:
    return main(["logout"])
