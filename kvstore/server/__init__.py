"""The daemon: configuration, authentication, the per-call pipeline shared by gRPC and
the control lane, the servicers, events, metrics, INFO, and `Daemon`, the composition
root that builds the tiers and the store and serves them."""
