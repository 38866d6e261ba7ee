"""Count the UCX messages a test's processes post: ``record_sends(monkeypatch)`` returns a list that grows by each
message's byte count as ``UcxNode.post_send`` posts it (in this process only)."""

from __future__ import annotations

from kpool_pd.connector.shared.ucx import UcxNode


def record_sends(monkeypatch) -> list[int]:
    """The byte count of every UCX message posted in this process from now on, in order."""
    posted: list[int] = []
    original = UcxNode.post_send

    def post_send(self, ep, view, tag, **kwargs):
        posted.append(view.numel())
        return original(self, ep, view, tag, **kwargs)
    monkeypatch.setattr(UcxNode, "post_send", post_send)
    return posted
