"""The GPU snapshot path's bookkeeping on a CPU machine: streams, events and page-locking stubbed,
tensors of 300 elements or more treated as device tensors (so chunks mix device and host pieces).
What it checks: pieces land at the right offsets, checksums summed apart combine into the digests a
restore verifies (``device_staging`` + ``recovery``), the lanes path still rejects a corrupted slot.
The real thing on a GPU: ``tests/gpu`` (``scripts/gpu_checks.sh``)."""
import contextlib
import time

import pytest
import torch
from megatron_ft.agent import shm
from megatron_ft.capture import snapfile
from megatron_ft.capture.state import TorchStateAdapter
from megatron_ft.trainer import device_staging, page_locked
from megatron_ft.trainer.recovery import Restorer
from megatron_ft.trainer.snapshot import SnapshotEngine


class Stream:
    def __init__(self, *a, **k):
        pass

    def wait_event(self, e):
        pass

    def synchronize(self):
        pass


class Event(Stream):
    def record(self, s=None):
        pass


class CudaRuntime:
    registered: list = []

    def cudaHostRegister(self, ptr, n, flags):
        self.registered.append(n)
        return 0

    def cudaHostUnregister(self, ptr):
        return 0


@pytest.fixture(autouse=True)
def fake(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: CudaRuntime())
    monkeypatch.setattr(device_staging, "pinned_bytes", lambda n: torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(device_staging, "on_device", lambda t: t.numel() >= 300)
    device_staging._SAID.clear()  # (what is said once per process: once per test)
    yield
    device_staging.release_page_locked()  # the process keeps page-locked slots across engines: not across tests


@pytest.mark.parametrize("chunk,sums", [(1 << 10, "host"), (1 << 12, "host"), (1 << 20, "host"),
                                        (1 << 10, "device"), (1 << 12, "device")])
def test_the_gpu_path_snapshots_and_restores_bit_exact_and_rejects_corruption(agent, chunk, sums, monkeypatch):
    """With the checksums summed on the host as chunks land, or on the "device" from the sources (the
    lanes of each device piece combined with the host pieces'): a restore verifies them either way."""
    monkeypatch.setattr(device_staging, "default_sums", lambda: sums)
    c = agent.client()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(33, 77), torch.nn.Linear(77, 5))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ad = TorchStateAdapter(m, opt)
    ident = {"run_id": agent.cfg.run_id, "rank": 0, "world_size": 1}
    eng = SnapshotEngine(c, 0, ident, chunk)
    for s in (1, 2):
        eng.wait()
        m(torch.randn(4, 33)).sum().backward()
        opt.step()
        ad.extra = {"iteration": s}
        eng.snapshot(s, *ad.capture())
    st = eng.wait()
    assert st.ok, st
    assert eng._staging is not None and all(a is not None for a in eng._staging.areas) and eng._staging.sums == sums
    want = {k: v.clone() for k, v in m.state_dict().items()}
    eng.close()
    device_staging.release_page_locked()  # as a fresh process finds the slots: through pinned blocks
    monkeypatch.setattr(device_staging, "FRESH_RESTORE", "bounce")
    torch.manual_seed(5)
    m2 = torch.nn.Sequential(torch.nn.Linear(33, 77), torch.nn.Linear(77, 5))
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    ad2 = TorchStateAdapter(m2, opt2)
    r = Restorer(0, 1, ident, agent.cfg.run_id, agent.cfg.persist.dir, c).restore(ad2)
    assert (r.source, r.step) == ("local_memory", 2), r
    for k in want:
        assert torch.equal(m2.state_dict()[k], want[k])
    assert ad2.restored_extra == {"iteration": 2}
    # a flipped bit in step 2's slot: the lanes path rejects it and the restore takes step 1
    [v] = [x for x in c.request("list", rank=0)["versions"] if x["step"] == 2]
    seg = shm.open_segment(v["path"])
    hdr = snapfile.read_header(seg.mm)
    seg.mm[hdr.geometry.data_off + 100] ^= 1
    seg.close()
    r = Restorer(0, 1, ident, agent.cfg.run_id, agent.cfg.persist.dir, c).restore(TorchStateAdapter(m2, opt2))
    assert r.step == 1 and "checksum mismatch" in r.rejected[0], r


