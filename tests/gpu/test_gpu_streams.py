"""The CuPy transport's stream handling (``make gpu-check``'s stage ``streams``).

1. **Ordering**: the send buffer is written by a kernel queued behind a long sleep on the caller's stream; the
   transport must start after it (the received data is right). **Ablation**: the same without the transport's event
   wait must receive the stale buffer (else the check could not see the bug).
2. **Stream-side waits**: a synchronous all-reduce and an async all-to-all's wait, both behind the sleep, return to
   the host long before the sleep ends, and their results are right once the device catches up; the count
   exchange's all-gather, whose result the host reads, does block (its bounded host wait).
3. **Watchdog**: a primitive queued behind a sleep longer than ``timeout_s`` is found overdue by the transport's
   watchdog thread (the host idle meanwhile), which aborts the NCCL communicator; the next call raises
   ``TimeoutError`` naming the primitive.

Under the GPU stand-in NCCL is a loopback and work is done when issued: ordering and its ablation are not observable,
and the watchdog runs over a stream whose events never fire.
"""
from __future__ import annotations

import time
from typing import Optional

SLEEP_S = 0.2


class Span:
    """A stretch of the caller's stream between two timing events (its length is read after a sync)."""

    def __init__(self, start, end, nominal_s: float) -> None:
        self.start, self.end, self.nominal_s = start, end, nominal_s

    @classmethod
    def record(cls) -> "Span":
        import torch
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return cls(start, None, 0.0)

    def close(self) -> None:
        import torch
        self.end = torch.cuda.Event(enable_timing=True)
        self.end.record()

    def seconds(self) -> float:
        """The span's device time (waits for its end); the nominal length under the stand-in."""
        if self.start is None:
            return self.nominal_s
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


class Device:
    """The GPU (or the stand-in, ``real`` False): a delay queued on the caller's stream, and a transport."""

    def __init__(self, real: bool) -> None:
        import torch
        self.real, self.dev = real, torch.device("cuda", 0)
        self.cycles_per_s: Optional[float] = None

    def sync(self) -> None:
        if self.real:
            import torch
            torch.cuda.synchronize()

    def delay(self, seconds: float) -> "Span":
        """Queue ``seconds`` of sleep on the caller's stream (nothing under the stand-in); returns the sleep's
        :class:`Span`, whose length the checks read afterwards: the SM clock ramps from idle (345 MHz) to 1,980
        MHz under load, so a sleep counted in cycles lasts what the clock makes of it, and a check that assumed
        its nominal length would judge against the wrong figure."""
        import torch
        if not self.real:
            return Span(None, None, seconds)
        if self.cycles_per_s is None:
            torch.cuda._sleep(1_000_000)   # loads the kernel and wakes the clock before it is measured
            torch.cuda.synchronize()
            probe = Span.record()
            torch.cuda._sleep(50_000_000)
            probe.close()
            self.cycles_per_s = 50_000_000 / probe.seconds()
        span = Span.record()
        torch.cuda._sleep(int(seconds * self.cycles_per_s))
        span.close()
        return span

    def transport(self, timeout_s, stalled: bool = False):
        """The CuPy transport of one rank (under the GPU stand-in in a dry run). ``stalled``: the watchdog's case,
        where the delay leaves the primitive unfinished past its deadline; the stand-in's device is never behind,
        so there its communication stream is one whose events never complete."""
        from ds_hecate.comm.gpu.nccl_comm import CupyTransport
        t = CupyTransport(None, 0, 1, self.dev, timeout_s=timeout_s)
        if stalled and not self.real:
            from gpu_fakes import StalledStreams
            t.streams = StalledStreams()
        return t


def ordering(d: Device, ablate: bool) -> bool:
    import torch
    transport = d.transport(60)
    if ablate:
        def start(tensors, streams=transport.streams):
            return torch.cuda.stream(streams.stream)   # no wait_event: the bug this check must catch
        transport.streams.start = start
    send = torch.zeros(1 << 20, device=d.dev)
    recv = torch.empty_like(send)
    d.sync()
    d.delay(SLEEP_S)   # delays the producer on the caller's stream
    send.fill_(7.0)
    transport.all_to_all(recv, send, [send.numel()], [send.numel()], False)
    d.sync()
    return bool((recv == 7.0).all())


