"""The decode node's side of the connector: the handshaken prefill nodes (``PrefillPeer``) and the
pulls that land their grants in this node's blocks. Import names from ``connector``."""
