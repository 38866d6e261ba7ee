"""The wire format of ``kpoolpd.v1.PrefillService`` (``proto/kpoolpd/v1/prefill.proto``): its
messages, enum values, client stub and servicer base, from the code ``proto/generate.py`` writes.

The connector speaks it on both sides; a test or a tool that talks to a prefill node directly
imports it as ``from connector import prefill_api as pb``. Nothing else imports the generated code.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from kpool_pd.connector._generated.kpoolpd.v1 import prefill_pb2 as _pb
from kpool_pd.connector._generated.kpoolpd.v1 import prefill_pb2_grpc as _pb_grpc

# messages
AnnouncedOffer = _pb.AnnouncedOffer
AwaitOffersRequest = _pb.AwaitOffersRequest
AwaitOffersResponse = _pb.AwaitOffersResponse
Chunk = _pb.Chunk
HandshakeRequest = _pb.HandshakeRequest
HandshakeResponse = _pb.HandshakeResponse
HeartbeatRequest = _pb.HeartbeatRequest
HeartbeatResponse = _pb.HeartbeatResponse
Layout = _pb.Layout
PrefillDone = _pb.PrefillDone
PrefillRequest = _pb.PrefillRequest
PrefillResponse = _pb.PrefillResponse
PackedPullRequest = _pb.PackedPullRequest
PackedPullResponse = _pb.PackedPullResponse
PullDone = _pb.PullDone
PullRequest = _pb.PullRequest
PullResponse = _pb.PullResponse
PullFailure = _pb.PullFailure
PullBatch = _pb.PullBatch
PullSessionRequest = _pb.PullSessionRequest
PullSessionResponse = _pb.PullSessionResponse
PushRequest = _pb.PushRequest
Region = _pb.Region
ReleaseRequest = _pb.ReleaseRequest
ReleaseResponse = _pb.ReleaseResponse
RingRange = _pb.RingRange

# enum values (connector.Transport and connector.shared.plan.PoolKind map to them one to one)
TRANSPORT_UNSPECIFIED = _pb.TRANSPORT_UNSPECIFIED
TRANSPORT_UCX = _pb.TRANSPORT_UCX
TRANSPORT_GRPC_STREAM = _pb.TRANSPORT_GRPC_STREAM
POOL_KIND_UNSPECIFIED = _pb.POOL_KIND_UNSPECIFIED
POOL_KIND_BLOCKS = _pb.POOL_KIND_BLOCKS
POOL_KIND_RINGS = _pb.POOL_KIND_RINGS

# the service
SERVICE_DESCRIPTOR = _pb.DESCRIPTOR.services_by_name["PrefillService"]
SERVICE_NAME: str = SERVICE_DESCRIPTOR.full_name
PrefillServiceStub = _pb_grpc.PrefillServiceStub
PrefillServiceServicer = _pb_grpc.PrefillServiceServicer
add_PrefillServiceServicer_to_server = _pb_grpc.add_PrefillServiceServicer_to_server


def add_to_server(servicer: PrefillServiceServicer, server: grpc.aio.Server, *,
                  pull_response_serializer: Callable[[object], bytes]) -> None:
    """Register ``servicer`` on ``server`` as ``add_PrefillServiceServicer_to_server`` does, except
    that the responses of Pull and PrefillPush (PullResponse streams) go through ``pull_response_serializer``
    (which may take pre-encoded bytes)."""
    handlers = {}
    for method in SERVICE_DESCRIPTOR.methods:
        request_type = getattr(_pb, method.input_type.name)
        response_type = getattr(_pb, method.output_type.name)
        serializer = (pull_response_serializer if method.name in ("Pull", "PrefillPush")
                      else response_type.SerializeToString)
        make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=request_type.FromString,
                                     response_serializer=serializer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
