"""In-process restart under NCCL, the decisions that run on CPU: the trainers' ``TORCH_NCCL_*``
defaults, the NCCL abort's choice and order with stand-in ``distributed_c10d`` modules, the sticky CUDA
error classifier, the grace per backend, and that a trainer which cannot rejoin ends instead of saying
``restarting``.

What only a GPU machine can check (not run here): the abort of real NCCL communicators inside one group
start/end unblocking a collective whose peer died (2+ GPUs, one process each), ``torch.cuda.synchronize``
under a sticky error (an illegal-address kernel) raising the messages classified here, and the watchdog
leaving a survivor alive under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``.
"""
from types import SimpleNamespace

import pytest

from megatron_ft.config import ConfigError, from_dict
from megatron_ft.spares import fast_restart as fr
from megatron_ft.trainer import in_process
from test_in_process import keeper, recv, with_keeper  # noqa: F401 - keeper is a fixture
from megatron_ft.transport import wire


# ---------------------------------------------------------------- the trainers' NCCL environment
def test_nccl_env_defaults_keep_the_watchdog_from_ending_a_survivor():
    env = in_process.nccl_env_defaults(True)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert in_process.nccl_env_defaults(False) == {}  # every trainer replaced: torch's teardown is fine


def test_the_users_nccl_settings_win():
    """Applied as ``megatron-ft launch`` does (setdefault on the environment torchrun inherits)."""
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "PATH": "/bin"}
    for var, value in in_process.nccl_env_defaults(True).items():
        env.setdefault(var, value)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "PATH": "/bin"}


def test_the_launcher_applies_them_only_with_in_process_restart():
    import inspect

    from megatron_ft import launch

    src = inspect.getsource(launch.NodeLauncher._run)
    block = src[src.index("if self.cfg.launch.in_process_restart:"):]
    assert "nccl_env_defaults(True)" in block and "env.setdefault(var, value)" in block


def test_the_launcher_leaves_gloo_eager_unless_the_environment_asks_for_lazy():
    """The gloo defaults reach the environment torchrun passes on, applied before and independently of
    the in-process restart's settings; lazy gloo is not among them (a dead peer's pair that never
    connected makes a collective wait out its whole timeout: docs/architecture.md, "At scale: groups")."""
    import inspect

    from megatron_ft import launch

    assert "TORCH_GLOO_LAZY_INIT" not in launch.GLOO_ENV_DEFAULTS
    src = inspect.getsource(launch.NodeLauncher._run)
    block = src[src.index("for var, value in GLOO_ENV_DEFAULTS.items():"):]
    assert block.index("env.setdefault(var, value)") < block.index("if self.pool is not None:")
    assert src.index("GLOO_ENV_DEFAULTS") > src.index("env = network.trainer_env(")  # the trainers' env, not the launcher's
    assert src.index("GLOO_ENV_DEFAULTS") < src.index("self._run_torchrun(env)")


# ---------------------------------------------------------------- the abort
class FakeGroup:
    def __init__(self, name, backend, calls, group_calls=True):
        self.name, self.backend, self.calls = name, backend, calls
        self.nccl = SimpleNamespace()
        if group_calls:
            self.nccl._group_start = lambda: calls.append("group_start")
            self.nccl._group_end = lambda: calls.append("group_end")

    def _get_backend(self, device):
        assert str(device) == "cuda"
        return self.nccl

    def abort(self):
        self.calls.append(f"abort {self.name}")


def fake_c10d(groups, initialized=True):
    """A stand-in for ``torch.distributed.distributed_c10d``: the registry (creation order) and the
    calls the shim makes."""
    return SimpleNamespace(is_initialized=lambda: initialized, get_backend=lambda pg: pg.backend,
                           _world=SimpleNamespace(pg_map={g: None for g in groups}))


def test_nccl_groups_are_aborted_newest_first_inside_one_group_start_end():
    calls = []
    world, tp, dp = (FakeGroup(n, "nccl", calls) for n in ("world", "tp", "dp"))
    cpu = FakeGroup("gloo-side", "gloo", calls)
    assert in_process._abort_nccl_groups(fake_c10d([world, tp, cpu, dp]), "cuda") == in_process.ABORTED
    assert calls == ["group_start", "abort dp", "abort tp", "abort world", "group_end"]  # gloo: sockets


