"""Finding Macs on the local network by Bonjour (mDNS), the way Finder does, and checking ssh to each.

macOS advertises ``_ssh._tcp`` whenever Remote Login is on, so a Mac needs nothing installed to be
found. ``browse`` listens for those adverts (the ``zeroconf`` package) on one interface or all; each
answer names the Mac and its addresses. ``check`` then tries ssh (BatchMode: a missing key fails
instead of asking) to its ``.local`` name, then to each address, and surveys the first that answers
(``cluster/survey.py``): the Mac's own report says which address is on which kind of link. A Mac ssh
cannot reach keeps what its addresses alone say.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mlxpipe.cluster.addresses import LINK_LOCAL, address_kind
from mlxpipe.cluster.survey import Machine, survey
from mlxpipe.errors import SetupError, UsageError
from mlxpipe.host import Host

SERVICE = "_ssh._tcp.local."
RESOLVE_TIMEOUT_MS = 2000
SSH_CONNECT_TIMEOUT = 3  # seconds per destination tried: a Mac on the desk answers in milliseconds


@dataclass(frozen=True)
class Advertised:
    """One ``_ssh._tcp`` advert: the Mac's name, its ``.local`` host name and addresses."""

    name: str  # the instance name: the Mac's computer name ("Studio 1")
    server: str  # its host name, without the final dot: "studio-1.local"
    addresses: tuple[str, ...]
    port: int = 22


@dataclass(frozen=True)
class Found:
    """A Mac found: its addresses by kind, and whether ssh works from here (and on which destination)."""

    name: str
    server: str
    addresses: tuple[tuple[str, str], ...]  # (address, kind)
    ssh: str | None = None  # the destination ssh reached it on
    error: str | None = None  # why ssh did not, when it did not
    fix: str | None = None
    machine: Machine | None = None

    def to_json(self) -> dict[str, Any]:
        kinds: dict[str, list[str]] = {}
        for address, kind in self.addresses:
            kinds.setdefault(kind, []).append(address)
        return {"name": self.name, "host": self.server, "addresses": kinds, "ssh": self.ssh is not None,
                "ssh_destination": self.ssh, "error": self.error, "fix": self.fix,
                "chip": self.machine.chip if self.machine else None,
                "memory_bytes": self.machine.memory_bytes if self.machine else None}


def interface_addresses(interface: str) -> list[str]:
    """The IPv4 addresses of ``interface`` (a name such as en0, or one of its addresses) on this machine."""
    import ifaddr

    adapters = ifaddr.get_adapters()
    for adapter in adapters:
        ips = [ip.ip for ip in adapter.ips if isinstance(ip.ip, str)]
        if interface in (adapter.name, adapter.nice_name) or interface in ips:
            if not ips:
                raise UsageError(f"--interface {interface}: it has no IPv4 address", "connect it, or name another")
            return [interface] if interface in ips else ips
    names = ", ".join(sorted({a.name for a in adapters}))
    raise UsageError(f"--interface {interface}: no such interface here", f"use one of: {names}")


def browse(interface: str | None, timeout: float, on_seen: Callable[[str], None] | None = None) -> list[Advertised]:
    """Listen ``timeout`` seconds for ``_ssh._tcp`` adverts (on ``interface``, else every interface), then resolve
    each."""
    from zeroconf import InterfaceChoice, IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

    interfaces: Any = interface_addresses(interface) if interface else InterfaceChoice.All
    zc = Zeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
    names: list[str] = []
    lock = threading.Lock()

    def seen(zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
        if state_change is not ServiceStateChange.Added:
            return
        with lock:
            if name in names:
                return
            names.append(name)
        if on_seen:
            on_seen(name)

    try:
        browser = ServiceBrowser(zc, SERVICE, handlers=[seen])
        time.sleep(timeout)
        browser.cancel()
        found = []
        for name in sorted(names):
            info = ServiceInfo(SERVICE, name)
            if not info.request(zc, RESOLVE_TIMEOUT_MS):
                continue
            server = (info.server or name).rstrip(".")
            found.append(Advertised(_instance(name), server, _ordered(info.parsed_scoped_addresses()), info.port or 22))
        return found
    finally:
        zc.close()


def _ordered(addresses: Sequence[str]) -> tuple[str, ...]:
    """IPv4 before IPv6, each in numeric order: answers arrive in any order."""
    def key(address: str) -> tuple[int, int]:
        try:
            ip = ipaddress.ip_address(address.split("%")[0])
        except ValueError:
            return (9, 0)
        return (ip.version, int(ip))

    return tuple(sorted(dict.fromkeys(addresses), key=key))


def _instance(name: str) -> str:
    """``"Studio 1._ssh._tcp.local."`` -> ``"Studio 1"``."""
    return name[: -len(SERVICE) - 1] if name.endswith("." + SERVICE) else name


def destinations(advert: Advertised) -> list[str]:
    """Where to try ssh, best first: the ``.local`` name (stable across DHCP leases), then each IPv4 address,
    routable before link-local."""
    ipv4 = [a for a in advert.addresses if ":" not in a]
    ordered = sorted(ipv4, key=lambda a: address_kind(a) == LINK_LOCAL)
    return [advert.server, *ordered] if advert.server else ordered


def check(advert: Advertised, connect_timeout: int = SSH_CONNECT_TIMEOUT) -> Found:
    """Try ssh to the advert's destinations in turn; survey the first that answers."""
    error: SetupError | None = None
    error_from_name = False
    for destination in destinations(advert):
        try:
            machine = survey(Host(0, destination), connect_timeout=connect_timeout)
        except SetupError as e:
            # An address's failure says more than the name's (which this machine may not resolve at all):
            # "connection refused" there is Remote Login off.
            if error is None or (destination != advert.server and error_from_name):
                error, error_from_name = e, destination == advert.server
            continue
        kinds = tuple((a, address_kind(a, machine.interfaces)) for a in advert.addresses)
        return Found(advert.name, advert.server, kinds, destination, machine=machine)
    kinds = tuple((a, address_kind(a)) for a in advert.addresses)
    return Found(advert.name, advert.server, kinds, None, error.message if error else "no address to try",
                 error.hint if error else None)


def discover(interface: str | None, timeout: float, on_seen: Callable[[str], None] | None = None,
             on_checked: Callable[[Found], None] | None = None) -> list[Found]:
    """Every Mac advertising ssh, checked in parallel, in name order."""
    adverts = browse(interface, timeout, on_seen)
    return check_all(adverts, on_checked)


def check_all(adverts: Sequence[Advertised], on_checked: Callable[[Found], None] | None = None) -> list[Found]:
    if not adverts:
        return []

    def one(advert: Advertised) -> Found:
        found = check(advert)
        if on_checked:
            on_checked(found)
        return found

    with ThreadPoolExecutor(max_workers=min(16, len(adverts))) as pool:
        return list(pool.map(one, adverts))
