from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ChallengeRequest(_message.Message):
    __slots__ = ("client_nonce",)
    CLIENT_NONCE_FIELD_NUMBER: _ClassVar[int]
    client_nonce: bytes
    def __init__(self, client_nonce: _Optional[bytes] = ...) -> None: ...

class ChallengeResponse(_message.Message):
    __slots__ = ("server_nonce", "server_proof")
    SERVER_NONCE_FIELD_NUMBER: _ClassVar[int]
    SERVER_PROOF_FIELD_NUMBER: _ClassVar[int]
    server_nonce: bytes
    server_proof: bytes
    def __init__(self, server_nonce: _Optional[bytes] = ..., server_proof: _Optional[bytes] = ...) -> None: ...
