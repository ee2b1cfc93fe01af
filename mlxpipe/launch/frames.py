"""Events through ``mlx.launch``'s merged output: frames that survive being cut.

``mlx.launch`` reads each rank's output in raw pieces (at most 8 KiB, and less
when a pipe or an ssh packet holds less) and writes every rank's pieces to one
stream as they come, so a line of one rank can be cut anywhere and another
rank's output written into the cut. A plain JSON line per event then loses
(or, worse, garbles) whatever is cut: long token lists, results, adapters.

So each supervisor writes its events as frames (``encode``), one line each::

    @@mlxpipe@@ #<rank>:<seq>:<c|n><+|.>:<length>:<crc32> <payload>

* ``seq`` counts the rank's frames from 0, so a lost frame is known, never silent;
* ``c``/``n``: whether losing it fails the run (a token, a result) or not (a heartbeat, a log line);
* ``+``: the event's JSON continues in the next frame (events are cut into
  frames of at most ``FRAME_PAYLOAD`` characters; each frame is written whole,
  below a pipe's atomic write size);
* ``length`` and ``crc32`` of the payload: a frame is accepted only when whole
  and intact, and tell where a cut frame's rest must end.

The controller's ``Demux`` puts the pieces back together: a rank's bytes arrive
in order, so a cut frame's rest is the next piece of that rank, and the length
and checksum say which pending frame a piece completes. Whatever cannot be put
back is reported as lost, with its rank, and never delivered garbled.

mlxpipe runs mlx.launch with its reads made whole lines (``launch/mlx_launch.py``),
so the stream it gets has no cut frames: the putting back is for an mlx.launch
that runs unpatched. There, the cuts its 8 KiB reads make are put back
(``tests/launch/test_frames.py`` cuts and merges streams as it does, 2 to 4
ranks), but for rare interleavings the pieces alone cannot tell apart (about 1
in 100 of its random streams of 150 events a rank has one). A frame that
arrives in several small pieces interleaved with other ranks' pieces (a
terminal handing a half-written line to ssh) may be lost too. Every loss is
reported, never delivered garbled, and the run fails when the lost frame
mattered.
"""

from __future__ import annotations

import json
import os
import re
import threading
import zlib
from dataclasses import dataclass, field

from mlxpipe.protocol.message import Wire, tag_of
from mlxpipe.protocol.wire import EVENT_PREFIX

FRAME_PAYLOAD = 3500  # characters of JSON per frame: a whole frame stays below PIPE_BUF (4096)
NONCRITICAL = frozenset({"alive", "log", "progress"})  # losing one of these fails nothing
_HEADER = re.compile(re.escape(EVENT_PREFIX) + r"#(-?\d+):(\d+):([cn])([+.]):(\d+):([0-9a-f]{8}) ")
_ORPHANS = 8  # unplaced pieces kept for a frame cut inside its header
_HEADER_START = re.compile(r"#[-0-9:cn+.a-f]{0,40}")
_HEADER_MAX = len(EVENT_PREFIX) + 50  # characters: a header is shorter

Item = Wire | str  # an event, or a line of plain text


def encode(event: Wire, rank: int, seq: int) -> list[str]:
    """The frames (lines, newline included) carrying ``event``, numbered from ``seq``."""
    payload = json.dumps(event)  # ASCII: mlx.launch drops bytes of a UTF-8 character it cuts
    kind = "n" if tag_of(event) in NONCRITICAL else "c"
    parts = [payload[i : i + FRAME_PAYLOAD] for i in range(0, max(len(payload), 1), FRAME_PAYLOAD)]
    lines = []
    for i, part in enumerate(parts):
        more = "+" if i < len(parts) - 1 else "."
        fields = f"{rank}:{seq + i}:{kind}{more}:{len(part)}"
        lines.append(f"{EVENT_PREFIX}#{fields}:{_crc(fields, part):08x} {part}\n")
    return lines


class Writer:
    """One rank's frames to a file descriptor (its standard output): numbered in order, each frame in
    one write (a pipe then never splits it), safe from several threads."""

    def __init__(self, rank: int, fd: int = 1) -> None:
        self.rank, self.fd = rank, fd
        self._seq = 0  # frames written
        self._lock = threading.Lock()

    def write(self, event: Wire) -> None:
        """Write ``event``; raises ``OSError`` when nobody reads the other end any more."""
        with self._lock:
            lines = encode(event, self.rank, self._seq)
            self._seq += len(lines)
            for line in lines:
                data = line.encode()
                while data:
                    data = data[os.write(self.fd, data):]


@dataclass
class _Frame:
    rank: int
    seq: int
    critical: bool
    more: bool
    length: int
    crc: int
    body: str = ""

    @property
    def need(self) -> int:
        return self.length - len(self.body)

    def fits(self, rest: str) -> bool:
        """``rest`` completes this frame: the right length, and the checksum of header and payload."""
        fields = f"{self.rank}:{self.seq}:{'c' if self.critical else 'n'}{'+' if self.more else '.'}:{self.length}"
        return len(self.body) + len(rest) == self.length and _crc(fields, self.body + rest) == self.crc

    def intact(self) -> bool:
        return self.fits("")


