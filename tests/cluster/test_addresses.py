"""Choosing the addresses the ranks talk over: Thunderbolt, then Ethernet, Wi-Fi last, on a subnet every host shares."""

from __future__ import annotations

import ipaddress

import pytest

from mlxpipe.cluster import addresses
from mlxpipe.cluster.macos import BRIDGE, ETHERNET, OTHER, THUNDERBOLT, WIFI, Interface


def iface(device: str, kind: str, *cidrs: str, active: bool = True, up: bool = True) -> Interface:
    return Interface(device, kind, None, tuple(ipaddress.IPv4Interface(c) for c in cidrs), active, up)


def test_ethernet_over_wifi() -> None:
    hosts = [
        [iface("en0", ETHERNET, "10.0.0.1/24"), iface("en1", WIFI, "192.168.1.10/24")],
        [iface("en0", ETHERNET, "10.0.0.2/24"), iface("en1", WIFI, "192.168.1.11/24")],
    ]
    best = addresses.best_network(hosts)
    assert best is not None
    assert (best.kind, str(best.subnet), best.ips, best.devices) == (
        ETHERNET, "10.0.0.0/24", ("10.0.0.1", "10.0.0.2"), ("en0", "en0")
    )


def test_thunderbolt_over_ethernet_for_a_pair() -> None:
    hosts = [
        [iface("en0", ETHERNET, "10.0.0.1/24"), iface("en2", THUNDERBOLT, "192.168.0.1/30")],
        [iface("en0", ETHERNET, "10.0.0.2/24"), iface("en3", THUNDERBOLT, "192.168.0.2/30")],
    ]
    best = addresses.best_network(hosts)
    assert best is not None and best.kind == THUNDERBOLT and best.ips == ("192.168.0.1", "192.168.0.2")


def test_point_to_point_thunderbolt_links_do_not_join_three_hosts() -> None:
    # A ring's links are /30 pairs: no one of them holds all three, so Ethernet joins them.
    hosts = [
        [iface("en0", ETHERNET, "10.0.0.1/24"), iface("en2", THUNDERBOLT, "192.168.0.1/30")],
        [iface("en0", ETHERNET, "10.0.0.2/24"), iface("en2", THUNDERBOLT, "192.168.0.2/30"),
         iface("en3", THUNDERBOLT, "192.168.0.5/30")],
        [iface("en0", ETHERNET, "10.0.0.3/24"), iface("en3", THUNDERBOLT, "192.168.0.6/30")],
    ]
    best = addresses.best_network(hosts)
    assert best is not None and best.kind == ETHERNET and best.ips == ("10.0.0.1", "10.0.0.2", "10.0.0.3")


def test_a_subnet_one_host_reaches_by_wifi_counts_as_wifi() -> None:
    # Both hosts on 10.0.0.0/24, one by cable and one by Wi-Fi; the other subnet is wired on both.
    hosts = [
        [iface("en0", ETHERNET, "10.0.0.1/24"), iface("en5", ETHERNET, "172.16.0.1/16")],
        [iface("en1", WIFI, "10.0.0.2/24"), iface("en0", ETHERNET, "172.16.0.2/16")],
    ]
    found = addresses.shared_networks(hosts)
    assert [(n.kind, str(n.subnet)) for n in found] == [(ETHERNET, "172.16.0.0/16"), (WIFI, "10.0.0.0/24")]


def test_wifi_only_when_nothing_wired_joins_every_host() -> None:
    hosts = [
        [iface("en0", ETHERNET, "10.0.0.1/24"), iface("en1", WIFI, "192.168.1.10/24")],
        [iface("en0", ETHERNET, "10.9.0.2/24"), iface("en1", WIFI, "192.168.1.11/24")],  # another wired subnet
    ]
    best = addresses.best_network(hosts)
    assert best is not None and best.kind == WIFI and best.ips == ("192.168.1.10", "192.168.1.11")


def test_a_host_on_one_subnet_by_two_interfaces_uses_its_faster_one() -> None:
    hosts = [
        [iface("en1", WIFI, "10.0.0.9/24"), iface("en0", ETHERNET, "10.0.0.1/24")],
        [iface("en0", ETHERNET, "10.0.0.2/24")],
    ]
    best = addresses.best_network(hosts)
    assert best is not None and best.kind == ETHERNET and best.ips == ("10.0.0.1", "10.0.0.2")


def test_link_local_inactive_and_down_interfaces_are_never_chosen() -> None:
    hosts = [
        [iface("bridge0", BRIDGE, "169.254.3.4/16"), iface("en0", ETHERNET, "10.0.0.1/24", active=False),
         iface("en1", WIFI, "192.168.1.10/24")],
        [iface("bridge0", BRIDGE, "169.254.9.9/16"), iface("en0", ETHERNET, "10.0.0.2/24", up=False),
         iface("en1", WIFI, "192.168.1.11/24")],
    ]
    best = addresses.best_network(hosts)
    assert best is not None and best.kind == WIFI


def test_no_shared_network() -> None:
    apart = [[iface("en0", ETHERNET, "10.0.0.1/24")], [iface("en0", ETHERNET, "10.1.0.1/24")]]
    assert addresses.best_network(apart) is None
    assert addresses.best_network([]) is None


@pytest.mark.parametrize(("address", "kind"), [
    ("10.0.0.1", ETHERNET), ("192.168.1.10", WIFI), ("169.254.7.7", addresses.LINK_LOCAL),
    ("fe80::1%en0", addresses.LINK_LOCAL), ("172.16.0.1", addresses.UNKNOWN), ("not an address", addresses.UNKNOWN),
])
def test_address_kind_from_the_hosts_report_else_the_address(address: str, kind: str) -> None:
    report = [iface("en0", ETHERNET, "10.0.0.1/24"), iface("en1", WIFI, "192.168.1.10/24"), iface("x", OTHER)]
    assert addresses.address_kind(address, report) == kind
