"""Generated gRPC stubs for proto/kvstore/v1 (made by `make stubs`; never edit by hand)."""
