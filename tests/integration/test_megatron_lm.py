"""Upstream Megatron-LM's own ``pretrain_gpt.py``, patched, under ``megatron-ft launch``.

The end-to-end tests run ``megatron-ft demo --megatron-lm SOURCE``: an unpatched upstream tree
(``MEGATRON_LM_DIR``) or the project's shared archive of a supported release (the newest by default,
``megatron_ft.testing.megatron_lm.TAGS``) is patched into a copy with the series of its release, run once without a
failure and once with one, and every rank's parameter digest and loss at every iteration compared bit
for bit, with the tier reached and the step resumed from asserted (bit-exact alone cannot tell a
recovery from a fresh start). Dropout is upstream's default, 0.1.
"""
import json
import os
import subprocess
import sys

import pytest
from conftest import run_demo

from megatron_ft.megatron import upstream
from megatron_ft.testing import megatron_lm
from megatron_ft.rank_files import rank_files

SOURCE = megatron_lm.source()
needs_upstream = pytest.mark.skipif(not SOURCE, reason=f"no upstream Megatron-LM: set MEGATRON_LM_DIR (a checkout "
                                                       f"at {megatron_lm.TAG}) or provide ../shared/upstream/megatron-lm-"
                                                       f"{megatron_lm.TAG}.tar.gz")
OLDER = [t for t in megatron_lm.TAGS if t != megatron_lm.TAG]
RELEASES = list(megatron_lm.TAGS)  # the slow set runs on every supported release


def release_source(release):
    source = megatron_lm.source(release)
    if not source:
        pytest.skip(f"no upstream Megatron-LM {release}: provide ../shared/upstream/megatron-lm-{release}.tar.gz")
    return source


def test_ci_runs_upstream_megatron_lm_not_skips_it():
    """Under CI=true the upstream tests must run: the newest release's archive (or MEGATRON_LM_DIR) is there."""
    if os.environ.get("CI") != "true":
        pytest.skip("only CI must have the archive")
    assert SOURCE, f"no upstream Megatron-LM {megatron_lm.TAG} archive: CI would skip the upstream tests"


def test_cpu_flags_are_added_only_where_absent():
    argv = ["pretrain_gpt.py", "--transformer-impl=transformer_engine", "--no-rope-fusion", "--lr", "1"]
    out = upstream.cpu_argv(argv)
    assert out[:len(argv)] == argv
    added = out[len(argv):]
    assert "--transformer-impl" not in added and "--no-rope-fusion" not in added  # the user's choice stays
    assert added[added.index("--distributed-backend") + 1] == "gloo"
    assert "--use-cpu-initialization" in added and "--no-gradient-accumulation-fusion" in added


def test_ranks_are_pinned_to_nodes_and_torchruns_rank_kept(monkeypatch):
    monkeypatch.setenv("MFT_NODE_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")  # torchrun ordered this node first
    monkeypatch.setenv("MFT_TORCHRUN_RANK", "unset")  # recorded, so restored after the test
    monkeypatch.delenv("MFT_TORCHRUN_RANK")
    assert upstream.pin_rank() == 2
    assert (os.environ["RANK"], os.environ["GROUP_RANK"], os.environ["MFT_TORCHRUN_RANK"]) == ("2", "1", "0")
    assert upstream.pin_rank() == 2 and os.environ["MFT_TORCHRUN_RANK"] == "0"  # idempotent
    from megatron_ft.trainer import distributed

    assert (distributed.stable_rank(), distributed.torchrun_rank()) == (2, 0)
    monkeypatch.delenv("MFT_NODE_RANK")
    assert upstream.pin_rank() is None


