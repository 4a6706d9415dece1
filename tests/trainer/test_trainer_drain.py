"""The rollout pod's preStop hook finds its own Ray node (rlhf_trainer.drain.local_node): the one alive
node at the pod's address, and none when that is not a single node (then it drains nothing)."""

from __future__ import annotations

import pytest
from rlhf_trainer.drain import local_node

pytestmark = pytest.mark.unit


def test_the_pods_node_is_the_one_alive_node_at_its_address() -> None:
    nodes = {"aa": ("10.0.0.5", True), "bb": ("10.0.0.6", True), "cc": ("10.0.0.5", False)}
    assert local_node(nodes, "10.0.0.5") == "aa"  # the dead node that had the address before is not it
    assert local_node(nodes, "10.0.0.6") == "bb"


def test_no_node_or_two_at_the_address_drain_nothing() -> None:
    assert local_node({"aa": ("10.0.0.5", True)}, "10.0.0.9") is None
    assert local_node({"aa": ("10.0.0.5", True), "bb": ("10.0.0.5", True)}, "10.0.0.5") is None
    assert local_node({}, "10.0.0.5") is None
