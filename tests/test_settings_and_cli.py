"""Settings precedence (flags > env > config file > defaults) and CLI behaviour on bad input."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from services.runtime.settings import ConfigError, ServiceSettings, load_settings, split_host_port
from silod.cli.main import build_parser, main


def test_defaults_apply_without_any_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SILOD_CONFIG", raising=False)
    settings = load_settings(ServiceSettings)
    assert settings.listen == "127.0.0.1:0"
    assert settings.metrics_port == 0
    assert settings.log_format == "json"


@pytest.mark.parametrize("suffix, body", [
    (".yaml", "metrics_port: 9100\nlog_format: text\nlisten: 0.0.0.0:7000\n"),
    (".toml", 'metrics_port = 9100\nlog_format = "text"\nlisten = "0.0.0.0:7000"\n'),
])
def test_flags_beat_env_beat_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str, body: str) -> None:
    config = tmp_path / f"silod{suffix}"
    config.write_text(body)
    only_file = load_settings(ServiceSettings, config)
    assert (only_file.metrics_port, only_file.log_format, only_file.listen) == (9100, "text", "0.0.0.0:7000")

    monkeypatch.setenv("SILOD_METRICS_PORT", "9200")
    env_over_file = load_settings(ServiceSettings, config)
    assert env_over_file.metrics_port == 9200
    assert env_over_file.log_format == "text"  # untouched by env: still from the file

    flag_over_env = load_settings(ServiceSettings, config, metrics_port="9300")
    assert flag_over_env.metrics_port == 9300


def test_config_file_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "c.yml"
    config.write_text("log_level: debug\n")
    monkeypatch.setenv("SILOD_CONFIG", str(config))
    assert load_settings(ServiceSettings).log_level == "debug"


@pytest.mark.parametrize("name, body, expected", [
    ("unknown.yaml", "metrics_prot: 1\n", "metrics_prot"),
    ("badvalue.yaml", "metrics_port: 70000\n", "metrics_port"),
    ("badenum.toml", 'log_format = "xml"\n', "log_format"),
    ("broken.yaml", "metrics_port: [1,\n", "config"),
    ("settings.ini", "x=1\n", ".yaml, .yml or .toml"),
])
def test_bad_config_names_the_setting(tmp_path: Path, name: str, body: str, expected: str) -> None:
    config = tmp_path / name
    config.write_text(body)
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        load_settings(ServiceSettings, config)


def test_missing_config_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(ServiceSettings, tmp_path / "nope.yaml")


@pytest.mark.parametrize("address, ok", [
    ("127.0.0.1:50051", ("127.0.0.1", 50051)), ("[::1]:9", ("::1", 9)), ("host:0", ("host", 0)),
    ("nohost", None), (":80", None), ("h:port", None), ("h:70000", None),
])
def test_split_host_port(address: str, ok: tuple[str, int] | None) -> None:
    if ok is None:
        with pytest.raises(ConfigError, match="listen"):
            split_host_port(address)
    else:
        assert split_host_port(address) == ok


def test_help_marks_services_not_yet_implemented() -> None:
    help_text = " ".join(build_parser().format_help().split())
    for name in ("metadata", "estimator", "scheduler", "cache-server", "worker-agent"):
        assert name in help_text
    assert help_text.count("[not implemented yet]") == 0  # every service is implemented


def test_every_setting_is_a_flag() -> None:
    argv = ["estimator", "--listen", "1.2.3.4:5", "--metrics-port", "9", "--auth-token", "t"]
    args = build_parser(argv).parse_args(argv)
    assert (args.listen, args.metrics_port, args.auth_token) == ("1.2.3.4:5", "9", "t")
    assert not hasattr(build_parser(["estimator"]).parse_args(["estimator"]), "listen")  # unset flags leave env/config in charge


def _silod(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "silod.cli", *argv], capture_output=True, text=True, timeout=60, env=env)


def test_service_with_bad_config_exits_2_without_traceback(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("metrics_port: lots\n")
    result = _silod("estimator", "--config", str(config))
    assert result.returncode == 2
    assert "metrics_port" in result.stderr
    assert "Traceback" not in result.stderr


def test_service_with_bad_listen_address_fails_cleanly() -> None:
    result = _silod("estimator", "--listen", "not-an-address")
    assert result.returncode != 0
    assert "listen" in result.stderr
    assert "Traceback" not in result.stderr


def test_dataset_register_bad_uri_names_it(tmp_path: Path) -> None:
    result = _silod("dataset", "register", "d1", "ftp://example/x", "--metadata", "127.0.0.1:1")
    assert result.returncode == 1
    assert "uri:" in result.stderr and "Traceback" not in result.stderr
    missing = _silod("dataset", "register", "d1", (tmp_path / "absent").as_uri(), "--metadata", "127.0.0.1:1")
    assert missing.returncode == 1 and "uri:" in missing.stderr


def test_client_against_unreachable_service_reports_unavailable() -> None:
    result = _silod("dataset", "list", "--metadata", "127.0.0.1:1")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr and "Traceback" not in result.stderr


def test_a_client_command_piped_into_a_closed_reader_ends_quietly() -> None:
    # `silod simulate list | head -0`: the reader is gone before the first line is written.
    proc = subprocess.Popen([sys.executable, "-m", "silod.cli", "simulate", "list"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    stderr = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == -signal.SIGPIPE, (proc.returncode, stderr)
    assert stderr == ""


def test_calling_main_from_python_leaves_the_callers_sigpipe_alone(capsys: pytest.CaptureFixture[str]) -> None:
    # A process that calls main() (a test, a notebook) must not die of its next write to a
    # closed socket: only the program itself makes SIGPIPE fatal.
    assert main(["dataset", "list", "--metadata", "127.0.0.1:1"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
    left, right = socket.socketpair()
    right.close()
    with left, pytest.raises(BrokenPipeError):
        left.send(b"x")
