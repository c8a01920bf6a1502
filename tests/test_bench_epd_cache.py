"""The pure parts of bench/epd_cache/: the subscriber's RESP parsing, the wake figures of a miss,
and the distinct images of a round (the benchmark itself is run by hand, bench/README.md)."""

from __future__ import annotations

import pytest

from bench.epd_cache.analysis import wake
from bench.epd_cache.landing import parse_pushes
from bench.epd_cache.workload import ImageSource, plan_round

CONFIRM = b"*3\r\n$9\r\nsubscribe\r\n$10\r\nepd:events\r\n:1\r\n"
READY = b'{"kind":"ready","key":"ab","reason":""}'
MESSAGE = b"*3\r\n$7\r\nmessage\r\n$10\r\nepd:events\r\n$%d\r\n%s\r\n" % (len(READY), READY)


def test_parse_pushes_reads_whole_arrays_and_leaves_the_tail():
    buffer = CONFIRM + MESSAGE + MESSAGE[:-5]
    pushes, used = parse_pushes(buffer)
    assert pushes == [[b"subscribe", b"epd:events", b"1"], [b"message", b"epd:events", READY]]
    assert used == len(CONFIRM) + len(MESSAGE)
    assert parse_pushes(buffer[used:] + MESSAGE[-5:]) == ([[b"message", b"epd:events", READY]], len(MESSAGE))


@pytest.mark.parametrize("cut", [1, 4, 12, 20, len(MESSAGE) - 1])
def test_parse_pushes_waits_for_an_incomplete_array(cut):
    assert parse_pushes(MESSAGE[:cut]) == ([], 0)


def test_parse_pushes_refuses_what_is_not_an_array():
    with pytest.raises(ValueError, match="not a RESP array at byte 0"):
        parse_pushes(b"+OK\r\n")
    with pytest.raises(ValueError, match=r"unexpected RESP type b'\+'"):
        parse_pushes(b"*1\r\n+OK\r\n")


def _miss(landed, created, misses=2.0, **events):
    return {"case": "miss", "landed_at": landed, "created_at": created, "prefill_cache_misses": misses}, events


def test_wake_of_a_miss_that_waited():
    reply, events = _miss(100.0, 99.998, queued=99.5, paired=99.6, embeddings_ready=100.0015)
    assert wake(reply, events) == {"waited": True, "wake_ms": 1.5, "wake_upper_ms": 3.5,
                                    "paired_before_landing_ms": 400.0}


def test_wake_of_a_miss_paired_after_the_landing_or_without_a_cache_miss_did_not_wait():
    reply, events = _miss(100.0, 99.998, queued=99.5, paired=100.01, embeddings_ready=100.011)
    assert wake(reply, events)["waited"] is False
    reply, events = _miss(100.0, 99.998, misses=0.0, queued=99.5, paired=99.6, embeddings_ready=100.0015)
    assert wake(reply, events)["waited"] is False


def test_wake_falls_back_to_created_at_and_skips_hits():
    reply, events = _miss(None, 99.998, queued=99.5, paired=99.6, embeddings_ready=100.0015)
    assert wake(reply, events) == {"waited": True, "wake_upper_ms": 3.5, "paired_before_landing_ms": 398.0}
    assert wake({**reply, "case": "hit"}, events) == {"waited": False}


def test_a_round_never_repeats_an_image():
    source = ImageSource(size=32, salt=7)
    pairs = plan_round(source, [1, 4, 8], requests=3, round_index=1) + plan_round(source, [1, 4, 8], 3, 2)
    images = [p for pair in pairs for p in pair.pngs]
    assert [pair.n for pair in pairs[:6]] == [1, 4, 8, 1, 4, 8]
    assert [pair.index for pair in pairs[:6]] == [-1, -1, -1, 0, 0, 0]
    assert len(images) == 2 * 4 * 13 == len(set(images))
