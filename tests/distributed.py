"""Run test functions on W gloo ranks: a pool of W worker processes that stay alive between tasks.

A collective op needs W processes that make the same calls. Spawning them (and importing torch
and Numba in each) takes seconds, far longer than one tiny simulated example, so a `GlooPool`
starts its W workers once and sends them tasks through queues: a task is a module-level
function, named ``"module:function"`` so it pickles by name, and keyword arguments; each rank
runs ``function(rank=..., world=..., **kwargs)`` and returns its result, or the exception's
traceback text. Every rank of a pool runs every task, so the ranks make their collectives in
the same order.

Every wait is bounded (`TIMEOUT_S`): a task that does not finish on every rank in time (a hang
in a collective), or a worker that dies, fails the test with what is known and kills the
workers, so a broken pool cannot leak processes; later tasks on it fail at once (one hang costs
one timeout, not one per test). A task that raises on some ranks while every rank reports back
fails its test only: the pool goes on. `close` shuts the workers down and joins them (killing
any that do not exit).

The workers are started with the "spawn" method (a fresh interpreter, no forked torch state),
rendezvous over TCP on a free localhost port, and set NUMBA_ENABLE_CUDASIM=1 before anything
imports Numba, so CPU tensors run the Numba kernels under the CUDA simulator.
"""

from __future__ import annotations

import importlib
import itertools
import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

TIMEOUT_S = 120.0  # the longest any task (or the start) may take on every rank
# gloo's own collective timeout is longer, so a hang always ends in the pool's timeout (which
# kills the workers) and never in a gloo error that would leave the group out of step. Then
# "every rank reported" means every collective was matched, and the pool can run the next task.
GLOO_TIMEOUT_S = 2 * TIMEOUT_S
POLL_S = 1.0  # how often a wait checks that the workers are still alive
JOIN_S = 10.0  # how long a worker may take to exit before it is killed
TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


def gloo_unavailable() -> str | None:
    """None when torch.distributed's gloo backend can run here, else the reason."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend in this torch build"
    return None


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PoolError(AssertionError):
    """A task failed on some rank, hung, or a worker died (an AssertionError: the test fails)."""


def _resolve(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _serve(rank: int, world: int, port: int, tasks, results) -> None:
    """A worker: join the gloo group, then run tasks until it receives None."""
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before anything imports Numba (kernels_numba reads it too)
    for path in (str(TESTS_DIR), str(REPO_ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    except BaseException:
        results.put((None, rank, False, traceback.format_exc()))
        return
    results.put((None, rank, True, "ready"))
    try:
        while (task := tasks.get()) is not None:
            task_id, target, kwargs = task
            try:
                value = _resolve(target)(rank=rank, world=world, **kwargs)
                results.put((task_id, rank, True, value))
            except BaseException:
                results.put((task_id, rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class GlooPool:
    """W worker processes in one gloo group. ``pool.run("module:function", **kwargs)`` runs the
    function on every rank and returns the W results in rank order."""

    def __init__(self, world: int, timeout: float = TIMEOUT_S):
        """Start `world` workers and wait (at most TIMEOUT_S) until all joined the group; each
        later task may take `timeout` seconds on every rank."""
        import torch.multiprocessing as mp

        self.world, self.timeout = world, timeout
        self._ids = itertools.count()
        self._broken: str | None = None
        ctx = mp.get_context("spawn")
        port = free_port()
        # The children import the repo and these helpers whatever the parent's path (and Numba
        # sees the simulator flag from its first import on).
        env = {"NUMBA_ENABLE_CUDASIM": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, (str(TESTS_DIR), str(REPO_ROOT), os.environ.get("PYTHONPATH"))))}
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_serve, args=(rank, world, port, self._tasks[rank], self._results),
                                   name=f"gloo-rank-{rank}-of-{world}", daemon=True) for rank in range(world)]
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)  # spawn passes the parent's environment at start
        try:
            for p in self._procs:
                p.start()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        self._collect(None, "starting the workers (gloo rendezvous)", TIMEOUT_S)  # however short `timeout` is

    def run(self, target: str, **kwargs) -> list:
        """Run ``target(rank=r, world=W, **kwargs)`` on every rank; the results in rank order.
        Raises PoolError if any rank raised (with every failing rank's traceback), or if the
        ranks do not all finish within the timeout (the pool is then killed)."""
        if self._broken:
            raise PoolError(f"the {self.world}-rank pool is unusable: {self._broken}")
        task_id = next(self._ids)
        for q in self._tasks:
            q.put((task_id, target, kwargs))
        return self._collect(task_id, f"{target}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})", self.timeout)

    def _collect(self, task_id, what: str, timeout: float) -> list:
        outcomes: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world)) - set(outcomes))
                self._fail(f"{what}: ranks {missing} did not finish within {timeout:.0f} s (a hang in a "
                           f"collective?); the workers were killed", outcomes)
            try:
                got_id, rank, ok, value = self._results.get(timeout=min(POLL_S, left))
            except queue.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    codes = ", ".join(f"{p.name} exit code {p.exitcode}" for p in dead)
                    self._fail(f"{what}: a worker died ({codes}); the workers were killed", outcomes)
                continue
            if got_id == task_id:  # (a result of an earlier task cannot arrive: a timeout kills the pool)
                outcomes[rank] = (ok, value)
        failures = {rank: value for rank, (ok, value) in sorted(outcomes.items()) if not ok}
        if failures:
            if task_id is None:
                self._fail(f"{what} failed", outcomes)
            raise PoolError(f"{what} raised on ranks {list(failures)}:\n" +
                            "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in failures.items()))
        return [outcomes[rank][1] for rank in range(self.world)]

    def _fail(self, message: str, outcomes) -> NoReturn:
        self._broken = message
        self.kill()
        details = "".join(f"\n--- rank {rank} ---\n{value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok)
        raise PoolError(message + details)

    def alive(self) -> list:
        return [p for p in self._procs if p.is_alive()]

    def kill(self) -> None:
        """Terminate every worker (then kill those that ignore it) and join them."""
        for p in self.alive():
            p.terminate()
        self._join()

    def _join(self) -> None:
        for p in self._procs:
            p.join(JOIN_S)
            if p.is_alive():
                p.kill()
                p.join(JOIN_S)
        for q in (*self._tasks, self._results):
            q.cancel_join_thread()  # unread tasks of killed workers: nothing to flush them to
            q.close()

    def close(self) -> None:
        """Ask every worker to leave the group and exit; join them, killing any that do not."""
        if not self._broken:
            self._broken = "closed"
            for q in self._tasks:
                q.put(None)
        self._join()
