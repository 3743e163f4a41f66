"""A raw grpc-python echo server: the ceiling for kvstore's gRPC bytes path.

Same transport, same streaming shape (client-stream of chunks in, server-stream of
chunks out), but no protobuf, no index, no checksums: bytes in, bytes out. Started by
the benchmark as a subprocess; prints its port, serves until killed.
"""

from __future__ import annotations

import asyncio
import sys

import grpc

_ident = lambda b: b  # noqa: E731 - raw bytes on the wire


async def _put(request_iterator, context):  # type: ignore[no-untyped-def]
    n = 0
    async for chunk in request_iterator:
        n += len(chunk)
    return n.to_bytes(8, "little")


async def _fetch(request, context):  # type: ignore[no-untyped-def]
    count, chunk_bytes = int.from_bytes(request[:8], "little"), int.from_bytes(request[8:16], "little")
    payload = b"\x5a" * chunk_bytes
    for _ in range(count):
        yield payload


async def main() -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20), ("grpc.so_reuseport", 0)])
    handlers = {
        "Put": grpc.stream_unary_rpc_method_handler(_put, request_deserializer=_ident, response_serializer=_ident),
        "Fetch": grpc.unary_stream_rpc_method_handler(_fetch, request_deserializer=_ident, response_serializer=_ident),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
