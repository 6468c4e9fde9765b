"""Spawned gloo process groups for the distributed tests, shared across test cases.

A :class:`Pool` starts ``world_size`` CPU processes once (``torch.multiprocessing``
spawn, file rendezvous in a temporary directory, a gloo timeout so a stuck collective
errors instead of hanging) and runs test *cases* on all of them: a case is a function
``case(rank, world_size, *args) -> picklable`` in an importable module, called on every
rank with the default process group initialised. :meth:`Pool.run` returns the results
by rank, re-raises a rank's exception in the test process (with its traceback text),
and kills the whole pool when a case does not finish within its timeout, so a hang is
a test failure, never a blocked suite.
"""

from __future__ import annotations

import datetime
import os
import queue
import shutil
import sys
import tempfile
import traceback

import torch.multiprocessing as mp

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


class RankError(AssertionError):
    """A case raised on some rank; the message holds every failing rank's traceback."""


def _worker(rank: int, world: int, init_file: str, tasks, results, collective_timeout: float) -> None:
    sys.path.insert(0, _TESTS_DIR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=collective_timeout),
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, module, name, args = task
        try:
            mod = __import__(module)
            result = (True, getattr(mod, name)(rank, world, *args))
        except BaseException as exc:  # reported to the test process
            result = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        results.put((task_id, rank, result))
    dist.destroy_process_group()


class Pool:
    """``world_size`` spawned gloo ranks that run cases until closed."""

    def __init__(self, world_size: int, collective_timeout: float = 60.0):
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix="gefen-dist-")
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, os.path.join(self._dir, "rendezvous"), self._tasks[r],
                      self._results, collective_timeout),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._next = 0
        self.broken = False

    def run(self, case, *args, timeout: float = 120.0) -> list:
        """Run ``case`` on every rank; results by rank."""
        if self.broken:
            raise RuntimeError("this pool was killed by an earlier timeout")
        self._next += 1
        task_id = self._next
        for q in self._tasks:
            q.put((task_id, case.__module__, case.__name__, args))
        results: dict[int, tuple] = {}
        while len(results) < self.world_size:
            try:
                tid, rank, res = self._results.get(timeout=timeout)
            except queue.Empty:
                self.kill()
                missing = sorted(set(range(self.world_size)) - set(results))
                raise TimeoutError(
                    f"{case.__name__}: ranks {missing} did not finish within {timeout} s "
                    "(a hang); the pool was killed"
                ) from None
            if tid == task_id:
                results[rank] = res
        failures = [(r, msg) for r, (ok, msg) in sorted(results.items()) if not ok]
        if failures:
            raise RankError(
                f"{case.__name__} failed on ranks {[r for r, _ in failures]}:\n"
                + "\n".join(f"--- rank {r}:\n{msg}" for r, msg in failures)
            )
        return [results[r][1] for r in range(self.world_size)]

    def run_expecting_errors(self, case, *args, timeout: float = 120.0) -> list:
        """Run a case that returns per rank; a case that raises is reported as the
        (type name, message) of its exception instead of failing the test."""
        return self.run(_capture, case.__module__, case.__name__, args, timeout=timeout)

    def kill(self) -> None:
        self.broken = True
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)

    def close(self) -> None:
        if self.broken:
            return
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


def _capture(rank: int, world: int, module: str, name: str, args: tuple):
    """Runs a case and returns ("ok", result) or ("raised", type name, message)."""
    mod = __import__(module)
    try:
        return ("ok", getattr(mod, name)(rank, world, *args))
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))
