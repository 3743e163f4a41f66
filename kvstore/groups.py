"""Hit rules of KV groups: which parts of which blocks a prefix needs, and so which parts
a put stores. Written once for the SDK and the daemon, which must agree to the part.

A layout with groups (`KVLayout.groups`) stores each block as parts, one per group that
needs it. For a prefix of `n` blocks (a put of n blocks, or a hit of n blocks):

- full attention, MLA, and auxiliary groups without a window (rule EVERY): every block;
- sliding-window groups, and auxiliary groups with a window (rule WINDOW): the last
  `window_blocks` blocks, where `window_blocks = ceil((window_tokens - 1) / block_size)`:
  the next token computed attends to itself and the `window_tokens - 1` tokens before
  it, which lie in that many blocks (vLLM's sliding-window manager counts the same);
- state groups (rule END): the last block only (the state after the prefix's last token).

A put of n blocks stores exactly what a prefix of its n blocks needs: the prefix ends an
engine asks the store to keep are the ends of its puts. Why: a put is what an engine
computed for one request (its prompt, or one chunk of it), and the prefix a later request
reuses is a prefix that an earlier request had: a repeated prompt, the next turn of a
conversation (whose prompt extends the last one), or a chunk boundary. A state group has
no other choice (a state exists only where an engine stopped), and a sliding-window
group's parts outside every such window can never be read, so they are not kept: that is
what `stored_bytes` against `full_bytes` saves. The cost: a prompt that shares only part
of an earlier put (a shared system prompt followed by a different question) hits its
full-attention groups but not a window or state group at that point, so the whole hit is
shorter; an engine that wants such a point reusable puts it as a put of its own.

`Lookup` answers the longest prefix every group can serve. On the wire a grouped block
travels as its parts, group-major: every part of group 0 in block order, then group 1's,
and so on (`part_order`), each part its own unit with its own checksum.

Primitives: `Rule`, `rule_of`, `window_blocks`, `needed`, `part_order`, `part_count`,
`stored_bytes`, `full_bytes`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvstore.layout import GroupKind, KVGroup, KVLayout


class Rule(enum.Enum):
    EVERY = "every"  # every block of the prefix
    WINDOW = "window"  # the blocks inside the window before the prefix end
    END = "end"  # the block at the prefix end


def rule_of(group: KVGroup) -> Rule:
    if group.kind is GroupKind.STATE:
        return Rule.END
    if group.kind is GroupKind.SLIDING_WINDOW or (group.kind is GroupKind.AUXILIARY and group.window_tokens):
        return Rule.WINDOW
    return Rule.EVERY


def window_blocks(group: KVGroup, block_size_tokens: int) -> int:
    """How many blocks before a prefix end a window group needs (see the module docstring)."""
    return -(-(group.window_tokens - 1) // block_size_tokens)


@dataclass(frozen=True, slots=True)
class GroupNeed:
    """The blocks [start, stop) of a prefix that one group needs (positions in the prefix)."""

    group: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def needed(layout: KVLayout, n_blocks: int) -> list[GroupNeed]:
    """Per group, the blocks a prefix of `n_blocks` needs (and a put of them stores)."""
    out = []
    bst = layout.block_size_tokens
    for g, group in enumerate(layout.groups):
        rule = rule_of(group)
        if rule is Rule.EVERY:
            start = 0
        elif rule is Rule.WINDOW:
            start = max(0, n_blocks - window_blocks(group, bst))
        else:
            start = max(0, n_blocks - 1)
        out.append(GroupNeed(g, start, n_blocks))
    return out


def part_order(layout: KVLayout, n_blocks: int) -> list[tuple[int, int]]:
    """The parts of a prefix (or put) of `n_blocks` in wire order: (group, block) pairs,
    group-major, blocks in chain order."""
    return [(need.group, j) for need in needed(layout, n_blocks) for j in range(need.start, need.stop)]


def part_count(layout: KVLayout, n_blocks: int) -> int:
    return sum(len(need) for need in needed(layout, n_blocks))


def stored_bytes(layout: KVLayout, n_blocks: int) -> int:
    """Bytes a put of `n_blocks` stores under the hit rules."""
    return sum(len(need) * layout.groups[need.group].bytes_per_block for need in needed(layout, n_blocks))


def full_bytes(layout: KVLayout, n_blocks: int) -> int:
    """Bytes the same put would take with every group kept for every block."""
    return n_blocks * layout.bytes_per_block