def test_a_restore_in_the_same_process_copies_straight_from_its_page_locked_slot(agent, caplog, monkeypatch):
    """The process keeps its page-locked slots across snapshot engines (an in-process restart closes one
    and makes the next): a restore copies straight from them, no bounce block is made, a flipped bit is
    still caught; the next engine reuses them instead of page-locking again; once released, a restore
    goes through pinned blocks."""
    c = agent.client()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(33, 77), torch.nn.Linear(77, 5))
    ad = TorchStateAdapter(m)
    ident = {"run_id": agent.cfg.run_id, "rank": 0, "world_size": 1}
    CudaRuntime.registered.clear()
    eng = SnapshotEngine(c, 0, ident, 1 << 12)
    for s in (1, 2):
        with torch.no_grad():
            m[0].weight.add_(1.0)
        ad.extra = {"iteration": s}
        eng.snapshot(s, *ad.capture())
        assert eng.wait().ok
    assert len(CudaRuntime.registered) == 2, "each slot page-locked once"
    eng.close()  # (an in-process restart: this engine ends, the process goes on)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()

    def restore(expect_bounce: bool):
        bounce = []
        real = device_staging.pinned_bytes
        caplog.clear()
        with caplog.at_level("INFO", logger="megatron_ft"), pytest.MonkeyPatch.context() as mp:
            mp.setattr(device_staging, "pinned_bytes", lambda n: bounce.append(n) or real(n))
            r = Restorer(0, 1, ident, agent.cfg.run_id, agent.cfg.persist.dir, c).restore(TorchStateAdapter(m))
        straight = any("straight from the slot page-locked" in x.getMessage() for x in caplog.records)
        assert straight != expect_bounce and bool(bounce) == expect_bounce, (straight, bounce)
        return r

    r = restore(expect_bounce=False)
    assert (r.source, r.step) == ("local_memory", 2), r
    assert all(torch.equal(m.state_dict()[k], want[k]) for k in want)
    eng = SnapshotEngine(c, 0, ident, 1 << 12)  # the next round's engine: the same slots, adopted
    ad.extra = {"iteration": 3}
    eng.snapshot(3, *ad.capture())
    assert eng.wait().ok
    eng.close()
    assert len(CudaRuntime.registered) == 2, "the next engine reused the page-locked slots"
    [v] = [x for x in c.request("list", rank=0)["versions"] if x["step"] == 3]
    seg = shm.open_segment(v["path"])
    seg.mm[snapfile.read_header(seg.mm).geometry.data_off + 100] ^= 1
    seg.close()
    r = restore(expect_bounce=False)
    assert r.step == 2 and "checksum mismatch" in r.rejected[0], r
    device_staging.release_page_locked()
    assert device_staging.page_locked_file(v["path"]) is None
    monkeypatch.setattr(device_staging, "FRESH_RESTORE", "bounce")  # (a fresh process on 4 KiB pages)
    r = restore(expect_bounce=True)
    assert r.step == 2, r


def test_device_sums_turn_to_the_host_once_the_kernel_is_gone(agent, monkeypatch):
    """The checksum kernel failed (lanes_kernel.AVAILABLE turned off, said once): the next snapshots are
    summed on the host rather than with torch's slower reductions, and they still restore."""
    kernel = {"there": True}
    monkeypatch.setattr(device_staging, "default_sums", lambda: "device" if kernel["there"] else "host")
    c = agent.client()
    m = torch.nn.Linear(40, 30)
    ad = TorchStateAdapter(m)
    ident = {"run_id": agent.cfg.run_id, "rank": 0, "world_size": 1}
    eng = SnapshotEngine(c, 0, ident, 1 << 12)
    ad.extra = {"iteration": 1}
    eng.snapshot(1, *ad.capture())
    assert eng.wait().ok and eng._staging.sums == "device"
    kernel["there"] = False
    with torch.no_grad():
        m.weight.add_(1.0)
    ad.extra = {"iteration": 2}
    eng.snapshot(2, *ad.capture())
    assert eng.wait().ok and eng._staging.sums == "host"
    eng.close()
    want = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.zero_()
    r = Restorer(0, 1, ident, agent.cfg.run_id, agent.cfg.persist.dir, c).restore(TorchStateAdapter(m))
    assert (r.source, r.step) == ("local_memory", 2), r
    assert torch.equal(m.weight, want)


