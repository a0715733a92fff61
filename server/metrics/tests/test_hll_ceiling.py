"""HitRateCeiling: r* = (N - U) / N over rolling windows: accuracy, roll-over, memory, threads, bad input."""

import threading

import pytest

from pegaflow.server.metrics.hll_ceiling import MAX_WINDOW_BYTES, HitRateCeiling

DEFAULT_WINDOWS = {"15m": 900, "1h": 3600, "24h": 86400}


class FakeClock:
    """An injected monotonic clock the test moves by hand."""

    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def block_keys(start, stop, namespace=3):
    prefix = namespace.to_bytes(4, "little")
    return [prefix + i.to_bytes(32, "big") for i in range(start, stop)]


def test_no_requests_means_no_ceiling():
    ceiling = HitRateCeiling(DEFAULT_WINDOWS)
    for window in DEFAULT_WINDOWS:
        assert ceiling.ceiling(window) is None
        assert ceiling.counts(window) == (0, 0.0)
    ceiling.add([])
    assert ceiling.ceiling("15m") is None


def test_estimate_within_two_percent_on_a_million_keys():
    # 10^6 distinct blocks, requested 2.5 x 10^6 times (every block at least once, some up to 4 times).
    distinct = 1_000_000
    keys = block_keys(0, distinct)
    requests = keys + keys[::2] + keys[::3] + keys[: distinct // 2] + keys[::7]
    ceiling = HitRateCeiling(DEFAULT_WINDOWS)
    for i in range(0, len(requests), 65_536):  # the metrics feeder's batch size
        ceiling.add(requests[i : i + 65_536])
    true_ceiling = (len(requests) - distinct) / len(requests)
    for window in DEFAULT_WINDOWS:
        n, u = ceiling.counts(window)
        assert n == len(requests)
        assert abs(u / distinct - 1) < 0.02, u
        r = ceiling.ceiling(window)
        assert abs(r / true_ceiling - 1) < 0.02, (r, true_ceiling)


def test_all_distinct_requests_give_a_ceiling_near_zero_never_negative():
    ceiling = HitRateCeiling({"w": 60})
    ceiling.add(block_keys(0, 50_000))
    n, u = ceiling.counts("w")
    assert n == 50_000 and u <= n
    assert 0.0 <= ceiling.ceiling("w") < 0.03


def test_single_request():
    ceiling = HitRateCeiling({"w": 60})
    ceiling.add(block_keys(0, 1))
    assert ceiling.counts("w") == (1, 1.0)
    assert ceiling.ceiling("w") == 0.0


def test_window_rolls_over_bucket_by_bucket():
    clock = FakeClock(now=0.0)
    # 60 s / 15 buckets = 4 s buckets; 600 s / 15 = 40 s buckets.
    ceiling = HitRateCeiling({"short": 60, "long": 600}, clock=clock)
    a = block_keys(0, 1000)
    ceiling.add(a)  # t=0, bucket 0 of "short"
    clock.now = 30.0
    ceiling.add(a)  # the same blocks again: half of all requests could hit
    assert ceiling.counts("short")[0] == 2000
    assert ceiling.ceiling("short") == pytest.approx(0.5, abs=0.01)

    clock.now = 59.9  # bucket 14: the t=0 bucket is still inside the window
    assert ceiling.counts("short")[0] == 2000
    clock.now = 60.0  # bucket 15: the t=0 bucket has left
    n, u = ceiling.counts("short")
    assert n == 1000
    assert ceiling.ceiling("short") == pytest.approx(0.0, abs=0.01)
    # The long window still sees both.
    assert ceiling.counts("long")[0] == 2000
    assert ceiling.ceiling("long") == pytest.approx(0.5, abs=0.01)

    clock.now = 90.0  # the t=30 bucket has left the short window too
    assert ceiling.counts("short") == (0, 0.0)
    assert ceiling.ceiling("short") is None
    ceiling.add(block_keys(5000, 5100))
    assert ceiling.counts("short")[0] == 100
    assert ceiling.counts("long")[0] == 2100

    clock.now = 30.0 + 600.0  # only the t=90 bucket is left in the long window
    assert ceiling.counts("long")[0] == 100
    clock.now = 90.0 + 600.0
    assert ceiling.ceiling("long") is None


def test_a_block_repeated_in_the_next_window_is_distinct_again():
    clock = FakeClock()
    ceiling = HitRateCeiling({"w": 60}, clock=clock)
    keys = block_keys(0, 2000)
    ceiling.add(keys)
    clock.now += 61
    ceiling.add(keys)
    assert ceiling.counts("w")[0] == 2000
    assert ceiling.ceiling("w") == pytest.approx(0.0, abs=0.03)


def test_memory_stays_under_one_mib_per_window():
    clock = FakeClock()
    for precision in (14, 16):
        ceiling = HitRateCeiling(DEFAULT_WINDOWS, precision=precision, clock=clock)
        # Touch every bucket of every window many times over.
        for step in range(200):
            clock.now += 86400 / 15 / 3
            ceiling.add(block_keys(step * 10, step * 10 + 10))
            if step % 50 == 0:
                ceiling.counts("24h")
        for window in DEFAULT_WINDOWS:
            assert ceiling.memory_bytes(window) <= MAX_WINDOW_BYTES == 1 << 20
        # The 24h window really holds a full ring of buckets (the bound is not met by holding nothing).
        assert ceiling.memory_bytes("24h") >= 14 * (1 << precision)


def test_memory_at_default_precision():
    clock = FakeClock()
    ceiling = HitRateCeiling(DEFAULT_WINDOWS, clock=clock)
    for _ in range(40):
        clock.now += 60
        ceiling.add(block_keys(0, 10))
    # 15m window: up to 15 live buckets + 1 spare + the read's merge, 16 KiB each.
    assert 15 * 16384 <= ceiling.memory_bytes("15m") <= 17 * 16384


def test_concurrent_adds_count_every_request():
    ceiling = HitRateCeiling({"w": 3600})

    def worker(w):
        for i in range(20):
            ceiling.add(block_keys(i * 500, (i + 1) * 500, namespace=w % 2))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    reader_done = []

    def reader():
        for _ in range(50):
            ceiling.ceiling("w")
        reader_done.append(True)

    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.join()
    r.join()
    n, u = ceiling.counts("w")
    assert n == 4 * 20 * 500
    assert abs(u / 20_000 - 1) < 0.03  # two namespaces x 10,000 blocks
    assert reader_done


def test_unknown_window_is_a_key_error():
    ceiling = HitRateCeiling({"15m": 900})
    with pytest.raises(KeyError, match="unknown window"):
        ceiling.ceiling("1h")
    with pytest.raises(KeyError):
        ceiling.memory_bytes("nope")


@pytest.mark.parametrize(
    "windows",
    [{}, {"": 60}, {"w": 0}, {"w": -1}, {"w": float("inf")}, {"w": float("nan")}, {"w": "60"}, {1: 60}],
)
def test_bad_windows_are_rejected(windows):
    with pytest.raises((TypeError, ValueError)):
        HitRateCeiling(windows)


@pytest.mark.parametrize("precision", [3, 18, 14.5])
def test_bad_precision_is_rejected(precision):
    with pytest.raises((TypeError, ValueError)):
        HitRateCeiling({"w": 60}, precision=precision)


def test_bad_keys_are_rejected_and_leave_no_trace():
    ceiling = HitRateCeiling({"w": 60})
    with pytest.raises(TypeError):
        ceiling.add(["not bytes"])
    assert ceiling.counts("w") == (0, 0.0)


def test_staged_keys_land_in_the_bucket_of_their_time_even_with_no_read_between():
    # add() stages keys and folds them into the windows later: keys staged before a bucket boundary
    # must still leave the window with that bucket, not with the one the fold happened in.
    clock = FakeClock(now=0.0)
    ceiling = HitRateCeiling({"w": 60}, clock=clock)  # 15 buckets of 4 s
    ceiling.add(block_keys(0, 100))
    clock.now = 5.0  # the next bucket; nothing read in between
    ceiling.add(block_keys(100, 150))
    clock.now = 60.5  # the t=0 bucket has left, the t=5 one has not
    requests, distinct = ceiling.counts("w")
    assert requests == 50 and distinct == pytest.approx(50, rel=0.05)
