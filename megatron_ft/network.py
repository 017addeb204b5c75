"""The job's network: where megatron-ft's own servers listen, what the trainers' collectives are told,
and the check that refuses a node its peers could not reach.

* :func:`listen_address` - the address node ``node``'s servers (the agent's store server and peer
  transport, a rendezvous generation its launcher hosts) bind: ``network.interface``'s address when
  set, else the node's host (``health.host_of``; :func:`node_host`: a standby's own name when it took
  the node's place on a host of its own);
* :func:`trainer_env` - ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` from ``network.interface``,
  unless the environment already names them (the user's choice wins);
* :func:`megatron_ft.config.port_plan` - every port megatron-ft's own processes listen on, each moved by
  one setting (``megatron-ft config FILE --ports`` prints it as a firewall table, :func:`describe_ports`;
  a configuration whose ranges overlap is refused when it is read). None is picked by the kernel, and the
  agents' servers (the store, the peer transport) and the trainers' process-group store (a TCPStore given
  its listening socket: :func:`megatron_ft.spares.fast_restart.store_listener`) listen on the node's own
  address only; torch's own listeners are the exception (gloo's and NCCL's connections, and torchrun's
  rendezvous TCPStore bind every interface: docs/security.md);
* :func:`node_address_problem` - run by each launcher of a multi-host job before anything starts: a node
  whose own name resolves to a loopback address (Debian's installer writes ``127.0.1.1 <hostname>``
  into /etc/hosts), to nothing, or to no address of this host would advertise an address its peers
  cannot reach and the job would hang; the launcher ends the job instead (exit 2) with the name, the
  address and the fix.

The judgement is a pure function of what was resolved (:func:`name_problem`)::

    >>> name_problem("node2", ["127.0.1.1"], {"10.0.0.3", "127.0.0.1"}, "health.host_pattern")
    'node2 resolves to 127.0.1.1 here, a loopback address: the other hosts cannot reach this node under that name (health.host_pattern)'
    >>> name_problem("node2", ["10.0.0.3"], {"10.0.0.3", "127.0.0.1"}, "health.host_pattern") is None
    True
    >>> name_problem("node2", ["10.0.0.9"], {"10.0.0.3"}, "health.host_pattern")
    'node2 resolves to 10.0.0.9, which is not an address of this host (its addresses: 10.0.0.3) (health.host_pattern)'

The ports of a job of hosts of their own (on one machine, the per-node servers take one port per node)::

    >>> from megatron_ft.config import from_dict
    >>> cfg = from_dict({"cluster": {"nodes": 4}, "health": {"host_pattern": "node{node}"}})
    >>> for r in port_plan(cfg):
    ...     print(r.span, r.setting)
    29400-29407 launch.rdzv_port
    29500 health.store_port
    29600 network.peer_port
    29700-29703 launch.trainer_port
    >>> from_dict({"cluster": {"nodes": 4}, "launch": {"trainer_port": 29502}})
    Traceback (most recent call last):
    megatron_ft.config.ConfigError: launch.trainer_port=29502 is invalid: its ports 29502-29505 (the trainers' store) overlap 29500-29503 of health.store_port=29500 (the agents' coordination store); move one of them
"""
from __future__ import annotations

import ipaddress
import os
import socket
from typing import Iterable, Optional

import psutil

from .config import ConfigError, FTConfig, port_plan

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def local_addresses() -> dict[str, set[str]]:
    """Interface name -> its IPv4 addresses, on this host."""
    return {name: {a.address for a in addrs if a.family == socket.AF_INET}
            for name, addrs in psutil.net_if_addrs().items()}


def interface_address(name: str) -> str:
    """``name``'s IPv4 address on this host; a :class:`ConfigError` naming the interfaces there are."""
    found = local_addresses()
    addrs = sorted(found.get(name, ()))
    if not addrs:
        have = ", ".join(f"{n} ({', '.join(sorted(a)) or 'no IPv4'})" for n, a in sorted(found.items()))
        raise ConfigError(f"network.interface={name!r} is invalid on {socket.gethostname()}: "
                          + ("it has no IPv4 address" if name in found else "no such interface")
                          + f"; this host has {have}")
    return addrs[0]


#: set by a standby launcher that took a node's place on a host of its own, for the node's agent: the
#: name this host serves the node under (the cluster file's name for the node is the lost host's)
NODE_HOST_VARIABLE = "MFT_NODE_HOST"


def node_host(cfg: FTConfig, node: int, env: Optional[dict] = None) -> str:
    """The name node ``node`` is served under from this host: :data:`NODE_HOST_VARIABLE` when set, else
    the cluster file's name for it (``health.host_of``)."""
    env = os.environ if env is None else env
    return env.get(NODE_HOST_VARIABLE) or cfg.health.host_of(node)


def adopted(cfg: FTConfig, node: int, env: Optional[dict] = None) -> bool:
    """Whether node ``node`` runs here on a host other than the one the cluster file names for it (a
    standby took its place): the other nodes cannot reach it under its configured name."""
    return not cfg.health.one_machine and node_host(cfg, node, env) != cfg.health.host_of(node)


def listen_address(cfg: FTConfig, node: int) -> str:
    """Where node ``node``'s own servers listen (see the module docstring)."""
    if cfg.network.interface:
        return interface_address(cfg.network.interface)
    host = node_host(cfg, node)
    return "127.0.0.1" if host == "localhost" else host


