"""A worker group's plan: what the launcher writes at each start of a group
(deploy/group_plan.py) and each rank reads when it joins (workers/group/).

Both sides import it from here, the contract between the processes, so the
rank never imports the launcher. Three things:

- `RankSpec`: one rank's place in its group, as the supervisor hands it over;
- the ring hostfile, mlx.launch's format: a JSON list, one entry per rank,
  each a list of the "ip:port" that rank listens on (`write_ring`, `read_ring`);
- the plan beside it (`plan_path`): {"lockstep": {rank: rank 0's tcp address
  for it}, "jaccl": {"coordinator", "ring", "devices"}}, the lockstep part
  only for ranks on other hosts, the JACCL part only for a JACCL group.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RankSpec:
    """One rank of a group, as the supervisor hands it to the process."""

    group: str  # the group's name: its rank 0's worker id, e.g. "worker-0"
    rank: int
    size: int
    hostfile: str  # the ring hostfile: every rank's "ip:port" (write_ring)

    @property
    def name(self) -> str:
        """The process's name: the group's for rank 0 (the one the router
        sees), "<group>.r<rank>" for the followers."""
        return self.group if self.rank == 0 else f"{self.group}.r{self.rank}"


def rank_names(group: str, size: int) -> list[str]:
    return [RankSpec(group, r, size, "").name for r in range(size)]


def lockstep_address_name(group: str, rank: int) -> str:
    """The ipc name (in the run dir) of rank 0's record stream to `rank`."""
    return f"{group}.lockstep.r{rank}"


def write_ring(path: str, ring: list) -> None:
    """The ring hostfile: `ring[r]` is the list of "ip:port" rank r listens on."""
    with open(path, "w") as f:
        json.dump(ring, f)


def read_ring(hostfile: str) -> list:
    with open(hostfile) as f:
        return json.load(f)


def plan_path(hostfile: str) -> str:
    """Where a group's plan sits, beside its ring hostfile."""
    return os.path.splitext(hostfile)[0] + ".plan.json"


def write_plan(path: str, lockstep: dict, jaccl: dict | None = None) -> None:
    with open(path, "w") as f:
        json.dump({"lockstep": lockstep, **({"jaccl": jaccl} if jaccl else {})}, f)


def jaccl_plan(hostfile: str) -> dict | None:
    """A JACCL group start's {"coordinator", "ring", "devices"}; None otherwise."""
    try:
        with open(plan_path(hostfile)) as f:
            return json.load(f).get("jaccl")
    except FileNotFoundError:
        return None


def read_plan(hostfile: str) -> dict[int, str]:
    """{rank: rank 0's tcp lockstep address for it}: the ranks of other
    hosts; {} for a group on one host (no plan)."""
    try:
        with open(plan_path(hostfile)) as f:
            return {int(r): a for r, a in json.load(f)["lockstep"].items()}
    except FileNotFoundError:
        return {}
