"""The deploy/ files and docs/operations.md stay in step with the code: their configs
validate, the dashboard and alert rules query metrics the daemon exports, and the
documented config table names every setting."""

from __future__ import annotations

import asyncio
import json
import re
import textwrap
import urllib.request
from pathlib import Path

from kvstore.client import AsyncClient
from kvstore.server.config import FIELDS, load_config

ROOT = Path(__file__).resolve().parents[2]
# Exported only once the store counts migrations (the tiered store); absent before.
OPTIONAL_METRICS = {"kvstore_migrations_total"}


def _sidecar_toml() -> str:
    text = (ROOT / "deploy/kubernetes/sidecar.yaml").read_text()
    block = text.split("kvstore.toml: |\n", 1)[1].split("\n---", 1)[0]
    return textwrap.dedent(block)


def test_deploy_configs_validate(tmp_path):
    sidecar = tmp_path / "sidecar.toml"
    sidecar.write_text(_sidecar_toml())
    cfg = load_config({"config": str(sidecar)}, env={})
    assert cfg.metrics_listen == "0.0.0.0:9464" and cfg.metrics_remote and cfg.log_format == "json"
    assert cfg.ssd_path == "/var/lib/kvstore"
    node = load_config({"config": str(ROOT / "deploy/systemd/kvstore.toml")}, env={})
    assert node.metrics_listen.startswith("127.0.0.1:")


def test_operations_doc_lists_every_setting():
    doc = (ROOT / "docs/operations.md").read_text()
    rows = re.findall(r"^\| (`\w+`(?: / `\w+`)*) \|", doc, re.MULTILINE)
    table = {name for row in rows for name in re.findall(r"`(\w+)`", row)}
    assert {f.name for f in FIELDS} <= table


async def test_dashboard_and_alerts_query_exported_metrics(daemon):
    dashboard = json.loads((ROOT / "deploy/grafana/kvstore-dashboard.json").read_text())
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"\bkvstore_\w+", target["expr"]))
    # The rule file is YAML; its expressions are the only kvstore_* words in it.
    used |= set(re.findall(r"\bkvstore_\w+", (ROOT / "deploy/prometheus/kvstore-alerts.yaml").read_text()))
    # A single daemon exports no kvstore_cluster_*: tests/cluster checks those against a pool's daemon.
    used = {m for m in used if not m.startswith("kvstore_cluster_")}
    async with AsyncClient(daemon.unix_target) as kv:
        await kv.stats()  # labelled series (RPC latency) appear once observed
    body = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{daemon.daemon.metrics_address}/metrics", timeout=10).read().decode()
    )
    exported = set(re.findall(r"^(kvstore_\w+?)(?:\{| )", body, re.MULTILINE))
    assert used - OPTIONAL_METRICS <= exported, used - OPTIONAL_METRICS - exported
