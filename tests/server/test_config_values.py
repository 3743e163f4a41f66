"""Configured values that are not numbers a person meant, refused from every source with
one line naming the field, the source and the bounds: NaN and infinities (which slip
through `value < lo or value > hi`), sizes too large to be a number of bytes. Also files
that are not UTF-8 and `KVSTORE_*` names that are no setting: one line each, no traceback.

Sources: flags, `KVSTORE_*` environment, the TOML file (which has `nan` and `inf`
literals), the live `SetConfig` path (`kvstore config set`) against a real daemon, and
`kvstore serve` as a subprocess.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli.main import main
from kvstore.client.admin import AdminClient
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.server.auth import parse_token_file
from kvstore.server.config import FIELDS, OTHER_ENV, RETIRED, load_config
from tests.procs import clean_env

FLOAT_FIELDS = [f.name for f in FIELDS if f.kind == "float"]
NOT_FINITE = ("nan", "NaN", "inf", "-inf", "infinity", "1e999")


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("text", NOT_FINITE)
def test_a_number_that_is_not_finite_is_refused_from_flags_and_env(name, text):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ConfigError) as info:
        load_config({name: text}, env={})
    message = str(info.value)
    assert name in message and flag in message and "[" in message, message
    env = "KVSTORE_" + name.upper()
    with pytest.raises(ConfigError) as info:
        load_config({}, env={env: text})
    assert name in str(info.value) and env in str(info.value)


@pytest.mark.parametrize("literal", ("nan", "inf", "-inf", "+nan"))
def test_a_toml_nan_or_inf_literal_is_refused(tmp_path, literal):
    path = tmp_path / "kvstore.toml"
    path.write_text(f"hint_budget = {literal}\n")
    with pytest.raises(ConfigError) as info:
        load_config({}, env={}, config_file=str(path))
    message = str(info.value)
    assert "hint_budget" in message and str(path) in message and "[0, 1]" in message, message


@pytest.mark.parametrize("name", [f.name for f in FIELDS if f.kind == "size"])
def test_a_size_too_large_to_be_bytes_is_refused_not_a_crash(name):
    with pytest.raises(ConfigError) as info:
        load_config({name: "9" * 400}, env={})
    assert name in str(info.value)


def test_config_set_refuses_nan_and_keeps_the_value(daemon_thread, capsys):
    t = daemon_thread.tcp_target
    with AdminClient(t) as admin:
        before = admin.get_config("hint_budget")[0].value
        for text in ("nan", "inf", "-inf"):
            with pytest.raises(InvalidArgument) as info:
                admin.set_config("hint_budget", text)
            assert "hint_budget" in str(info.value) and "SetConfig" in str(info.value)
        assert admin.get_config("hint_budget")[0].value == before
    code = main(["config", "set", "hint_budget", "nan", "--target", t])
    err = capsys.readouterr().err
    assert code == 1 and "hint_budget" in err and "finite" in err and len(err.strip().splitlines()) == 1, err


def test_serve_with_a_nan_watermark_exits_with_one_line(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix:{tmp_path / 'kv.sock'}",
         "--metrics-listen", "off", "--host-capacity", "16MiB", "--host-high-watermark", "nan"],
        env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "host_high_watermark" in lines[0] and "--host-high-watermark" in lines[0], \
        proc.stderr


@pytest.mark.parametrize("argv", (["stats", "--timeout", "nan"], ["stats", "--timeout", "inf"],
                                  ["top", "--interval", "nan"], ["events", "--duration=-inf"]))
def test_cli_durations_must_be_finite(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "finite number of seconds" in capsys.readouterr().err


# ------------------------------------------------------------------ files that are not UTF-8


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    path = tmp_path / "kvstore.toml"
    path.write_bytes(b"hint_budget = 0.5  # caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_config({}, env={}, config_file=str(path))
    assert str(path) in str(info.value) and "UTF-8" in str(info.value) and "0xe9" in str(info.value)
    assert main(["config", "validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1 and "UTF-8" in out


def test_a_token_file_that_is_not_utf8_stops_the_daemon_with_one_line(tmp_path: Path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_bytes(b'[[tenant]]\nname = "caf\xe9"\n')
    tokens.chmod(0o600)
    with pytest.raises(ConfigError) as info:
        parse_token_file(str(tokens))
    assert str(tokens) in str(info.value) and "UTF-8" in str(info.value)
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix:{tmp_path / 'kv.sock'}",
         "--metrics-listen", "off", "--host-capacity", "16MiB", "--auth-token-file", str(tokens)],
        env=clean_env(), capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "UTF-8" in lines[0], proc.stderr


# ------------------------------------------------------------------ KVSTORE_* names


def test_a_kvstore_env_name_that_is_no_setting_is_refused_like_a_toml_typo(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config({}, env={"KVSTORE_HOST_CAPACTY": "1GiB"})
    message = str(info.value)
    assert "KVSTORE_HOST_CAPACTY" in message and "did you mean KVSTORE_HOST_CAPACITY" in message, message
    path = tmp_path / "kvstore.toml"
    path.write_text('host_capacty = "1GiB"\n')
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config({}, env={}, config_file=str(path))


def test_the_kvstore_env_names_that_are_not_settings_are_accepted():
    env = {name: "x" for name in OTHER_ENV}
    env.update({
        "KVSTORE_CONFIG": "",  # set but empty: as if unset
        "KVSTORE_BENCH_ROUNDS": "1",
        # What Kubernetes sets in every pod of the namespace of a Service named kvstore.
        "KVSTORE_SERVICE_HOST": "10.0.0.1", "KVSTORE_SERVICE_PORT": "50051", "KVSTORE_SERVICE_PORT_GRPC": "50051",
        "KVSTORE_PORT": "tcp://10.0.0.1:50051", "KVSTORE_PORT_50051_TCP": "tcp://10.0.0.1:50051",
        "KVSTORE_PORT_50051_TCP_PROTO": "tcp", "KVSTORE_PORT_50051_TCP_PORT": "50051",
        "KVSTORE_PORT_50051_TCP_ADDR": "10.0.0.1",
        "KVSTORE_NOT_A_SETTING": "",  # empty: ignored, as an empty setting is
        "KVSTORE_GRACE_S": "3",
    })
    assert load_config({}, env=env).grace_s == 3.0


def test_the_other_kvstore_env_names_are_the_ones_the_code_reads():
    """OTHER_ENV is the one list: every KVSTORE_ name the package reads is a setting or on it."""
    root = Path(__file__).resolve().parents[2]
    settings = {"KVSTORE_" + f.name.upper() for f in FIELDS}
    read: set[str] = set()
    for source in [*root.glob("kvstore/**/*.py"), *root.glob("client/**/*.py"), *root.glob("tiers/**/*.py")]:
        read.update(re.findall(r"\bKVSTORE_[A-Z][A-Z0-9_]*[A-Z0-9]\b", source.read_text()))
    retired = {"KVSTORE_" + name.upper() for name in RETIRED}
    not_env = {"KVSTORE_NAME"}  # the config docstring's placeholder
    assert read - settings - retired - not_env <= OTHER_ENV, read - settings - retired - not_env - OTHER_ENV


def test_serve_with_a_typo_in_the_environment_exits_with_one_line(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix:{tmp_path / 'kv.sock'}",
         "--metrics-listen", "off", "--host-capacity", "16MiB"],
        env={**clean_env(), "KVSTORE_HINT_BUDGT": "0.5"}, capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "KVSTORE_HINT_BUDGT" in lines[0], proc.stderr
