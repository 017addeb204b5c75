"""The GPU snapshot path on a real CUDA device: device -> page-locked agent slot on a side stream,
restore through pinned blocks, CUDA RNG captured and restored. Skipped without CUDA (CI has none);
run on a GPU machine with ``pytest tests/gpu``."""
import os

import pytest
import torch

from megatron_ft.capture.state import TorchStateAdapter
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
    assert eng._staging is not None and eng._staging._registered, "the slots were page-locked"
    torch.cuda.synchronize()
    next_draw = torch.randn(8, device="cuda")  # what the run draws after step 3's snapshot ... and a forward
    eng.close()

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


def test_a_restore_lands_after_what_the_training_stream_had_queued(agent):
    """The restore ordering a CPU run can only record: a zero-fill queued on the training stream
    behind a long kernel (``torch.cuda._sleep``) must land before the restored bytes, not after them
    and after their verification. Without the staging streams' wait on the caller's stream the
    parameters end as zeros here."""
    c = agent.client()
    m, opt = model_on_gpu(0)
    ad = TorchStateAdapter(m, opt)
    eng = SnapshotEngine(c, 0, identity(agent.cfg), 1 << 16)
    step(m, opt)
    ad.extra = {"iteration": 1}
    eng.snapshot(1, *ad.capture())
    assert eng.wait().ok
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