def trainer_env(cfg: FTConfig, env: dict) -> dict:
    """``env`` with the collectives' interface variables from ``network.interface`` where unset."""
    out = dict(env)
    if cfg.network.interface:
        for var in IFNAME_VARIABLES:
            out.setdefault(var, cfg.network.interface)
    return out


def multi_host(cfg: FTConfig) -> bool:
    """Whether the job's nodes are meant to be hosts of their own (named hosts, or a rendezvous host
    that is not this machine's loopback)."""
    return not cfg.health.one_machine or not _is_loopback(cfg.launch.master_addr)


def _is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def resolve(name: str) -> list[str]:
    """The IPv4 addresses ``name`` resolves to here (empty: none)."""
    try:
        return sorted({ai[4][0] for ai in socket.getaddrinfo(name, None, socket.AF_INET)})
    except OSError:
        return []


def name_problem(name: str, resolved: list[str], local: Iterable[str], where: str) -> Optional[str]:
    """What is wrong with this host's name ``name`` resolving to ``resolved`` on a host whose addresses
    are ``local`` (None: nothing). ``where`` says where the name comes from."""
    if not resolved:
        return f"{name} does not resolve here ({where})"
    loop = [a for a in resolved if _is_loopback(a)]
    if loop:
        return (f"{name} resolves to {loop[0]} here, a loopback address: the other hosts cannot reach this node "
                f"under that name ({where})")
    mine = set(local)
    if not mine & set(resolved):
        others = ", ".join(sorted(a for a in mine if not _is_loopback(a))) or "none but loopback"
        return (f"{name} resolves to {', '.join(resolved)}, which is not an address of this host (its addresses: "
                f"{others}) ({where})")
    return None


FIX = ("make the name resolve to this host's address on the network the job's hosts share (/etc/hosts or "
       "DNS: Debian's installer maps the host name to 127.0.1.1), or name the hosts by names that do "
       "(health.hosts / health.host_pattern), and set network.interface to that network's interface "
       "(e.g. eth0), which the collectives are then told too")


def peer_port(cfg: FTConfig, node: int) -> int:
    """The port node ``node``'s agent serves its peers on."""
    return cfg.network.peer_port + (node if cfg.health.one_machine else 0)


def port_free(addr: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``addr`` now, as the servers bind it (``SO_REUSEADDR``: a port left in
    TIME_WAIT by a stopped server counts as free)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
            return True
        except OSError:
            return False


def rendezvous_ports(cfg: FTConfig, gen: int) -> list[int]:
    """The ports a launcher hosting rendezvous generation ``gen`` tries, in order: the range of
    ``launch.rdzv_port``, from ``rdzv_port + gen`` on, wrapping around.

    >>> from megatron_ft.config import from_dict
    >>> rendezvous_ports(from_dict({"launch": {"rdzv_port": 29400, "rdzv_ports": 3}}), 1)
    [29401, 29402, 29400]
    """
    lc = cfg.launch
    return [lc.rdzv_port + (gen + i) % lc.rdzv_ports for i in range(lc.rdzv_ports)]


def describe_ports(cfg: FTConfig) -> str:
    """:func:`port_plan` as a table for a firewall between the job's hosts (``megatron-ft config --ports``)."""
    rows = [("port(s)", "setting", "server", "listens in", "clients", "runs in")]
    rows += [(r.span, r.setting, r.what, r.server, r.clients, r.when) for r in port_plan(cfg)]
    rows.append(("any", "-", "gloo / NCCL connections, torch's TCPStore servers", "trainers, torchrun",
                 "the job's hosts: allow all TCP between them", "every job"))
    where = ("one machine: the per-node servers take port + node" if cfg.health.one_machine else
             "on each host")
    return f"TCP ports of run {cfg.run_id} ({where}; listening address: "\
           f"{'the address of ' + cfg.network.interface if cfg.network.interface else 'the node host name'})\n" + \
        "\n".join(" | ".join(row) for row in rows)


def node_address_problem(cfg: FTConfig, node: int, env: Optional[dict] = None) -> Optional[str]:
    """Why node ``node`` of a multi-host job cannot be reached by its peers as configured (None: it can,
    or the job runs on one machine). Resolves names; no connection is made."""
    if not multi_host(cfg):
        return None
    env = os.environ if env is None else env
    found = local_addresses()
    local = set().union(*found.values()) if found else set()
    if cfg.network.interface:
        try:
            local = {interface_address(cfg.network.interface)} | {a for a in local if _is_loopback(a)}
        except ConfigError as e:
            return str(e)
    checks = []
    if adopted(cfg, node, env):
        checks.append((node_host(cfg, node, env), f"this host's name, under which it took node {node}'s place "
                                                  f"({NODE_HOST_VARIABLE})"))
    elif not cfg.health.one_machine:
        where = "health.hosts" if cfg.health.hosts else "health.host_pattern"
        checks.append((cfg.health.host_of(node), f"node {node}'s name in {where}"))
    if not cfg.network.interface and not all(v in env for v in IFNAME_VARIABLES[:1]):
        checks.append((socket.gethostname(), "this host's name, which gloo advertises without network.interface "
                                             "or GLOO_SOCKET_IFNAME"))
    for name, where in checks:
        problem = name_problem(name, resolve(name), local, where)
        if problem:
            return f"node {node} cannot be reached by the other hosts: {problem}. Fix: {FIX}"
    return None