def test_slots_that_cannot_be_page_locked_still_take_snapshots(agent, monkeypatch, caplog):
    """cudaHostRegister refused (an old driver, a locked-memory limit): the copies go into the
    unregistered slot (the driver stages them), the snapshot still commits, and the reason is logged once."""

    class Refusing(CudaRuntime):
        def cudaHostRegister(self, ptr, n, flags):
            return 999  # cudaErrorUnknown

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    c = agent.client()
    m = torch.nn.Linear(40, 30)
    ad = TorchStateAdapter(m)
    ident = {"run_id": agent.cfg.run_id, "rank": 0, "world_size": 1}
    eng = SnapshotEngine(c, 0, ident, 1 << 12)
    for s in (1, 2):
        ad.extra = {"iteration": s}
        eng.snapshot(s, *ad.capture())
        assert eng.wait().ok
    assert eng._staging is not None and eng._staging.areas == [None, None]
    assert sum("could not page-lock 2 snapshot slot(s)" in r.getMessage() for r in caplog.records) == 1
    eng.close()
    want = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.zero_()
    r = Restorer(0, 1, ident, agent.cfg.run_id, agent.cfg.persist.dir, c).restore(TorchStateAdapter(m))
    assert (r.source, r.step) == ("local_memory", 2)
    assert torch.equal(m.weight, want)


class Recorded:
    """CUDA streams and events stubbed to record what is issued where: ``ops`` holds (stream, what,
    detail) in the order issued - a stream's ``wait`` for an event, its ``sync``, an event's ``record``
    (the event knows the stream ``on`` and the ``thread`` it was recorded from). ``torch.cuda.stream``
    makes a stream current for the calling thread; ``current()`` is that stream, else ``callers``
    (the restoring thread's own stream)."""

    def __init__(self, monkeypatch):
        import threading

        ops: list = []
        local = threading.local()

        class RecStream(Stream):
            def __init__(self, *a, name="staging", **k):
                self.name = name

            def wait_event(self, e):
                ops.append((self, "wait", e))

            def synchronize(self):
                ops.append((self, "sync", None))

        class RecEvent(Event):
            def record(self, s=None):
                self.on, self.thread = s, threading.get_ident()
                ops.append((s, "record", self))

        @contextlib.contextmanager
        def on_stream(s):
            stack = local.__dict__.setdefault("stack", [])
            stack.append(s)
            try:
                yield
            finally:
                stack.pop()

        self.ops, self.local, self.callers = ops, local, RecStream(name="caller's")
        monkeypatch.setattr(torch.cuda, "Stream", RecStream)
        monkeypatch.setattr(torch.cuda, "Event", RecEvent)
        monkeypatch.setattr(torch.cuda, "stream", on_stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: self.current())

    def current(self):
        stack = self.local.__dict__.get("stack")
        return stack[-1] if stack else self.callers

    def streams(self) -> list:
        """The streams other than the caller's that something was issued on, in order of first use."""
        return list(dict.fromkeys(s for s, _, _ in self.ops if isinstance(s, Stream) and s is not self.callers))


def snapshot_of_step_1_then_zeroed(agent):
    """A model snapshotted as step 1 (the engine closed: its slots stay page-locked in this process), then
    its parameters zeroed; returns (client, model, identity, the state to restore)."""
    c = agent.client()
    m = torch.nn.Sequential(torch.nn.Linear(33, 77), torch.nn.Linear(77, 5))
    ad = TorchStateAdapter(m)
    ident = {"run_id": agent.cfg.run_id, "rank": 0, "world_size": 1}
    eng = SnapshotEngine(c, 0, ident, 1 << 10)
    ad.extra = {"iteration": 1}
    eng.snapshot(1, *ad.capture())
    assert eng.wait().ok
    eng.close()
    want = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    return c, m, ident, want


def restore_step_1(agent, c, m, ident, want) -> None:
    r = Restorer(0, 1, ident, agent.cfg.run_id, agent.cfg.persist.dir, c).restore(TorchStateAdapter(m))
    assert (r.source, r.step) == ("local_memory", 1), r
    assert all(torch.equal(m.state_dict()[k], want[k]) for k in want)


