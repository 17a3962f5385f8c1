"""scheduler/policy.py, the value objects every policy and both mechanisms share, imports no other
scheduler module, not even for type checking: nothing it names depends on what uses it."""

from __future__ import annotations

import ast
from pathlib import Path

import scheduler.policy
from scheduler.policy import TenantQuota
from scheduler.quotas import TenantQuota as FormerHome


def test_policy_imports_no_scheduler_module():
    tree = ast.parse(Path(scheduler.policy.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not [name for name in imported if name.split(".")[0] == "scheduler"]


def test_tenant_quota_is_a_value_object_of_the_policy_layer():
    assert FormerHome is TenantQuota  # scheduler.quotas still names it
    assert TenantQuota(gpus={"": 8, "v100": 4}).nominal_gpus == 12
