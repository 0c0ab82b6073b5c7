"""A timeline of one allreduce, recorded on demand (``Client(..., timeline=True)``).

Marks, in seconds since the allreduce started (``time.perf_counter``):

* ``prepared``     the first data window's encoding under this worker's guess at the maxima, while the
                   negotiation is out, ended (the whole window, or the prefix encoded when the maxima came
                   back; :class:`ina.chunk_encoding.FirstWindow`). ``guess_held``: whether that encoding was
                   used (it was made and the agreed maxima were the guess); None: none was tried (codecs with
                   error feedback, sparse streams);
* ``negotiated``   the exponent negotiation's round trip is over (the switch's maxima are back);
* ``first_send``   the first data packet went out (the first block was encoded before it, or while negotiating);
* ``window_sent``  the first window of chunks (the job's slots) is out: from here on sends wait for results;
* ``first_result`` the first result came back (one window's round trip after ``window_sent``);
* ``last_send``    the last chunk went out for the first time;
* ``last_result``  the last result came back;
* ``done``         the sum is in the caller's tensor.

Totals: ``encode_s`` and ``decode_s`` (codec CPU time, inside the stream or while negotiating),
``rx_bursts`` (receive calls that returned results) and ``results`` (fresh results), so results /
rx_bursts is the client's mean receive burst. ``t0``: the start, in ``time.perf_counter`` seconds
(CLOCK_MONOTONIC, one clock for every process: ranks' timelines can be put on one axis).
"""
from __future__ import annotations

import time

MARKS = ("prepared", "negotiated", "first_send", "window_sent", "first_result", "last_send", "last_result", "done")


class Timeline:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.marks: dict[str, float] = {}
        self.encode_s = self.decode_s = 0.0
        self.rx_bursts = self.results = 0
        self.idle_turns = 0       # the data stream's loop turns whose receive took nothing (a wait ran out)
        self.guess_held: bool | None = None     # None: no first window was tried while negotiating

    def mark(self, name: str) -> None:
        """Record ``name`` the first time it happens (later calls keep the first time)."""
        if name not in self.marks:
            self.marks[name] = time.perf_counter() - self.t0

    def to_dict(self) -> dict:
        d = {name: round(self.marks[name], 6) for name in MARKS if name in self.marks}
        d.update(t0=self.t0, encode_s=round(self.encode_s, 6), decode_s=round(self.decode_s, 6),
                 rx_bursts=self.rx_bursts, idle_turns=self.idle_turns, results=self.results, guess_held=self.guess_held)
        return d
