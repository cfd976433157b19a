"""The front-end's view of the ranks on other nodes: each node is one ``ControlLink`` in the control group.

Messages to a node: ``("rank", rank, msg)`` (``msg`` a rank inbox message, see ``rank_worker``), ``("bye",)``
(the front-end is done; the node stops its ranks) and ``("refused", why)`` (the node's configuration differs).
From a node: ``("from_rank", msg)`` (a rank outbox message), ``("exit", rank, code)`` (a rank process ended) and
``("bye", {rank: exit code})`` (its last message). The data-parallel engine addresses a remote rank through
``RemoteInbox`` / ``RemoteRank``, which stand where a local rank's queue and process stand, so placement, replies
and failure checks treat every rank alike.
"""

from __future__ import annotations

import threading

from .control_link import ControlLink


def describe_ranks(ranks: range) -> str:
    return f"DP rank {ranks[0]}" if len(ranks) == 1 else f"DP ranks {ranks[0]}..{ranks[-1]}"


class RemoteNode:
    def __init__(self, group, node: int, ranks: range, outbox, *, heartbeat_s: float, label: str | None = None):
        self.node, self.ranks, self.label = node, ranks, label
        self.exit_codes: dict[int, int] = {}
        self.lost: str | None = None  # why the link failed
        self.closed = threading.Event()  # the node said goodbye
        self._ended = threading.Event()  # goodbye, or the link failed
        self._outbox = outbox
        self.link = ControlLink(group, node, on_message=self._on_message, on_error=self._on_error,
                                heartbeat_s=heartbeat_s, name=f"deepinfer-node{node}")

    def describe(self) -> str:
        return self.label or f"node {self.node} ({describe_ranks(self.ranks)})"

    def _on_message(self, obj) -> None:
        kind = obj[0]
        if kind == "from_rank":
            self._outbox.put(obj[1])
        elif kind == "exit":
            self.exit_codes[obj[1]] = obj[2]
        elif kind == "bye":
            self.exit_codes.update(obj[1])
            self.closed.set()
            self._ended.set()

    def _on_error(self, text: str) -> None:
        if self.closed.is_set():
            return
        self.lost = text
        self._ended.set()
        self._outbox.put(("node_lost", self.node, text))

    def close(self, timeout_s: float) -> None:
        """Say goodbye (after every rank was sent its shutdown) and wait for the node's own goodbye."""
        if self.lost is None and not self.closed.is_set():
            self.link.send(("bye",))
            self._ended.wait(timeout_s)
        self.link.close_sending(min(timeout_s, 5.0))


class RemoteInbox:
    """A remote rank's inbox: ``put`` sends through its node's link."""

    def __init__(self, node: RemoteNode, rank: int) -> None:
        self.node, self.rank = node, rank

    def put(self, msg) -> None:
        self.node.link.send(("rank", self.rank, msg))


class RemoteRank:
    """A remote rank's process as the front-end sees it: its exit code as its node reports it."""

    pid = None

    def __init__(self, node: RemoteNode, rank: int) -> None:
        self.node, self.rank = node, rank

    @property
    def exitcode(self) -> int | None:
        return self.node.exit_codes.get(self.rank)

    def is_alive(self) -> bool:
        return self.exitcode is None and self.node.lost is None and not self.node.closed.is_set()
