"""A node's stable id: configured, kept under the SSD path, or derived from a data directory."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from kvstore.cluster.node_id import NODE_ID_FILE, NodeIdSource, resolve_node_id, validate_node_id
from kvstore.errors import ConfigError


def test_a_configured_id_wins() -> None:
    got = resolve_node_id("rack1-node7", ssd_path="/nonexistent", data_dir="/tmp")
    assert (got.value, got.source) == ("rack1-node7", NodeIdSource.CONFIGURED)


@pytest.mark.parametrize("bad", ["", "-lead", "has space", "a/b", "x" * 64, "n\u00e9"])
def test_invalid_ids_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="not a valid node id"):
        validate_node_id(bad)


def test_the_id_is_created_once_under_the_ssd_path_and_kept(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    first = resolve_node_id(ssd_path=str(ssd), hostname="gpu-17.example.org")
    assert first.source is NodeIdSource.CREATED
    assert first.value.startswith("gpu-17-")
    assert (ssd / NODE_ID_FILE).read_text().strip() == first.value
    again = resolve_node_id(ssd_path=str(ssd), hostname="renamed")
    assert (again.value, again.source) == (first.value, NodeIdSource.FILE)
    assert [p.name for p in ssd.iterdir()] == [NODE_ID_FILE]  # no temporary file left


def _resolve_into(ssd: str, out: multiprocessing.Queue[str]) -> None:
    out.put(resolve_node_id(ssd_path=ssd).value)


def test_processes_racing_on_one_ssd_path_agree(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue[str] = ctx.Queue()
    procs = [ctx.Process(target=_resolve_into, args=(str(tmp_path), out)) for _ in range(4)]
    for p in procs:
        p.start()
    ids = {out.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(30)
    assert len(ids) == 1
    assert (tmp_path / NODE_ID_FILE).read_text().strip() in ids


def test_a_damaged_id_file_is_a_config_error_that_names_it(tmp_path: Path) -> None:
    (tmp_path / NODE_ID_FILE).write_text("not an id!\n")
    with pytest.raises(ConfigError, match=NODE_ID_FILE):
        resolve_node_id(ssd_path=str(tmp_path))


def test_an_unwritable_ssd_path_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot keep the node id"):
        resolve_node_id(ssd_path=str(blocker / "ssd"))


def test_a_derived_id_is_stable_for_a_host_and_directory(tmp_path: Path) -> None:
    a = resolve_node_id(data_dir=str(tmp_path), hostname="host-a")
    assert a.source is NodeIdSource.DERIVED
    assert a == resolve_node_id(data_dir=str(tmp_path) + os.sep, hostname="host-a")
    assert a.value.startswith("host-a-")
    assert resolve_node_id(data_dir=str(tmp_path), hostname="host-b").value != a.value
    other = tmp_path / "other"
    other.mkdir()
    assert resolve_node_id(data_dir=str(other), hostname="host-a").value != a.value
    validate_node_id(resolve_node_id(data_dir=str(tmp_path), hostname="...").value)


def test_no_source_for_an_id_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="stable node id"):
        resolve_node_id()
