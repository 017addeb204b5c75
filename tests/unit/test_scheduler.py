"""Where ``megatron-ft launch`` runs in a Slurm step or a Kubernetes indexed Job (pure functions of
the environment a step's task or a pod gets)."""
import pytest

from megatron_ft import config as ftconfig
from megatron_ft.scheduler import Allocation, allocation, placed

STEP = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "81", "SLURM_STEP_NODELIST": "gpu-a[07-08],gpu-b01",
        "SLURM_STEP_NUM_NODES": "3", "SLURM_JOB_NODELIST": "gpu-a[07-08],gpu-b[01-02]", "SLURM_NNODES": "4"}


def test_a_slurm_step_places_this_host_by_its_name_among_the_steps_hosts():
    a = allocation({**STEP, "SLURMD_NODENAME": "gpu-b01", "SLURM_NODEID": "2"})
    assert (a.scheduler, a.index, a.hosts) == ("slurm", 2, ("gpu-a07", "gpu-a08", "gpu-b01"))
    # without the node's name, its index in the job
    assert allocation({**STEP, "SLURM_NODEID": "1"}).index == 1
    # the job's list when the step's is absent
    job = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP_") or k == "SLURM_STEP_ID"}
    assert allocation({**job, "SLURMD_NODENAME": "gpu-b02"}).hosts[-1] == "gpu-b02"


def test_outside_a_step_or_a_pod_nothing_is_placed():
    assert allocation({"SLURM_JOB_ID": "81", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "a[1-2]"}) is None
    assert allocation({}) is None


def test_a_kubernetes_pod_is_the_node_of_its_index():
    a = allocation({"JOB_COMPLETION_INDEX": "5"})
    assert (a.scheduler, a.index, a.hosts) == ("kubernetes", 5, ())
    assert a.node_rank(8) == 5


@pytest.mark.parametrize("env,match", [
    ({**STEP, "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "0"}, r"names 3 hosts but SLURM_STEP_NUM_NODES=2"),
    ({**STEP, "SLURM_STEP_NODELIST": "gpu[3-", "SLURM_NODEID": "0"}, r"SLURM_STEP_NODELIST='gpu\[3-' is invalid"),
    ({**STEP, "SLURM_NODEID": "7"}, r"SLURM_NODEID=7 is invalid: SLURM_STEP_NODELIST names 3 hosts"),
    ({**STEP}, r"no SLURM_NODEID: cannot tell this host's place"),
    ({"JOB_COMPLETION_INDEX": "x"}, r"JOB_COMPLETION_INDEX='x' is invalid: must be an integer"),
])
def test_an_environment_that_does_not_add_up_is_refused_naming_it(env, match):
    with pytest.raises(ftconfig.ConfigError, match=match):
        allocation(env)


def test_the_steps_first_hosts_are_the_nodes_unless_the_cluster_file_names_them():
    alloc = Allocation("slurm", 1, ("h1", "h2", "h3"), "")
    cfg = placed(ftconfig.from_dict({"cluster": {"nodes": 2}}), alloc)
    assert cfg.health.host_list(2) == ["h1", "h2"] and cfg.launch.master_addr == "h1"
    named = ftconfig.from_dict({"cluster": {"nodes": 2}, "health": {"host_pattern": "n{node}.ib"},
                                "launch": {"master_addr": "n0.ib"}})
    assert placed(named, alloc) == named
    with pytest.raises(ftconfig.ConfigError, match=r"allocation has 3 hosts .* but cluster.nodes=4"):
        placed(ftconfig.from_dict({"cluster": {"nodes": 4}}), alloc)


def test_a_host_beyond_the_nodes_is_a_standby():
    assert Allocation("slurm", 2, ("h1", "h2", "h3"), "SLURM_NODEID=2").node_rank(2) is None
