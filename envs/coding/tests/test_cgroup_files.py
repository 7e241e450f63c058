"""The cgroup v2 file protocol, on a directory standing in for the unified hierarchy.

The CI VM has cgroup v1 (its memory controller is bound there), so the real v2 path
cannot run here; these check what the code writes and reads in v2's files: enabling the
controllers for children, the limits of a sandbox's cgroup, and the OOM counter.
"""

from __future__ import annotations

from pathlib import Path

from openenv_grpc_envs.coding.cgroups import CgroupParents, SandboxCgroup, _v2_parents


def _unified(root: Path, controllers: str, active: str = "") -> Path:
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text(active + "\n")
    return root


def test_v2_enables_memory_and_pids_for_children(tmp_path: Path) -> None:
    own = _unified(tmp_path, "cpuset cpu io memory pids")
    parents, why = _v2_parents(own)
    assert parents == CgroupParents(2, own, own) and why == ""
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_v2_without_a_memory_controller_says_so(tmp_path: Path) -> None:
    own = _unified(tmp_path, "hugetlb")  # what this VM's cgroup2 mount offers
    parents, why = _v2_parents(own)
    assert parents is None
    assert why == f"cgroup v2: no memory controller in {own}"


def test_v2_sandbox_cgroup_limits_and_oom_counter(tmp_path: Path) -> None:
    own = _unified(tmp_path, "memory pids", "memory pids")
    cgroup = SandboxCgroup(CgroupParents(2, own, own), "sandbox", 512 << 20, 32)
    (path,) = cgroup.paths
    assert (path / "memory.max").read_text() == str(512 << 20)
    assert (path / "pids.max").read_text() == "32"
    assert not (path / "memory.swap.max").exists()  # written only where the kernel has it
    assert cgroup.procs_files == [str(path / "cgroup.procs")]
    (path / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\n")
    assert cgroup.oom_kills() == 2
