"""Runtime configuration: the daemon's current `Config` and the fields that may change live.

Primitives: `RuntimeConfig.get`, `.set` (the `SetConfig` RPC), `.reload` (SIGHUP).
Only fields marked `runtime=True` in the config table change while the daemon runs;
values are converted and bounds-checked by the same code as every other source, so
`kvstore config set` accepts exactly what the TOML file would. A reload applies the
runtime fields that changed and names the others, which need a restart.

A field changes live only if something applies it: each runtime field has an applier
(`register`) that pushes the new value into the object that uses it. A field marked
runtime without an applier is treated as restart-only rather than silently ignored.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvstore.core.policies.hints import HintedPolicy
from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError
from kvstore.logs import set_level
from kvstore.server.config import FIELD_BY_NAME, FIELDS, Config, Field, format_bounds, format_value, parse_field

if TYPE_CHECKING:
    from kvstore.core.store import Store
    from kvstore.server.events import EventBus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConfigValue:
    field: Field
    value: Any

    @property
    def text(self) -> str:
        return format_value(self.value)

    @property
    def bounds(self) -> str:
        return format_bounds(self.field)


@dataclass(frozen=True, slots=True)
class ReloadResult:
    applied: tuple[str, ...]
    needs_restart: tuple[str, ...]


class RuntimeConfig:
    def __init__(self, config: Config, store: Store, bus: EventBus | None = None) -> None:
        self.current = config
        self._store = store
        self._bus = bus
        self._appliers: dict[str, Callable[[Any], None]] = {}
        for name in ("max_blocks_per_call", "max_lease_ms", "default_pin_ms"):
            self.register(name, functools.partial(self._set_limit, name))
        self.register("log_level", set_level)
        self.register("hint_budget", self._set_hint_budget)
        if bus is not None:
            self.register("events_queue", lambda value: setattr(bus, "queue_size", value))

    def register(self, name: str, apply: Callable[[Any], None]) -> None:
        """Make runtime field `name` changeable live; `apply` receives each new value."""
        if name not in FIELD_BY_NAME or not FIELD_BY_NAME[name].runtime:
            raise ValueError(f"{name} is not a runtime-modifiable config field")
        self._appliers[name] = apply

    def is_live(self, field: Field) -> bool:
        return field.runtime and field.name in self._appliers

    def _set_limit(self, name: str, value: int) -> None:
        self._store.limits = replace(self._store.limits, **{name: value})

    def _set_hint_budget(self, value: float) -> None:
        # Hint-aware policies read their budget on every decision; others have none.
        for st in self._store.tiers:
            if isinstance(st.policy, HintedPolicy):
                st.policy.budget_fraction = value

    def as_dict(self) -> dict[str, Any]:
        return self.current.as_dict()

    def get(self, name: str = "") -> list[ConfigValue]:
        if name:
            field = FIELD_BY_NAME.get(name)
            if field is None:
                raise InvalidArgument(f"unknown setting {name!r}; known: {', '.join(sorted(FIELD_BY_NAME))}")
            return [ConfigValue(field, getattr(self.current, name))]
        return [ConfigValue(f, getattr(self.current, f.name)) for f in FIELDS]

    def set(self, name: str, raw: str) -> ConfigValue:
        """Change one runtime-modifiable field; returns the previous value."""
        field = FIELD_BY_NAME.get(name)
        if field is None:
            raise InvalidArgument(f"unknown setting {name!r}; known: {', '.join(sorted(FIELD_BY_NAME))}")
        if not self.is_live(field):
            runtime = ", ".join(f.name for f in FIELDS if self.is_live(f))
            raise FailedPrecondition(
                f"{name} cannot change while the daemon runs; set it in the config file and restart. "
                f"Settings that can change live: {runtime}"
            )
        try:
            value = parse_field(name, raw, "SetConfig")
        except KVStoreError as exc:
            raise InvalidArgument(str(exc)) from None
        previous = ConfigValue(field, getattr(self.current, name))
        self._apply(replace(self.current, **{name: value}))
        logger.info("config %s changed at runtime: %s -> %s", name, previous.text, format_value(value))
        return previous

    def reload(self, load: Callable[[], Config]) -> ReloadResult:
        """Re-read every source (file, env, flags); apply the runtime fields that changed."""
        new = load()
        applied, restart = [], []
        changes: dict[str, Any] = {}
        for f in FIELDS:
            old_value, new_value = getattr(self.current, f.name), getattr(new, f.name)
            if old_value == new_value:
                continue
            if self.is_live(f):
                changes[f.name] = new_value
                applied.append(f.name)
            else:
                restart.append(f.name)
        if changes:
            self._apply(replace(self.current, **changes))
        if restart:
            logger.warning("reload: %s changed in the config; restart the daemon to apply", ", ".join(restart))
        logger.info("reload: applied %s", ", ".join(applied) if applied else "nothing (no runtime setting changed)")
        return ReloadResult(tuple(applied), tuple(restart))

    def _apply(self, config: Config) -> None:
        for name, apply in self._appliers.items():
            value = getattr(config, name)
            if value != getattr(self.current, name):
                apply(value)
        self.current = config
