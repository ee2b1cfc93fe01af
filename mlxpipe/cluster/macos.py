"""What macOS's own tools print, read into plain values: pure functions, no ssh, no MLX.

``mlxpipe cluster`` asks each Mac over ssh (``cluster/survey.py``) and reads the answers here:

* ``sysctl -n machdep.cpu.brand_string hw.memsize``: the chip and the memory in bytes;
* ``sw_vers``: the macOS version;
* ``networksetup -listallhardwareports``: which device (``en0``) is which port (``Ethernet``,
  ``Wi-Fi``, ``Thunderbolt 1``, ``Thunderbolt Bridge``), hence each interface's kind;
* ``ifconfig``: each interface's IPv4 addresses with their netmask, its status, a bridge's members;
* ``system_profiler SPThunderboltDataType -json``: each Thunderbolt bus (one per receptacle), its
  domain UUID and the domain UUID of the Mac plugged into it (what ``mlx.distributed_config`` reads
  to find the cables);
* ``ibv_devices``: the RDMA devices (``rdma_en2``), listed only once RDMA is enabled (macOS 26.2+);
* ``df -Pk``: the free space of a directory's disk.

Every parser takes the text as printed and returns an empty or None value for what it cannot
read, so a Mac that lacks a tool (an older macOS without ``ibv_devices``) is a fact, not a crash.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field

# Interface kinds, fastest first: what the IP choice ranks (cluster/addresses.py).
THUNDERBOLT, BRIDGE, ETHERNET, OTHER, WIFI = "thunderbolt", "thunderbolt bridge", "ethernet", "other", "wi-fi"
KINDS = (THUNDERBOLT, BRIDGE, ETHERNET, OTHER, WIFI)

_THUNDERBOLT_PORT = re.compile(r"Thunderbolt (\d+)")


@dataclass(frozen=True)
class Interface:
    """One network interface of a Mac: its device, kind and IPv4 addresses."""

    device: str  # en0, bridge0
    kind: str  # one of KINDS
    port: str | None = None  # networksetup's "Hardware Port" name
    addresses: tuple[ipaddress.IPv4Interface, ...] = ()  # address with its netmask
    active: bool = True  # ifconfig's "status: active" (interfaces without a status line count as active)
    up: bool = True  # the UP flag
    members: tuple[str, ...] = ()  # a bridge's member devices


@dataclass(frozen=True)
class ThunderboltBus:
    """One Thunderbolt bus (one receptacle) and the Mac at its other end, if any."""

    receptacle: str  # receptacle_id_key: "Thunderbolt <receptacle>" in networksetup
    domain: str  # this bus's domain UUID
    peer_domain: str | None = None  # the domain UUID of the Mac plugged in here
    peer_name: str | None = None  # that Mac's name as this one sees it ("Mac Studio")
    speed: str | None = None  # current_speed_key: "80 Gb/s" connected, "Up to 120 Gb/s" idle (TB5)
    name: str | None = None  # this Mac's name (device_name_key)

    @property
    def generation(self) -> int | None:
        """5 for Thunderbolt 5 (80 Gb/s links, 120 Gb/s boost), 4 for 40 Gb/s (Thunderbolt 3/4), else None."""
        return thunderbolt_generation(self.speed)


def thunderbolt_generation(speed: str | None) -> int | None:
    """The Thunderbolt generation a ``current_speed_key`` value says: ``"Up to 80 Gb/s x1"`` -> 5."""
    found = re.search(r"(\d+)\s*Gb/s", speed or "")
    if not found:
        return None
    gbps = int(found.group(1))
    return 5 if gbps >= 80 else 4 if gbps >= 40 else None


def parse_sysctl_chip(text: str) -> tuple[str | None, int | None]:
    """``sysctl -n machdep.cpu.brand_string hw.memsize`` -> ``("Apple M3 Ultra", 274877906944)``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    chip = lines[0] if lines and not lines[0].isdigit() else None
    memory = next((int(line) for line in lines if line.isdigit()), None)
    return chip, memory


def parse_sw_vers(text: str) -> str | None:
    """``sw_vers`` -> ``"26.2"`` (its ProductVersion)."""
    found = re.search(r"^ProductVersion:\s*(\S+)", text, re.MULTILINE)
    return found.group(1) if found else None


def parse_df(text: str) -> int | None:
    """``df -Pk DIR`` -> the bytes free on DIR's disk (POSIX format: the 4th column, in KiB)."""
    lines = [line.split() for line in text.splitlines() if line.strip()]
    for fields in lines[1:]:
        if len(fields) >= 6 and fields[3].isdigit():
            return int(fields[3]) * 1024
    return None


def parse_hardware_ports(text: str) -> dict[str, str]:
    """``networksetup -listallhardwareports`` -> ``{device: port name}``, such as
    ``{"en0": "Ethernet", "en2": "Thunderbolt 1"}``."""
    ports: dict[str, str] = {}
    port: str | None = None
    for line in text.splitlines():
        if line.startswith("Hardware Port:"):
            port = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and port is not None:
            ports[line.split(":", 1)[1].strip()] = port
            port = None
    return ports


