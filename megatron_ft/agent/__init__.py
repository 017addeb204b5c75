"""The per-node snapshot agent: shared-memory slots, versions, persistence, restore service."""
