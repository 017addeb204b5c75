"""Persisted snapshots on disk: the same container bytes as in shared memory, written atomically,
and a per-step completion record so a restore never lists a step's rank files.

Directory layout::

    <persist.dir>/<run_id>/step_0000000120/rank_00003.mft        one per rank (any number of digits >= 5)
    <persist.dir>/<run_id>/step_0000000120/nodes/node_00001.json  one per node that wrote files of the step
    <persist.dir>/<run_id>/step_0000000120/MANIFEST.json          the step is complete (sealed)

Contracts:

* **Rank files.** Written by the agent of the node that holds the rank, to a temporary name,
  fsynced, renamed, and the directory fsynced: a file either exists whole or not at all.
* **Node markers.** When every one of a node's rank files of a step is durable, its agent writes
  ``nodes/node_<N>.json`` (:func:`mark_persisted`; the same atomic write): the ranks it wrote, each
  file's size and its version record's CRC32. A marker is never written before the files it names.
* **Manifest.** The agent whose marker makes the markers cover every rank ``0..world_size-1`` writes
  ``MANIFEST.json``: a temporary file, fsynced, then ``link`` to the final name, which fails if it
  exists, so exactly one writer wins and the manifest never changes once there. Two agents that
  finish at the same moment both see the other's marker (each writes its own before it looks); a
  shared filesystem that shows one of them late leaves the step sealed by its markers only (below).
  An agent reads the other markers only once ``nodes/`` holds enough of them to cover the world at
  its own rank count, so the job reads O(nodes) markers per step, not O(nodes^2).
* **Readers** (:func:`complete_steps`, on every rank's restore path) list the run directory (one
  entry per step) and per step read ``MANIFEST.json``: one open. Only a step without a manifest
  costs more: the ``nodes/`` directory (one entry per node) and each marker, O(nodes). A step is
  complete when its manifest says ``world_size >= W``, or else its valid markers' ranks cover
  ``0..W-1``. No reader lists the rank files of a step. Markers and manifests are explicit,
  versioned JSON (``docs/formats.md``); one that is missing, torn, of another format or version,
  run or step is ignored, never an error: the step is then incomplete unless the rest covers it.
* **Steps from before the markers** (rank files, no ``nodes/`` and no manifest) are *incomplete*:
  the restore does not fall back to listing their R files. The disk tier does not offer such a step
  (a job upgraded mid-run resumes from its memory tiers or a step persisted since); it is pruned
  like any other.
* What a reader may assume of a complete step: every rank's file was written whole. Not that it is
  still there or still good: restore verifies every chunk checksum, and a file a rank later renamed
  ``*.corrupt`` (refused or found corrupt) leaves the step listed; that rank's open fails and the
  restore's collective verdict skips the step.
* **Pruning.** Each agent keeps the newest ``persist.keep`` steps of its own ranks (:func:`prune`):
  for an older step it removes the manifest first (the step stops being complete before any file
  goes), then the markers naming its ranks, then its files; the last one removes the directory.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from ..capture import checksum, snapfile  # imported with the agent: its first persist must not pay for imports

_STEP_RE = re.compile(r"step_(\d{10,})$")
_RANK_RE = re.compile(r"rank_(\d{5,})\.mft$")  # zero-padded to 5 digits, wider above 99999
_NODE_RE = re.compile(r"node_(\d{5,})\.json$")
_WRITE_BLOCK = 64 << 20

NODES_DIR = "nodes"
MANIFEST = "MANIFEST.json"
MARKER_FORMAT = "megatron-ft-persist-node"
MANIFEST_FORMAT = "megatron-ft-persist-manifest"
RECORD_VERSION = 1  # of both; a reader ignores any other
_MAX_RECORD = 64 << 20  # a marker or manifest longer than this is not one of ours


def run_dir(base: str, run_id: str) -> str:
    return os.path.join(base, run_id)


def step_dir(base: str, run_id: str, step: int) -> str:
    return os.path.join(base, run_id, f"step_{step:010d}")


def rank_file(base: str, run_id: str, step: int, rank: int) -> str:
    """The persisted file of ``rank`` at ``step``; any non-negative rank.

    >>> os.path.basename(rank_file("/p", "run", 120, 3)), os.path.basename(rank_file("/p", "run", 120, 1_000_000))
    ('rank_00003.mft', 'rank_1000000.mft')
    >>> [int(_RANK_RE.match(f"rank_{r:05d}.mft").group(1)) for r in (0, 99999, 123456)]
    [0, 99999, 123456]
    """
    if rank < 0:
        raise ValueError(f"rank {rank} is negative")
    return os.path.join(step_dir(base, run_id, step), f"rank_{rank:05d}.mft")


def marker_file(base: str, run_id: str, step: int, node: int) -> str:
    """Node ``node``'s completion marker of ``step`` (written by :func:`mark_persisted`)."""
    return os.path.join(step_dir(base, run_id, step), NODES_DIR, f"node_{node:05d}.json")


