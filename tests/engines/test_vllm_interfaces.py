"""The adapters against the interfaces of the vLLM installed here: every abstract method
of vLLM's connector and secondary-tier bases is implemented (a new vLLM that adds one
fails this test before it fails an engine), and the connector declares itself a cache.

docs/engines.md lists the vLLM releases whose interfaces were read (0.32 to 0.34) and
what changed between them."""

from __future__ import annotations

import inspect
import warnings

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


def abstract_methods(cls: type) -> set[str]:
    return {name for name, member in inspect.getmembers(cls) if getattr(member, "__isabstractmethod__", False)}


def implemented(cls: type, base: type) -> set[str]:
    """Methods `cls` defines below `base` in its MRO."""
    mro = cls.__mro__[: cls.__mro__.index(base)]
    return {name for klass in mro for name in vars(klass)}


def imported() -> tuple[type, type, type, type]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
        from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

        from kvstore.client.vllm import KVStoreConnector
        from kvstore.client.vllm_tier import KVStoreTier
    return KVConnectorBase_V1, KVStoreConnector, SecondaryTierManager, KVStoreTier


def test_the_connector_implements_every_abstract_method():
    base, connector, _, _ = imported()
    missing = abstract_methods(base) - implemented(connector, base)
    assert not missing, f"vLLM's KVConnectorBase_V1 has abstract methods the connector lacks: {sorted(missing)}"
    assert not inspect.isabstract(connector)


def test_the_tier_implements_every_abstract_method():
    _, _, base, tier = imported()
    missing = abstract_methods(base) - implemented(tier, base)
    assert not missing, f"vLLM's SecondaryTierManager has abstract methods the tier lacks: {sorted(missing)}"
    assert not inspect.isabstract(tier)


def test_the_connector_is_a_cache_whose_dropped_saves_are_later_misses():
    _, connector, _, _ = imported()
    assert connector.requires_kv_delivery.fget(None) is False  # type: ignore[attr-defined]