def stream_side_waits(d: Device) -> dict:
    import torch
    import torch.distributed as dist
    transport = d.transport(60)
    value = torch.full((1024,), 3.0, device=d.dev)
    send = torch.arange(4096, dtype=torch.float32, device=d.dev).reshape(64, 64)
    recv = torch.empty_like(send)
    transport.all_reduce(torch.zeros(1, device=d.dev), dist.ReduceOp.SUM)   # warm-up: NCCL's first call sets up
    d.sync()
    first = d.delay(SLEEP_S)
    reduce_s = host_seconds(lambda: transport.all_reduce(value, dist.ReduceOp.SUM))
    work = transport.all_to_all(recv, send, [64], [64], True)
    wait_s = host_seconds(work.wait)
    d.sync()
    right = bool((value == 3.0).all()) and bool(torch.equal(recv, send))
    second = d.delay(SLEEP_S)
    counts = torch.empty(4, dtype=torch.int64, device=d.dev)
    gather_s = host_seconds(lambda: transport.all_gather(counts, torch.arange(4, device=d.dev)))
    right = right and counts.tolist() == [0, 1, 2, 3]
    # Judged against the sleeps as the device measured them: a stream-side wait returns within a few ms of a
    # 0.2 s sleep; the count exchange's host wait sits it out. A sleep far shorter than asked proves nothing.
    slept = (first.seconds(), second.seconds())
    long_enough = min(slept) >= SLEEP_S / 2
    limit = slept[0] / 4
    ok = (right and long_enough and reduce_s < limit and wait_s < limit
          and (not d.real or gather_s > slept[1] / 2))
    return {"ok": ok, "results_right": right, "all_reduce_host_s": reduce_s, "wait_host_s": wait_s,
            "count_exchange_host_s": gather_s, "sleep_s": SLEEP_S, "slept_s": slept, "sleeps_long_enough":
            long_enough}


def watchdog(d: Device) -> dict:
    import torch
    timeout_s = 0.2
    transport = d.transport(timeout_s, stalled=True)
    send = torch.ones(256, device=d.dev)
    recv = torch.empty_like(send)
    d.sync()
    span = d.delay(5 * timeout_s)   # the primitive cannot complete before its deadline
    start = time.monotonic()
    transport.all_to_all(recv, send, [256], [256], False)
    call_s = time.monotonic() - start
    while transport.failure is None and time.monotonic() - start < 20 * timeout_s:
        time.sleep(0.01)
    fired_s = time.monotonic() - start
    raised = ""
    try:
        transport.all_reduce(send)
    except TimeoutError as exc:
        raised = str(exc)
    d.sync()
    slept = span.seconds()
    ok = (slept > 2 * timeout_s and call_s < timeout_s and transport.aborted and fired_s < 10 * timeout_s
          and "NCCL all-to-all did not complete within 0.2 s" in raised)
    return {"ok": ok, "call_host_s": call_s, "fired_after_s": fired_s, "aborted": transport.aborted,
            "next_call_raised": raised, "timeout_s": timeout_s, "slept_s": slept}


def host_seconds(fn) -> float:
    """Host time of one call (what a stream-side wait must keep small)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_the_transport_starts_after_the_producer_and_the_ablation_is_caught(gpu):
    d = Device(gpu.real)
    assert ordering(d, ablate=False)
    if gpu.real:   # under the stand-in the work is done when issued: the ablation cannot be seen
        assert not ordering(d, ablate=True), "without the event wait the transport must read the stale buffer"


def test_waits_leave_the_host_free_and_the_watchdog_aborts(gpu):
    """Behind a sleeping caller stream: a synchronous all-reduce and an async wait return to the host at once, the
    count exchange waits; a primitive that cannot finish before its deadline is aborted by the watchdog."""
    d = Device(gpu.real)
    waits = stream_side_waits(d)
    assert waits["ok"], waits
    fired = watchdog(d)
    assert fired["ok"], fired
