"""The GPU snapshot path on a real CUDA device: device -> page-locked agent slot on a side stream, the
checksums summed on the device by the Triton kernel (or on the host), restore straight from the process's
page-locked slot or through pinned blocks, CUDA RNG captured and restored. Skipped without CUDA (CI has
none); run on a GPU machine with ``pytest tests/gpu`` (``scripts/gpu_checks.sh``)."""
import os

import pytest
import torch

from megatron_ft.capture.state import TorchStateAdapter
from megatron_ft.trainer import device_staging, page_locked
from megatron_ft.trainer.recovery import Restorer
from megatron_ft.trainer.snapshot import SnapshotEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before its first use


def identity(cfg):
    return {"run_id": cfg.run_id, "rank": 0, "world_size": 1}


def model_on_gpu(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def step(m, opt):
    x = torch.randn(64, 256, device="cuda")  # draws from the CUDA generator
    loss = m(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def snapshot_bytes(m, opt):
    """Every parameter and optimizer tensor, copied to the host (the reference, not the product)."""
    out = {f"p.{n}": p.detach().cpu().clone() for n, p in m.named_parameters()}
    for i, p in enumerate(m.parameters()):
        for k, v in opt.state[p].items():
            out[f"o.{i}.{k}"] = v.detach().cpu().clone()
    return out


def test_a_gpu_snapshot_restores_bit_exact_with_the_cuda_rng(agent):
    c = agent.client()
    m, opt = model_on_gpu(0)
    ad = TorchStateAdapter(m, opt)
    eng = SnapshotEngine(c, 0, identity(agent.cfg), 1 << 16)  # many chunks: sums overlap copies
    for s in range(1, 4):
        eng.wait()
        step(m, opt)
        ad.extra = {"iteration": s}
        eng.snapshot(s, *ad.capture())
        if s == 3:
            want = snapshot_bytes(m, opt)
            rng_want = torch.cuda.get_rng_state()
        step_forward = m(torch.randn(64, 256, device="cuda")).sum()  # the next forward overlaps the copy
        del step_forward
    st = eng.wait()
    assert st.ok and st.step == 3, st
    assert eng._staging is not None and all(a is not None for a in eng._staging.areas), "the slots were page-locked"
    torch.cuda.synchronize()
    next_draw = torch.randn(8, device="cuda")  # what the run draws after step 3's snapshot ... and a forward
    eng.close()
    device_staging.release_page_locked()  # as a restarted process finds the slots: through pinned blocks

    m2, opt2 = model_on_gpu(1)  # a restarted process: other weights, empty optimizer state
    ad2 = TorchStateAdapter(m2, opt2)
    res = Restorer(0, 1, identity(agent.cfg), agent.cfg.run_id, agent.cfg.persist.dir, c).restore(ad2)
    assert (res.source, res.step) == ("local_memory", 3), res
    assert ad2.restored_extra == {"iteration": 3}
    got = snapshot_bytes(m2, opt2)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k
    assert all(p.is_cuda for p in m2.parameters())
    assert all(v.is_cuda for p in m2.parameters() for k, v in opt2.state[p].items() if v.dim()), "state beside params"
    assert torch.equal(torch.cuda.get_rng_state(), rng_want)
    m2(torch.randn(64, 256, device="cuda")).sum()
    assert torch.equal(torch.randn(8, device="cuda"), next_draw)


def test_training_after_a_gpu_restore_matches_the_uninterrupted_run(agent):
    """Snapshot at step 2, go on to step 4; restore step 2 into a fresh model and train to step 4 again:
    the same bytes (CUDA RNG included), with deterministic algorithms."""
    torch.use_deterministic_algorithms(True)
    try:
        run_twice_from_step_2(agent)
    finally:
        torch.use_deterministic_algorithms(False)


def run_twice_from_step_2(agent):
    c = agent.client()
    m, opt = model_on_gpu(0)
    ad = TorchStateAdapter(m, opt)
    eng = SnapshotEngine(c, 0, identity(agent.cfg), 1 << 16)
    for s in (1, 2):
        eng.wait()
        step(m, opt)
        ad.extra = {"iteration": s}
        eng.snapshot(s, *ad.capture())
    eng.wait()
    for s in (3, 4):
        step(m, opt)
    want = snapshot_bytes(m, opt)
    eng.close()

    m2, opt2 = model_on_gpu(5)
    ad2 = TorchStateAdapter(m2, opt2)
    res = Restorer(0, 1, identity(agent.cfg), agent.cfg.run_id, agent.cfg.persist.dir, c).restore(ad2)
    assert (res.source, res.step) == ("local_memory", 2), res
    for s in (3, 4):
        step(m2, opt2)
    got = snapshot_bytes(m2, opt2)
    for k in want:
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k


def snapshot_of_step_1(agent):
    """A model and AdamW on the GPU after one step, snapshotted as step 1 (the engine left open)."""
    c = agent.client()
    m, opt = model_on_gpu(0)
    ad = TorchStateAdapter(m, opt)
    eng = SnapshotEngine(c, 0, identity(agent.cfg), 1 << 16)
    step(m, opt)
    ad.extra = {"iteration": 1}
    eng.snapshot(1, *ad.capture())
    assert eng.wait().ok
    return c, m, opt, ad, eng


def test_a_restore_lands_after_what_the_training_stream_had_queued(agent):
    """The restore ordering a CPU run can only record: a zero-fill queued on the training stream
    behind a long kernel (``torch.cuda._sleep``) must land before the restored bytes, not after them
    and after their verification. Without the staging streams' wait on the caller's stream the
    parameters end as zeros here."""
    c, m, opt, ad, eng = snapshot_of_step_1(agent)
    want = snapshot_bytes(m, opt)
    eng.close()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time on the training stream, then the zero-fill behind it
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    res = Restorer(0, 1, identity(agent.cfg), agent.cfg.run_id, agent.cfg.persist.dir, c).restore(TorchStateAdapter(m, opt))
    assert (res.source, res.step) == ("local_memory", 1), res
    torch.cuda.synchronize()
    got = snapshot_bytes(m, opt)
    for k in want:
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("nbytes", [32, 4099, 8192 * 32 * 3 + 77, (64 << 20) + 5])
def test_the_compiled_checksum_kernel_gives_the_host_lanes(nbytes):
    """The Triton kernel compiled for this device (the CPU tests run it interpreted) against the host's
    lanes of the same bytes: whole rows across many programs, the tail, wrap-around."""
    from megatron_ft.capture import checksum, lanes_kernel

    assert lanes_kernel.AVAILABLE, "Triton comes with CUDA builds of torch"
    g = torch.Generator(device="cuda").manual_seed(nbytes)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    got = [v % 2**64 for v in checksum.tensor_lanes(buf).tolist()]
    assert got == checksum.host_lanes(buf.cpu())
    assert lanes_kernel.AVAILABLE, "the kernel failed and was turned off"


def test_device_and_host_sums_write_the_same_checksums(agent):
    """The same state snapshotted with its checksums summed on the host (as chunks land in the slot) and on
    the device (from the sources, by the kernel): the two version records carry the same digests."""
    from megatron_ft.trainer.recovery import Container

    c = agent.client()
    m, opt = model_on_gpu(0)
    step(m, opt)
    ad = TorchStateAdapter(m, opt)
    eng = SnapshotEngine(c, 0, identity(agent.cfg), 1 << 16)
    records = {}
    ad.extra = {"iteration": 1}
    eng.snapshot(1, *ad.capture())  # (creates the engine's staging)
    assert eng.wait().ok
    for s, sums in ((2, "host"), (3, "device")):  # the agent keeps the newest two
        eng._staging.sums = sums
        eng.snapshot(s, *ad.capture())
        assert eng.wait().ok
    for v in c.request("list", rank=0)["versions"]:
        cont = Container(v["path"])
        records[v["step"]] = cont.version["chunks"]
        cont.close()
    eng.close()
    assert len(records[2]) > 1 and records[2] == records[3]


def test_a_restore_beside_the_engine_reads_its_page_locked_slot_on_the_device(agent, caplog):
    """A restore in the process whose engine page-locked the slots: the copy engine reads the slot (no
    bounce), verified on the device, bit-exact."""
    c, m, opt, ad, eng = snapshot_of_step_1(agent)
    want = snapshot_bytes(m, opt)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    with caplog.at_level("INFO", logger="megatron_ft"):
        res = Restorer(0, 1, identity(agent.cfg), agent.cfg.run_id, agent.cfg.persist.dir, c).restore(ad)
    assert (res.source, res.step) == ("local_memory", 1), res
    assert any("straight from the slot page-locked" in r.getMessage() for r in caplog.records)
    got = snapshot_bytes(m, opt)
    for k in want:
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k
    eng.close()


def test_the_guard_judges_the_restored_bytes_not_what_the_tensors_held_before(agent):
    """The value guard's reads are queued behind the restore's copies, launched while they are in flight:
    a version holding a NaN, restored into zeroed tensors from the slot this process page-locked, must be
    refused (read before its bytes landed, the guard would see zeros and pass it) and the restore rolls
    back to the version before it."""
    c, m, opt, ad, eng = snapshot_of_step_1(agent)
    want = snapshot_bytes(m, opt)
    with torch.no_grad():
        next(m.parameters()).view(-1)[123] = float("nan")
    ad.extra = {"iteration": 2}
    eng.snapshot(2, *ad.capture())
    assert eng.wait().ok
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    res = Restorer(0, 1, identity(agent.cfg), agent.cfg.run_id, agent.cfg.persist.dir, c).restore(ad)
    assert (res.source, res.step, res.rollbacks) == ("local_memory", 1, 1), res
    assert "non-finite values" in res.rejected[0], res.rejected
    from megatron_ft.trainer import guard
    assert guard._FUSED["usable"], "the guard's fused reduction failed on this device"
    got = snapshot_bytes(m, opt)
    for k in want:
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k
    eng.close()


def test_a_later_capture_copies_what_the_training_stream_queued_before_the_hand_over(agent):
    """Megatron-LM's path (``SnapshotEngine.snapshot_later``): the training thread takes the state - here
    owned copies queued on its stream behind a long kernel (``torch.cuda._sleep``) and a write - and hands
    it over; the worker encodes it, registers the layout (the staging and the page-locked slots made on
    the worker) and copies. The copies must wait for the point of the hand-over: without it they read the
    copies' destinations before the write lands and the restore finds the old weights. A write to the
    model queued after the hand-over is not in the snapshot."""
    from megatron_ft.capture.state import LaterCapture

    c = agent.client()
    m, opt = model_on_gpu(0)
    held, _ = model_on_gpu(1)  # the taken state's own tensors
    eng = SnapshotEngine(c, 0, identity(agent.cfg), 1 << 16)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time on the training stream
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(1.5)  # the step's result, behind the long kernel
        for p, q in zip(held.parameters(), m.parameters()):
            p.copy_(q)  # the taking
    taken = TorchStateAdapter(held)
    taken.extra = {"iteration": 1}
    st = eng.snapshot_later(1, LaterCapture(taken.capture, torch.device("cuda", torch.cuda.current_device())))
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(-7.0)  # the next step's write, after the hand-over
    assert eng.wait().ok and st.ok, st
    assert "capture" in st.phases
    eng.close()
    m2, _ = model_on_gpu(2)
    res = Restorer(0, 1, identity(agent.cfg), agent.cfg.run_id, agent.cfg.persist.dir, c).restore(TorchStateAdapter(m2))
    assert (res.source, res.step) == ("local_memory", 1), res
    assert all(bool((p == 1.5).all()) for p in m2.parameters()), "the copies did not wait for the hand-over"


@pytest.mark.parametrize("way", ["page-lock", "bounce"])
def test_a_fresh_process_restores_bit_exact_either_way(agent, way, monkeypatch, caplog):
    """A fresh process (no page-locked slot of its own): page-locking the slot range by range while the
    copies go (several ranges of 64 KiB, on three threads), or through pinned blocks. Bit-exact either
    way; page-locked, the slot stays page-locked for the process's next engine, which reuses it."""
    monkeypatch.setattr(device_staging, "FRESH_RESTORE", way)
    monkeypatch.setattr(page_locked, "LOCK_RANGE", 64 << 10)
    monkeypatch.setattr(page_locked, "LOCK_ALIGN", 64 << 10)
    monkeypatch.setattr("megatron_ft.trainer.restore_plan.threads_here", lambda n: 3)
    c, m, opt, ad, eng = snapshot_of_step_1(agent)
    want = snapshot_bytes(m, opt)
    eng.close()
    device_staging.release_page_locked()
    m2, opt2 = model_on_gpu(1)
    with caplog.at_level("INFO", logger="megatron_ft"):
        res = Restorer(0, 1, identity(agent.cfg), agent.cfg.run_id, agent.cfg.persist.dir, c).restore(
            TorchStateAdapter(m2, opt2))
    assert (res.source, res.step) == ("local_memory", 1), res
    got = snapshot_bytes(m2, opt2)
    for k in want:
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k
    locked = any("page-locking it range by range" in r.getMessage() for r in caplog.records)
    assert locked == (way == "page-lock"), [r.getMessage() for r in caplog.records][-5:]
    [v] = [x for x in c.request("list", rank=0)["versions"] if x["step"] == 1]
    assert (device_staging.page_locked_file(v["path"]) is not None) == (way == "page-lock")
    eng = SnapshotEngine(c, 0, identity(agent.cfg), 1 << 16)  # the next engine
    ad2 = TorchStateAdapter(m2, opt2)
    ad2.extra = {"iteration": 2}
    caplog.clear()
    with caplog.at_level("INFO", logger="megatron_ft"):
        eng.snapshot(2, *ad2.capture())
        assert eng.wait().ok
    eng.close()
    if way == "page-lock":
        assert any("(1 already page-locked by this process)" in r.getMessage() for r in caplog.records)
    device_staging.release_page_locked()
