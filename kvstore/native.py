"""The compiled helpers (kvstore/_native/*.c), or None where they were not built.

The module is optional: where no C compiler was available at install, kvstore runs the
same steps in numpy and Python. Its sources sit in the folder `kvstore/_native/`, which
Python imports as an empty namespace package where the built module is absent: that is
taken as not built too. `XXH3` says whether the helpers that hash (chain hashing,
copy-and-hash) are usable: they call XXH3 in the library the `xxhash` package loads,
bound here once and checked against XXH3's published values before it is used.
"""

from __future__ import annotations

try:
    from kvstore import _native as native
except ImportError:  # pragma: no cover - where no C compiler was available at install
    native = None  # type: ignore[assignment]
else:
    if getattr(native, "__file__", None) is None:  # the sources' folder, not the built module
        native = None  # type: ignore[assignment]


def _bind_xxhash() -> bool:
    if native is None:
        return False
    try:
        from xxhash import _xxhash  # type: ignore[attr-defined]  # the package's extension
    except ImportError:  # pragma: no cover - an xxhash release laid out otherwise
        return False
    path = getattr(_xxhash, "__file__", None)
    return isinstance(path, str) and native.bind_xxhash(path)


XXH3 = _bind_xxhash()

__all__ = ["XXH3", "native"]
