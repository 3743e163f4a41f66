"""A prefix computed on one node is a hit on another: put a chain through the first
daemon, then look it up and fetch it through the second (what `make run-cluster` suggests).

    python scripts/cluster-demo.py unix:/path/n0.sock unix:/path/n2.sock
"""

from __future__ import annotations

import os
import sys
import time

from kvstore.client import Client
from kvstore.layout import KVLayout

LAYOUT = KVLayout(model="demo/tiny", dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64,
                  block_size_tokens=16)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    first, second = argv
    tokens = [int.from_bytes(os.urandom(2), "little") for _ in range(64 * LAYOUT.block_size_tokens)]
    blocks = [os.urandom(LAYOUT.bytes_per_block) for _ in range(64)]
    with Client(first) as kv:
        put = kv.put(LAYOUT, tokens, blocks, wait_for_owners=True)
    print(f"put 64 blocks through {first}: {put.forwarded_blocks} forwarded to their owners, "
          f"{put.owner_committed_blocks} committed there")
    with Client(second) as kv:
        began = time.perf_counter()
        hit = kv.lookup(LAYOUT, tokens)
        took_ms = (time.perf_counter() - began) * 1e3
        got = kv.fetch(LAYOUT, tokens)
    exact = [bytes(g) for g in got] == blocks[: len(got)]
    print(f"lookup through {second}: {hit.num_blocks} of 64 blocks hit, {hit.remote_blocks} of them on other "
          f"nodes ({took_ms:.1f} ms); fetched {len(got)}, {'byte-exact' if exact else 'WRONG BYTES'}")
    return 0 if exact and hit.num_blocks == 64 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
