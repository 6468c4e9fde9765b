#!/usr/bin/env python
"""How much of a CPU optimizer step is the C core and how much is Python and the
extension around it: times every call into ``gefen._C`` during ``optimizer.step()``
(by wrapping the module's functions) and reports, per step, the median time inside each
C call and the rest of the step (Python: state lookup, item building, argument parsing
in the extension).

    python benchmarks/step_overhead.py [--sizes 16M] [--dtypes fp32] [--steps 10]
    python benchmarks/step_overhead.py --quick       # seconds
    python benchmarks/step_overhead.py --full        # without the kept step plan
    python benchmarks/step_overhead.py --full --phased --sizes 12x256   # CUDA parameters' path

After the first steps Gefen runs the C plans it kept: their C calls are ``rebind`` (this
step's gradients), the step itself and ``unbind``. ``--full`` times the path every step
took before (a plan built and parsed every step). ``--phased`` sends CPU parameters
through ``factored_stats()`` and ``update()`` as sharded and CUDA parameters go; with
``--full`` it is the host side of a CUDA step today (its plans are not kept).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import step_time as ST  # noqa: E402
import torch  # noqa: E402

from gefen import _ext  # noqa: E402


class _TimedPlan:
    """A step plan (``_C.AdamStep``, ``_C.MuonStep``) whose method calls are timed
    under ``"<Plan>.<method>"``; attributes pass through."""

    def __init__(self, timer, kind, plan):
        self._timer, self._kind, self._plan = timer, kind, plan

    def __getattr__(self, attr):
        value = getattr(self._plan, attr)
        if attr.startswith("_") or not callable(value):
            return value
        return self._timer._wrap(f"{self._kind}.{attr}", value)


class CallTimer:
    """Replaces the functions of gefen._C with timed wrappers while active; the step
    plans it builds (classes) return plans whose methods are timed too (the C work of a
    step runs in their ``step``/``factored_stats``/``update``/``momentum``)."""

    def __init__(self):
        self.times = collections.defaultdict(float)
        self._saved = {}

    def __enter__(self):
        mod = _ext._C
        for name in dir(mod):
            fn = getattr(mod, name)
            if name.startswith("_") or not callable(fn):
                continue
            self._saved[name] = fn
            setattr(mod, name, self._wrap_plan(name, fn) if name.endswith("Step")
                    else self._wrap(name, fn))
        return self

    def _wrap_plan(self, name, cls):
        timed_new = self._wrap(name, cls)  # building the plan: validation, tensor checks

        def build(*args, **kwargs):
            return _TimedPlan(self, name, timed_new(*args, **kwargs))
        return build

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[name] += time.perf_counter() - t0
        return timed

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(_ext._C, name, fn)


def _time_kept(opt, timer) -> None:
    """Time the C plans a Gefen optimizer kept from an earlier step (gefen/_steady.py)
    with ``timer``, or (None) untime them."""
    steady = opt.__dict__.get("_steady")
    if steady is None:
        return
    for parts in (steady.phased, steady.whole):
        for i, (device, plan, idx) in enumerate(parts):
            plan = plan._plan if isinstance(plan, _TimedPlan) else plan
            parts[i] = (device, plan if timer is None else _TimedPlan(timer, "AdamStep", plan), idx)


def profile(name: str, named, steps: int, warmup: int, full: bool = False):
    opt = C.make_optimizer(name, named, lr=1e-4, weight_decay=0.01)
    if full:  # never keep a step's plan: every step builds and parses its items
        opt._keep_steady = lambda plan: None
    for _ in range(warmup):
        opt.step()
    totals, parts = [], collections.defaultdict(list)
    for _ in range(steps):
        with CallTimer() as ct:
            _time_kept(opt, ct)
            t0 = time.perf_counter()
            opt.step()
            totals.append(time.perf_counter() - t0)
            _time_kept(opt, None)  # (the same plans, or those this step kept)
        for k, v in ct.times.items():
            parts[k].append(v)
        parts["(outside C)"].append(totals[-1] - sum(ct.times.values()))
    return statistics.median(totals), {k: statistics.median(v) for k, v in parts.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16M")
    p.add_argument("--dtypes", default="fp32")
    p.add_argument("--optimizers", default="gefen,gefen-block")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1M only, 3 timed steps, 2 warmup")
    p.add_argument("--full", action="store_true",
                   help="never run a kept step plan (gefen/_steady.py): every step takes the "
                        "full path, building and parsing its items")
    p.add_argument("--phased", action="store_true",
                   help="the two-phase calls of sharded and CUDA parameters instead of the whole "
                        "CPU step (gefen.gefen._WHOLE_CPU_STEP = False)")
    C.add_common_args(p)
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.steps, a.warmup = "1M", 3, 2  # two: the first step learns, the second keeps its plan
    C.set_threads(a.threads)
    if a.phased:
        import gefen.gefen as gefen_module

        gefen_module._WHOLE_CPU_STEP = False
    path = ("full" if a.full else "steady") + (", phased" if a.phased else "")
    C.print_header("gefen step: C core vs the rest",
                   {"sizes": a.sizes, "dtypes": a.dtypes, "optimizers": a.optimizers,
                    "path": path})
    results = []
    for dname in C.parse_list(a.dtypes):
        for size in C.parse_list(a.sizes):
            for name in C.parse_list(a.optimizers):
                named = ST.build_params(size, ST.DTYPES[dname], torch.device("cpu"), 0, False)
                total, parts = profile(name, named, a.steps, a.warmup, a.full)
                row = "  ".join(f"{k} {v * 1e3:.3f}" for k, v in sorted(parts.items()))
                print(f"{size:>4} {dname:>5} {name:<12} step {total * 1e3:8.3f} ms | {row} ms")
                results.append({"set": size, "dtype": dname, "optimizer": name,
                                "step_ms": total * 1e3,
                                "parts_ms": {k: v * 1e3 for k, v in parts.items()}})
    C.write_json(a.json, {"benchmark": "step_overhead", "machine": C.machine_info(),
                          "path": path, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
