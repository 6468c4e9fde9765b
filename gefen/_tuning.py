"""How Gefen's whole CPU step runs its factored parameters, chosen by timing.

A factored parameter's step can read its gradient twice (the statistics pass, then the
update: the default) or once, with the momentum and its codes formed in the statistics
pass while the rows are in cache (``momentum_in_stats``: 15 instead of 18 bytes per fp32
parameter, but the update's parameter pass no longer hides under the search). The bits
are the same either way (``tests/test_fused_step.py``); which is faster depends on the
machine's balance of memory bandwidth and arithmetic, and no CPU feature tells it
(docs/performance.md, "Reading the gradient once"). So the optimizer measures: its first
whole steps alternate the two in ABBA order, each C call timed alone, and the rest of the
run takes the one whose median was faster by more than a margin (the two-phase step on a
tie), measuring again every ``retune_every`` steps in case the machine's load changed.

Only the time of the C call is measured, so the Python around it (the same for both) and
the steps that build new plans do not enter. Ranks of a distributed run choose on their
own: the choice changes no number and no collective.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Dict, List, Optional

_LOG = logging.getLogger("gefen")

#: One round of the measurement: the two-phase step, the fused one, the fused one, the
#: two-phase one (a drift in the machine's speed cancels out of the comparison).
_ABBA = (False, True, True, False)


class FactoredTuner:
    """Chooses ``momentum_in_stats`` for the whole-step plans of one optimizer.

    ``flag()`` says what the next step should run; ``record(flag, seconds)`` takes the
    time of the C call that ran it. The first ``warmup`` records (cold caches, first-touch
    page faults) are dropped; the next ``4 * rounds`` follow the ABBA order; then the
    choice holds for ``retune_every`` steps (0: for good) before the measurement repeats.
    ``margin``: the fused step is chosen only when its median is at least this fraction
    faster than the two-phase one's.
    """

    def __init__(self, rounds: int = 2, warmup: int = 2, margin: float = 0.02,
                 retune_every: int = 1000, clock: Callable[[], float] = time.perf_counter,
                 choice: Optional[bool] = None):
        if rounds < 1 or warmup < 0 or not 0.0 <= margin < 1.0 or retune_every < 0:
            raise ValueError("FactoredTuner: rounds >= 1, warmup >= 0, 0 <= margin < 1, "
                             "retune_every >= 0")
        self.rounds, self.warmup, self.margin, self.retune_every = rounds, warmup, margin, retune_every
        self.clock = clock
        self.medians: Optional[Dict[bool, float]] = None  # of the last measurement
        self._restart(self.warmup)
        #: the flag chosen; None while measuring. Given (True or False): held for good
        #: (benchmarks compare the two this way), no measurement.
        self.choice = choice
        if choice is not None:
            self.retune_every = 0

    def _restart(self, skip: int) -> None:
        self._skip = skip
        self._times: Dict[bool, List[float]] = {False: [], True: []}
        self._n = 0  # measured steps so far (ABBA position)
        self._since = 0  # steps since the choice

    def _asked(self) -> bool:
        """The form the measurement asks for next (its ABBA position)."""
        return _ABBA[self._n % len(_ABBA)]

    def flag(self) -> bool:
        """The ``momentum_in_stats`` the next whole step should run with."""
        if self.choice is not None:
            return self.choice
        return False if self._skip > 0 else self._asked()

    def record(self, flag: bool, seconds: float) -> None:
        """The time of one whole step's C call that ran with ``flag``."""
        if self.choice is not None:
            self._since += 1
            if self.retune_every and self._since >= self.retune_every:
                self.choice = None
                self._restart(0)
            return
        if self._skip > 0:
            self._skip -= 1
            return
        if flag != self._asked():  # not the step asked for (a test, a switch)
            return
        self._times[flag].append(seconds)
        self._n += 1
        if self._n < len(_ABBA) * self.rounds:
            return
        self.medians = {f: statistics.median(t) for f, t in self._times.items()}
        two_phase, fused = self.medians[False], self.medians[True]
        self.choice = fused < two_phase * (1.0 - self.margin)
        _LOG.debug("factored CPU step: two phases %.3f ms, momentum in the statistics "
                   "pass %.3f ms (medians of %d); chose %s", two_phase * 1e3, fused * 1e3,
                   self.rounds * 2, "the momentum in the statistics pass" if self.choice
                   else "two phases")

    def step(self, plan, quantizer, nthreads: int) -> None:
        """``plan.step(quantizer, nthreads)`` with this tuner's flag set on ``plan`` (a CPU
        ``_C.AdamStep`` with factored items), timed and recorded."""
        flag = self.flag()
        plan.momentum_in_stats = flag
        t0 = self.clock()
        plan.step(quantizer, nthreads)
        self.record(flag, self.clock() - t0)
