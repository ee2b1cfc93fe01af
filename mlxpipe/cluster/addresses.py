"""Which addresses the ranks talk over: the fastest network every host is on, never Wi-Fi when a wired one is.

Pure functions over the interfaces each host reported (``cluster/macos.py``). A network is an IPv4
subnet; the hosts share one when each has an address in it. Its kind is its slowest member's
(Thunderbolt, then the Thunderbolt Bridge, Ethernet, anything else, Wi-Fi last), so a subnet that
one host reaches over Wi-Fi counts as Wi-Fi. Self-assigned link-local addresses (169.254/16) are
never chosen: a Mac picks a new one at each start, so a hostfile naming one goes stale.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from mlxpipe.cluster.macos import KINDS, Interface

LINK_LOCAL = "link-local"
UNKNOWN = "unknown"
_LINK_LOCAL_NET = ipaddress.IPv4Network("169.254.0.0/16")


@dataclass(frozen=True)
class Network:
    """A subnet every host has an address on: one address per host, in the hosts' order."""

    subnet: ipaddress.IPv4Network
    kind: str  # the slowest kind among the hosts' interfaces on it
    ips: tuple[str, ...]
    devices: tuple[str, ...]  # each host's interface on it


def usable(iface: Interface) -> list[ipaddress.IPv4Interface]:
    """The addresses of ``iface`` a hostfile may name: up, active, not link-local."""
    if not (iface.up and iface.active):
        return []
    return [a for a in iface.addresses if a.ip not in _LINK_LOCAL_NET]


def shared_networks(hosts: Sequence[Sequence[Interface]]) -> list[Network]:
    """Every subnet all ``hosts`` have an address on, fastest first (then by subnet, for a stable order)."""
    if not hosts:
        return []
    by_subnet: dict[ipaddress.IPv4Network, list[tuple[int, str, str] | None]] = {}
    for i, interfaces in enumerate(hosts):
        for iface in interfaces:
            for address in usable(iface):
                slots = by_subnet.setdefault(address.network, [None] * len(hosts))
                rank = KINDS.index(iface.kind)
                # A host on one subnet by two interfaces: its fastest one.
                if slots[i] is None or rank < slots[i][0]:  # type: ignore[index]
                    slots[i] = (rank, str(address.ip), iface.device)
    networks = []
    for subnet, slots in by_subnet.items():
        if any(s is None for s in slots):
            continue
        members = [s for s in slots if s is not None]
        kind = KINDS[max(rank for rank, _, _ in members)]
        networks.append(Network(subnet, kind, tuple(ip for _, ip, _ in members), tuple(d for _, _, d in members)))
    return sorted(networks, key=lambda n: (KINDS.index(n.kind), int(n.subnet.network_address)))


def best_network(hosts: Sequence[Sequence[Interface]]) -> Network | None:
    """The fastest network all ``hosts`` share; None when they share none."""
    found = shared_networks(hosts)
    return found[0] if found else None


def address_kind(address: str, interfaces: Sequence[Interface] = ()) -> str:
    """The kind of interface ``address`` belongs to: from the host's own report when there is one,
    else what the address alone says (``link-local``: a Thunderbolt Bridge or a cable without DHCP)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return UNKNOWN
    for iface in interfaces:
        if any(a.ip == ip for a in iface.addresses):
            return iface.kind
    return LINK_LOCAL if ip.is_link_local else UNKNOWN
