"""Server reflection against the real daemon under both protocol names: `grpc.reflection.v1`
(what grpcurl and Postman ask for first) and `grpc.reflection.v1alpha`.

The requests are hand-made bytes from grpc/reflection/v1/reflection.proto's field
numbers (the v1alpha messages have the same ones), so the v1 calls do not lean on the
daemon's own descriptors; answers are read with the v1alpha classes for the same reason.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

pytestmark = pytest.mark.asyncio

PROTOCOLS = ("grpc.reflection.v1", "grpc.reflection.v1alpha")
SERVICES = {"kvstore.v1.KVStore", "kvstore.v1.Admin", "grpc.health.v1.Health", *(f"{p}.ServerReflection"
                                                                                  for p in PROTOCOLS)}


def string_field(number: int, text: str) -> bytes:
    data = text.encode()
    assert len(data) < 128
    return bytes([number << 3 | 2, len(data)]) + data


LIST_SERVICES = string_field(7, "*")  # ServerReflectionRequest.list_services


def file_containing_symbol(symbol: str) -> bytes:
    return string_field(4, symbol)


async def ask(channel: grpc.aio.Channel, protocol: str,
              *requests: bytes) -> list[reflection_pb2.ServerReflectionResponse]:
    call = channel.stream_stream(f"/{protocol}.ServerReflection/ServerReflectionInfo",
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    return [answer async for answer in call(iter(requests), timeout=10)]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_both_reflection_protocols_list_the_services(daemon, protocol):
    for target in (daemon.unix_target, daemon.tcp_target):
        async with grpc.aio.insecure_channel(target) as channel:
            (answer,) = await ask(channel, protocol, LIST_SERVICES)
        assert answer.WhichOneof("message_response") == "list_services_response", answer
        assert {s.name for s in answer.list_services_response.service} == SERVICES


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_both_reflection_protocols_describe_every_listed_service(daemon, protocol):
    """What `grpcurl describe` does: the file that declares each service, which names it."""
    async with grpc.aio.insecure_channel(daemon.tcp_target) as channel:
        answers = await ask(channel, protocol, *(file_containing_symbol(s) for s in sorted(SERVICES)))
    for service, answer in zip(sorted(SERVICES), answers, strict=True):
        assert answer.WhichOneof("message_response") == "file_descriptor_response", (service, answer)
        files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                 for raw in answer.file_descriptor_response.file_descriptor_proto]
        declared = {f"{f.package}.{s.name}" for f in files for s in f.service}
        assert service in declared, (service, declared)


async def test_a_v1_request_that_does_not_parse_is_invalid_argument(daemon):
    async with grpc.aio.insecure_channel(daemon.tcp_target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ask(channel, "grpc.reflection.v1", b"\xff\xff\xff")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
