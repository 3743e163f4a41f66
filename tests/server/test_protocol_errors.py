"""Requests that do not parse, and enum values the daemon does not know, against the real
daemon: every method on every plane answers INVALID_ARGUMENT with a message, the daemon
logs no traceback for them, and auth is decided before the bytes are read.

The calls are made with hand-made bytes through grpc's generic call objects (no stubs),
so nothing on the client side can refuse them first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from conftest import make_config
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from kvstore.client import AsyncClient
from kvstore.control_lane_wire import HEADER, HELLO_ANSWER, MAGIC, METHOD_IDS, frame, lane_path
from kvstore.convert import layout_to_proto
from kvstore.server.auth import new_token
from kvstore.server.daemon import Daemon
from kvstore.v1 import admin_pb2, kvstore_pb2

pytestmark = pytest.mark.asyncio

# A tag whose varint never ends, and a length-delimited field 1 that claims more bytes
# than follow: neither parses as any message.
MALFORMED = (b"\xff\xff\xff", b"\x0a\x05ab")


def methods() -> Iterator[tuple[str, bool, bool]]:
    """(path, client streaming, server streaming) of every method the daemon serves."""
    for file, name in ((kvstore_pb2, "KVStore"), (admin_pb2, "Admin"), (health_pb2, "Health"),
                       (reflection_pb2, "ServerReflection")):
        service = file.DESCRIPTOR.services_by_name[name]
        for method in service.methods:
            yield f"/{service.full_name}/{method.name}", method.client_streaming, method.server_streaming


METHODS = list(methods())


async def call_raw(channel: grpc.aio.Channel, path: str, client_streaming: bool, server_streaming: bool,
                   messages: list[bytes], metadata: tuple[tuple[str, str], ...] = ()) -> grpc.aio.AioRpcError:
    """Send `messages` (raw bytes) to `path`; the error the daemon answered with."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if client_streaming and server_streaming:
            call = channel.stream_stream(path)(iter(messages), metadata=metadata, timeout=10)
            async for _ in call:
                pass
        elif client_streaming:
            await channel.stream_unary(path)(iter(messages), metadata=metadata, timeout=10)
        elif server_streaming:
            async for _ in channel.unary_stream(path)(messages[0], metadata=metadata, timeout=10):
                pass
        else:
            await channel.unary_unary(path)(messages[0], metadata=metadata, timeout=10)
    return info.value


def assert_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info or r.exc_text]
    assert not loud, [f"{r.name} {r.levelname} {r.getMessage()}" for r in loud]


@pytest.mark.parametrize("payload", MALFORMED, ids=["endless-varint", "short-field"])
async def test_every_grpc_method_answers_a_request_that_does_not_parse_invalid_argument(daemon, payload, caplog):
    caplog.set_level(logging.DEBUG)
    async with grpc.aio.insecure_channel(daemon.tcp_target) as channel:
        for path, client_streaming, server_streaming in METHODS:
            err = await call_raw(channel, path, client_streaming, server_streaming, [payload])
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, err.code(), err.details())
            assert "does not parse" in err.details(), (path, err.details())
            assert "DecodeError" not in err.details() and "Traceback" not in err.details()
    assert_no_traceback(caplog)


async def test_a_put_chunk_that_does_not_parse_is_invalid_argument_and_stores_nothing(daemon, layout, caplog):
    """The header parses, a later message does not: the put is refused and rolled back."""
    caplog.set_level(logging.DEBUG)
    tokens = list(range(layout.block_size_tokens))
    header = kvstore_pb2.PutRequest(header=kvstore_pb2.PutHeader(
        namespace=kvstore_pb2.Namespace(layout=layout_to_proto(layout)),
        keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens))))
    async with grpc.aio.insecure_channel(daemon.tcp_target) as channel:
        err = await call_raw(channel, "/kvstore.v1.KVStore/Put", True, False,
                             [header.SerializeToString(), b"\x12\x05\x08"])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "Put" in err.details() and "does not parse" in err.details()
    async with AsyncClient(daemon.tcp_target) as kv:
        assert (await kv.lookup(layout, tokens)).num_blocks == 0
    assert_no_traceback(caplog)


