"""The peer credential for tests that speak PrefillService on the wire themselves (raw bytes, a chosen
``authorization``): a session proved through PeerAuth, as ``kpool_pd.connector.shared.peer_client`` proves one,
the server's proof checked. A session belongs to the server that issued it, not to a connection."""

from __future__ import annotations

import hmac
import secrets

import grpc

from kpool_pd.connector.shared.peer_auth import (NONCE_BYTES, ChallengeRequest, PeerAuthStub, client_credential,
                                        peer_authorization, server_proof)


async def peer_metadata(address: str, token: str, *, timeout_s: float = 5.0) -> tuple[tuple[str, str], ...]:
    """``authorization: KpoolPd-Peer ...`` of a new session with the server at ``address`` (plaintext)."""
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    async with grpc.aio.insecure_channel(address) as channel:
        r = await PeerAuthStub(channel).Challenge(ChallengeRequest(client_nonce=client_nonce), timeout=timeout_s)
    if not hmac.compare_digest(r.server_proof, server_proof(token, client_nonce, r.server_nonce)):
        raise AssertionError(f"the server at {address} did not prove the peer token")
    return (("authorization", peer_authorization(r.server_nonce, client_credential(token, client_nonce,
                                                                                    r.server_nonce))),)
