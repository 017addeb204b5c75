"""megatron-ft: in-memory fault tolerance for Megatron-LM (megatron-core) and DeepSpeed.

The data path, one module each:

    trainer state (state.py, megatron/state.py)
      -> layout (layout.py: flat chunks, metadata, checksums)
      -> staging copy (snapshot.py: background, bucketed, double buffer)
      -> agent shared memory (shm.py, agent/server.py: versions, serve restores)
      -> disk (agent/persist.py: atomic, verified)

Restore runs the path backwards (recovery.py): local agent memory first, then disk.
"""

__version__ = "0.1.0"