@dataclass
class _Rank:
    next_seq: int = 0
    pending: _Frame | None = None  # its frame whose rest has not come yet
    parts: list[str] = field(default_factory=list)  # an event's frames so far
    lost_event: bool = False  # a frame of the event being assembled was lost
    began: int = -1  # when (``Demux``'s count of frame starts) its latest frame started


class Demux:
    """Rebuild the ranks' events from the lines of ``mlx.launch``'s merged output.

    ``feed`` takes one line and returns what it completes: event dicts, plain
    text (output that is no frame), and ``{"event": "lost", "rank", "frames",
    "critical"}`` for frames that could not be put back.

    A line is pieces of several ranks' output: a piece that starts with a
    header begins a frame; one that does not continues a frame cut earlier.
    The line's last piece ends some frame (its newline ends the line), so a
    cut frame's rest is found at the end of a line by its length and checksum.
    """

    def __init__(self) -> None:
        self._ranks: dict[int, _Rank] = {}
        # Unplaced pieces, perhaps frames cut inside their headers, each with the count of frame starts seen
        # before it: a rank whose frame started after a piece cannot have written that piece (its bytes come in
        # order), which tells apart two pieces such as "@@ml" and "@@mlx" that the same rest completes.
        self._orphans: list[tuple[str, int]] = []
        self._starts = 0  # frames started so far, of every rank
        self._out: list[Item] = []

    def feed(self, line: str) -> list[Item]:
        line = line.replace("\r", "").rstrip("\n")  # a remote terminal writes CR LF; JSON has no raw CR
        self._out = []
        starts = [m.start() for m in _HEADER.finditer(line)]
        first = starts[0] if starts else len(line)
        if first:
            self._headless(line[:first], ends_line=first == len(line))
        for i, at in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else len(line)
            self._framed(line[at:end], ends_line=end == len(line))
        return self._out

    def close(self) -> list[Item]:
        """The stream ended: frames still waiting for their rest are lost."""
        self._out = []
        for rank, state in self._ranks.items():
            if state.pending is not None:
                self._lost(rank, 1, state.pending)
                state.pending = None
        return self._out

    # --- pieces ---------------------------------------------------------------------

    def _framed(self, piece: str, ends_line: bool) -> None:
        """A piece that starts with a frame's header."""
        m = _HEADER.match(piece)
        assert m is not None
        frame = _frame(m)
        body = piece[m.end() :]
        frame.body = body[: frame.length]
        if frame.intact():
            self._begin(frame)
            self._complete(frame)
            if len(body) > frame.length:  # cut right before its newline: another rank's piece follows
                self._headless(body[frame.length :], ends_line)
            return
        # Cut: what follows the frame's head is another rank's piece, and the line's
        # last piece is the rest of one of the frames cut earlier.
        if ends_line:
            rest = self._take_tail(piece)
            if len(rest) < m.end():
                # That rest began inside this "header": a frame cut inside its header (its start set aside) was
                # completed by the rest, so the header was another frame's start joined to it, cut once more.
                if rest:
                    self._headless(rest, ends_line=False)
                return
            body = rest[m.end() :]
        self._begin(frame)
        if len(body) >= frame.length:
            self._lost(frame.rank, 1, frame)
            return
        frame.body = body
        self._ranks[frame.rank].pending = frame

    def _headless(self, text: str, ends_line: bool) -> None:
        """A piece without a header: the rest of a cut frame, or plain output."""
        if ends_line:
            rest = self._take_tail(text)
            if rest == text:  # it ends no cut frame: plain output
                self._plain(text)
                return
            text = rest  # what came before that frame's rest: another cut frame's piece
        elif self._finish_exact(text) or self._join_orphan(text, ends_line):
            return
        if not text:
            return
        if _header_start(text):
            self._orphans = (self._orphans + [(text, self._starts)])[-_ORPHANS:]
        elif not self._extend_unique(text):
            self._plain(text)

    def _plain(self, text: str) -> None:
        if text.strip():
            self._out.append(text)

    def _take_tail(self, text: str) -> str:
        """Complete the frame whose rest ends ``text`` (a line's end); return the text before it.

        That frame is a pending one (its length says where its rest starts), or
        one cut inside its header (its start set aside as an orphan).
        """
        # The longest rest first: a short one (a frame cut near its end) may also fit the line's last characters.
        waiting = sorted((s for s in self._ranks.values() if s.pending is not None),
                         key=lambda s: -s.pending.need)  # type: ignore[union-attr]
        for state in waiting:
            frame = state.pending
            assert frame is not None
            # Its rest; or a piece set aside as a cut header, then its rest: that piece may have been its middle
            # ("@"), or the start of a header the line's search took whole from its last characters.
            for i, middle in [(None, ""), *((i, o) for i, (o, _) in enumerate(self._orphans))]:
                size = frame.need - len(middle)
                if not 0 < size <= len(text):
                    continue
                tail = text[len(text) - size :]
                if frame.fits(middle + tail):
                    if i is not None:
                        del self._orphans[i]
                    frame.body += middle + tail
                    state.pending = None
                    self._complete(frame)
                    return text[: len(text) - len(tail)]
        for i, (orphan, seen) in enumerate(self._orphans):
            for at in range(len(text)):
                if not _HEADER.match(orphan + text[at : at + _HEADER_MAX]):
                    continue
                frame = _parse(orphan + text[at:])
                if frame is not None and frame.intact() and self._could_have_written(frame.rank, seen):
                    del self._orphans[i]
                    self._begin(frame)
                    self._complete(frame)
                    return text[:at]
        return text

    def _finish_exact(self, text: str) -> bool:
        """``text`` is exactly the rest of a pending frame (cut again right before its newline)."""
        for state in self._ranks.values():
            frame = state.pending
            if frame is not None and frame.fits(text):
                frame.body += text
                state.pending = None
                self._complete(frame)
                return True
        return False

    def _extend_unique(self, text: str) -> bool:
        """A middle piece: it goes to the one pending frame it fits in, if only one."""
        fits = [s.pending for s in self._ranks.values() if s.pending is not None and s.pending.need > len(text)]
        if len(fits) != 1:
            return False
        fits[0].body += text
        return True

    def _join_orphan(self, text: str, ends_line: bool) -> bool:
        """``text`` is the rest of a frame cut inside its header, whose start was set aside."""
        for i, (orphan, seen) in enumerate(self._orphans):
            m = _HEADER.match(orphan + text)
            if m is not None and self._could_have_written(int(m.group(1)), seen):
                del self._orphans[i]
                self._framed(orphan + text, ends_line)
                return True
        return False

    # --- bookkeeping ----------------------------------------------------------------

    def _could_have_written(self, rank: int, seen: int) -> bool:
        """Whether ``rank`` could have written a piece set aside after ``seen`` frame starts: not if a frame of
        its started since."""
        state = self._ranks.get(rank)
        return state is None or state.began < seen

    def _begin(self, frame: _Frame) -> None:
        """A rank's next frame starts: whatever of its earlier frames is missing is lost."""
        state = self._ranks.setdefault(frame.rank, _Rank())
        state.began, self._starts = self._starts, self._starts + 1
        if state.pending is not None:
            self._lost(frame.rank, 1, state.pending)
            state.pending = None
        if frame.seq > state.next_seq:
            self._lost(frame.rank, frame.seq - state.next_seq, None)
        state.next_seq = frame.seq + 1

    def _complete(self, frame: _Frame) -> None:
        state = self._ranks[frame.rank]
        state.parts.append(frame.body)
        if frame.more:
            return
        parts, broken = state.parts, state.lost_event
        state.parts, state.lost_event = [], False
        if broken:
            return  # its loss is reported already
        try:
            self._out.append(json.loads("".join(parts)))
        except json.JSONDecodeError:  # its first frames were lost unseen
            self._out.append({"event": "lost", "rank": frame.rank, "frames": len(parts), "critical": frame.critical})

    def _lost(self, rank: int, frames: int, frame: _Frame | None) -> None:
        """``frames`` of ``rank``'s frames are lost: ``frame`` when it was seen in part."""
        state = self._ranks.setdefault(rank, _Rank())
        critical = True if frame is None else frame.critical  # unseen: assume it mattered
        # The event being assembled is lost; a known middle frame: drop its rest when it ends.
        # (An unseen one's later frames fail to parse, and are reported then.)
        state.parts, state.lost_event = [], frame is not None and frame.more
        self._out.append({"event": "lost", "rank": rank, "frames": frames, "critical": critical})


def _header_start(text: str) -> bool:
    """``text`` is the start of a frame cut inside its header."""
    if len(text) <= len(EVENT_PREFIX):
        return EVENT_PREFIX.startswith(text)
    return text.startswith(EVENT_PREFIX) and _HEADER_START.fullmatch(text, len(EVENT_PREFIX)) is not None


def _frame(m: re.Match[str]) -> _Frame:
    return _Frame(int(m.group(1)), int(m.group(2)), m.group(3) == "c", m.group(4) == "+",
                  int(m.group(5)), int(m.group(6), 16))


def _parse(text: str) -> _Frame | None:
    """The frame that is exactly ``text``, or None."""
    m = _HEADER.match(text)
    if m is None:
        return None
    frame = _frame(m)
    frame.body = text[m.end() :]
    return frame


def _crc(fields: str, payload: str) -> int:
    """The checksum of a frame: its header's fields too, so a header put back wrong fails it."""
    return zlib.crc32(f"{fields} {payload}".encode())
