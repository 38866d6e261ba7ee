"""What both roles of the connector use: the wire conversions and frames, transfer plans, pool
regions, the UCX worker, hosts, credentials, channels, settings, compatibility checks, errors and
metrics. Import names from ``connector``."""
