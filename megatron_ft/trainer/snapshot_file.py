"""A rank's state written into a container file at once, on the calling thread: the same container as
the snapshot engine writes into its agent's slot (header, layout and version records, data checksummed
chunk by chunk), without an agent.

For a state that must be kept outside the node agents' memory by a process of its own - the
references and fixtures of the re-slicing tests, a hand-made container to inspect - and read back
with :class:`~megatron_ft.trainer.recovery.Container` like any slot or persisted file. The file appears
whole or not at all (written under a temporary name, then renamed).

Worked example: two tensors written and read back, their checksums verified on the way.

>>> import os, tempfile, torch
>>> from megatron_ft.capture.state import StateTensor
>>> from megatron_ft.trainer.recovery import Container
>>> path = os.path.join(tempfile.mkdtemp(), "rank0.mft")
>>> state = {"w": torch.arange(6.0), "step": torch.tensor([3])}
>>> write_snapshot_file(path, 7, [StateTensor(n, t) for n, t in state.items()], {"note": "x"}, {"rank": 0})
>>> c = Container(path)
>>> c.check_identity({"rank": 0}, 7)
>>> back = {n: torch.zeros_like(t) for n, t in state.items()}
>>> c.load_verified({n: StateTensor(n, t) for n, t in back.items()}); c.close()
>>> back["w"].tolist(), back["step"].tolist(), c.version["extra"]
([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [3], {'note': 'x'})
>>> os.unlink(path); os.rmdir(os.path.dirname(path))
"""
from __future__ import annotations

import mmap
import os

import numpy as np

from ..capture import checksum, snapfile
from ..capture.layout import plan_layout
from ..capture.state import StateTensor
from .snapshot import copy_and_sum

#: the default chunk size (bytes) a file's data is checksummed in, as the engine's default
CHUNK_BYTES = 4 << 20


def write_snapshot_file(path: str, step: int, tensors: list[StateTensor], extra: dict, identity: dict,
                        chunk_size: int = CHUNK_BYTES) -> None:
    """Write ``tensors`` (host tensors) and the JSON-safe ``extra`` as step ``step`` of a CLEAN container at
    ``path``, its identity ``identity``. Not collective; owns nothing after it returns."""
    layout = plan_layout([t.spec() for t in tensors], chunk_size, identity)
    layout_json = layout.to_json()
    geometry = snapfile.geometry_for(layout, layout_json)
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, geometry.total)
        with mmap.mmap(fd, geometry.total) as buf:
            snapfile.init_container(buf, layout_json, geometry)
            area = np.frombuffer(buf, np.uint8)[geometry.data_off: geometry.data_off + layout.data_nbytes]
            sums = copy_and_sum(layout, layout.all_pieces(), tensors, area)
            del area  # (no view of the mapping may outlive it)
            snapfile.write_version(buf, step, {"chunks": [f"{s:016x}" for s in sums], "checksum": checksum.ALGORITHM,
                                               "extra": extra, "identity": identity})
            snapfile.set_state(buf, snapfile.CLEAN)
            buf.flush()
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        os.close(fd)
