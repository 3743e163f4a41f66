"""A raw grpc-python echo server: the ceiling for kvstore's gRPC bytes path.

Same transport and streaming shape as kvstore's Put and Fetch (a client stream of one
small header message and then one message per chunk in; a server stream of a header and
the chunks out), but no protobuf, no index, no copies into or out of a store and no
checksums: bytes in, bytes out. Put keeps the chunks it received (the messages
themselves, as gRPC handed them over); Fetch sends back the chunks of the last put, so a
client gets back exactly the payloads it sent. Started by the benchmark as a subprocess
(`echo_server.py [HOST]`, default 127.0.0.1); prints its port, serves until killed.
"""

from __future__ import annotations

import asyncio
import sys

import grpc

_ident = lambda b: b  # noqa: E731 - raw bytes on the wire

_stored: list[bytes] = []


async def _put(request_iterator, context):  # type: ignore[no-untyped-def]
    stream = request_iterator.__aiter__()
    await anext(stream)  # the header message
    chunks = [chunk async for chunk in stream]
    _stored[:] = chunks
    return sum(map(len, chunks)).to_bytes(8, "little")


async def _fetch(request, context):  # type: ignore[no-untyped-def]
    yield len(_stored).to_bytes(8, "little")  # the header message
    for chunk in list(_stored):
        yield chunk


async def main() -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20), ("grpc.so_reuseport", 0)])
    handlers = {
        "Put": grpc.stream_unary_rpc_method_handler(_put, request_deserializer=_ident, response_serializer=_ident),
        "Fetch": grpc.unary_stream_rpc_method_handler(_fetch, request_deserializer=_ident, response_serializer=_ident),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    host = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"  # bench/net.py serves another namespace
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
