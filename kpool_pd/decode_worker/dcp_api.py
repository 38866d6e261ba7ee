"""The service a DCP decode instance's rank 0 drives its other ranks through,
``kpoolpd.v1.DcpRankService`` (``proto/kpoolpd/v1/dcp.proto``): its messages, client stub and
servicer base, from the code ``proto/generate.py`` writes.

Ranks 1..N-1 serve it (``kpool_pd.decode_worker.dcp_rank``) and rank 0 calls it (``kpool_pd.decode_worker.dcp_ranks``);
nothing else imports the generated code.
"""

from __future__ import annotations

from kpool_pd.decode_worker._generated.kpoolpd.v1 import dcp_pb2 as _pb
from kpool_pd.decode_worker._generated.kpoolpd.v1 import dcp_pb2_grpc as _pb_grpc

# messages
LandRequest = _pb.LandRequest
LandResponse = _pb.LandResponse
StepRequest = _pb.StepRequest
StepResponse = _pb.StepResponse
DropRequest = _pb.DropRequest
DropResponse = _pb.DropResponse
StatusRequest = _pb.StatusRequest
StatusResponse = _pb.StatusResponse

# the service
SERVICE_DESCRIPTOR = _pb.DESCRIPTOR.services_by_name["DcpRankService"]
SERVICE_NAME: str = SERVICE_DESCRIPTOR.full_name
DcpRankServiceStub = _pb_grpc.DcpRankServiceStub
DcpRankServiceServicer = _pb_grpc.DcpRankServiceServicer
add_DcpRankServiceServicer_to_server = _pb_grpc.add_DcpRankServiceServicer_to_server