def manifest_file(base: str, run_id: str, step: int) -> str:
    """The step's manifest: present only once every rank's file is durable."""
    return os.path.join(step_dir(base, run_id, step), MANIFEST)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_fsynced(tmp: str, pieces, flag: int) -> None:
    """Create ``tmp`` (``flag``: ``O_TRUNC`` or ``O_EXCL``), write every piece whole, fsync it; on any
    failure the file is removed and the error raised. The caller renames (or links) it into place."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | flag, 0o644)
    try:
        for chunk in pieces:
            written = 0
            while written < len(chunk):
                written += os.write(fd, chunk[written:])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)


def write_container(buf, path: str) -> int:
    """Atomically write the used part of a CLEAN container (header, records, data) to ``path``."""
    hdr = snapfile.read_header(buf)
    if hdr.state != snapfile.CLEAN:
        raise ValueError(f"refusing to persist a {snapfile.STATE_NAMES[hdr.state]} container")
    end = hdr.geometry.data_off + hdr.geometry.data_len
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    view = memoryview(buf)
    _write_fsynced(tmp, (view[off: min(end, off + _WRITE_BLOCK)] for off in range(0, end, _WRITE_BLOCK)),
                   os.O_TRUNC)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
    return end


def verify_container(buf) -> None:
    """Raise :class:`~megatron_ft.capture.snapfile.SnapshotFormatError` unless ``buf`` holds a CLEAN
    container whose record is well formed and every chunk matches its checksum."""
    hdr = snapfile.read_header(buf)
    if hdr.state != snapfile.CLEAN:
        raise snapfile.SnapshotFormatError(f"container is {snapfile.STATE_NAMES[hdr.state]}, not clean")
    layout = snapfile.read_layout(buf, hdr)
    version = snapfile.read_version(buf, hdr)
    sums = version.get("chunks", [])
    if version.get("checksum") not in checksum.READS or len(sums) != layout.num_chunks:
        raise snapfile.SnapshotFormatError(f"record has {len(sums)} {version.get('checksum')} checksums for "
                                           f"{layout.num_chunks} chunks")
    data_off = hdr.geometry.data_off
    if len(buf) < data_off + layout.data_nbytes:
        raise snapfile.SnapshotFormatError(f"container ends early ({len(buf)} bytes, needs "
                                           f"{data_off + layout.data_nbytes})")
    for i in range(layout.num_chunks):
        lo, hi = layout.chunk_bounds(i)
        got = checksum.checksum(np.frombuffer(buf, np.uint8, hi - lo, data_off + lo), version["checksum"])
        if f"{got:016x}" != sums[i]:
            raise snapfile.SnapshotFormatError(f"chunk {i} checksum mismatch (stored {sums[i]}, computed {got:016x})")


def node_marker(run_id: str, step: int, node: int, files: Mapping[int, tuple[int, int]]) -> dict:
    """The completion marker of node ``node`` for ``step``: ``files`` maps each rank it wrote to the
    file's size and its version record's CRC32 (pure; :func:`mark_persisted` writes it).

    >>> rec = node_marker("run", 120, 1, {123456: (8192, 0xDEADBEEF), 1_000_000: (4096, 7)})
    >>> rec["ranks"][0]
    {'rank': 123456, 'bytes': 8192, 'record_crc32': 'deadbeef'}
    >>> sorted(marker_ranks(rec, "run", 120))
    [123456, 1000000]
    >>> marker_ranks(rec, "run", 121) is None  # a marker of another step (or run, format, version) is no marker
    True
    """
    return {"format": MARKER_FORMAT, "version": RECORD_VERSION, "run_id": run_id, "step": step, "node": node,
            "ranks": [{"rank": r, "bytes": n, "record_crc32": f"{crc & 0xFFFFFFFF:08x}"}
                      for r, (n, crc) in sorted(files.items())]}


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _header_ok(rec: Any, fmt: str, run_id: str, step: int) -> bool:
    return (isinstance(rec, dict) and rec.get("format") == fmt and rec.get("version") == RECORD_VERSION
            and rec.get("run_id") == run_id and _is_count(rec.get("step")) and rec["step"] == step)


def marker_ranks(rec: Any, run_id: str, step: int) -> Optional[set[int]]:
    """The ranks a node marker of ``run_id``'s ``step`` vouches for, or ``None`` if ``rec`` is not
    a well-formed one (any other value, format, version, run or step)."""
    if not _header_ok(rec, MARKER_FORMAT, run_id, step) or not _is_count(rec.get("node")):
        return None
    entries = rec.get("ranks")
    if not isinstance(entries, list):
        return None
    ranks = set()
    for e in entries:
        if not (isinstance(e, dict) and _is_count(e.get("rank")) and _is_count(e.get("bytes"))
                and isinstance(e.get("record_crc32"), str) and re.fullmatch(r"[0-9a-f]{8}", e["record_crc32"])):
            return None
        ranks.add(e["rank"])
    return ranks


def manifest_world(rec: Any, run_id: str, step: int) -> Optional[int]:
    """The world size a manifest of ``run_id``'s ``step`` seals (every rank below it has its file),
    or ``None`` if ``rec`` is not a well-formed one."""
    if not _header_ok(rec, MANIFEST_FORMAT, run_id, step):
        return None
    w = rec.get("world_size")
    return w if _is_count(w) and w > 0 else None


def _read_record(path: str) -> Any:
    """The JSON value in ``path``; ``None`` when it is missing, unreadable, too long or not JSON."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_RECORD + 1)
        if len(raw) > _MAX_RECORD:
            return None
        return json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None


