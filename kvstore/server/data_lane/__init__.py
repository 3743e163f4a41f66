"""The daemon's side of the data lane (bulk block bytes on sockets of their own; glossary in
docs/local-data-plane.md): the listener and its connections (`server`), the transfers a
LaneFetch or LanePut opens (`transfers`, `transfer`), and the two kinds of transfer
(`fetch`, `put`). Framing and socket primitives are in the shared `kvstore.data_lane`."""