def test_a_group_with_an_nccl_side_counts_and_a_gloo_only_process_aborts_nothing():
    calls = []
    mixed = FakeGroup("mixed", "cpu:gloo,cuda:nccl", calls)
    assert in_process._abort_nccl_groups(fake_c10d([mixed]), "cuda") == in_process.ABORTED
    assert calls == ["group_start", "abort mixed", "group_end"]
    calls.clear()
    gloo = FakeGroup("world", "gloo", calls)
    assert in_process._abort_nccl_groups(fake_c10d([gloo]), "cuda") == in_process.NO_NCCL
    assert in_process._abort_nccl_groups(fake_c10d([], initialized=False), "cuda") == in_process.NO_NCCL
    assert calls == []


def test_without_group_start_end_several_nccl_groups_are_not_aborted_and_one_is():
    calls = []
    groups = [FakeGroup(n, "nccl", calls, group_calls=False) for n in ("world", "tp")]
    assert in_process._abort_nccl_groups(fake_c10d(groups), "cuda") == in_process.NO_SAFE_ABORT
    assert calls == []  # nothing half-aborted: a fresh process takes this one's place
    assert in_process._abort_nccl_groups(fake_c10d(groups[:1]), "cuda") == in_process.ABORTED
    assert calls == ["abort world"]  # a single communicator cannot deadlock with another


def test_the_private_names_the_shim_uses_exist_in_this_torch():
    """Caught here when a torch upgrade renames them (the shim's comment names the version checked)."""
    import torch
    import torch.distributed.distributed_c10d as c10d

    assert isinstance(c10d._world.pg_map, dict) and callable(c10d.get_backend) and callable(c10d.is_initialized)
    assert hasattr(c10d.ProcessGroup, "_get_backend") and hasattr(c10d.ProcessGroup, "abort")
    nccl = getattr(torch._C._distributed_c10d, "ProcessGroupNCCL", None)  # absent from CPU builds
    if nccl is not None:
        assert hasattr(nccl, "_group_start") and hasattr(nccl, "_group_end")


def test_abort_round_on_cpu_shuts_the_sockets_and_allows_the_rejoin(monkeypatch):
    monkeypatch.setattr(in_process, "_ROUND_SOCKETS", None)
    assert in_process.abort_round(1) is None


def test_abort_round_refuses_the_rejoin_when_the_nccl_abort_cannot_be_made_safely(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(in_process, "_ROUND_SOCKETS", None)
    calls = []
    unsafe = [FakeGroup(n, "nccl", calls, group_calls=False) for n in ("world", "tp")]
    monkeypatch.setattr(dist, "distributed_c10d", fake_c10d(unsafe))
    why = in_process.abort_round(1)
    assert why is not None and "no NCCL group start/end" in why and calls == []

    failing = [FakeGroup(n, "nccl", calls) for n in ("world", "tp")]
    failing[1].abort = lambda: (_ for _ in ()).throw(RuntimeError("NCCL communicator was aborted"))
    monkeypatch.setattr(dist, "distributed_c10d", fake_c10d(failing))
    assert "aborting the NCCL groups failed: RuntimeError" in in_process.abort_round(1)
    assert calls == ["group_start", "group_end"]  # the group ended all the same


# ---------------------------------------------------------------- sticky CUDA errors
@pytest.mark.parametrize("code", [214, 700, 702, 710, 714, 715, 716, 717, 718, 719, 999])
def test_sticky_codes(code):
    assert in_process.sticky_cuda_error(code)
    assert in_process.sticky_cuda_error(SimpleNamespace(error_code=code))


@pytest.mark.parametrize("code", [0, 1, 2, 98, 209, 701, 720, 801])  # invalid value, OOM, no kernel, ...
def test_recoverable_codes(code):
    assert not in_process.sticky_cuda_error(code)


class AcceleratorError(RuntimeError):
    """Like torch's: the CUDA error code on the exception."""

    def __init__(self, message, code):
        super().__init__(message)
        self.error_code = code


@pytest.mark.parametrize("error,sticky", [
    (RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                  "asynchronously reported at some other API call"), True),
    (RuntimeError("CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA`"), True),
    (RuntimeError("CUDA error: unspecified launch failure"), True),
    (RuntimeError("CUDA error: misaligned address"), True),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), True),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1, unhandled cuda error, ncclUnhandledCudaError: "
                  "Call to CUDA function failed.\nLast error:\nCuda failure 700 'an illegal memory access'"), True),
    (AcceleratorError("CUDA error: whatever the text", 716), True),
    (AcceleratorError("CUDA error: an illegal memory access was encountered", 2), False),  # the code decides
    (RuntimeError("CUDA error: out of memory"), False),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("Connection closed by peer [127.0.0.1]:29500"), False),
    (RuntimeError("NCCL communicator was aborted on rank 1"), False),
    (ValueError("an illegal memory access was encountered"), False),  # not a CUDA error's message
])
def test_sticky_messages(error, sticky):
    assert in_process.sticky_cuda_error(error) is sticky