def _write_record(path: str, rec: dict, exclusive: bool = False) -> bool:
    """Write ``rec`` as JSON to ``path`` atomically and durably (temporary file, fsync, then rename,
    or with ``exclusive`` a ``link`` that fails if ``path`` exists; the directory fsynced).
    Returns ``False`` only when ``exclusive`` and ``path`` already existed (nothing written)."""
    d = os.path.dirname(path)
    tmp = f"{path}.tmp.{os.getpid()}.{os.urandom(4).hex()}"  # agents of different hosts may share a pid
    _write_fsynced(tmp, [memoryview(json.dumps(rec, sort_keys=True).encode())], os.O_EXCL)
    won = True
    try:
        if not exclusive:
            os.rename(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                won = False
            except OSError:  # a filesystem without hard links: the content is the same whoever renames last
                won = not os.path.exists(path)
                if won:
                    os.rename(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(d)
    return won


def _marker_nodes(base: str, run_id: str, step: int) -> list[int]:
    """The nodes with a marker file of the step (one listing of ``nodes/``, O(nodes) entries)."""
    try:
        with os.scandir(os.path.join(step_dir(base, run_id, step), NODES_DIR)) as it:
            names = [e.name for e in it]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [int(m.group(1)) for m in map(_NODE_RE.match, names) if m]


def _markers(base: str, run_id: str, step: int, nodes: Optional[list[int]] = None) -> dict[int, set[int]]:
    """node -> ranks, of the step's well-formed markers (O(nodes): one listing, one read each)."""
    out: dict[int, set[int]] = {}
    for node in _marker_nodes(base, run_id, step) if nodes is None else nodes:
        rec = _read_record(marker_file(base, run_id, step, node))
        ranks = marker_ranks(rec, run_id, step)
        if ranks is not None and rec["node"] == node:
            out[node] = ranks
    return out


def _covers(ranks: set[int], world_size: int) -> bool:
    return all(r in ranks for r in range(world_size))


def seal(base: str, run_id: str, step: int, world_size: int, min_markers: int = 0) -> bool:
    """Write the step's manifest if its markers cover every rank ``0..world_size-1`` and no manifest
    exists yet (exactly one concurrent caller writes it). Returns whether the step is sealed by a
    manifest now, whoever wrote it. With fewer than ``min_markers`` marker files the markers are not
    read (the caller knows the set cannot be complete yet): the step is left unsealed."""
    if os.path.exists(manifest_file(base, run_id, step)):
        return True
    nodes = _marker_nodes(base, run_id, step)
    if len(nodes) < min_markers:
        return False
    markers = _markers(base, run_id, step, nodes)
    covered = set().union(*markers.values()) if markers else set()
    if world_size <= 0 or not _covers(covered, world_size):
        return False
    rec = {"format": MANIFEST_FORMAT, "version": RECORD_VERSION, "run_id": run_id, "step": step,
           "world_size": world_size, "nodes": sorted(markers)}
    _write_record(manifest_file(base, run_id, step), rec, exclusive=True)
    return True


def mark_persisted(base: str, run_id: str, step: int, node: int, containers: Mapping[int, Any],
                   world_size: int) -> bool:
    """Node ``node``'s agent, once the files of ``step`` of all its ranks are durable (written by
    :func:`write_container`): write its marker listing them (``containers``: rank -> the CLEAN container
    each file was written from, for its size and record CRC), then :func:`seal` the step if this
    marker completes the set. Returns whether the step is sealed by a manifest.

    Cost: one listing of ``nodes/``; the markers are read only once there are as many as the world
    needs at this node's rank count (nodes holding equal numbers of ranks: only the last to finish
    reads them), so a step costs the job O(nodes) marker reads, not O(nodes^2). Were nodes to hold
    unequal numbers, the step may stay sealed by its markers alone, which readers accept."""
    files = {}
    for rank, buf in containers.items():
        hdr = snapfile.read_header(buf)
        files[rank] = (hdr.geometry.data_off + hdr.geometry.data_len, hdr.version_crc)
    path = marker_file(base, run_id, step, node)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _fsync_dir(step_dir(base, run_id, step))  # the nodes/ entry is durable before the marker in it
    _write_record(path, node_marker(run_id, step, node, files))
    if not files:  # nothing of this node's completes the set
        return os.path.exists(manifest_file(base, run_id, step))
    return seal(base, run_id, step, world_size, min_markers=-(-world_size // len(files)))


def step_complete(base: str, run_id: str, step: int, world_size: int) -> bool:
    """Whether every rank ``0..world_size-1`` has a whole file of ``step``: by its manifest (one read),
    else by its markers (O(nodes)); never by listing rank files."""
    w = manifest_world(_read_record(manifest_file(base, run_id, step)), run_id, step)
    if w is not None and w >= world_size:
        return True
    markers = _markers(base, run_id, step)
    return _covers(set().union(*markers.values()) if markers else set(), world_size)


def _steps(base: str, run_id: str) -> list[int]:
    try:
        names = os.listdir(run_dir(base, run_id))
    except FileNotFoundError:
        return []
    return [int(m.group(1)) for m in map(_STEP_RE.match, names) if m]


def list_steps(base: str, run_id: str) -> dict[int, set[int]]:
    """step -> set of ranks that have a (whole) file for it. Lists every step directory: O(ranks) per
    step, for tools and tests; the restore path uses :func:`complete_steps`."""
    out: dict[int, set[int]] = {}
    root = run_dir(base, run_id)
    for step in _steps(base, run_id):
        ranks = set()
        try:
            names = os.listdir(os.path.join(root, f"step_{step:010d}"))
        except FileNotFoundError:  # pruned meanwhile
            continue
        for f in names:
            r = _RANK_RE.match(f)
            if r:
                ranks.add(int(r.group(1)))
        out[step] = ranks
    return out


def complete_steps(base: str, run_id: str, world_size: int) -> list[int]:
    """Steps for which every rank 0..world_size-1 has a file, newest first (:func:`step_complete`:
    one listing of the run directory, then one read per step, O(nodes) for a step without manifest)."""
    return sorted((s for s in _steps(base, run_id) if step_complete(base, run_id, s, world_size)), reverse=True)


def prune(base: str, run_id: str, ranks: Iterable[int], keep: int, protect: Optional[int] = None) -> list[str]:
    """Delete the files of ``ranks`` for all but the newest ``keep`` steps that have any (never
    ``protect``). Per pruned step: the manifest first, then the markers naming any of ``ranks``, then
    the files; the step directory goes with the last marker (with the last rank file for a step
    without markers). Returns the rank files removed."""
    removed = []
    ranks = sorted(set(ranks))

    def has_mine(s: int) -> bool:  # a refused file (*.corrupt) still counts: its marker is pruned with it
        return any(os.path.exists(p) or os.path.exists(p + ".corrupt")
                   for p in (rank_file(base, run_id, s, r) for r in ranks))
    mine = sorted((s for s in _steps(base, run_id) if has_mine(s)), reverse=True)
    for s in mine[keep:]:
        if s == protect:
            continue
        try:
            os.unlink(manifest_file(base, run_id, s))
        except FileNotFoundError:
            pass
        markers = _markers(base, run_id, s)
        for node, theirs in markers.items():
            if theirs.intersection(ranks):
                try:
                    os.unlink(marker_file(base, run_id, s, node))
                except FileNotFoundError:
                    pass
        for r in ranks:
            for p in (rank_file(base, run_id, s, r), rank_file(base, run_id, s, r) + ".corrupt"):
                try:
                    os.unlink(p)
                    removed.append(p)
                except FileNotFoundError:
                    pass
        d = step_dir(base, run_id, s)
        try:
            if os.path.isdir(os.path.join(d, NODES_DIR)):
                last = not _markers(base, run_id, s)
            else:  # no node marked the step (written before markers, or its writers died first)
                last = not any(_RANK_RE.match(f) for f in os.listdir(d))
        except FileNotFoundError:
            continue
        if last:
            shutil.rmtree(d, ignore_errors=True)
    return removed
