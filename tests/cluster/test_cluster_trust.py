"""Trust between the daemons of a pool (SECURITY.md, *Between the daemons of a pool*):
operator commands that act on the pool ask first, whatever runs them.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from conftest import SMALL_LAYOUT

from tests.cluster.pool_fixtures import pool, unix_target
from tests.procs import clean_env

LAYOUT = SMALL_LAYOUT


async def cli(*args: str, stdin: bytes = b"") -> tuple[int, str, str]:
    """`kvstore ARGS` in a process of its own, its standard input a pipe holding `stdin`
    (not a terminal: what a script gives it)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvstore.cli", *args, env=clean_env(),
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_a_scripted_drain_asks_like_flush_and_drains_nothing_without_a_yes(tmp_path: Path) -> None:
    async with pool(tmp_path, 2) as (a, b):
        target = unix_target(b)
        for answer in (b"", b"n\n"):
            code, _, err = await cli("cluster", "drain", "--target", target, stdin=answer)
            assert code == 1 and "nothing drained" in err, (answer, code, err)
            assert not b.cluster.left and not b.cluster.draining
            assert set(a.cluster.membership.view.members) == {"n0", "n1"}
        code, out, _ = await cli("cluster", "drain", "--target", target, stdin=b"y\n")
        assert code == 0 and "left the pool" in out
        assert b.cluster.left
