"""The prefill node's side of the connector: the PrefillService it serves to decode nodes (Handshake,
Prefill, Pull, PullSession, Release, Heartbeat), its grants under lease, its sends, and the
PrefillEngine protocol that the model side implements. Import names from ``connector``."""
