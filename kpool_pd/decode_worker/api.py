"""The decode node's public API, ``kpoolpd.v1.GenerateService`` (``proto/kpoolpd/v1/generate.proto``):
its messages, client stub and servicer base, from the code ``proto/generate.py`` writes.

The decode node serves it (``kpool_pd.decode_worker.service``) and clients call it (``kpool_pd.decode_worker.client``);
nothing else imports the generated code.
"""

from __future__ import annotations

from kpool_pd.decode_worker._generated.kpoolpd.v1 import generate_pb2 as _pb
from kpool_pd.decode_worker._generated.kpoolpd.v1 import generate_pb2_grpc as _pb_grpc

# messages
GenerateRequest = _pb.GenerateRequest
GenerateResponse = _pb.GenerateResponse
GenerateStarted = _pb.GenerateStarted
GenerateTokens = _pb.GenerateTokens
GenerateFinished = _pb.GenerateFinished
ModelInfoRequest = _pb.ModelInfoRequest
ModelInfoResponse = _pb.ModelInfoResponse

# the service
SERVICE_DESCRIPTOR = _pb.DESCRIPTOR.services_by_name["GenerateService"]
SERVICE_NAME: str = SERVICE_DESCRIPTOR.full_name
GenerateServiceStub = _pb_grpc.GenerateServiceStub
GenerateServiceServicer = _pb_grpc.GenerateServiceServicer
add_GenerateServiceServicer_to_server = _pb_grpc.add_GenerateServiceServicer_to_server
