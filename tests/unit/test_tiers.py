"""The promised recovery tiers (megatron_ft.tiers): the table every demo and chaos trial checks."""
import pytest

from megatron_ft import tiers


@pytest.mark.parametrize("failure,scheme,beyond,want", [
    ("trainer", "none", False, "local_memory"),
    ("all-trainers", "rs", False, "local_memory"),
    ("agent-then-trainer", "xor", False, "local_memory"),
    ("launcher", "replica", False, "local_memory"),
    ("corrupt", "none", False, "local_memory"),
    ("corrupt", "replica", False, "peer_memory"),
    ("node", "replica", False, "peer_memory"),
    ("node0", "replica", False, "peer_memory"),
    ("node", "xor", False, "decoded"),
    ("node", "rs", False, "decoded"),
    ("node", "rs", True, "disk"),
    ("node", "none", False, "disk"),
])
def test_promised_tier_table(failure, scheme, beyond, want):
    assert tiers.promised(failure, scheme, beyond) == want


def test_a_lower_tier_is_wrong_not_a_fallback():
    assert tiers.meets("decoded", "decoded") and tiers.meets("peer_memory", "decoded")
    assert tiers.meets("local_memory", "peer_memory")
    assert not tiers.meets("disk", "decoded") and not tiers.meets("none", "disk")
    assert not tiers.meets("decoded+disk", "decoded")  # the worst rank's tier counts
    assert tiers.lowest("local_memory+peer_memory") == "peer_memory"


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="failure 'nodes'"):
        tiers.promised("nodes", "rs")
    with pytest.raises(ValueError, match="tier 'memory'"):
        tiers.meets("memory", "disk")
