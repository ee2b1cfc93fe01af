"""Reading macOS's tools: the recordings of tests/fixtures/macs/ and the variants real Macs print."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from mlxpipe.cluster import macos
from mlxpipe.cluster.macos import BRIDGE, ETHERNET, OTHER, THUNDERBOLT, WIFI

MACS = Path(__file__).parent.parent / "fixtures" / "macs"


def test_sysctl_gives_the_chip_and_the_memory() -> None:
    assert macos.parse_sysctl_chip("Apple M3 Ultra\n274877906944\n") == ("Apple M3 Ultra", 274877906944)
    assert macos.parse_sysctl_chip("") == (None, None)
    assert macos.parse_sysctl_chip("68719476736\n") == (None, 68719476736)  # brand_string unknown: memory still read


def test_sw_vers_gives_the_product_version() -> None:
    assert macos.parse_sw_vers((MACS / "studio" / "sw_vers.txt").read_text()) == "26.2"
    assert macos.parse_sw_vers("ProductName:\tmacOS\nProductVersion:\t15.7.1\nBuildVersion:\t24G231\n") == "15.7.1"
    assert macos.parse_sw_vers("") is None


def test_df_gives_the_free_bytes() -> None:
    text = ("Filesystem     1024-blocks      Used Available Capacity  Mounted on\n"
            "/dev/disk3s5    1942700360 811239452 1099611916    43%    /System/Volumes/Data\n")
    assert macos.parse_df(text) == 1099611916 * 1024
    assert macos.parse_df("") is None


def test_hardware_ports_name_each_device() -> None:
    ports = macos.parse_hardware_ports((MACS / "studio" / "hardware_ports.txt").read_text())
    assert ports == {"en0": "Ethernet", "bridge0": "Thunderbolt Bridge", "en1": "Wi-Fi",
                     **{f"en{i + 2}": f"Thunderbolt {i + 1}" for i in range(6)}}
    assert macos.thunderbolt_devices(ports) == {str(i + 1): f"en{i + 2}" for i in range(6)}


@pytest.mark.parametrize(("port", "kind"), [
    ("Thunderbolt 1", THUNDERBOLT), ("Thunderbolt 12", THUNDERBOLT), ("Thunderbolt Bridge", BRIDGE),
    ("Wi-Fi", WIFI), ("AirPort", WIFI), ("Ethernet", ETHERNET), ("Ethernet Adapter (en4)", ETHERNET),
    ("Thunderbolt Ethernet Slot 0", ETHERNET), ("USB 10/100/1000 LAN", ETHERNET), ("10GbE", ETHERNET),
    ("iPhone USB", OTHER), ("Bluetooth PAN", OTHER), (None, OTHER),
])
def test_port_kinds(port: str | None, kind: str) -> None:
    assert macos.port_kind(port) == kind


IFCONFIG = """\
lo0: flags=8049<UP,LOOPBACK,RUNNING,MULTICAST> mtu 16384
\toptions=1203<RXCSUM,TXCSUM,TXSTATUS,SW_TIMESTAMP>
\tinet 127.0.0.1 netmask 0xff000000
\tinet6 ::1 prefixlen 128 
en0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\toptions=50b<RXCSUM,TXCSUM,VLAN_HWTAGGING,AV,CHANNEL_IO>
\tether 3c:a6:f6:4e:21:08
\tinet6 fe80::18a1:2bff:fe3c:4d5e%en0 prefixlen 64 secured scopeid 0xb 
\tinet 192.168.1.23 netmask 0xffffff00 broadcast 192.168.1.255
\tnd6 options=201<PERFORMNUD,DAD>
\tmedia: autoselect (10Gbase-T <full-duplex>)
\tstatus: active
en1: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tether 3c:a6:f6:51:7c:92
\tinet 192.168.1.40 netmask 0xffffff00 broadcast 192.168.1.255
\tstatus: active
en2: flags=8963<UP,BROADCAST,SMART,RUNNING,PROMISC,SIMPLEX,MULTICAST> mtu 1500
\toptions=460<TSO4,TSO6,CHANNEL_IO>
\tether 36:d0:6e:a1:00:00
\tinet 192.168.0.1 netmask 0xfffffffc broadcast 192.168.0.3
\tmedia: autoselect <full-duplex>
\tstatus: active
en3: flags=8963<UP,BROADCAST,SMART,RUNNING,PROMISC,SIMPLEX,MULTICAST> mtu 1500
\tether 36:d0:6e:a1:00:01
\tmedia: autoselect <full-duplex>
\tstatus: inactive
bridge0: flags=8822<BROADCAST,SMART,SIMPLEX,MULTICAST> mtu 1500
\toptions=63<RXCSUM,TXCSUM,TSO4,TSO6>
\tether 36:d0:6e:a1:00:40
\tConfiguration:
\t\tid 0:0:0:0:0:0 priority 0 hellotime 0 fwddelay 0
\tmember: en2 flags=3<LEARNING,DISCOVER>
\t        ifmaxaddr 0 port 10 priority 0 path cost 0
\tmember: en3 flags=3<LEARNING,DISCOVER>
\t        ifmaxaddr 0 port 11 priority 0 path cost 0
\tmedia: <unknown type>
\tstatus: inactive
utun0: flags=8051<UP,POINTOPOINT,RUNNING,MULTICAST> mtu 1380
\tinet6 fe80::ce81:b1c:bd2c:69e%utun0 prefixlen 64 scopeid 0x10 
"""


def test_ifconfig_gives_each_interface_its_kind_and_addresses() -> None:
    ports = macos.parse_hardware_ports((MACS / "studio" / "hardware_ports.txt").read_text())
    found = {i.device: i for i in macos.parse_ifconfig(IFCONFIG, ports)}
    assert sorted(found) == ["bridge0", "en0", "en1", "en2", "en3"]  # no loopback, no utun
    assert found["en0"].kind == ETHERNET and found["en0"].addresses == (ipaddress.IPv4Interface("192.168.1.23/24"),)
    assert found["en1"].kind == WIFI and found["en1"].port == "Wi-Fi"
    assert found["en2"].kind == THUNDERBOLT and found["en2"].addresses == (ipaddress.IPv4Interface("192.168.0.1/30"),)
    assert found["en3"].active is False and found["en3"].addresses == ()
    bridge = found["bridge0"]
    assert bridge.kind == BRIDGE and bridge.up is False and bridge.members == ("en2", "en3")


def test_ifconfig_reads_dotted_netmasks_and_skips_unknown_devices_without_addresses() -> None:
    text = "en5: flags=8863<UP,RUNNING> mtu 1500\n\tinet 10.0.0.5 netmask 255.255.0.0 broadcast 10.0.255.255\n" \
           "awdl0: flags=8943<UP,BROADCAST,RUNNING> mtu 1500\n\tstatus: active\n"
    (only,) = macos.parse_ifconfig(text, {})
    assert only.device == "en5" and only.kind == OTHER
    assert only.addresses == (ipaddress.IPv4Interface("10.0.0.5/16"),)


def test_thunderbolt_buses_and_the_macs_plugged_in() -> None:
    one = macos.parse_thunderbolt((MACS / "mesh2" / "studio-1.json").read_text())
    two = macos.parse_thunderbolt((MACS / "mesh2" / "studio-2.json").read_text())
    assert sorted(b.receptacle for b in one) == ["1", "2", "3", "4", "5", "6"]
    (cabled,) = [b for b in one if b.peer_domain]
    (other,) = [b for b in two if b.peer_domain]
    assert (cabled.receptacle, cabled.peer_domain, cabled.peer_name) == ("1", other.domain, "Mac Studio")
    assert other.peer_domain == cabled.domain
    assert cabled.generation == 5 and cabled.speed == "80 Gb/s" and cabled.name == "Mac Studio"


def test_a_drive_on_a_thunderbolt_port_is_no_peer() -> None:
    # A bus with a drive plugged in: its item has no domain UUID, so it is not another Mac.
    text = ('{"SPThunderboltDataType": [{"_name": "thunderboltusb4_bus_3", "domain_uuid_key": "D1", '
            '"receptacle_1_tag": {"receptacle_id_key": "4", "current_speed_key": "80 Gb/s"}, '
            '"_items": [{"_name": "Envoy Ultra", "mode_key": "usb_four_v2"}]}]}')
    (bus,) = macos.parse_thunderbolt(text)
    assert bus.peer_domain is None and bus.receptacle == "4"


@pytest.mark.parametrize(("text", "found"), [("not json", ()), ('{"SPThunderboltDataType": []}', ()), ("[]", ()),
                                             ('{"SPThunderboltDataType": [{"_name": "x"}]}', ())])
def test_thunderbolt_without_buses(text: str, found: tuple[object, ...]) -> None:
    assert macos.parse_thunderbolt(text) == found


@pytest.mark.parametrize(("speed", "generation"), [
    ("Up to 120 Gb/s", 5), ("80 Gb/s", 5), ("Up to 80 Gb/s x1", 5), ("Up to 40 Gb/s", 4), ("40 Gb/s", 4),
    ("Up to 20 Gb/s", None), (None, None), ("", None),
])
def test_thunderbolt_generation(speed: str | None, generation: int | None) -> None:
    assert macos.thunderbolt_generation(speed) == generation


def test_ibv_devices_lists_rdma_devices_only_when_enabled() -> None:
    enabled = (MACS / "mini" / "ibv_devices.txt").read_text()
    assert macos.parse_ibv_devices(enabled) == ("rdma_en2", "rdma_en3", "rdma_en4")
    assert macos.parse_ibv_devices((MACS / "ibv_devices-disabled.txt").read_text()) == ()
    assert macos.parse_ibv_devices("") == ()
