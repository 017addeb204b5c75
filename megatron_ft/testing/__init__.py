"""Test and demo harness: fault campaigns and helpers. Never imported by the runtime modules."""
