"""Control messages between the front-end and another node, over a gloo process group (torch.distributed).

The control group holds the front-end (group rank 0) and one process per other node (group rank = node rank). A
``ControlLink`` joins two of its members: pickled Python objects travel as a length tensor then a byte tensor
(gloo point-to-point ``send`` / ``recv``, as ``torch.distributed.send_object_list`` does). One thread sends (in
order, from a queue; a ``("ping",)`` when there is nothing to send for ``heartbeat_s``, so the peer can tell an idle
link from a dead one) and one thread receives, handing every object to ``on_message`` until the peer's last
one (``("bye", ...)``). A receive that fails, or
waits longer than the group's timeout, is reported once through ``on_error``: a dead peer closes the connection
and is seen at once, a hung one within the timeout.
"""

from __future__ import annotations

import datetime
import pickle
import queue as queue_mod
import threading

import torch
import torch.distributed as dist

PING = ("ping",)
_STOP = object()


def connect_store(addr: str, port: int, timeout_s: float, *, host: bool) -> dist.Store:
    """The rendezvous store at ``addr:port`` (hosted by node 0's front-end, ``host=True``)."""
    try:
        return dist.TCPStore(addr, port, is_master=host, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # the store's own errors do not say what was being reached
        what = "host the rendezvous store on" if host else "reach node 0's rendezvous store at"
        raise RuntimeError(f"could not {what} {addr}:{port} within {timeout_s:.0f} s: {exc}") from exc


def control_group(store: dist.Store, rank: int, size: int, timeout_s: float, hello=None) -> dist.ProcessGroup:
    """The front-end + node control group (its own gloo group beside the ranks' default group). ``hello``: an
    object the members read with ``read_hello`` once the group is formed (a node's engine configuration)."""
    members = dist.PrefixStore("control", store)
    members.set(f"hello/{rank}", pickle.dumps(hello))
    members.set(f"arrived/{rank}", "1")
    try:
        return dist.ProcessGroupGloo(members, rank, size, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        missing = [r for r in range(size) if not members.check([f"arrived/{r}"])]
        who = "node 0 (the front-end)" if missing == [0] else f"node(s) {missing}"
        raise RuntimeError(f"{who} did not join the control group within {timeout_s:.0f} s: {exc}") from exc


def read_hello(store: dist.Store, rank: int):
    return pickle.loads(dist.PrefixStore("control", store).get(f"hello/{rank}"))


def send_object(group: dist.ProcessGroup, obj, peer: int) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    group.send([torch.tensor([data.numel()], dtype=torch.int64)], peer, 0).wait()
    group.send([data], peer, 0).wait()


def recv_object(group: dist.ProcessGroup, peer: int):
    size = torch.zeros(1, dtype=torch.int64)
    group.recv([size], peer, 0).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.recv([data], peer, 0).wait()
    return pickle.loads(data.numpy().tobytes())


class ControlLink:
    """Both directions between this process and ``peer`` in ``group``; ``send`` never blocks the caller."""

    def __init__(self, group: dist.ProcessGroup, peer: int, *, on_message, on_error, heartbeat_s: float,
                 name: str, is_last=lambda obj: obj[0] == "bye") -> None:
        self.group, self.peer, self.name = group, peer, name
        self._on_message, self._on_error, self._is_last = on_message, on_error, is_last
        self._heartbeat_s = heartbeat_s
        self._outgoing: queue_mod.Queue = queue_mod.Queue()
        self._failed = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name=f"{name}-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name=f"{name}-recv", daemon=True)
        self._sender.start()
        self._receiver.start()

    def send(self, obj) -> None:
        self._outgoing.put(obj)

    def close_sending(self, timeout_s: float) -> None:
        """Send what is queued, then stop sending (pings included)."""
        self._outgoing.put(_STOP)
        self._sender.join(timeout_s)

    def wait_closed(self, timeout_s: float) -> bool:
        self._receiver.join(timeout_s)
        return not self._receiver.is_alive()

    def _fail(self, exc: BaseException) -> None:
        if not self._failed.is_set():
            self._failed.set()
            self._on_error(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")

    def _send_loop(self) -> None:
        while not self._failed.is_set():
            try:
                obj = self._outgoing.get(timeout=self._heartbeat_s)
            except queue_mod.Empty:
                obj = PING
            if obj is _STOP:
                return
            try:
                send_object(self.group, obj, self.peer)
            except Exception as exc:  # noqa: BLE001 - reported to the owner, who stops the deployment
                self._fail(exc)
                return

    def _recv_loop(self) -> None:
        while not self._failed.is_set():
            try:
                obj = recv_object(self.group, self.peer)
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
                return
            self._on_message(obj)  # pings too: they prove the peer alive
            if self._is_last(obj):  # the peer's goodbye: nothing follows it
                return
