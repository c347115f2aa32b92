"""The scheduler's messages and their framing (``_scheduler.messages``): whole messages out of
bytes arriving in any pieces; oversized or broken frames refused."""

from __future__ import annotations

import struct

import pytest

from aio_mclookup._scheduler.messages import (
    MAX_FRAME,
    Answers,
    FrameError,
    FrameReader,
    Reset,
    Submit,
    encode,
)


def test_messages_come_out_whole_from_any_pieces() -> None:
    sent = [
        Submit([(1, 64, b"\x01" * 96, 32), (2, 16, [b"a", b"bb"], 0)], discard=[7]),
        Reset(),
        Answers([(1, 48, ((0, 48),)), (2, None, "ValueError('x')")]),
    ]
    stream = b"".join(encode(m) for m in sent)
    for piece in (1, 3, 7, len(stream)):
        reader = FrameReader()
        got = []
        for start in range(0, len(stream), piece):
            got += reader.feed(stream[start : start + piece])
        assert got == sent


def test_an_oversized_frame_is_refused_before_it_is_buffered() -> None:
    reader = FrameReader()
    with pytest.raises(FrameError, match="over"):
        reader.feed(struct.pack(">I", MAX_FRAME + 1) + b"x" * 10)


def test_a_frame_that_does_not_unpickle_is_refused() -> None:
    with pytest.raises(FrameError, match="unpickle"):
        FrameReader().feed(struct.pack(">I", 3) + b"not")
