"""Control messages between trainers and their node's agent.

Frames, versions, errors, timeouts and retries are the wire layer's
(:mod:`megatron_ft.transport.wire`); this module names the operations. Only small control data
travels here; snapshot bytes go through shared memory.

Operations (request fields -> reply fields):

==============  ==========================================  =================================
op              request                                     reply
==============  ==========================================  =================================
hello           rank, local_rank, pid, run_id[, role]       node, agent_pid, settings
register        rank, layout                                slots: [path, ...], adopted
begin           rank, step                                  slot (index) | refused, busy
commit          rank, slot, step                            -
abort           rank, slot                                  -
global          rank, step (consistent on every rank)       -
rewind          rank, step (the job resumes from it)        -
invalidate      rank, step (found corrupt at restore)       invalidated (bool)
list            rank                                        versions: [{slot, step, state, path}]
peer_list       rank                                        versions rebuildable from peers
recover         rank, step                                  source (the tier it came from)
sched_*         the scheduled transport's pins and receives
status          -                                           every rank's versions, persists
persist         step                                        queued (bool), step
wait_persisted  wait_s                                      persisted: [step, ...]
adopt           launcher_pid (a restarted launcher)         node, agent_pid
bye             -                                           - (orderly trainer exit)
shutdown        -                                           - (agent removes its segments and exits)
==============  ==========================================  =================================
"""
from __future__ import annotations

from ..transport.wire import Client, RemoteError


class AgentError(RemoteError):
    """The agent refused a request; ``kind`` names the agent-side error class (e.g. SharedMemoryError)."""


class AgentClient(Client):
    """A connection to the node's agent over :mod:`megatron_ft.transport.wire` (thread-safe: one
    request at a time). ``timeout`` bounds every call: ``agent.request_timeout_s``. After an agent
    restart the connection is re-opened once and ``hello`` sent again (the wire's retry policy)."""

    def __init__(self, socket_path: str, timeout: float):
        super().__init__(socket_path, timeout, error=AgentError)
        self.socket_path = socket_path

    def connect(self, hello: dict) -> dict:  # type: ignore[override]
        """Open the connection and say ``hello`` (rank, local_rank, pid, run_id[, role])."""
        reply = super().connect({"op": "hello", **hello})
        assert reply is not None
        return reply

    def close(self, orderly: bool = True) -> None:  # type: ignore[override]
        """``orderly``: say ``bye`` first (the agent then does not treat the trainer as lost)."""
        super().close("bye" if orderly else None)


MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path on Linux, minus the terminating NUL


def socket_path(socket_dir: str, run_id: str, node: int) -> str:
    path = f"{socket_dir.rstrip('/')}/{run_id}.node{node}.sock"
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"agent.socket_dir={socket_dir!r} is too long: the agent socket path {path!r} has "
                         f"{len(path.encode())} bytes, Unix sockets allow {MAX_SOCKET_PATH}; use a shorter directory")
    return path
