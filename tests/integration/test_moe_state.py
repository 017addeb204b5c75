"""A mixture-of-experts rank's state, captured and restored in process (tests/integration/moe_state_job.py):
4 gloo ranks, TP1 PP1 DP4, expert parallelism 2 (expert-data-parallel size 2), a real megatron-core MoE GPT
with the load-balancing loss, the router's expert bias and the chained distributed optimizer.

The restored job must train on exactly as the uninterrupted one: every rank's parameters (dense and
expert buffers), every part of the chained optimizer (its step counters too), the router's buffers,
the scheduler and every RNG stream. Expert buckets sharded over the whole data-parallel group and
gathered there (instead of over the expert-data-parallel group) mix two experts' bytes: the parameters
differ after the restore.
"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "tests", "integration", "moe_state_job.py")


def run_job(out, ep: int):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("MFT_RUN_DIR", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
           str(29500 + os.getpid() % 1000 + 11), JOB, "--out", str(out), "--ep", str(ep)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"job failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"


def load(out, tag, rank):
    with open(out / f"{tag}.rank{rank}.json") as f:
        return json.load(f)


def test_moe_state_restores_every_rank_bit_exact_with_expert_parallelism(tmp_path):
    run_job(tmp_path, ep=2)
    rngs = {}
    for r in range(4):
        ref, res = load(tmp_path, "ref", r), load(tmp_path, "res", r)
        # what this test covers is really there: expert buffers, the router's bias, both optimizer parts
        assert any("expert_buffer" in k for k in ref["param_buffers"]), sorted(ref["param_buffers"])
        assert any(k.endswith("router.expert_bias") for k in ref["module_buffers"]), sorted(ref["module_buffers"])
        assert {k.split(".")[0] for k in ref["optimizer"]} == {"opt0", "opt1"}, sorted(ref["optimizer"])[:4]
        assert any(k.endswith(".step") for k in ref["optimizer"] if k.startswith("opt1."))
        assert "expert-parallel-rng" in ref["rng"]["tracker"]
        diff = sorted(s for s in set(ref) | set(res) if ref.get(s) != res.get(s))
        detail = {s: sorted(k for k in ref[s] if ref[s][k] != res.get(s, {}).get(k))[:4]
                  for s in diff if isinstance(ref.get(s), dict)}
        assert not diff, f"rank {r}: {diff} differ from the uninterrupted run: {detail}"
        rngs[r] = load(tmp_path, "restored", r)
        # right after the restore every stream is this rank's own, as captured, and so are the router's
        # buffers (a fresh router's bias, updated by a few steps of +-rate, can match by chance at the end)
        assert rngs[r]["restored"] == rngs[r]["captured"], (r, rngs[r])
        assert rngs[r]["buffers_restored"] == rngs[r]["buffers_captured"], (r, rngs[r])
    # each expert-parallel rank has a stream of its own: a stream restored from another expert-parallel
    # rank (or one shared stream) would differ from the one captured
    by_ep = {}
    for r, rec in rngs.items():
        by_ep.setdefault(rec["ep_rank"], set()).add(rec["captured"]["expert-parallel-rng"])
    assert len(by_ep) == 2 and all(len(v) == 1 for v in by_ep.values()), by_ep
    assert by_ep[0] != by_ep[1], by_ep


def moe_demo(tmp_path, *args):
    from conftest import run_demo

    cmd = [sys.executable, "-m", "megatron_ft.cli", "demo", "--quiet", "--moe", "--iters=8", "--kill-at=4",
           f"--workdir={tmp_path / 'demo'}", *args]
    return run_demo(cmd, timeout=1200)


# each compares every rank's losses, parameters (dense and expert buffers), both parts of the chained
# optimizer, the routers' buffers, the scheduler and every RNG stream with an uninterrupted run
@pytest.mark.slow
@pytest.mark.parametrize("args,tier", [
    (["--fail=trainer"], "local_memory"),                                # EP2 on 2 nodes x 2
    (["--fail=node", "--redundancy=replica"], "peer_memory"),             # EP2 on 2 nodes x 2
    (["--fail=node", "--redundancy=rs"], "decoded"),                      # EP4 on 4 nodes x 1: EDP 1
])
def test_moe_demo_recovers_bit_exact(tmp_path, args, tier):
    s = moe_demo(tmp_path, *args)
    assert s["recovered_from"] == tier, s
    with open(tmp_path / "demo" / "reference" / "args.json") as f:
        targs = json.load(f)["train_args"]
    ep = "4" if "--redundancy=rs" in args else "2"
    assert targs[targs.index("--expert-model-parallel-size") + 1] == ep and "--moe-router-enable-expert-bias" in targs


@pytest.mark.slow
def test_a_poisoned_expert_shard_is_refused_and_every_rank_rolls_back(tmp_path):
    """NaN in the expert parameter bucket slice of one rank's newest committed snapshot (step 4), its
    checksums recomputed: it verifies, so only the guard's finiteness check can refuse it. The victim dies
    right after; every rank rolls back to step 3 together, from local memory, and trains on bit for bit."""
    from megatron_ft.rank_files import all_files

    s = moe_demo(tmp_path, "--fail=trainer", "--kill-point=poison-expert-after-commit")
    assert (s["recovered_from"], s["resumed_step"], s["rollbacks"]) == ("local_memory", 3, 1), s
    events = [json.loads(ln) for f in all_files(os.path.join(s["workdir"], "run", "events"), ".jsonl")
              for ln in open(f)]
    fired = [e for e in events if e.get("event") == "fault"]
    assert len(fired) == 1 and fired[0]["step"] == 4 and fired[0]["point"] == "poison-expert-after-commit", fired
    poisoned = fired[0]["tensors"]
    assert len(poisoned) == 1 and poisoned[0].startswith("model.c0.e"), poisoned  # an expert bucket slice
    restores = [e for e in events if e.get("event") == "restore" and e.get("source") not in (None, "none")]
    # every rank of the job restored once, each from its local memory at step 3 after one rollback
    assert sorted((e["source"], e["step"], e["rollbacks"]) for e in restores) == [("local_memory", 3, 1)] * 4, restores
    rejected = [r for e in restores for r in e.get("rejected", [])]
    # the owner of the shard refused it naming the tensor; the others followed its verdict
    assert any("step 4: non-finite values" in r and poisoned[0] in r for r in rejected), rejected
    assert any("step 4: refused by the guard on another rank" in r for r in rejected), rejected
