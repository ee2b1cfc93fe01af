"""worker/inbox.py: the messages a rank reads on standard input, numbered in arrival order."""

from __future__ import annotations

import io
import os
import threading

from mlxpipe.protocol import wire
from mlxpipe.protocol.messages import MESSAGES
from mlxpipe.worker.inbox import Inbox


def test_messages_are_taken_in_the_order_they_arrived_and_none_ends_the_input() -> None:
    read_fd, write_fd = os.pipe()
    inbox = Inbox(io.TextIOWrapper(io.FileIO(read_fd, "r")))
    writer = io.FileIO(write_fd, "w")
    sent = [{"type": "submit", "id": i, "prompt": "x" * (1500 * i)} for i in range(3)]  # the last spans lines
    for message in sent[:2]:
        writer.write(wire.encode_request(message))
    inbox.wait_beyond(1)
    assert inbox.received == 2
    assert inbox.next() == MESSAGES.from_wire(sent[0])
    writer.write(wire.encode_request(sent[2]))
    writer.close()  # the controller's end of input
    inbox.wait_beyond(3)
    assert inbox.received == 4  # the end counts as one
    assert inbox.take(4) == [MESSAGES.from_wire(sent[1]), MESSAGES.from_wire(sent[2]), None]
    assert inbox.consumed == 4
    assert inbox.take(2) == []  # what was taken is not given again


def test_next_waits_for_a_message_that_has_not_arrived_yet() -> None:
    read_fd, write_fd = os.pipe()
    inbox = Inbox(io.TextIOWrapper(io.FileIO(read_fd, "r")))
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(inbox.next()))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and got == []  # nothing yet: it waits
    with io.FileIO(write_fd, "w") as writer:
        writer.write(wire.encode_request({"type": "exit"}))
    reader.join(10)
    assert got == [MESSAGES.from_wire({"type": "exit"})]