def test_every_restore_stream_waits_for_what_the_caller_queued_before_its_first_copy(agent, monkeypatch):
    """The restore's copies run on streams of their own, from several threads; the destinations were
    allocated (and perhaps zero-filled) on the caller's stream. Each staging stream's first operation
    must be a wait for an event recorded on the caller's current stream, by the caller's thread,
    before any copy. Recorded with stubs: this checks the bookkeeping; that a queued zero-fill really
    lands before the restored bytes is checked on a GPU (``tests/gpu/test_device_staging.py``)."""
    import threading

    caller = threading.get_ident()
    rec = Recorded(monkeypatch)
    upload = device_staging.RestoreStaging.upload

    def recorded_upload(self, k, dst):
        rec.ops.append((self.stream, "copy", None))
        return upload(self, k, dst)

    monkeypatch.setattr(device_staging.RestoreStaging, "upload", recorded_upload)
    monkeypatch.setattr("megatron_ft.trainer.restore_plan.threads_here", lambda n: 4)  # several restore threads
    monkeypatch.setattr(device_staging, "FRESH_RESTORE", "bounce")
    state = snapshot_of_step_1_then_zeroed(agent)
    device_staging.release_page_locked()  # as a fresh process: through pinned blocks, from several threads
    rec.ops.clear()  # (the snapshot's own streams)
    restore_step_1(agent, *state)
    streams = rec.streams()
    assert len(streams) >= 2, "the restore copied from several threads"
    for s in streams:
        first = next((what, e) for st, what, e in rec.ops if st is s)
        assert first[0] == "wait", f"a staging stream copied before waiting: {[w for st, w, _ in rec.ops if st is s][:3]}"
        assert first[1].on is rec.callers and first[1].thread == caller


def test_the_restores_sums_and_value_guard_are_queued_behind_every_copy(agent, monkeypatch):
    """What reads the restored bytes on the device - the lanes of pieces copied straight from a
    page-locked slot, the value guard's sums - is queued on a stream that first waits for an event
    recorded on every staging stream after its copies (and for the caller's point), before the host
    waits for anything: launched while the copies are in flight, run once the bytes have landed.
    Recorded with stubs (the bookkeeping); the bytes' order on a real device: ``tests/gpu``."""
    from megatron_ft.trainer import guard, restore_device

    rec = Recorded(monkeypatch)
    ops, callers = rec.ops, rec.callers
    real_upload, real_sum, real_screen = device_staging.RestoreStaging.upload_page_locked, restore_device.sum_landed, \
        guard.ValueScreen.__init__

    def upload(self, src, dst):
        ops.append((self.stream, "copy", None))
        return real_upload(self, src, dst)

    def sum_landed(landed):
        ops.append((rec.current(), "lanes", len(landed)))
        return real_sum(landed)

    def screen(self, tensors):
        ops.append((rec.current(), "guard", None))
        return real_screen(self, tensors)

    monkeypatch.setattr(device_staging.RestoreStaging, "upload_page_locked", upload)
    monkeypatch.setattr(restore_device, "sum_landed", sum_landed)
    monkeypatch.setattr(guard.ValueScreen, "__init__", screen)
    state = snapshot_of_step_1_then_zeroed(agent)  # the restore copies straight from the page-locked slots
    ops.clear()
    restore_step_1(agent, *state)
    [(join, _, n)] = [op for op in ops if op[1] == "lanes"]
    assert n > 0 and join is not callers, "the slot's pieces were summed on the caller's stream"
    [guarded] = [i for i, op in enumerate(ops) if op[1] == "guard"]
    assert ops[guarded][0] is join, "the guard read the bytes on another stream than the lanes"
    copies = [i for i, op in enumerate(ops) if op[1] == "copy"]
    staging = {ops[i][0] for i in copies}
    waited = {e.on for s, what, e in ops if s is join and what == "wait"}
    assert staging | {callers} <= waited, "the sums' stream did not wait for every staging stream"
    for s in staging:
        point = next(i for i, (st, what, e) in enumerate(ops) if st is join and what == "wait" and e.on is s)
        assert point > max(i for i in copies if ops[i][0] is s), "waited for a point before the last copy"
    first_sync = min(i for i, op in enumerate(ops) if op[1] == "sync")
    assert first_sync > guarded, "the host waited for the copies before queueing the guard"
    assert any(s is join and what == "sync" for s, what, _ in ops), "the host never waited for the sums' stream"


