"""The import rules of ARCHITECTURE.md section 2, read from the source with `ast`.

Each package may import only the packages below it: the shared root (`kvstore/*.py` and
the generated stubs in `kvstore/v1`) nothing of ours; `kvstore.core` the shared root but
not the stubs, the wire codec or the lane framing; `tiers/` the shared root and the tier
contract; `kvstore.cluster` the shared root, core and the SDK; `kvstore.server` the shared
root, core, cluster and the tier registry (`kvstore.tiers` itself, not its modules, and of
it only the registry's names: what the server needs of a built tier is in the contract,
`kvstore.core.tier`); the SDK the shared root and the stubs. Nothing imports
`kvstore.cli`. Imports inside functions count too: a lazy import is still an edge. torch
and cupy are imported at module level only by `tiers/` and the SDK's tensor glue, which
the rest of the SDK loads lazily: importing `kvstore` or `kvstore.client` never loads them.

Also (docs/architecture.md, "Layout"): the SDK's private modules (`kvstore.client._*`)
are the SDK's own, imported from nowhere else; each package imports only the third-party
packages on its list (`THIRD_PARTY`), so that, say, a plotting library cannot creep into
the control plane; and the CLI imports at module level only the standard library, the
shared root and itself, everything else inside the command that needs it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Where each source folder's modules live in the import namespace (pyproject's package-dir).
SOURCES = {"kvstore": "kvstore", "tiers": "kvstore.tiers", "client": "kvstore.client"}

# package -> prefixes of kvstore modules it may import (besides itself).
# The shared root is every module directly in kvstore/, the stubs and the compiled helpers.
SHARED = tuple(sorted(f"kvstore.{p.stem}" for p in (ROOT / "kvstore").glob("*.py") if p.stem != "__init__")) + (
    "kvstore.v1", "kvstore._native", "kvstore")
CORE_MAY = tuple(m for m in SHARED if m not in ("kvstore.wire", "kvstore.control_lane_wire", "kvstore.data_lane", "kvstore.v1"))
ALLOWED: dict[str, tuple[str, ...]] = {
    "shared": SHARED,
    "core": CORE_MAY + ("kvstore.core",),
    "tiers": SHARED + ("kvstore.core.tier", "kvstore.tiers"),
    "cluster": SHARED + ("kvstore.core", "kvstore.cluster", "kvstore.client"),
    "server": SHARED + ("kvstore.core", "kvstore.cluster", "kvstore.server", "=kvstore.tiers"),
    "client": SHARED + ("kvstore.client",),
    "cli": ("",),  # anything
}

# What `kvstore.tiers` exports, and all the server may import from it: the registry (tier
# kinds, settings, builders, and the `Tier` they build) and what the daemon calls around a
# build. Never a tier's class.
TIER_REGISTRY = frozenset({
    "HBM", "HOST", "SSD", "TIER_BUILDERS", "TIER_KINDS", "Tier", "TierBuilder", "TierSettings", "build_hbm",
    "build_host", "build_ssd", "build_tiers", "default_shm_dir", "free_bytes", "make_copier",
    "remove_stale_segments",
})

# The SDK modules that are the tensor glue (loaded lazily by the rest of the SDK).
TORCH_MODULES = {"kvstore.client.tensors", "kvstore.client._device", "kvstore.client.hf", "kvstore.client.vllm",
                 "kvstore.client.sglang", "kvstore.client._sglang_pages"}

# package -> the third-party top-level packages it may import (anywhere in its modules).
BASE = ("grpc", "google", "numpy", "xxhash")
# The lossless codecs (kvstore.codecs: lz4, zstandard) are shared: the data lane's
# framing encodes with them on every side, and the SSD tier's records use them.
CODECS = ("lz4", "zstandard")
THIRD_PARTY: dict[str, tuple[str, ...]] = {
    "shared": BASE + CODECS,
    "core": ("numpy", "xxhash"),
    "tiers": ("numpy", "xxhash", "torch", "cupy") + CODECS,
    "cluster": BASE + ("aetcd",),
    "server": BASE + ("grpc_health", "grpc_reflection", "prometheus_client", "zmq", "msgpack"),
    "client": BASE + ("torch", "cupy", "transformers", "vllm", "cryptography", "sglang"),
    "cli": BASE + ("grpc_health", "rich", "matplotlib", "zmq", "msgpack"),
}


def package_of(module: str) -> str:
    for pkg in ("core", "server", "cluster", "cli", "tiers", "client"):
        if module == f"kvstore.{pkg}" or module.startswith(f"kvstore.{pkg}."):
            return pkg
    return "shared"


def modules() -> dict[str, Path]:
    out = {}
    for folder, base in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([base, *parts])
            if folder == "kvstore" and parts and parts[0] in ("tiers", "client"):
                continue
            out[name] = path
    return out


def imports(name: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found = []
    top_level = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        at_top = id(node) in top_level
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, at_top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((mod, node.lineno, at_top))
            # `from kvstore.core import replay` imports the submodule.
            found += [(f"{mod}.{a.name}", node.lineno, at_top) for a in node.names]
    return found


def allowed(pkg: str, target: str) -> bool:
    for prefix in ALLOWED[pkg]:
        if prefix == "":
            return True
        if prefix.startswith("="):
            if target == prefix[1:]:
                return True
        elif prefix == "kvstore":
            if target == "kvstore":
                return True
        elif target == prefix or target.startswith(prefix + "."):
            return True
    return False


def violations() -> set[tuple[str, str]]:
    mods = modules()
    out = set()
    for name, path in mods.items():
        pkg = package_of(name)
        for target, _line, at_top in imports(name, path):
            if target.split(".")[0] in ("torch", "cupy") and at_top and pkg != "tiers" and name not in TORCH_MODULES:
                out.add((name, target))
            if not target.startswith("kvstore"):
                continue
            if (pkg == "server" and target not in mods and target.rsplit(".", 1)[0] == "kvstore.tiers"
                    and target.rsplit(".", 1)[1] not in TIER_REGISTRY):
                out.add((name, target))  # a name from the tier package that is not the registry's
            if target not in mods and target.rsplit(".", 1)[0] in mods:
                target = target.rsplit(".", 1)[0]  # `from module import name`
            if target not in mods:
                continue
            if package_of(target) == "cli" and pkg != "cli":
                out.add((name, target))
            elif not allowed(pkg, target):
                out.add((name, target))
    return out


def test_imports_follow_the_layering() -> None:
    found = sorted(violations())
    assert not found, "imports that break ARCHITECTURE.md section 2:\n" + "\n".join(f"  {a} -> {b}" for a, b in found)


def test_private_sdk_modules_are_the_sdks_own() -> None:
    found = sorted((name, target) for name, path in modules().items() if package_of(name) != "client"
                   for target, _, _ in imports(name, path) if target.startswith("kvstore.client._"))
    assert not found, "private SDK modules imported from outside the SDK:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in found)


def test_third_party_imports_are_on_each_packages_list() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found = sorted({(name, target.split(".")[0]) for name, path in modules().items()
                    for target, _, _ in imports(name, path)
                    if target and target.split(".")[0] not in stdlib | {"kvstore"}
                    and target.split(".")[0] not in THIRD_PARTY[package_of(name)]})
    assert not found, "third-party imports not on their package's list (THIRD_PARTY):\n" + "\n".join(
        f"  {a} -> {b}" for a, b in found)


def test_the_cli_imports_lazily() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found = []
    for name, path in modules().items():
        if package_of(name) != "cli":
            continue
        for target, line, at_top in imports(name, path):
            root = target.split(".")[0]
            if not at_top or root in stdlib or package_of(target) in ("shared", "cli") and root == "kvstore":
                continue
            found.append(f"  {name}:{line} -> {target}")
    assert not found, "the CLI imports these at module level (import them in the command that needs them):\n" + \
        "\n".join(found)


def test_the_tier_package_exports_its_registry_only() -> None:
    tree = ast.parse((ROOT / "tiers" / "__init__.py").read_text())
    exported = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets))
    assert set(exported) == TIER_REGISTRY


def test_the_sdk_imports_without_torch_or_the_daemon() -> None:
    code = ("import sys, kvstore.client, kvstore.client.admin; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'cupy') "
            "or m.split('.')[:2] in (['kvstore', 'core'], ['kvstore', 'server'], ['kvstore', 'tiers'], ['kvstore', 'cli'])]; "
            "print(' '.join(sorted(bad)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""
