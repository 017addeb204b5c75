"""Where a run's per-rank files go: one directory per node, so that no directory holds a file per rank.

Layout (``base`` is one kind's directory: ``$MFT_RUN_DIR/events``, ``.../profile``, ``.../transport``,
``.../faults``)::

    <base>/node<N>/rank<R><suffix>     one per rank of node N, e.g. events/node3/rank27.jsonl
    <base>/node<N>/<name>              the node's own files, e.g. events/node3/agent.jsonl

so a directory holds at most a node's ranks' files (plus the node's own) and ``base`` one directory
per node: at 1,000,000 ranks on 8 per node, 125,000 entries in ``base`` and 8 in each node's.

Contracts:

* Ranks and nodes are non-negative integers written in decimal without padding, any size (no ceiling
  at 99,999 or 65,535); a negative or non-integer one is a ``ValueError`` naming the value. Names
  are short: ``node<N>/rank<R>`` of a rank below 10**7 is under 30 bytes.
* Writers name their path with :func:`rank_path` / :func:`node_path` and the node they run on
  (:func:`process_node` when they have no better source). Readers do not need the node: they glob
  (:func:`rank_files`, :func:`find_rank_file`, :func:`all_files`), and they also find the flat layout
  (``<base>/rank<R><suffix>``) that earlier versions wrote, so a directory from an older run still reads.
* A listing is ordered by rank as a number (``rank99999`` before ``rank123456``), never by name.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Mapping, Optional

_NODE_DIR_RE = re.compile(r"node(\d+)$")


def _check(what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}={value!r} is invalid: a non-negative integer")
    return value


def node_dir(base: str, node: int) -> str:
    """``<base>/node<node>``: the directory of node ``node``'s files of one kind."""
    return os.path.join(base, f"node{_check('node', node)}")


def rank_path(base: str, rank: int, suffix: str, node: int) -> str:
    """``<base>/node<node>/rank<rank><suffix>``: the file of ``rank`` (which runs on ``node``).

    >>> rank_path("/run/events", 999_999, ".jsonl", 124_999)
    '/run/events/node124999/rank999999.jsonl'
    """
    return os.path.join(node_dir(base, node), f"rank{_check('rank', rank)}{suffix}")


def node_path(base: str, node: int, name: str) -> str:
    """``<base>/node<node>/<name>``: a file of the node itself (its agent's, say), beside its ranks'."""
    if not name or "/" in name or name.startswith("rank"):
        raise ValueError(f"name={name!r} is invalid: a plain file name not starting with 'rank'")
    return os.path.join(node_dir(base, node), name)


def process_node(rank: int = 0, env: Optional[Mapping[str, str]] = None) -> int:
    """The node this process's files go under: ``MFT_NODE_RANK`` (``megatron-ft launch``'s stable
    node), else torchrun's ``GROUP_RANK``, else ``rank // LOCAL_WORLD_SIZE``, else 0 (one process)."""
    env = os.environ if env is None else env
    for name in ("MFT_NODE_RANK", "GROUP_RANK"):
        if env.get(name, "") != "":
            try:
                return _check(name, int(env[name]))
            except ValueError:
                raise ValueError(f"{name}={env[name]!r} is invalid: a non-negative integer") from None
    local = env.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return _check("rank", rank) // int(local)
    return 0


def _rank_of(name: str, suffix: str) -> Optional[int]:
    if not (name.startswith("rank") and name.endswith(suffix)):
        return None
    digits = name[4:len(name) - len(suffix)]
    return int(digits) if digits.isdigit() else None


def rank_files(base: str, suffix: str) -> list[tuple[int, str]]:
    """Every rank's file of ``suffix`` under ``base`` (``node*/rank<R><suffix>`` and the flat
    ``rank<R><suffix>``) as ``(rank, path)``, ordered by rank as a number; ``[]`` if ``base`` is absent."""
    out = []
    nested = [p for p in glob.glob(os.path.join(glob.escape(base), "node*", f"rank*{suffix}"))
              if _NODE_DIR_RE.match(os.path.basename(os.path.dirname(p)))]
    for path in (*nested, *glob.glob(os.path.join(glob.escape(base), f"rank*{suffix}"))):
        r = _rank_of(os.path.basename(path), suffix)
        if r is not None and os.path.isfile(path):
            out.append((r, path))
    return sorted(out)


def find_rank_file(base: str, rank: int, suffix: str, node: Optional[int] = None) -> Optional[str]:
    """The file of ``rank`` under ``base``: under ``node`` when given and there, else under any node
    (a glob of one name), else the flat layout's; None if there is none."""
    if node is not None and os.path.isfile(p := rank_path(base, rank, suffix, node)):
        return p
    name = f"rank{_check('rank', rank)}{suffix}"
    found = sorted(p for p in glob.glob(os.path.join(glob.escape(base), "node*", name))
                   if _NODE_DIR_RE.match(os.path.basename(os.path.dirname(p))))
    if found:
        return found[0]
    flat = os.path.join(base, name)
    return flat if os.path.isfile(flat) else None


def all_files(base: str, suffix: str = "") -> list[str]:
    """Every file ending in ``suffix`` under ``base``, in both layouts (ranks' and nodes' own files):
    for readers that take every record of a kind. Ordered by node, then rank, numerically."""
    def key(path: str):
        parent = _NODE_DIR_RE.match(os.path.basename(os.path.dirname(path)))
        r = _rank_of(os.path.basename(path), suffix)
        return (int(parent.group(1)) if parent else -1, r is None, r if r is not None else 0, path)

    paths = [p for p in (*glob.glob(os.path.join(glob.escape(base), f"*{suffix}")),
                         *(p for p in glob.glob(os.path.join(glob.escape(base), "node*", f"*{suffix}"))
                           if _NODE_DIR_RE.match(os.path.basename(os.path.dirname(p)))))
             if os.path.isfile(p)]
    return sorted(paths, key=key)