@pytest.mark.parametrize("sums", ["host", "device"])
def test_a_later_capture_copies_after_the_point_the_training_thread_handed_it_over(agent, sums, monkeypatch):
    """Megatron-LM's path (``snapshot_later``): the training thread takes the state (clones queued on its
    stream) and hands it over; the worker encodes it, registers its layout - making the staging and
    page-locking the slots there - and copies. The copies must wait for an event recorded on the training
    thread's current stream, by the training thread, at the hand-over (after the taking), not for one
    recorded later on the worker. Recorded with stubs (the bookkeeping); that the bytes of a clone queued
    behind a long kernel are the ones copied: ``tests/gpu``."""
    import threading

    from megatron_ft.capture.state import LaterCapture

    monkeypatch.setattr(device_staging, "default_sums", lambda: sums)
    rec = Recorded(monkeypatch)
    ops, callers, trainer = rec.ops, rec.callers, threading.get_ident()
    c = agent.client()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(33, 77), torch.nn.Linear(77, 5))
    ident = {"run_id": agent.cfg.run_id, "rank": 0, "world_size": 1}
    eng = SnapshotEngine(c, 0, ident, 1 << 10)
    encoded_on = []
    for s in (1, 2):
        with torch.no_grad():
            m[0].weight.add_(1.0)
        taken = TorchStateAdapter(m)  # the taking: owned copies of the parameters, queued on the training stream
        held = torch.nn.Sequential(torch.nn.Linear(33, 77), torch.nn.Linear(77, 5))
        held.load_state_dict(m.state_dict())
        taken.model, taken.extra = held, {"iteration": s}
        ops.append((callers, "take", s))

        def encode(ad=taken):
            encoded_on.append(threading.get_ident())
            return ad.capture()

        st = eng.snapshot_later(s, LaterCapture(encode, torch.device("cuda", 0)))
        with torch.no_grad():  # training goes on at once: the next step's write is not in this snapshot
            m[0].weight.add_(100.0)
        assert eng.wait().ok and st.ok, st
        with torch.no_grad():
            m[0].weight.sub_(100.0)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    assert eng._staging is not None, "the worker's registration made no staging for the device state"
    eng.close()
    assert encoded_on and trainer not in encoded_on, "the state was encoded on the training thread"
    staging = [s for s in rec.streams() if s is not callers]
    assert staging, "nothing was copied on a staging stream"
    takes = [i for i, op in enumerate(ops) if op[1] == "take"]
    waited = 0
    for s in staging:  # the first thing queued on it (a host wait for an idle stream queues nothing)
        what, e = next(((what, e) for on, what, e in ops if on is s and what != "sync"), (None, None))
        if what is None:
            continue
        waited += 1
        assert what == "wait", f"a staging stream's first operation was {what!r}, not a wait for the hand-over"
        assert e.on is callers and e.thread == trainer, "the copies waited for a point not taken at the hand-over"
    assert waited, "no staging stream waited for the hand-over"
    # each step's copies waited for a point recorded after that step's taking, before the next step's
    points = [next(i for i, op in enumerate(ops) if op == (callers, "record", e))
              for on, what, e in ops if what == "wait" and on in staging and e.on is callers]
    for k, t in enumerate(takes):
        nxt = takes[k + 1] if k + 1 < len(takes) else len(ops)
        assert any(t < r < nxt for r in points), f"step {k + 1}'s copies waited for no point after its taking"
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    r = Restorer(0, 1, ident, agent.cfg.run_id, agent.cfg.persist.dir, c).restore(TorchStateAdapter(m))
    assert (r.source, r.step) == ("local_memory", 2), r
    assert all(torch.equal(m.state_dict()[k], want[k]) for k in want)


