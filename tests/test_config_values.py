"""Configured values that are not numbers a person meant, refused from every source with
one line naming the field, the source and the bounds: NaN and infinities (which slip
through `value < lo or value > hi`), sizes too large to be a number of bytes.

Sources: flags, `KVSTORE_*` environment, the TOML file (which has `nan` and `inf`
literals), the live `SetConfig` path (`kvstore config set`) against a real daemon, and
`kvstore serve` as a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli.main import main
from kvstore.client.admin import AdminClient
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.server.config import FIELDS, load_config
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
