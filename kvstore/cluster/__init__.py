"""The layer above one node: daemons on many nodes form one pool (ARCHITECTURE.md section 8).

`membership` keeps the live member set (on etcd v3, or a static peer list), `node_id`
gives a node its stable name, and `placement` maps placement units of a chain to their
owners by rendezvous hashing over that set. This package may import the shared root,
`kvstore.core` and the SDK (to call peers), never the server or the CLI. A single-node
daemon imports none of it, and nothing here imports the etcd client until a cluster
backed by etcd starts.
"""