async def test_the_lane_answers_every_method_that_does_not_parse_invalid_argument(daemon, caplog):
    caplog.set_level(logging.DEBUG)
    path = lane_path(daemon.unix_target[len("unix:"):])

    def exchange() -> list[tuple[str, int, bytes]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(path)
            sock.sendall(frame(0, MAGIC))
            assert HELLO_ANSWER.unpack(read_frame(sock)[1])[0] == MAGIC
            answers = []
            for name, mid in METHOD_IDS.items():
                sock.sendall(frame(mid, MALFORMED[0]))
                answers.append((name, *read_frame(sock)))
            return answers

    for name, code, message in await asyncio.to_thread(exchange):
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0], (name, code, message)
        assert b"does not parse" in message
    assert_no_traceback(caplog)


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    def exact(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise EOFError("the lane closed the connection")
            out += chunk
        return out

    length, code = HEADER.unpack(exact(HEADER.size))
    return code, exact(length)


# ------------------------------------------------------------------ auth comes first


@pytest.fixture
async def auth_daemon(tmp_path: Path) -> AsyncIterator[tuple[Daemon, str]]:
    token, token_hash = new_token()
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[[tenant]]\nname = "ops"\nrole = "admin"\nlocal_plane = true\ntokens = ["{token_hash}"]\n')
    os.chmod(tokens, 0o600)
    d = Daemon(make_config(tmp_path, auth_token_file=str(tokens)))
    await d.start()
    try:
        yield d, token
    finally:
        await d.stop(grace_s=0)


async def test_without_a_token_a_request_that_does_not_parse_is_refused_as_unauthenticated(auth_daemon, caplog):
    """A caller without a token learns nothing from its bytes: it gets the answer a
    well-formed request would get. With the token, the same bytes are INVALID_ARGUMENT.
    Health checks need no token, so they answer INVALID_ARGUMENT either way."""
    caplog.set_level(logging.DEBUG)
    d, token = auth_daemon
    open_paths = ("/grpc.health.v1.Health/",)
    async with grpc.aio.insecure_channel(d.bound[1]) as channel:
        for path, client_streaming, server_streaming in METHODS:
            anonymous = await call_raw(channel, path, client_streaming, server_streaming, [MALFORMED[0]])
            expected = grpc.StatusCode.INVALID_ARGUMENT if path.startswith(open_paths) else \
                grpc.StatusCode.UNAUTHENTICATED
            assert anonymous.code() == expected, (path, anonymous.code(), anonymous.details())
            signed = await call_raw(channel, path, client_streaming, server_streaming, [MALFORMED[0]],
                                    metadata=(("authorization", f"Bearer {token}"),))
            assert signed.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, signed.code(), signed.details())
    assert_no_traceback(caplog)


# ------------------------------------------------------------------ enum values


async def test_prefetch_to_a_tier_value_the_daemon_does_not_know_is_refused(daemon, layout):
    tokens = list(range(layout.block_size_tokens * 2))
    async with AsyncClient(daemon.tcp_target) as kv:
        await kv.put(layout, tokens, [os.urandom(layout.bytes_per_block) for _ in range(2)])
    request = kvstore_pb2.PrefetchRequest(namespace=kvstore_pb2.Namespace(layout=layout_to_proto(layout)),
                                          keys=kvstore_pb2.BlockKeys(tokens=kvstore_pb2.TokenIds(token_ids=tokens)))
    async with grpc.aio.insecure_channel(daemon.tcp_target) as channel:
        prefetch = channel.unary_unary("/kvstore.v1.KVStore/Prefetch",
                                       request_serializer=kvstore_pb2.PrefetchRequest.SerializeToString,
                                       response_deserializer=kvstore_pb2.PrefetchResponse.FromString)
        request.tier = 99  # type: ignore[assignment]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await prefetch(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "99" in info.value.details() and "TIER_HOST" in info.value.details()
        # The known values still work: unspecified is the top tier.
        request.tier = kvstore_pb2.TIER_UNSPECIFIED
        assert (await prefetch(request, timeout=10)).tier == kvstore_pb2.TIER_HOST
        request.tier = kvstore_pb2.TIER_HOST
        assert (await prefetch(request, timeout=10)).already == 2