def test_triton_stand_in_answers_module_protocol_like_a_module():
    """``inspect`` walks sys.modules asking for ``__file__``: the stand-in must not answer it."""
    code = ("import sys, inspect\n"
            "from megatron_ft.megatron import upstream\n"
            "upstream._stand_in_triton_modules()\n"
            "m = sys.modules[upstream.TRITON_MODULES[0]]\n"
            "assert not hasattr(m, '__file__')\n"
            "f = m.enable_batch_invariant_mode\n"
            "try:\n    f()\nexcept RuntimeError as e:\n    print('RAISED', e)\n"
            "inspect.getmodule(inspect.currentframe())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RAISED" in out.stdout and "needs Triton" in out.stdout


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    if not SOURCE:
        pytest.skip("no upstream Megatron-LM")
    return megatron_lm.patched_tree(SOURCE, str(tmp_path_factory.mktemp("upstream") / "megatron-lm"))


WARM_UP = """
import sys, types
sys.path.insert(0, sys.argv[1])
sys.argv[1:] = []
import megatron.training.initialize as initialize
from megatron.training.global_vars import set_args
from torch._dynamo.utils import counters
args = types.SimpleNamespace(bias_gelu_fusion=False, bias_swiglu_fusion=False, bias_dropout_fusion=False,
                             bf16=False, fp16=False, ffn_hidden_size=16, hidden_size=8, tensor_model_parallel_size=1,
                             seq_length=4, context_parallel_size=1, micro_batch_size=1, swiglu=False,
                             sequence_parallel=False)
set_args(args)
initialize.set_jit_fusion_options()
print("off", counters["stats"]["unique_graphs"])
args.bias_dropout_fusion = True
initialize.set_jit_fusion_options()
print("on", counters["stats"]["unique_graphs"])
"""


@needs_upstream
def test_upstream_training_code_imports_with_the_projects_install(tree):
    """What upstream's training modules import (six, regex, megatron-core, ...) comes with the project's
    own install: in a new virtual environment this failed naming 'six' before the megatron extra had it."""
    assert megatron_lm.check_imports(tree) is None


def test_a_tree_that_does_not_import_is_refused_naming_the_missing_module(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("import os\nimport mft_absent_module.sub\n")
    with pytest.raises(megatron_lm.UpstreamImportError,
                       match=r"module 'mft_absent_module(\.sub)?' is missing.*pip install 'megatron-ft\[megatron\]'.*"
                             r"pip install mft_absent_module\)"):
        megatron_lm.check_imports(str(tmp_path))
    (tmp_path / "pretrain_gpt.py").write_text("raise SystemExit('upstream says no')\n")
    with pytest.raises(megatron_lm.UpstreamImportError, match=r"\(exit 1\):\nupstream says no"):
        megatron_lm.check_imports(str(tmp_path))


@pytest.mark.slow  # 28 s: a start-up saving, not a recovery; the default suite stays under 15 minutes
@needs_upstream
def test_the_cpu_layer_skips_the_warm_up_of_fusions_it_turned_off(tree):
    """Upstream compiles its fused bias+activation and bias+dropout+add functions at start whatever
    the fusion flags say; on CPU (fusions off) that compile is skipped, and it runs again when a
    fusion is turned on."""
    out = subprocess.run([sys.executable, "-c", WARM_UP, tree], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("off ", "on ")))
    assert lines["off"] == "0", out.stdout
    assert int(lines["on"]) > 0, out.stdout


HELP = """
import argparse, inspect, sys
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "upstream's own":
    from megatron_ft.megatron import upstream
    upstream._done.add("after")  # no bootstrap after the import: upstream's own behaviour
import megatron.training
from megatron.training import arguments
def help_text():  # every option's help (core_v0.19.0's own format_help fails on an unescaped '%' in one)
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(prog="p", allow_abbrev=False))
    return "\\n".join(f"{' '.join(a.option_strings)} {a.help}" for a in parser._actions)
first = help_text()
reads = []
orig = inspect.getsource
inspect.getsource = lambda obj: reads.append(obj) or orig(obj)
again = help_text()
print("READS", len(reads), first == again)
print(first)
"""


@pytest.mark.slow  # 14 s: a start-up saving, not a recovery; the default suite stays under 15 minutes
@needs_upstream
def test_argument_docstrings_are_read_once_per_process_and_say_the_same(tree):
    """Upstream reads its config dataclasses' field docstrings from their source at every parse (twice
    per start); with the bootstrap they are read once, at import, and the help says the same."""
    outs = {}
    for mode in ("upstream's own", "bootstrapped"):
        out = subprocess.run([sys.executable, "-c", HELP, tree, mode], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        head, _, help_text = out.stdout.partition("READS ")[2].partition("\n")
        outs[mode] = (head, help_text)
    assert outs["upstream's own"][0].split()[1] == "True" and int(outs["upstream's own"][0].split()[0]) > 0
    assert outs["bootstrapped"][0] == "0 True", outs["bootstrapped"][0]  # no source read for the second parser
    assert outs["bootstrapped"][1] == outs["upstream's own"][1] and "--hidden-size" in outs["bootstrapped"][1]


def demo(tmp_path, *args, iters=8, source=None):
    cmd = [sys.executable, "-m", "megatron_ft.cli", "demo", "--quiet", f"--megatron-lm={source or SOURCE}",
           f"--iters={iters}", f"--workdir={tmp_path / 'demo'}", *args]
    return run_demo(cmd)


@needs_upstream
def test_upstream_trainer_kill_resumes_from_local_memory_bit_exact(tmp_path):
    """Upstream pretrain_gpt.py of the newest release (TP1 PP2 DP2 on 2 simulated nodes x 2, dropout 0.1):
    one trainer SIGKILLed after iteration 4 resumes from its agent's memory, bit for bit. Its pretrain
    takes a configuration container built once, so no trainer rejoins in place: the keepers fork fresh
    trainers from the warm pool."""
    s = demo(tmp_path, "--fail=trainer", "--kill-at=4")
    assert s["megatron_lm_series"] == megatron_lm.TAG
    assert s["recovered_from"] == "local_memory" and 3 <= s["resumed_step"] <= 4, s
    assert s["restarted_by"] == "fast round 1" and s["kept_in_place"] == [], s
    log = open(tmp_path / "demo" / "run.log").read()
    assert "megatron.training from the spare pool; rank 0 pinned to node 0; CPU flags added" in log
    assert "in-process restart not offered (pretrain takes a configuration container" in log
    # the training-visible stall per snapshot is reported, beside a raw copy of the bytes and Megatron's save call
    st = s["snapshot_stall"]
    assert st and st["snapshots"] > 0 and st["failed"] == 0 and st["bytes_per_rank"] > 0, st
    assert st["raw_copy_s"] is not None and st["megatron_save_median_s"] is not None, st


@pytest.mark.slow
@pytest.mark.parametrize("release", OLDER)
def test_upstream_trainer_kill_on_an_older_release_rejoins_in_place(tmp_path, release):
    """The same on an older supported release (core_v0.16.1), whose pretrain parses its arguments itself:
    the survivors rejoin the round in their processes, built uninitialised."""
    source = megatron_lm.source(release)
    if not source:
        pytest.skip(f"no upstream Megatron-LM {release}")
    s = demo(tmp_path, "--fail=trainer", "--kill-at=4", source=source)
    assert s["megatron_lm_series"] == release
    assert s["recovered_from"] == "local_memory"
    assert 3 <= s["resumed_step"] <= 4
    # beneath torchrun: the killed rank re-forked, the survivors' pretrain() run again in their processes
    assert s["restarted_by"] == "fast round 1", s["restarted_by"]
    assert s["kept_in_place"] == [0, 1, 2], s
    # their second pretrain() ran with upstream's --no-initialization (their agents held versions)
    assert s["built_uninitialised"] == [0, 1, 2], s
    # forked from a pool that had imported megatron.training; ranks pinned and CPU flags added per trainer
    log = open(tmp_path / "demo" / "run.log").read()
    assert "megatron.training from the spare pool; rank 0 pinned to node 0; CPU flags added" in log
    assert "in-process restart offered" in log


PRODUCTION = ["--train-arg=--use-distributed-optimizer", "--train-arg=--overlap-param-gather",
              "--train-arg=--overlap-grad-reduce"]


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("scheme,optimizer,tier", [
    ("replica", [], "peer_memory"), ("replica", ["--train-arg=--use-distributed-optimizer"], "peer_memory"),
    ("replica", PRODUCTION, "peer_memory"), ("replica", [*PRODUCTION, "--train-arg=--bf16"], "peer_memory"),
    ("xor", [], "decoded"), ("rs", [], "decoded")],
    ids=["replica", "replica-distributed", "replica-overlapped", "replica-overlapped-bf16", "xor", "rs"])
def test_upstream_node_loss_resumes_from_the_group(tmp_path, release, scheme, optimizer, tier):
    """Production options among them: the distributed optimizer with its parameter all-gather deferred
    into the next forward pass and the gradient reduce-scatter overlapped with the backward pass (the
    snapshot is taken after Megatron's forced parameter sync), and bf16 with fp32 main parameters."""
    s = demo(tmp_path, "--fail=node", f"--redundancy={scheme}", "--kill-at=4", *optimizer,
             source=release_source(release))
    assert s["megatron_lm_series"] == release
    assert s["recovered_from"] == tier, s
    assert 1 <= s["newest_complete_at_loss"] <= s["resumed_step"] <= s["last_iteration_before_kill"], s


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("optimizer", [[], ["--train-arg=--use-distributed-optimizer"]], ids=["adam", "distributed"])
def test_upstream_all_trainers_of_a_node(tmp_path, release, optimizer):
    s = demo(tmp_path, "--fail=all-trainers", "--kill-at=4", *optimizer, source=release_source(release))
    assert s["recovered_from"] == "local_memory" and 3 <= s["resumed_step"] <= 4
    if release == megatron_lm.TAG:  # the newest release: every trainer a fresh one from the warm pool
        assert s["kept_in_place"] == [], s
    else:  # the other node's trainers rejoin in their processes
        assert len(s["kept_in_place"]) == 2, s


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("optimizer", [[], ["--train-arg=--use-distributed-optimizer"]], ids=["adam", "distributed"])
def test_upstream_node_loss_without_redundancy_resumes_from_the_persisted_step(tmp_path, release, optimizer):
    """--inmem-ckpt-persist-dir on the training command reaches the agents: after a node loss the job
    resumes from the newest step persisted whole before it (the demo reads the directory at the kill).
    Persisting every 3 steps, at least step 9 is on disk when iteration 12 ends."""
    s = demo(tmp_path, "--fail=node", "--kill-at=12", f"--train-arg=--inmem-ckpt-persist-dir={tmp_path / 'fast'}",
             "--train-arg=--inmem-ckpt-persist-interval=3", *optimizer, iters=16, source=release_source(release))
    assert s["newest_persisted_before_failure"] is not None and s["newest_persisted_before_failure"] >= 9, s
    assert s["recovered_from"] == "disk", s  # at least that step; one the survivors finished just after is as good
    assert s["newest_persisted_before_failure"] <= s["resumed_step"] <= s["last_iteration_before_kill"], s


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
def test_upstream_distributed_optimizer_resumes_bit_exact(tmp_path, release):
    """Without Apex/TE megatron-core's torch Adam keeps a step per parameter; the resume must give each
    the checkpoint's step (not the fresh optimizer's 0), or the bias correction restarts."""
    s = demo(tmp_path, "--fail=trainer", "--kill-at=4", "--train-arg=--use-distributed-optimizer",
             source=release_source(release))
    assert s["recovered_from"] == "local_memory" and 3 <= s["resumed_step"] <= 4


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
def test_upstream_production_options_after_a_trainer_kill(tmp_path, release):
    """The distributed optimizer, overlapped gradient reduce-scatter and parameter all-gather, bf16 with
    fp32 main parameters: a trainer kill resumes from local memory, bit for bit."""
    s = demo(tmp_path, "--fail=trainer", "--kill-at=4", *PRODUCTION, "--train-arg=--bf16",
             source=release_source(release))
    assert s["recovered_from"] == "local_memory" and 3 <= s["resumed_step"] <= 4


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
def test_upstream_node_loss_recovers_from_a_copy_the_scheduled_transport_sent(tmp_path, release):
    """``redundancy.transport: scheduled`` with upstream's loop (its training-loop hooks come from the
    patch series): the trainers profile, plan and send the peer copies themselves - the agents send
    none - so recovering the lost node from peer memory proves the copies arrived."""
    s = demo(tmp_path, "--fail=node", "--redundancy=replica", "--transport=scheduled", "--kill-at=6", iters=14,
             source=release_source(release))
    assert (s["transport"], s["recovered_from"]) == ("scheduled", "peer_memory"), s
    assert 1 <= s["newest_complete_at_loss"] <= s["resumed_step"] <= s["last_iteration_before_kill"], s
    files = [p for _, p in rank_files(str(tmp_path / "demo" / "run" / "transport"), ".json")]
    assert len(files) == 4, files  # written at each trainer's exit (atexit, also from a warm spare)
    for path in files:
        rec = json.load(open(path))
        assert rec["dsts"] and rec["transfers"], (path, rec.get("plan"))


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
def test_upstream_profiler_records_the_first_iterations(tmp_path, release):
    """``--inmem-ckpt-profile-iterations`` on upstream's command: every rank writes its timeline of
    the first W iterations (after a trainer kill, of the restarted generation's first W)."""
    s = demo(tmp_path, "--fail=trainer", "--kill-at=4", "--train-arg=--inmem-ckpt-profile-iterations=3",
             source=release_source(release))
    assert s["recovered_from"] == "local_memory" and 3 <= s["resumed_step"] <= 4
    profiles = [json.load(open(p)) for _, p in rank_files(str(tmp_path / "demo" / "run" / "profile"), ".json")]
    assert [p["rank"] for p in profiles] == [0, 1, 2, 3]
    for p in profiles:
        assert p["complete"] and len(p["iterations"]) == 3, {k: p[k] for k in ("rank", "complete")}
        kinds = {e["kind"] for it in p["iterations"] for e in it["events"]}
        assert {"compute", "optimizer"} <= kinds and ({"send", "recv"} & kinds), kinds


def captured_moe_state(workdir) -> dict:
    """What the ranks' snapshots of upstream's MoE state dict hold, read from the newest step the agents
    persisted (the same container as in memory): per rank the chained optimizer's parts, and over all
    ranks the keys of the sharded tensors whose bytes a snapshot holds (Megatron's ``fully_parallel``
    save deduplicates a replicated tensor onto one rank)."""
    import glob

    from megatron_ft.capture import snapfile

    steps = [d for d in sorted(glob.glob(os.path.join(workdir, "persist", "*", "step_*")))
             if os.path.exists(os.path.join(d, "MANIFEST.json"))]  # persisted whole
    assert steps, f"no step persisted whole under {workdir}/persist"
    step = steps[-1]
    parts, held = {}, set()
    for path in sorted(glob.glob(os.path.join(step, "rank_*.mft"))):
        with open(path, "rb") as f:
            buf = f.read()
        body = snapfile.read_version(buf, snapfile.read_header(buf))["extra"]["state_dict"]["body"]

        def walk(x):
            if isinstance(x, dict):
                st = x.get("state")
                if "$obj" in x and isinstance(st, dict) and "key" in st and isinstance(st.get("data"), dict) \
                        and "$t" in st["data"]:
                    held.add(st["key"])
                for v in x.values():
                    walk(v)
            elif isinstance(x, list):
                for v in x:
                    walk(v)

        walk(body["sharded"])
        optimizer = body["sharded"]["optimizer"]
        parts[os.path.basename(path)] = {k: json.dumps(v) for k, v in optimizer["$dict"]}
    return {"parts": parts, "held": held}


@pytest.mark.slow
@pytest.mark.parametrize("failure,tier", [(["--fail=trainer"], "local_memory"),
                                          (["--fail=node", "--redundancy=replica"], "peer_memory")],
                         ids=["trainer", "node-replica"])
@pytest.mark.parametrize("optimizer", [[], ["--train-arg=--use-distributed-optimizer"]], ids=["adam", "distributed"])
def test_upstream_moe_recovers_bit_exact(tmp_path, failure, tier, optimizer):
    """Upstream core_v0.19.0's own pretrain_gpt.py training a mixture-of-experts GPT (4 experts, top-2,
    expert parallelism 2 over DP4 on 2 nodes x 2, the allgather dispatcher, grouped GEMM off, the
    load-balancing loss, the router's expert bias): a trainer kill resumes from local memory, a node
    loss from its peer's copy, bit for bit - every rank's parameters and router buffers (the digest
    takes both) and loss at every iteration. The snapshots hold both parts of the chained optimizer
    (dense, expert) and the routers' expert bias."""
    # the trainer kill's agents also persist every 2nd step, whole: what the snapshots hold is read there
    persist = ["--train-arg=--inmem-ckpt-persist-interval=2"] if tier == "local_memory" else []
    s = demo(tmp_path, "--moe", *failure, "--kill-at=4", *optimizer, *persist, source=release_source(megatron_lm.TAG))
    assert s["megatron_lm_series"] == megatron_lm.TAG
    assert s["recovered_from"] == tier, s
    if tier == "local_memory":  # killed after iteration 4: its snapshot (4) or the one before
        assert 3 <= s["resumed_step"] <= 4, s
    else:  # the newest version the lost node's group had completed (a loaded machine: maybe one before)
        assert 1 <= s["newest_complete_at_loss"] <= s["resumed_step"] <= s["last_iteration_before_kill"], s
    with open(tmp_path / "demo" / "reference" / "args.json") as f:
        targs = json.load(f)["train_args"]
    for flag, value in (("--num-experts", "4"), ("--moe-router-topk", "2"), ("--expert-model-parallel-size", "2"),
                        ("--moe-token-dispatcher-type", "allgather"), ("--moe-aux-loss-coeff", "1e-2")):
        assert targs[targs.index(flag) + 1] == value, (flag, targs)
    assert "--moe-router-enable-expert-bias" in targs and "--moe-grouped-gemm" not in targs
    if tier != "local_memory":  # a node loss persists what it can; the capture is the trainer kill's check
        return
    cap = captured_moe_state(tmp_path / "demo")
    assert len(cap["parts"]) == 4, cap["parts"].keys()
    assert all(sorted(p) == [0, 1] for p in cap["parts"].values()), cap["parts"].keys()
    # the second part of the chain holds the experts' state: their keys (Adam), or its param groups say so
    # (the distributed optimizer's buckets)
    assert all(".experts." in p[1] or '"is_expert_parallel": true' in p[1] for p in cap["parts"].values())
    assert all(".experts." not in p[0] and '"is_expert_parallel": true' not in p[0] for p in cap["parts"].values())
    assert any(".experts." in k and not k.startswith(("optimizer", "chained")) for k in cap["held"])
    # the routers' bias, replicated on every rank, is saved by one of them
    assert any(k.endswith("mlp.router.expert_bias") for k in cap["held"]), sorted(cap["held"])[:20]
