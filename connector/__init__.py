"""The connector: gRPC control plane, UCX and gRPC-stream data planes, transfer plans, leases."""