def test_a_sticky_error_anywhere_in_the_chain_counts():
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as e:
            raise RuntimeError("the training step failed") from e
    except RuntimeError as outer:
        assert in_process.sticky_cuda_error(outer)
    assert not in_process.sticky_cuda_error(None)


def test_the_device_check_is_a_no_op_without_cuda():
    assert in_process.device_problem(0.0) is None  # CPU: nothing waited for
    assert in_process.device_check_s(10.0) == 5.0 < fr.AUTO_GRACE_S["nccl"]


# ---------------------------------------------------------------- the grace
def test_the_grace_per_backend():
    assert fr.effective_grace("auto", "gloo") == 2.0  # as tuned on CPU
    assert fr.effective_grace("auto", "nccl") > fr.effective_grace("auto", "gloo")
    assert fr.effective_grace(3.5, "nccl") == fr.effective_grace(3.5, "gloo") == 3.5  # a number is taken as is
    assert fr.in_process_grace({"MFT_IN_PROCESS_GRACE_S": "auto"}, "nccl") == fr.AUTO_GRACE_S["nccl"]
    assert fr.in_process_grace({"MFT_IN_PROCESS_GRACE_S": "auto"}) == 2.0  # no GPU here: gloo's
    assert fr.in_process_grace({"MFT_IN_PROCESS_GRACE_S": "2.0"}, "nccl") == 2.0  # an older launcher's value
    assert fr.in_process_grace({}, "nccl") is None and fr.in_process_grace({"MFT_IN_PROCESS_GRACE_S": "soon"}) is None
    assert fr.trainer_backend() == "gloo"


def test_the_grace_setting_takes_auto_or_seconds():
    assert from_dict({}).launch.in_process_grace_s == "auto"
    assert from_dict({"launch": {"in_process_grace_s": 3}}).launch.in_process_grace_s == 3.0
    for bad in (0.05, "soon", True):
        with pytest.raises(ConfigError, match=r"launch\.in_process_grace_s=.* is invalid: must be a number >= 0\.1 "
                                              r"\(seconds\) or 'auto'"):
            from_dict({"launch": {"in_process_grace_s": bad}})


def test_a_trainer_that_is_asked_ends_after_a_round_exits_fresh_only_for_a_failure():
    assert fr.rejoins_fresh(fr.Round(1, budget=1), 1)  # the round is open: its budget was spent already
    assert not fr.rejoins_fresh(fr.Round(1, budget=3), 0)


# ---------------------------------------------------------------- the trainer's decision
def test_a_sticky_cuda_error_ends_the_trainer_without_asking_for_a_round(keeper):  # noqa: F811
    def train(number):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        in_process.run(train)
    assert recv(keeper).op == "rejoinable"
    keeper.setblocking(False)  # no "failed": a process with an unusable context is replaced, as a crash
    with pytest.raises(BlockingIOError):
        keeper.recv(4096)


def test_a_device_problem_ends_the_trainer_instead_of_saying_restarting(keeper, monkeypatch):  # noqa: F811
    monkeypatch.setenv("MFT_IN_PROCESS_GRACE_S", "4")
    waited = []

    def stuck(deadline_s):
        waited.append(deadline_s)
        return "torch.cuda.synchronize() did not return within 2.0 s"

    monkeypatch.setattr(in_process, "device_problem", stuck)

    def train(number):
        raise RuntimeError("Connection closed by peer")

    def play_keeper():
        recv(keeper), recv(keeper)
        wire.send_packet(keeper, {"op": "round", "round": 1, "port": 2345})

    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        with_keeper(play_keeper, lambda: in_process.run(train))
    assert waited == [2.0]  # half of this trainer's grace
    keeper.setblocking(False)  # no "restarting": the keeper forks a fresh trainer into round 1
    with pytest.raises(BlockingIOError):
        keeper.recv(4096)
