"""Server reflection under both names clients ask for: `grpc.reflection.v1` (grpcurl,
Postman and grpc-java try it first) and the older `grpc.reflection.v1alpha`.

Primitives: `enable_reflection(service_names, server)`, `REFLECTION_SERVICES`.

grpcio-reflection ships only v1alpha. The two protocols are the same messages, field for
field, under another package name, so the v1alpha servicer answers both: its handler is
registered a second time under v1's method path, and v1's file descriptor (v1alpha's,
renamed) is added to the default descriptor pool, so that reflection describes itself
under either name. A grpcio-reflection that brings its own v1 descriptor is imported
first and its descriptor kept.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA = "grpc.reflection.v1alpha"
V1 = "grpc.reflection.v1"
V1_FILE = "grpc_reflection/v1/reflection.proto"
REFLECTION_SERVICES = (f"{V1}.ServerReflection", f"{V1ALPHA}.ServerReflection")


def _v1_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto, made from the v1alpha file by renaming."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = V1_FILE
    proto.package = V1
    old, new = f".{V1ALPHA}.", f".{V1}."
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old):]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old):]
            method.output_type = new + method.output_type[len(old):]
    proto.options.Clear()
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    proto.options.java_multiple_files = True
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_outer_classname = "ServerReflectionProto"
    return proto


def _register_v1_descriptor() -> None:
    with contextlib.suppress(ImportError):
        importlib.import_module("grpc_reflection.v1.reflection_pb2")
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
    except KeyError:
        pool.AddSerializedFile(_v1_descriptor().SerializeToString())


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection of `service_names` (the reflection services are added) on `server`
    under both protocol names."""
    _register_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer((*service_names, *REFLECTION_SERVICES))
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(tuple(
        grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}) for name in REFLECTION_SERVICES
    ))
