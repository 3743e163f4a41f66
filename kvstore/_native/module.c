/* kvstore._native: the few loops of kvstore's hot paths that pay for compiled code, one
   extension built from the files of this folder, each owned by the module that calls it:

   - table.c: the block table's chain probe, placement into and deletion from its key
     table, and a lookup's top tiers (kvstore.core.table, kvstore.core.store);
   - rows.c: a policy's row-list appends and compaction steps (kvstore.core.policies.rows);
   - pack.c: token ids and block hashes packed into bytes (kvstore.hashing, the SDK);
   - xxh.c: XXH3, bound from the xxhash package, and the loops that call it: chain
     hashes (kvstore.hashing), copy-and-hash (the SDK's shared-memory plane, the servicer),
     rendezvous scores and owners (kvstore.cluster.placement);
   - units.c: a lookup round's steps over a chain's placement units (kvstore.cluster.remote_lookup).

   Each has a Python twin that stays as the reference and as the fallback where this
   module was not built (kvstore.native says which). Arrays come in through the buffer
   protocol (numpy arrays, memoryviews), so the module needs neither numpy's headers nor
   a particular numpy at build time. */

#include "native.h"

static PyMethodDef methods[] = {
    {"prefix_rows", prefix_rows, METH_VARARGS,
     "prefix_rows(packed, key_columns, ns, out, every=False, indexed=0) -> count\n\n"
     "Write the rows of the longest indexed prefix of a packed chain into `out`; return its length.\n"
     "With `every`, write the row of every key (-1 where absent) and return N. With `indexed`, look\n"
     "for each key in the row after the previous key's first (rows with that flag only)."},
    {"top_tiers", top_tiers, METH_VARARGS,
     "top_tiers(rows, lt, out) -> count\n\n"
     "Write each row's top tier id (the lower nonzero of its two location tiers) into `out`;\n"
     "return how many of the rows hold a second copy."},
    {"rows_append", rows_append, METH_VARARGS,
     "rows_append(log, lst, pos, which, tail, rows, tracked_only, moved) -> tail\n\n"
     "Append rows in order as the newest of list `which` (RowLists.append, one pass)."},
    {"rows_compact", rows_compact, METH_VARARGS,
     "rows_compact(log, lst, pos, which, w, r, stop, into) -> w\n\n"
     "Move the valid entries of log[r:stop] down to log[w:] (RowLists._compact_step, one pass)."},
    {"place_rows", place_rows, METH_VARARGS,
     "place_rows(rows, key_columns) -> count\n\n"
     "Insert rows (absent, distinct keys) into the key slots at the first empty slot from each home."},
    {"unindex_rows", unindex_rows, METH_VARARGS,
     "unindex_rows(rows, key_columns) -> count\n\n"
     "Take indexed rows out of the key slots by backward-shift deletion."},
    {"join_hashes", join_hashes, METH_O,
     "join_hashes(hashes) -> bytes | None\n\n"
     "The items packed (N x 16 bytes) if each is a 16-byte bytes object, else None."},
    {"pack_u32", pack_u32, METH_O,
     "pack_u32(items) -> bytes | None\n\n"
     "A list or tuple of ints in [0, 2**32) as little-endian u32, else None."},
    {"bind_xxhash", bind_xxhash, METH_O,
     "bind_xxhash(path) -> bool\n\n"
     "Bind XXH3 from the already loaded library at `path`; True when bound and checked."},
    {"chain_hashes", chain_hashes, METH_VARARGS,
     "chain_hashes(namespace, packed, block_size_tokens) -> bytes\n\n"
     "The chained XXH3-128 block hashes (N x 16 bytes) of packed u32 token ids."},
    {"copy_hash", copy_hash, METH_VARARGS,
     "copy_hash(dst, src, of_source=False) -> int\n\n"
     "Copy src into dst and return the XXH3-64 of the copy (read from src with of_source), without the GIL."},
    {"frame_copy", frame_copy, METH_VARARGS,
     "frame_copy(prefixes, src, chunk) -> (messages, checksum)\n\n"
     "Each prefix followed by a copy of its chunk of src, and the XXH3-64 of the copied payload."},
    {"rendezvous_scores", rendezvous_scores, METH_VARARGS,
     "rendezvous_scores(prefix, keys, key_bytes, out) -> int\n\n"
     "XXH3-64 of prefix || key for each key_bytes-byte key of keys, into out (one uint64 each)."},
    {"rendezvous_best", rendezvous_best, METH_VARARGS,
     "rendezvous_best(prefixes, keys, key_bytes, positions, out) -> int\n\n"
     "Each unit's owner: the index of the prefix with the highest XXH3-64 of prefix || key (the earlier\n"
     "on a tie), the keys at `positions` (int64; None: every key), into out (one int64 each)."},
    {"gather_ranges", gather_ranges, METH_VARARGS,
     "gather_ranges(packed, item_bytes, starts, stops, idx) -> bytes\n\n"
     "The items [starts[j], stops[j]) of packed for each j of idx (None: every j), laid end to end."},
    {"spread_prefix", spread_prefix, METH_VARARGS,
     "spread_prefix(count, sizes, idx, out) -> int\n\n"
     "The first `count` blocks of units idx laid end to end, per unit, into out (0 elsewhere)."},
    {"units_reach", units_reach, METH_VARARGS,
     "units_reach(locs, found, sizes, best) -> (short, copied)\n\n"
     "best = max(locs, found); the first unit short of its size; whether one up to it was found elsewhere."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore._native", "Compiled loops of the lookup path.", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModule_Create(&module);
}
