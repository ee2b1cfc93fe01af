"""``mlxpipe cluster``: from a desk of Macs to a hostfile: ``discover``, ``init``, ``install``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mlxpipe import console
from mlxpipe.cli._errors import boundary
from mlxpipe.cli._options import Json
from mlxpipe.defaults import DEFAULT_DISCOVER_TIMEOUT, DEFAULT_HOSTFILE_OUT

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from rich.table import Table

    from mlxpipe.cluster.discover import Found
    from mlxpipe.cluster.init import Outcome
    from mlxpipe.cluster.install import Installed
    from mlxpipe.cluster.survey import Machine
    from mlxpipe.errors import SetupError

app = typer.Typer(
    name="cluster",
    help=(
        "Set up a cluster of Macs: find them, write the hostfile, install the same mlxpipe, mlx and mlx-lm on each.\n\n"
        "On Macs with Remote Login on (System Settings > General > Sharing) and your ssh key on them, three "
        "commands are the whole set-up: `mlxpipe cluster init --discover -o cluster.json`, "
        "`mlxpipe cluster install --hostfile cluster.json`, then `mlxpipe serve --hostfile cluster.json`."
    ),
    no_args_is_help=True,
    rich_markup_mode="rich",
)

Interface = Annotated[str | None, typer.Option(
    "--interface", "-i", help="Ask on this network interface only: a name such as en0, or one of its addresses.",
    show_default="every interface",
)]
Timeout = Annotated[float, typer.Option(
    "--timeout", help="Seconds to listen for Bonjour answers (Macs on the desk answer within one).",
)]


@app.command()
@boundary
def discover(interface: Interface = None, timeout: Timeout = DEFAULT_DISCOVER_TIMEOUT, json_out: Json = False) -> None:
    """Find the Macs on this network by Bonjour, and whether ssh works to each.

    A Mac with Remote Login on advertises ssh (_ssh._tcp), so nothing needs installing on it.
    One row per Mac: its name, its addresses by kind of link (Thunderbolt, Ethernet, Wi-Fi: the
    Mac's own report once ssh works, else what the address says), and ssh from here (keys only,
    as mlxpipe runs it). Exit status 1 when no Mac answers.

    Example: mlxpipe cluster discover --interface en0
    """
    found = _discover(interface, timeout, quiet=json_out)
    if json_out:
        console.print_json([f.to_json() for f in found])
    else:
        console.out.print(_found_table(found))
    if not found:
        where = f"on {interface}" if interface else "on any interface"
        console.error(f"no Mac answered {where} within {timeout:g} s",
                      "turn on Remote Login on each Mac (System Settings > General > Sharing), "
                      "or listen longer (--timeout) or elsewhere (--interface)")
        raise typer.Exit(1)
    for f in found:
        if f.ssh is None and not json_out:
            console.warn(f"{f.name}: ssh does not work from here: {f.error}" + (f"; {f.fix}" if f.fix else ""))


def _discover(interface: str | None, timeout: float, quiet: bool) -> list[Found]:
    from mlxpipe.cluster.discover import browse, check_all

    where = f"on {interface}" if interface else "on every interface"
    if quiet:
        return check_all(browse(interface, timeout))
    with console.err.status(f"listening {where} for Macs with Remote Login on...") as status:
        seen: list[str] = []

        def on_seen(name: str) -> None:
            seen.append(name)
            status.update(f"listening {where} for Macs with Remote Login on... {len(seen)} found")

        adverts = browse(interface, timeout, on_seen)
        status.update(f"checking ssh to {len(adverts)} Mac{'s' if len(adverts) != 1 else ''}...")
        return check_all(adverts)


@app.command()
@boundary
def init(
    hosts: Annotated[list[str] | None, typer.Argument(
        help="The hosts' ssh destinations (a name, user@name or an address), in rank order; with --discover, "
        "the Macs it finds come after them.", show_default=False,
    )] = None,
    discover: Annotated[bool, typer.Option(
        "--discover", help="Also take every Mac Bonjour finds (see `mlxpipe cluster discover`).",
    )] = False,
    output: Annotated[Path, typer.Option("--output", "-o", help="The hostfile to write.")] = DEFAULT_HOSTFILE_OUT,
    python: Annotated[str | None, typer.Option(
        "--python", help="The interpreter every host runs, as its path there.",
        show_default="~/.mlxpipe/venv's when it has this machine's versions, else another that has them, else "
        "~/.mlxpipe/venv's for `cluster install` to make",
    )] = None,
    interface: Interface = None,
    timeout: Timeout = DEFAULT_DISCOVER_TIMEOUT,
    json_out: Json = False,
) -> None:
    """Survey each host over ssh and write a hostfile that `mlxpipe doctor` passes.

    Each host is asked for its chip, memory, macOS, free disk, Pythons (with their mlx, mlx-lm
    and mlxpipe), network interfaces, Thunderbolt cables and RDMA. Where Thunderbolt cables join
    every host, MLX's own mlx.distributed_config configures the ports and chooses the backend
    (ring over Thunderbolt; JACCL where RDMA is on); else the hosts talk over the fastest
    network they share, never Wi-Fi when a wired one joins them. The hostfile adds memory_gb,
    python and hf_home to each host.

    What ssh cannot do (Remote Login, RDMA in Recovery mode, removing a Thunderbolt Bridge) is
    printed as one line per host and step. The hostfile is written, whole, only when every host
    could be set up; exit status 1 otherwise.

    Example: mlxpipe cluster init --discover -o cluster.json
    """
    from mlxpipe.cli import versions
    from mlxpipe.cluster import init as setup
    from mlxpipe.errors import UsageError

    names = list(hosts or [])
    steps: list[setup.Step] = []
    if discover:
        for f in _discover(interface, timeout, quiet=json_out):
            if f.ssh is None:
                steps.append(setup.Step(f.name, f"{f.fix or 'make ssh work from here'} ({f.error})", blocking=True))
            elif f.ssh not in names:
                names.append(f.ssh)
    if not names and not steps:
        raise UsageError("no hosts: name them (mlxpipe cluster init HOST ...) or pass --discover",
                         "with --discover, turn on Remote Login on each Mac first")
    progress = None if json_out else _survey_line
    machines, unreachable = setup.survey_all(names, progress)
    steps += unreachable
    outcome: Outcome
    if any(s.blocking for s in steps):
        outcome = setup.Outcome(machines, steps=steps)
    else:
        with console.err.status("wiring the hosts...") if not json_out else _nothing():
            outcome = setup.make(machines, versions=versions(), python=python)
        outcome.steps[:0] = steps
    written = outcome.complete
    links: Any = None
    links_note = None
    if written:
        setup.check_and_write(outcome, output)
        links, links_note = _measure_links(outcome, output, quiet=json_out)
    if json_out:
        console.print_json(_init_json(outcome, output if written else None, links, links_note))
    else:
        _print_init(outcome, output if written else None, links, links_note)
    if not written:
        count = sum(s.blocking for s in outcome.steps)
        console.error(f"{output} not written: {count} step{'s' if count != 1 else ''} to do first (above)",
                      "do them, then run the same `mlxpipe cluster init` again")
        raise typer.Exit(1)


def _measure_links(outcome: Outcome, hostfile: Path, quiet: bool) -> tuple[Any, str | None]:
    """The links measured over the new hostfile (``doctor --links``' job), or why not: hosts without
    this machine's mlx cannot run it yet (``cluster install`` measures them then)."""
    if outcome.to_install:
        return None, (f"not measured yet: after `mlxpipe cluster install`, `mlxpipe doctor --links --hostfile "
                      f"{hostfile}` measures them")
    return _links_job(hostfile, quiet)


def _links_job(hostfile: Path, quiet: bool) -> tuple[Any, str | None]:
    """The links job over ``hostfile``, its facts written beside it; or why not (a job that fails leaves the
    hostfile as it is, and says how to measure again)."""
    from mlxpipe.errors import MlxpipeError
    from mlxpipe.launch.links_job import measure

    later = f"`mlxpipe doctor --links --hostfile {hostfile}` measures them"

    def say(text: str) -> None:
        if not quiet:
            console.err.print(text, markup=False, highlight=False)

    try:
        return measure(hostfile, on_progress=say), None
    except MlxpipeError as e:
        return None, f"not measured ({e.message}); {later}"


def _nothing() -> AbstractContextManager[None]:
    import contextlib

    return contextlib.nullcontext()


def _survey_line(host: str, result: Machine | SetupError) -> None:
    from mlxpipe.cluster.survey import Machine

    if isinstance(result, Machine):
        console.err.print(f"{host}: {_machine_summary(result)}", markup=False, highlight=False)
    else:
        console.err.print(f"{host}: cannot be reached: {result.message.split(': ', 1)[-1]}", markup=False,
                          highlight=False)


@app.command()
@boundary
def install(
    hostfile: Annotated[Path, typer.Option(
        "--hostfile", help="The hosts (the hostfile `cluster init` wrote).",
    )] = DEFAULT_HOSTFILE_OUT,
    wheelhouse: Annotated[Path | None, typer.Option(
        "--wheelhouse", help="Install from these wheels only (a directory of .whl files for the hosts), never "
        "from a package registry.",
        show_default="the hosts' registry, else this machine's own packages "
        "(or pip download here for another platform)",
    )] = None,
    json_out: Json = False,
) -> None:
    """Give every host this machine's mlxpipe, mlx and mlx-lm, in a venv mlxpipe owns there (~/.mlxpipe/venv).

    Over ssh, host by host in parallel, with a line for each thing it does. A host whose venv
    already has these versions is left as it is (a second run changes nothing). A host that
    cannot reach a package registry gets this machine's wheels, copied over by rsync or scp.
    Afterwards the hostfile's python keys name the venvs (rewritten in one step), so `mlxpipe
    doctor`'s version check passes. Exit status 1 when a host fails.

    Example: mlxpipe cluster install --hostfile cluster.json
    """
    from mlxpipe.cluster.facts_file import facts_path
    from mlxpipe.cluster.hostfile import load_hostfile
    from mlxpipe.cluster.install import FAILED, INSTALLED, ControllerEnv, point_hostfile
    from mlxpipe.cluster.install import install as install_hosts
    from mlxpipe.errors import UsageError

    if wheelhouse is not None and not wheelhouse.is_dir():
        raise UsageError(f"--wheelhouse {wheelhouse}: no such directory", "pass a directory of .whl files")
    hosts = load_hostfile(hostfile)
    env = ControllerEnv.here()
    if not json_out:
        console.err.print(f"making {len({h.ssh for h in hosts.hosts})} hosts match this machine: {env.describe()}",
                          markup=False, highlight=False)

    def say(host: str, text: str) -> None:
        if not json_out:
            console.err.print(f"{host}: {text}", markup=False, highlight=False)

    results = install_hosts(hosts.hosts, wheelhouse=wheelhouse, on_progress=say, env=env)
    changed = point_hostfile(hostfile, results)
    failed = [r for r in results if r.status == FAILED]
    links, links_note = None, None
    if not failed and (any(r.status == INSTALLED for r in results) or not facts_path(hostfile).is_file()):
        links, links_note = _links_job(hostfile, quiet=json_out)  # the hosts can run MLX now: --layout auto's facts
    if json_out:
        console.print_json({"target": env.versions, "hosts": [r.to_json() for r in results],
                            "hostfile_updated": changed, "links": links.to_json() if links is not None else None,
                            "links_note": links_note})
    else:
        _print_installed(results, hostfile, changed)
        _print_links(links, links_note, hostfile)
    if failed:
        first = failed[0]
        console.error(f"{len(failed)} host{'s' if len(failed) > 1 else ''} failed: {first.detail}", first.fix)
        raise typer.Exit(1)


# --- what the commands print -----------------------------------------------------------------------


def _line(text: str) -> None:
    """One line of plain text on stdout, never wrapped (a path or a command stays whole for grep)."""
    console.out.print(text, markup=False, highlight=False, soft_wrap=True)


def _machine_summary(m: Machine) -> str:
    from mlxpipe.console import human_bytes

    parts = [m.chip or "chip unknown", human_bytes(m.memory_bytes) if m.memory_bytes else "memory unknown"]
    if m.macos:
        parts.append(f"macOS {m.macos}")
    if m.disk_free is not None:
        parts.append(f"{human_bytes(m.disk_free)} free")
    return ", ".join(parts)


def _found_table(found: Sequence[Found]) -> Table:
    from rich.markup import escape
    from rich.table import Table

    from mlxpipe.cluster.macos import KINDS

    kinds = [k for k in (*KINDS, "link-local", "unknown") if any(kind == k for f in found for _, kind in f.addresses)]
    t = Table(title=f"{len(found)} Mac{'s' if len(found) != 1 else ''} with Remote Login on", title_justify="left")
    t.add_column("name", no_wrap=True)
    t.add_column("ssh", overflow="fold")
    for kind in kinds:
        t.add_column(kind, overflow="fold")
    t.add_column("machine", overflow="fold")
    for f in found:
        ssh = f"[green]yes[/] ({escape(f.ssh)})" if f.ssh else "[bold red]no[/]"
        cells = ["\n".join(a for a, k in f.addresses if k == kind) or "-" for kind in kinds]
        t.add_row(escape(f.name), ssh, *map(escape, cells), escape(_machine_summary(f.machine)) if f.machine else "-")
    return t


def _print_init(outcome: Outcome, written: Path | None, links: Any, links_note: str | None) -> None:
    from rich.markup import escape
    from rich.table import Table

    from mlxpipe.console import human_bytes

    if outcome.data is not None:
        t = Table(title=f"backend {outcome.data['backend']}", title_justify="left")
        for name in ("rank", "host", "chip", "memory", "macOS", "free disk", "ips", "python"):
            t.add_column(name, overflow="fold", justify="right" if name in ("rank", "memory", "free disk") else "left")
        for rank, (m, entry) in enumerate(zip(outcome.machines, outcome.data["hosts"], strict=True)):
            t.add_row(str(rank), escape(m.ssh), escape(m.chip or "-"), human_bytes(m.memory_bytes), m.macos or "-",
                      human_bytes(m.disk_free), escape(", ".join(entry["ips"])), escape(entry["python"]))
        console.out.print(t)
    for note in outcome.notes:
        _line(note)
    for step in outcome.steps:
        _line(f"step: {step}")
    if written is None or outcome.data is None:
        return
    _line(f"wrote {written} ({len(outcome.data['hosts'])} hosts)")
    _print_links(links, links_note, written)
    if outcome.to_install:
        _line(f"next: mlxpipe cluster install --hostfile {written}  (mlxpipe, mlx and mlx-lm for "
              f"{', '.join(outcome.to_install)})")
    else:
        _line(f"next: mlxpipe doctor --hostfile {written}")


def _print_links(links: Any, note: str | None, hostfile: Path) -> None:
    """What the links job measured, one line per link, and where it wrote it; or why it did not run."""
    from mlxpipe.cli.render import link_lines
    from mlxpipe.cluster.facts_file import facts_path

    if links is None:
        if note:
            _line(f"links: {note}")
        return
    for text in link_lines(links):
        _line(f"links: {text}")
    _line(f"wrote {facts_path(hostfile)}")


def _init_json(outcome: Outcome, written: Path | None, links: Any, links_note: str | None) -> dict[str, Any]:
    return {
        "written": str(written) if written else None,
        "hostfile": outcome.data,
        "hosts": [{"ssh": m.ssh, "hostname": m.hostname, "chip": m.chip, "memory_bytes": m.memory_bytes,
                   "macos": m.macos, "disk_free": m.disk_free, "rdma": list(m.rdma) if m.rdma is not None else None,
                   "pythons": [{"path": p.path, "version": p.version, "packages": p.packages} for p in m.pythons]}
                  for m in outcome.machines],
        "notes": outcome.notes,
        "steps": [{"host": s.host, "step": s.what, "blocking": s.blocking} for s in outcome.steps],
        "to_install": outcome.to_install,
        "links": links.to_json() if links is not None else None,
        "links_note": links_note,
    }


def _print_installed(results: Sequence[Installed], hostfile: Path, changed: Sequence[str]) -> None:
    from mlxpipe.cluster.install import FAILED

    for r in results:
        source = f" (from {r.source})" if r.source else ""
        line = f"{r.host}: {r.status}: {r.detail}{source}"
        if r.status == FAILED and r.fix:
            line += f"; fix: {r.fix}"
        _line(line)
    if changed:
        _line(f"{hostfile}: python now names the venv for {', '.join(changed)}")
