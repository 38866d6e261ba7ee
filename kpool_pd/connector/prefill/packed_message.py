"""A PackedPull batch's message on the prefill node, holding only the bytes it serves.

The decode node lays its receive out for every pull it asked for, back to back, and posts one receive a piece
(``piece_bytes`` each). The prefill node sends every piece, but a refused pull's span carries nothing: the spans
the request claims for refused pulls are not checked against any grant, so a buffer the size of the whole message
would let a peer make the node allocate (and keep, ``StagingBuffers``) up to the batch's byte cap for a few bytes
served. ``PackedMessage`` keeps only the pieces that hold some served byte, back to back in one buffer; a piece
that holds none goes out from one zeroed piece. Bytes of a kept piece that no served span covers are zeroed, so
that no byte of an earlier batch (another request's, in a reused buffer) leaves the node.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kpool_pd.connector.shared.packed_staging import copy_all, piece_parts


class PackedMessage:
    """The pieces of a ``total``-byte message cut every ``piece_bytes`` and where each lives: the pieces some span
    of ``layout`` ((offset, nbytes), increasing, not overlapping) touches at ``home[i]`` of a buffer of ``nbytes``,
    the others nowhere (``None``)."""

    def __init__(self, layout: list[tuple[int, int]], total: int, piece_bytes: int) -> None:
        self.piece_bytes = piece_bytes
        self.pieces: list[tuple[int, int]] = []
        self.parts: list[list[tuple[int, int, int]]] = []
        self.home: list[int | None] = []
        self.nbytes = 0
        for piece, parts in piece_parts(layout, total, piece_bytes):
            self.pieces.append(piece)
            self.parts.append(parts)
            self.home.append(self.nbytes if parts else None)
            self.nbytes += piece[1] if parts else 0

    def at(self, offset: int) -> int:
        """Where the message's byte ``offset`` lies in the buffer (a byte of a kept piece)."""
        index = offset // self.piece_bytes
        home = self.home[index]
        if home is None:
            raise ValueError(f"byte {offset} of the message lies in a piece no span touches")
        return home + offset - self.pieces[index][0]


def _zero(piece: torch.Tensor) -> None:
    """Zero a uint8 tensor: in host memory through numpy (no OpenMP pool, as ``copy_all``)."""
    if piece.device.type == "cpu":
        piece.numpy().fill(0)
    else:
        piece.zero_()


def pack_in_pieces(spans: list[tuple[int, torch.Tensor]], message: PackedMessage, buffer: torch.Tensor
                   ) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Copy each span's source to its place and yield every piece of ``message`` in order as (offset, length, the
    bytes to send) as soon as they are written: in host memory piece by piece, so that the first pieces travel
    while later ones are packed; on a GPU every span in one operation first. A piece no span touches is zeros.
    # spans: [(offset, uint8 [n])], the layout ``message`` was made from; buffer: uint8 [>= message.nbytes]"""
    zeros = None
    if None in message.home:  # the first piece is the longest
        zeros = torch.zeros(message.pieces[0][1], dtype=torch.uint8, device=buffer.device)
    laid = _laid(spans, message, buffer, zeros)
    if buffer.device.type != "cpu":
        laid = list(laid)
        for _, _, piece, gaps, _, _ in laid:
            if gaps:
                _zero(piece)
        copy_all([p for *_, places, _ in laid for p in places], [s for *_, sources in laid for s in sources])
        for begin, length, piece, *_ in laid:
            yield begin, length, piece
        return
    for begin, length, piece, gaps, places, sources in laid:  # each piece's views made as it goes
        if gaps:
            _zero(piece)
        copy_all(places, sources)
        yield begin, length, piece


def _laid(spans: list[tuple[int, torch.Tensor]], message: PackedMessage, buffer: torch.Tensor,
          zeros: torch.Tensor | None):
    """For each piece of ``message``, in order: (offset, length, its bytes to send, whether some of them belong to
    no span (zeroed before it goes), the places of its parts in the buffer, their sources)."""
    for (begin, length), parts, home in zip(message.pieces, message.parts, message.home):
        if home is None:
            yield begin, length, zeros[:length], False, [], []
            continue
        piece = buffer[home:home + length]
        yield (begin, length, piece, sum(hi - lo for _, lo, hi in parts) < length,
               [piece[lo - begin:hi - begin] for _, lo, hi in parts],
               [spans[i][1][lo - spans[i][0]:hi - spans[i][0]] for i, lo, hi in parts])
