"""The pages of an SGLang host pool as byte buffers, for the HiCache backend
(`kvstore.client.sglang`). Nothing here imports SGLang: a pool is used through the
methods every SGLang host pool has (`get_page_buffer_meta`, `get_hybrid_pool_buffer` or
`kv_buffer`, `page_size`, `get_data_page`, `set_from_flat_data_page`).

A page of a pool is the bytes one SGLang page key names in that pool. Most pools keep a
page as a few separate pieces (`get_page_buffer_meta`: K and V of every layer for an MHA
pool in page_first layout, one piece per layer and K/V in layer_first, one row for MLA):
those are reached in place, as numpy views of the pool's own tensors (`PoolPages.pieces`),
so a byte moves between the pool and the daemon with the fewest copies the plane allows.
A pointer that lies in none of the pool's tensors is never dereferenced: such a pool
(and a pool without `get_page_buffer_meta`) is read and written through the pool's own
flat-page copy (`get_data_page` / `set_from_flat_data_page`) instead, one copy more.

Primitives: `PoolPages` (`pieces`, `gather`, `scatter`, `describe`), `page_starts`.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

# Attributes that describe a pool's geometry, read where a pool has them: any difference
# in one of them can change the bytes a page holds, so all go into the namespace.
_GEOMETRY_ATTRS = (
    "layout", "page_size", "layer_num", "start_layer", "end_layer", "head_num", "head_dim", "v_head_dim",
    "kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim", "item_bytes", "slot_page_size", "state_page_bytes",
    "head_group_num", "dsa_kv_cache_store_fp8",
)


def page_starts(host_indices: Any, n_pages: int, page_tokens: int) -> list[int] | None:
    """The first host index of each of `n_pages` pages, or None when `host_indices` does not
    hold exactly `n_pages * page_tokens` slots."""
    if host_indices is None:
        return None
    idx = host_indices.tolist() if hasattr(host_indices, "tolist") else list(host_indices)
    if len(idx) != n_pages * page_tokens:
        return None
    return [int(i) for i in idx[::page_tokens]]


class _Regions:
    """The pool's tensors as uint8 numpy views, found by address."""

    def __init__(self, tensors: Sequence[Any]) -> None:
        spans = []
        for t in tensors:
            if t is None or getattr(t, "device", None) is None or t.device.type != "cpu" or not t.is_contiguous():
                continue
            flat = t.reshape(-1).view(torch.uint8).numpy()
            spans.append((int(t.data_ptr()), flat))
        spans.sort(key=lambda s: s[0])
        self._starts = [s for s, _ in spans]
        self._arrays = [a for _, a in spans]

    def view(self, ptr: int, size: int) -> memoryview | None:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        start, arr = self._starts[i], self._arrays[i]
        off = ptr - start
        if off + size > arr.size:
            return None
        return memoryview(arr[off : off + size])


def _pool_tensors(pool: Any) -> list[Any]:
    get = getattr(pool, "get_hybrid_pool_buffer", None)
    tensors = list(get()) if callable(get) else []
    kv = getattr(pool, "kv_buffer", None)
    tensors += list(kv) if isinstance(kv, (list, tuple)) else [kv]
    return [t for t in tensors if t is not None and hasattr(t, "data_ptr")]


