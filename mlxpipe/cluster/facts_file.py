"""The cluster's facts file, beside its hostfile (``cluster.json`` -> ``cluster.facts.json``): where it lives, read
back for the hosts it was measured on only, and replaced in one step.

The links job (``launch/links_job.py``, ``mlxpipe doctor --links``) writes it; ``plan`` and the launching
commands read it (``load_facts``). The facts themselves are plain data (``plan/cluster_facts.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxpipe.cluster.hostfile import Hostfile
from mlxpipe.errors import HostfileError
from mlxpipe.paths import replacing
from mlxpipe.plan.cluster_facts import ClusterFacts

SUFFIX = ".facts.json"


def facts_path(hostfile: Path) -> Path:
    """Where the facts of ``hostfile`` live: beside it, ``cluster.json`` -> ``cluster.facts.json``."""
    return hostfile.with_name(hostfile.stem + SUFFIX)


def load_facts(hostfile: Hostfile) -> tuple[ClusterFacts | None, str | None]:
    """The facts measured for ``hostfile``, and None; or None and why there are none to use."""
    path = facts_path(hostfile.path)
    if not path.is_file():
        return None, f"no {path.name} beside {hostfile.path.name}: links not measured"
    try:
        facts = ClusterFacts.from_json(json.loads(path.read_text()), str(path))
    except (OSError, ValueError, HostfileError) as e:
        return None, f"{path}: {getattr(e, 'message', e)}"
    if not facts.matches([(h.ssh, h.ips) for h in hostfile.hosts]):
        return None, f"{path} is of other hosts than {hostfile.path.name} lists now: measure again"
    return facts, None


def write_facts(facts: ClusterFacts, hostfile: Path) -> Path:
    """Replace the facts file of ``hostfile`` with ``facts`` in one step."""
    path = facts_path(hostfile)
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(facts.to_json(), indent=2) + "\n")
    return path