def port_kind(port: str | None, device: str = "") -> str:
    """The kind of a networksetup port name: ``"Thunderbolt 1"`` -> thunderbolt, ``"Wi-Fi"`` -> wi-fi.

    "Thunderbolt Ethernet Slot 0" (an Ethernet adapter on a Thunderbolt port) is Ethernet; without a
    port name (a device networksetup does not list) the device name decides what it can.
    """
    if port is None:
        return BRIDGE if device.startswith("bridge") else OTHER
    if _THUNDERBOLT_PORT.fullmatch(port):
        return THUNDERBOLT
    if port == "Thunderbolt Bridge":
        return BRIDGE
    if "Wi-Fi" in port or "AirPort" in port:
        return WIFI
    if "Ethernet" in port or "LAN" in port or "GbE" in port:
        return ETHERNET
    return OTHER


def thunderbolt_devices(ports: dict[str, str]) -> dict[str, str]:
    """``{receptacle: device}`` from networksetup's ports: ``{"1": "en2", "2": "en3"}``."""
    found = {}
    for device, port in ports.items():
        match = _THUNDERBOLT_PORT.fullmatch(port)
        if match:
            found[match.group(1)] = device
    return found


_IFACE_START = re.compile(r"^([A-Za-z0-9_.-]+): flags=[0-9a-fA-F]+<([^>]*)>")
_INET = re.compile(r"^\s+inet (\d+\.\d+\.\d+\.\d+) netmask (0x[0-9a-fA-F]+|\d+\.\d+\.\d+\.\d+)")
_STATUS = re.compile(r"^\s+status: (\w+)")
_MEMBER = re.compile(r"^\s+member: (\S+)")


@dataclass
class _Reading:
    """An interface while ``parse_ifconfig`` reads its lines."""

    device: str
    up: bool
    addresses: list[ipaddress.IPv4Interface] = field(default_factory=list)
    active: bool = True
    members: list[str] = field(default_factory=list)


def parse_ifconfig(text: str, ports: dict[str, str] | None = None) -> tuple[Interface, ...]:
    """``ifconfig`` (macOS's format) -> the interfaces with their kind (from ``ports``) and IPv4 addresses.

    The loopback and interfaces without a port name or an address (utun, awdl, llw, anpi...) are left out.
    """
    ports = ports or {}
    read: list[_Reading] = []
    for line in text.splitlines():
        if start := _IFACE_START.match(line):
            read.append(_Reading(start.group(1), "UP" in start.group(2).split(",")))
        elif not read:
            continue
        elif inet := _INET.match(line):
            read[-1].addresses.append(ipaddress.IPv4Interface(f"{inet.group(1)}/{_prefix(inet.group(2))}"))
        elif status := _STATUS.match(line):
            read[-1].active = status.group(1) == "active"
        elif member := _MEMBER.match(line):
            read[-1].members.append(member.group(1))
    return tuple(
        Interface(r.device, port_kind(ports.get(r.device), r.device), ports.get(r.device), tuple(r.addresses),
                  r.active, r.up, tuple(r.members))
        for r in read
        if not r.device.startswith("lo") and (r.device in ports or r.addresses)
    )


def _prefix(netmask: str) -> int:
    """``0xffffff00`` or ``255.255.255.0`` -> 24."""
    value = int(netmask, 16) if netmask.startswith("0x") else int(ipaddress.IPv4Address(netmask))
    return bin(value).count("1")


def parse_thunderbolt(text: str) -> tuple[ThunderboltBus, ...]:
    """``system_profiler SPThunderboltDataType -json`` -> the buses that have a domain UUID.

    A bus's ``_items`` are the devices plugged into it; the first with a domain UUID is another Mac
    (a drive or a dock has none), read the way ``mlx.distributed_config`` reads it.
    """
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return ()
    buses = []
    for bus in data.get("SPThunderboltDataType", []) if isinstance(data, dict) else []:
        domain = bus.get("domain_uuid_key")
        tag = bus.get("receptacle_1_tag") or {}
        if not domain or "receptacle_id_key" not in tag:
            continue
        peers = [item for item in bus.get("_items", []) if item.get("domain_uuid_key")]
        peer = peers[0] if peers else {}
        buses.append(ThunderboltBus(
            receptacle=str(tag["receptacle_id_key"]), domain=domain, peer_domain=peer.get("domain_uuid_key"),
            peer_name=peer.get("_name"), speed=tag.get("current_speed_key"), name=bus.get("device_name_key"),
        ))
    return tuple(buses)


def parse_ibv_devices(text: str) -> tuple[str, ...]:
    """``ibv_devices`` -> the RDMA device names (``rdma_en2``...); empty while RDMA is disabled."""
    names = []
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0].startswith("rdma_"):
            names.append(fields[0])
    return tuple(names)
