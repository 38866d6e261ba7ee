"""What both daemons share: settings, TLS, logs, the gRPC server, metrics, signals, readiness, drain."""
