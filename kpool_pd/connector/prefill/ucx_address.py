"""The sanity check of a UCP worker address that a peer sent us, before any UCX call sees it.

UCX unpacks a worker address without knowing its length and trusts every byte: a header whose
version nibble is neither 0 (v1) nor 1 (v2) aborts the process (``ucs_assertv_always`` in
``ucp_address_unpack_header``), and a truncated or corrupt address makes it read past the end of
the buffer. ``check_worker_address`` walks the packed layout the way UCX 1.x unpacks it (non-unified
mode, the default) and refuses anything that would not end exactly at the last byte.

The layout (``ucp/wireup/address.c``), each field bounds-checked here:

- header: v1 is one byte, version in the low nibble, flags in the high nibble; v2 is two bytes,
  version and release in the first, flags in the second. Flags: debug info (a worker name follows),
  worker uuid (8 bytes; v1 always carries it), client id (8 bytes), active-message lanes only.
- a single ``0xff`` byte instead of devices: no transport at all (refused: nothing to reach).
- per device: the memory-domain byte (bit 7: no interfaces; in v2 an all-ones index is extended
  by one byte), the address-length byte (bit 7: last device, bit 6: a path count byte follows,
  bit 5: a system device byte follows; in v2 a length of 31 is extended by one byte), then the
  device address;
- per interface of a device: a 2-byte transport name checksum, the interface attributes (16
  bytes in v1, 8 in v2), the interface-address-length byte (bit 7: last interface, bit 6: endpoint
  addresses follow; in v2 a length of 63 is extended by one byte), the interface address, then
  any endpoint addresses (a length byte, the address, a lane byte whose bit 7 marks the last).

What this cannot see (a structurally sound address whose contents UCX later rejects, or crashes
on) is the job of ``kpool_pd.connector.prefill.ucx_probe``, which makes the first endpoint in a child process.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MIN_ADDRESS_BYTES = 2
MAX_ADDRESS_BYTES = 8192  # a real one is ~100 bytes on tcp, a few hundred with several HCAs and GPUs

_NULL_RESOURCE = 0xFF
_FLAG_DEBUG_INFO, _FLAG_WORKER_UUID, _FLAG_CLIENT_ID, _FLAG_AM_ONLY = 0x1, 0x2, 0x4, 0x8
_KNOWN_FLAGS = _FLAG_DEBUG_INFO | _FLAG_WORKER_UUID | _FLAG_CLIENT_ID | _FLAG_AM_ONLY
_MD_EMPTY_DEV = 0x80
_MD_MASK_V1, _MD_MASK_V2 = 0x1F, 0x7F
_DEV_LAST, _DEV_NUM_PATHS, _DEV_SYS_DEVICE, _DEV_LEN_MASK = 0x80, 0x40, 0x20, 0x1F
_IFACE_LAST, _IFACE_HAS_EP, _IFACE_LEN_MASK = 0x80, 0x40, 0x3F
_IFACE_ATTR_BYTES = {1: 16, 2: 8}
_MAX_INTERFACES = 128  # UCP_MAX_RESOURCES
_MAX_EP_ADDRESSES = 64  # UCP_MAX_LANES


class AddressVersion(enum.IntEnum):
    """The UCP address format (``UCX_ADDRESS_VERSION``); the wire value is one less."""

    V1 = 1
    V2 = 2


class WorkerAddressError(ValueError):
    """The bytes are not a UCP worker address that UCX can unpack safely; the message says why."""


@dataclass(frozen=True, kw_only=True)
class WorkerAddressInfo:
    """What the check read: the format, the header flags, and how many devices and interfaces
    the address describes (for logs)."""

    version: AddressVersion
    flags: int
    devices: int
    interfaces: int
    nbytes: int


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.data):
            raise WorkerAddressError(f"truncated: {what} needs {n} bytes at offset {self.pos}, "
                                     f"{len(self.data) - self.pos} left of {len(self.data)}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def byte(self, what: str) -> int:
        return self.take(1, what)[0]

    def extended(self, first: int, mask: int, version: AddressVersion, what: str) -> int:
        """A value packed in the low bits of ``first``; in v2 an all-ones value means the next byte holds it."""
        value = first & mask
        if version is AddressVersion.V2 and value == mask:
            value = self.byte(what)
        return value


def check_worker_address(address: bytes, *, unified_mode: bool = False) -> WorkerAddressInfo:
    """Check that ``address`` is a UCP worker address UCX can unpack without aborting or reading
    past its end. Pure and fast (no UCX call); callable anywhere.

    ``unified_mode``: this process runs UCX with ``UCX_UNIFIED_MODE=y``, whose addresses carry
    no lengths (they come from the local transports), so only the size and the header are checked.
    Raises ``WorkerAddressError`` (a ValueError) naming the first thing wrong; ``TypeError`` when
    ``address`` is not bytes."""
    if not isinstance(address, (bytes, bytearray, memoryview)):
        raise TypeError(f"a UCX worker address is bytes, got {type(address).__name__}")
    data = bytes(address)
    if not MIN_ADDRESS_BYTES <= len(data) <= MAX_ADDRESS_BYTES:
        raise WorkerAddressError(f"{len(data)} bytes; a UCX worker address has {MIN_ADDRESS_BYTES} to "
                                 f"{MAX_ADDRESS_BYTES}")
    r = _Reader(data)
    head = r.byte("the header")
    if head & 0x0F not in (0, 1):
        raise WorkerAddressError(f"header version {head & 0x0F} (byte 0x{head:02x}); UCX knows 0 (v1) and 1 (v2), "
                                 "and aborts on any other")
    version = AddressVersion((head & 0x0F) + 1)
    flags = head >> 4 if version is AddressVersion.V1 else r.byte("the v2 header flags")
    if flags & ~_KNOWN_FLAGS:
        raise WorkerAddressError(f"unknown header flags 0x{flags & ~_KNOWN_FLAGS:02x}")
    if version is AddressVersion.V1 or flags & _FLAG_WORKER_UUID:
        r.take(8, "the worker uuid")
    if flags & _FLAG_CLIENT_ID:
        r.take(8, "the client id")
    if flags & _FLAG_DEBUG_INFO:
        r.take(r.byte("the worker name length"), "the worker name")
    if unified_mode:
        return WorkerAddressInfo(version=version, flags=flags, devices=0, interfaces=0, nbytes=len(data))
    if r.pos < len(data) and data[r.pos] == _NULL_RESOURCE:
        raise WorkerAddressError("the address lists no transport")
    devices = interfaces = 0
    last_device = False
    md_mask = _MD_MASK_V1 if version is AddressVersion.V1 else _MD_MASK_V2
    while not last_device:
        devices += 1
        where = f"device {devices}"
        md = r.byte(f"{where}'s memory domain")
        r.extended(md, md_mask, version, f"{where}'s memory domain index")
        dev = r.byte(f"{where}'s address length")
        last_device = bool(dev & _DEV_LAST)
        dev_len = r.extended(dev, _DEV_LEN_MASK, version, f"{where}'s address length")
        if dev & _DEV_NUM_PATHS:
            r.byte(f"{where}'s path count")
        if dev & _DEV_SYS_DEVICE:
            r.byte(f"{where}'s system device")
        r.take(dev_len, f"{where}'s address")
        last_iface = bool(md & _MD_EMPTY_DEV)
        while not last_iface:
            interfaces += 1
            if interfaces > _MAX_INTERFACES:
                raise WorkerAddressError(f"more than {_MAX_INTERFACES} interfaces")
            what = f"interface {interfaces} ({where})"
            r.take(2 + _IFACE_ATTR_BYTES[version], f"{what}'s name checksum and attributes")
            length = r.byte(f"{what}'s address length")
            last_iface = bool(length & _IFACE_LAST)
            r.take(r.extended(length, _IFACE_LEN_MASK, version, f"{what}'s address length"), f"{what}'s address")
            last_ep, endpoints = not length & _IFACE_HAS_EP, 0
            while not last_ep:
                endpoints += 1
                if endpoints > _MAX_EP_ADDRESSES:
                    raise WorkerAddressError(f"{what}: more than {_MAX_EP_ADDRESSES} endpoint addresses")
                r.take(r.byte(f"{what}'s endpoint address length"), f"{what}'s endpoint address")
                last_ep = bool(r.byte(f"{what}'s endpoint lane") & 0x80)
    if r.pos != len(data):
        raise WorkerAddressError(f"{len(data) - r.pos} bytes left over after the last device (offset {r.pos} "
                                 f"of {len(data)})")
    if interfaces == 0:
        raise WorkerAddressError("the address lists no transport interface")
    return WorkerAddressInfo(version=version, flags=flags, devices=devices, interfaces=interfaces, nbytes=len(data))
