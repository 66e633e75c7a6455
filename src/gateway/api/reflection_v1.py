"""gRPC server reflection as `grpc.reflection.v1` beside `v1alpha`.

grpcio-reflection (1.85) serves only `grpc.reflection.v1alpha.ServerReflection`; current clients
(grpcurl, Postman, grpc-java/go's default) ask for `grpc.reflection.v1` first. The two
services' messages are the same fields with the same numbers (v1 is v1alpha promoted), so the
v1 service is the v1alpha servicer under the v1 name: the bytes it reads and writes are v1's.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as messages

SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection of `service_names` (and of both reflection services) as v1alpha and v1."""
    names = [*service_names, reflection.SERVICE_NAME, SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=messages.ServerReflectionRequest.FromString,
        response_serializer=messages.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"ServerReflectionInfo": handler}),)
    )