class PoolPages:
    """One registered SGLang host pool: how big its page is and where its bytes are.

    `logical` pools (DeepSeek-V4's KV anchor) hold no bytes. `direct` pools are reached in
    place through their page pieces; the others through their flat-page copy. `unit_bytes`
    is what one kvstore block of this pool holds in a plain namespace: a piece where every
    piece of a page has the same size and the pool is direct, else the whole page."""

    def __init__(self, name: str, pool: Any) -> None:
        self.name = name
        self.pool = pool
        self.page_tokens = int(getattr(pool, "page_size", 1) or 1)
        self.dtype = str(getattr(pool, "dtype", "uint8")).removeprefix("torch.")
        self._regions = _Regions(_pool_tensors(pool))
        self.piece_sizes: tuple[int, ...] = ()
        self.direct = False
        try:
            # Page 0's pieces: the pool computes addresses only, it reads nothing.
            meta = pool.get_page_buffer_meta(torch.arange(self.page_tokens, dtype=torch.int64))
        except Exception:  # a pool without the zero-copy description: its flat copy serves it
            meta = None
        # A pool that describes no pieces and has no buffer holds no bytes (V4's KV anchor).
        self.logical = meta is None and getattr(pool, "kv_buffer", None) is None
        if meta is not None:
            ptrs, sizes = meta
            self.piece_sizes = tuple(int(s) for s in sizes)
            self.direct = bool(ptrs) and all(self._regions.view(int(p), int(s)) is not None
                                             for p, s in zip(ptrs, sizes))
        if self.logical:
            self.page_bytes = 0
        elif self.direct:
            self.page_bytes = sum(self.piece_sizes)
        else:
            self.page_bytes = int(pool.get_dummy_flat_data_page().numel() * _itemsize(pool))
        self.uniform = self.direct and len(set(self.piece_sizes)) == 1
        self.units_per_page = len(self.piece_sizes) if self.uniform else 1
        self.unit_bytes = self.piece_sizes[0] if self.uniform else self.page_bytes
        # The byte order of a page as kvstore stores it: the pieces one after another, or
        # the pool's own flat page.
        self.form = "pieces" if self.direct else "flat"

    def as_flat(self) -> PoolPages:
        """This pool seen through SGLang's flat pages (`get_data_page(flat=True)`), the
        form of the deprecated page calls: one block per page, in the pool's own order."""
        flat = copy.copy(self)
        flat.direct = flat.uniform = False
        flat.form, flat.units_per_page = "flat-page", 1
        flat.page_bytes = flat.unit_bytes = int(self.pool.get_dummy_flat_data_page().numel() * _itemsize(self.pool))
        return flat

    def describe(self) -> str:
        """Everything about this pool that decides a page's bytes, as one string."""
        pool = self.pool
        parts = [type(pool).__name__, self.name, self.dtype, self.form]
        for attr in _GEOMETRY_ATTRS:
            value = getattr(pool, attr, None)
            if isinstance(value, (int, str, bool)) and not isinstance(value, type):
                parts.append(f"{attr}={value}")
        if self.piece_sizes:
            parts.append("pieces=" + ",".join(map(str, self.piece_sizes)))
        parts.append(f"page_bytes={self.page_bytes}")
        return "/".join(parts)

    # ----------------------------------------------------------------- bytes

    def pieces(self, host_indices: Any, n_pages: int) -> list[list[memoryview]] | None:
        """Per page, views of its pieces in the pool (in order), or None when the pool is
        not direct or the indices do not name `n_pages` pages of this pool."""
        if not self.direct:
            return None
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        per = len(self.piece_sizes)
        if len(ptrs) != n_pages * per or len(sizes) != len(ptrs):
            return None
        out: list[list[memoryview]] = []
        for p in range(n_pages):
            page = []
            for j in range(per):
                size = int(sizes[p * per + j])
                if size != self.piece_sizes[j]:
                    return None
                view = self._regions.view(int(ptrs[p * per + j]), size)
                if view is None:
                    return None
                page.append(view)
            out.append(page)
        return out

    def gather(self, host_indices: Any, n_pages: int, page_tokens: int) -> list[memoryview] | None:
        """Each page's bytes as one contiguous buffer (a copy: for group parts and flat pools)."""
        pieces = self.pieces(host_indices, n_pages)
        if pieces is not None:
            return [np.concatenate([np.frombuffer(v, np.uint8) for v in page]).data if len(page) > 1
                    else page[0] for page in pieces]
        starts = page_starts(host_indices, n_pages, page_tokens)
        if starts is None or self.logical:
            return None
        out = []
        for s in starts:
            page = self.pool.get_data_page(s, flat=True).contiguous()
            out.append(memoryview(page.view(-1).view(torch.uint8).numpy()))
        return out

    def scatter(self, host_indices: Any, pages: Sequence[Any], page_tokens: int) -> bool:
        """Write whole pages (bytes-like, `page_bytes` each) into the pool at the pages the
        indices name; False when the indices or sizes do not fit (nothing written then)."""
        n = len(pages)
        if any(len(memoryview(p)) != self.page_bytes for p in pages):
            return False
        pieces = self.pieces(host_indices, n)
        if pieces is not None:
            for page, data in zip(pieces, pages):
                src = memoryview(data).cast("B")
                off = 0
                for view in page:
                    view[:] = src[off : off + len(view)]
                    off += len(view)
            return True
        starts = page_starts(host_indices, n, page_tokens)
        if starts is None or self.logical:
            return False
        for s, data in zip(starts, pages):
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            dtype = getattr(self.pool, "dtype", torch.uint8)
            self.pool.set_from_flat_data_page(s, flat.view(dtype) if dtype != torch.uint8 else flat)
        return True


def _itemsize(pool: Any) -> int:
    dtype = getattr(pool, "dtype", None)
    return int(getattr(dtype, "itemsize", 1) or 1)