@pytest.mark.parametrize("refuse", ["none", "one holding device bytes", "the first"])
def test_a_fresh_process_page_locks_its_slot_range_by_range_while_copying(agent, refuse, monkeypatch, caplog):
    """A fresh process (no page-locked slot of its own) on a huge-page tmpfs page-locks the slot it
    restores in ranges, several threads at once, and copies each range straight from the slot once it is
    locked: no bounce block, bit-exact, and the next engine's snapshots reuse the ranges (no second
    page-locking of that slot). A range that cannot be page-locked is read through bounce blocks (the
    restore still bit-exact); if the first cannot, nothing is page-locked and the restore goes through
    blocks, said once. Every page-locking call is made with the rank's device current (a new thread's
    is device 0), and no copy from a range is queued before that range's page-locking returned."""
    import threading

    calls: list[int] = []  # the sizes page-locked since the restore began (the refused ones included)
    armed, refused = [False], set()  # refused: range indices (with one thread, the ranges go in order)
    locked_at: list[tuple[int, int, float]] = []  # (address, bytes, when the call returned)
    current = threading.local()  # the device each thread made current (the torch.cuda.device stub)
    elsewhere: list[str] = []  # page-locking calls made with no device current

    @contextlib.contextmanager
    def device(d):
        before = getattr(current, "d", None)
        current.d = d
        try:
            yield
        finally:
            current.d = before

    class Ranged(CudaRuntime):
        def cudaHostRegister(self, ptr, n, flags):
            if getattr(current, "d", None) is None:
                elsewhere.append(threading.current_thread().name)
            if not armed[0]:
                return 0
            calls.append(n)
            if refuse == "none":
                time.sleep(0.0005)  # (copies queued meanwhile would come first)
            locked_at.append((ptr, n, time.perf_counter()))
            return 999 if len(calls) - 1 in refused else 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Ranged())
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(device_staging, "FRESH_RESTORE", "page-lock")
    span = 512  # ranges shorter than the 1 KiB chunks: copies from the slot would span two of them
    monkeypatch.setattr(page_locked, "LOCK_RANGE", span)
    monkeypatch.setattr(page_locked, "LOCK_ALIGN", span)
    monkeypatch.setattr("megatron_ft.trainer.restore_plan.threads_here", lambda n: 3 if refuse == "none" else 1)
    c, m, ident, want = snapshot_of_step_1_then_zeroed(agent)
    device_staging.release_page_locked()  # a fresh process
    [v] = c.request("list", rank=0)["versions"]
    seg = shm.open_segment(v["path"])
    nbytes, data_off = seg.size, snapfile.read_header(seg.mm).geometry.data_off
    layout = snapfile.read_layout(bytes(seg.mm[:data_off]), snapfile.read_header(seg.mm))
    seg.close()
    if refuse == "the first":
        refused.add(0)
    elif refuse != "none":  # the last range holding a piece of a "device" tensor (300 elements or more)
        refused.add(max((data_off + p.dst_offset) // span for ps in layout.all_pieces() for p in ps
                        if layout.entries[p.entry_index].spec.numel >= 300))
        assert 0 not in refused
    armed[0] = True
    bounce, straight = [], []  # straight: (address, bytes) of each copy from the slot's mapping
    real, real_upload = device_staging.pinned_bytes, device_staging.RestoreStaging.upload_page_locked
    monkeypatch.setattr(device_staging, "pinned_bytes", lambda n: bounce.append(n) or real(n))

    def upload(self, src, dst):
        straight.append((src.data_ptr(), src.numel(), time.perf_counter()))
        return real_upload(self, src, dst)

    monkeypatch.setattr(device_staging.RestoreStaging, "upload_page_locked", upload)
    with caplog.at_level("INFO", logger="megatron_ft"):
        restore_step_1(agent, c, m, ident, want)
    said = [r.getMessage() for r in caplog.records]
    assert not elsewhere, f"page-locked on threads with no device current: {sorted(set(elsewhere))}"
    if refuse == "the first":
        assert bounce and not any("range by range" in x for x in said), said
        assert sum("could not page-lock" in x for x in said) == 1
        assert device_staging.page_locked_file(v["path"]) is None
        return
    assert any("range by range" in x for x in said), said
    assert len(calls) == -(-nbytes // span) > 3, (len(calls), nbytes)
    assert sum(calls) == nbytes, "the ranges cover the slot file"
    assert bool(bounce) == bool(refused), "a refused range goes through blocks, none otherwise"
    if refused:
        assert device_staging.page_locked_file(v["path"]) is None, "a slot with a range not locked is not whole"
        return
    base = device_staging.page_locked_file(v["path"]).array.ctypes.data
    assert straight and all((a - base) // span == (a + n - 1 - base) // span for a, n, _ in straight), \
        "a copy from the slot spans two page-locked ranges"
    for a, n, queued in straight:
        [returned] = [t for ptr, size, t in locked_at if ptr <= a < ptr + size]
        assert queued > returned, "a copy from a range was queued before the range was page-locked"
    cuts = []
    real_copy = device_staging.SnapshotStaging.copy_and_sum
    monkeypatch.setattr(device_staging.SnapshotStaging, "copy_and_sum",
                        lambda self, *a, **k: cuts.append(k.get("cut")) or real_copy(self, *a, **k))
    calls.clear()
    eng = SnapshotEngine(c, 0, ident, 1 << 10)  # the next engine: the restored slot is reused
    ad = TorchStateAdapter(m)
    for s in (2, 3):  # into the other slot, then into the one the restore page-locked
        ad.extra = {"iteration": s}
        eng.snapshot(s, *ad.capture())
        assert eng.wait().ok
    eng.close()
    assert len(calls) == 1, f"the engine page-locked {len(calls)} slots, not only the one the restore had not"
    assert not elsewhere, f"page-locked on threads with no device current: {sorted(set(elsewhere))}"
    # each copy into a slot stays inside one page-locked range: one piece for the slot locked whole,
    # cut at the ranges for the one the restore locked
    assert sorted(len(cut(0, 2 * span)) for cut in cuts) in ([1, 2], [1, 3]), "copies not cut at the ranges"
