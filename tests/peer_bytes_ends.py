"""The two ends of a peer byte transport, each a process of its own, for the contract test
(``tests/unit/test_peer_bytes_contract.py``).

``python tests/peer_bytes_ends.py recv --transport wire|group --mode M --rendezvous R``: an endpoint whose
landing keeps what lands (``keep``), declines everything (``decline``), refuses with an error
(``refuse``), takes longer than any send's bound to open (``slow``), or SIGKILLs its own process while a
buffer is landing (``die``). With ``wire`` it prints its address as the first line; it prints one JSON
line per landed buffer (``src``, ``step``, ``key``, ``sha256``) and ends at the sender's close.

``python tests/peer_bytes_ends.py send --transport ... --rendezvous R --to ADDR --buffers SPEC --timeout S``:
sends each buffer of ``SPEC`` (``step:key:size,...``; the bytes are a function of step, key and size)
and prints one JSON line per send: ``landed``, or the error's class, ``declined`` and message;
``--die-after-s T`` SIGKILLs the sending process T seconds into its last send (the ones before it
set the link up). The receiving end prints a line for each
buffer it abandoned (cut short after it opened).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ft.transport.peer_bytes import Buffer, MemoryLanding, PeerBytesError, PeerRefused  # noqa: E402

SECRET = b"the contract test's job secret 0123456789"


def payload(step: int, key: str, size: int) -> bytes:
    seed = hashlib.sha256(f"{step}:{key}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class TestLanding(MemoryLanding):
    def __init__(self, mode: str):
        super().__init__(refuse=mode == "decline")
        self.mode = mode

    def open(self, src, buffer, length):
        if self.mode == "refuse":
            raise ValueError(f"no room for {length} bytes here")
        if self.mode == "slow":
            time.sleep(3600)
        if self.mode == "die":
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return super().open(src, buffer, length)

    def abandoned(self, src, buffer):
        super().abandoned(src, buffer)
        print(json.dumps({"abandoned": [src, buffer.step, buffer.key]}), flush=True)

    def landed(self, src, buffer):
        if self.mode == "die":
            time.sleep(3600)
        super().landed(src, buffer)
        data = self.got[(src, buffer.step, buffer.key)]
        print(json.dumps({"src": src, "step": buffer.step, "key": buffer.key, "meta": buffer.meta,
                          "sha256": hashlib.sha256(data).hexdigest()}), flush=True)


def group(rank: int, rendezvous: str):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{rendezvous}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    return dist.group.WORLD


def receive(args) -> None:
    landing = TestLanding(args.mode)
    if args.transport == "wire":
        from megatron_ft.transport.wire_bytes import WireEndpoint
        end = WireEndpoint(landing, SECRET)
        print(json.dumps({"address": list(end.address)}), flush=True)
        sys.stdin.read()  # the test closes our stdin when it is done
        end.wait_idle(60)  # a dead sender's buffer: abandoned once its connection is seen to end
        end.close()
    else:
        from megatron_ft.transport.group_bytes import GroupBytes
        end = GroupBytes(group(1, args.rendezvous), landing, srcs=[0])
        end.join(120)  # ends at the sender's bye


def send(args) -> None:
    if args.transport == "wire":
        from megatron_ft.transport.wire_bytes import WireBytes, connector
        host, port = json.loads(args.to)
        end = WireBytes(0, connector(lambda peer: (host, port), 30.0, SECRET))
    else:
        from megatron_ft.transport.group_bytes import GroupBytes
        end = GroupBytes(group(0, args.rendezvous), MemoryLanding(refuse=True), srcs=[])
    specs = args.buffers.split(",")
    for i, spec in enumerate(specs):
        step, key, size = spec.split(":")
        buffer = Buffer(int(step), key, {"spec": spec})
        data = memoryview(payload(int(step), key, int(size)))
        t0 = time.monotonic()
        if args.die_after_s and i == len(specs) - 1:  # dies mid-transfer (a SIGKILL: no goodbye)
            threading.Timer(args.die_after_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
        try:
            end.send(1, buffer, data, timedelta(seconds=args.timeout))
            out = {"result": "landed"}
        except PeerBytesError as e:
            out = {"result": type(e).__name__, "message": str(e),
                   "declined": e.declined if isinstance(e, PeerRefused) else None}
        out.update(spec=spec, seconds=round(time.monotonic() - t0, 3),
                   sha256=hashlib.sha256(data).hexdigest())
        print(json.dumps(out), flush=True)
    end.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["send", "recv"])
    p.add_argument("--transport", choices=["wire", "group"], required=True)
    p.add_argument("--mode", default="keep", choices=["keep", "decline", "refuse", "slow", "die"])
    p.add_argument("--rendezvous", default="")
    p.add_argument("--to", default="")
    p.add_argument("--buffers", default="")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--die-after-s", type=float, default=0.0)
    a = p.parse_args()
    (send if a.role == "send" else receive)(a)
    if a.role == "recv" and a.transport == "group":
        os._exit(0)  # the group's threads may still wait on a dead peer
