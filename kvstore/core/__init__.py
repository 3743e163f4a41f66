"""The control plane: metadata only, on one event loop.

The tier contract (`tier`), the block table and index, leases, tenancy, policies and
the store's collaborators live here. Nothing in this package imports the gRPC stubs,
the server, the SDK or a concrete tier: tiers arrive as objects implementing
`kvstore.core.tier.Tier`.
"""
