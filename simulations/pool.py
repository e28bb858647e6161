"""The simulations' worker pools: forked, and stopped by their parent alone.

A pool's workers are the parent's children in its process group: a Ctrl-C
reached each of them too, and each printed a ``KeyboardInterrupt``
traceback while the parent stopped them anyway; a SIGTERM to the parent
alone killed it in its tracks, and left its workers running as orphans, to
die later on a broken pipe (an exploratory tester). Here a worker ignores
SIGINT and takes SIGTERM's default (its parent's handler is not its), and
:func:`exit_on_sigterm` makes the parent's SIGTERM kill its workers and exit.

(Not ``PR_SET_PDEATHSIG``: it fires when the parent *thread* ends, and a
pool forks the worker that replaces one that died from a thread of its own,
which ends as the pool closes: a worker killed so while it held the pool's
queue lock hung the parent's ``terminate()``.)
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.pool
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import FrameType
from typing import Any, TypeVar

log = logging.getLogger("ringlimit.simulations")

T = TypeVar("T")
R = TypeVar("R")


class _WatchedPool(multiprocessing.pool.Pool):
    """``multiprocessing``'s fork pool, keeping every worker process it starts:
    those it starts with and those it forks in a dead one's place. Not this
    process's live children after it was made: a worker killed before that
    look was missed, and if it died holding the task queue's lock, the others
    waited on it for good, and so did the command, silent (a review: 5 runs of
    9 with a worker killed as it started).

    ``Pool.Process`` is how ``multiprocessing`` makes each worker (a static
    method there, called as ``self.Process(ctx, ...)``, in 3.8 to 3.14)."""

    def __init__(self, processes: int) -> None:
        self.started: list[multiprocessing.process.BaseProcess] = []
        super().__init__(
            processes, initializer=_worker_setup, context=multiprocessing.get_context("fork")
        )

    # A static method in the base (typeshed says so); an instance's here, to keep the list.
    def Process(self, ctx: Any, *args: Any, **kwds: Any) -> Any:  # type: ignore[override]
        process = ctx.Process(*args, **kwds)
        self.started.append(process)  # (the pool's own thread appends replacements)
        return process


class Workers:
    """A fork pool and every worker process it started, so that its results can
    be waited for without waiting forever: a worker that dies takes its task
    with it, and ``multiprocessing``'s pool waits for that task for good (a
    worker killed by the kernel's out-of-memory killer hung the command,
    silent)."""

    def __init__(self, pool: _WatchedPool) -> None:
        self.pool = pool

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        end_within(self.pool)  # (a worker that died as the last result came in)

    def gather(
        self,
        tasks: Sequence[multiprocessing.pool.AsyncResult[R]],
        tick: Callable[[], object] | None = None,
    ) -> list[R]:
        """The results of ``tasks``, in their order, calling ``tick`` about every
        0.1 s meanwhile; :class:`WorkerDied` once a worker has ended, after the
        pool is stopped (:func:`end_within`)."""
        try:
            for task in tasks:
                while not task.ready():
                    check_alive(self.pool.started)
                    if tick is not None:
                        tick()
                    task.wait(0.1)
        except WorkerDied:
            end_within(self.pool)
            raise
        return [task.get() for task in tasks]


def fork_pool(processes: int) -> Workers | None:
    """``multiprocessing``'s fork pool of ``processes`` workers, set up as above:
    every pool of the simulations, so that a Ctrl-C in any phase is quiet. None
    when they cannot be started (the system's limit on processes, threads or
    memory), said in one line: the caller does that phase's work itself.

    Its workers are forked at once, by this thread, and never retired
    (no ``maxtasksperchild``): a pool forks the replacement of a retired worker
    from a thread of its own, while this one runs on, and a child forked so can
    inherit a lock another thread held and deadlock (CPython warns of such
    forks from 3.12).

    SIGTERM and SIGINT stay blocked while they are forked (they inherit the
    mask) until each has taken its own handling of them. When a fork failed,
    ``Pool()`` sent SIGTERM to the workers it had made and waited for them; the
    newest one, just forked, ran the handler it inherited from
    :func:`exit_on_sigterm`, whose pending flag CPython clears in a forked
    child: the signal was lost, and the command waited for that worker
    forever, silent, with one child (a CI run's failure, found by a tester).
    The pool's own threads start within ``Pool()`` and keep the mask, so a
    worker one of them forks to replace a dead one starts so too."""
    held = {signal.SIGTERM, signal.SIGINT}
    known = set(multiprocessing.active_children())
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        pool = _WatchedPool(processes)
    except (OSError, RuntimeError) as exc:  # a fork, a pipe, or a thread (RuntimeError)
        for child in started_since(known):  # forked before a thread could not start
            child.kill()
            child.join()
        log.warning(
            "cannot start %d worker processes (%s): running in this process", processes, exc
        )
        return None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    return Workers(pool)


def map_in_workers(fn: Callable[[T], R], items: Sequence[T], jobs: int) -> list[R]:
    """``[fn(item) for item in items]``, spread over up to ``jobs`` forked workers
    (one item at a time each); in this process when one would do, or when
    workers cannot be forked (:func:`fork_pool` says so). ``fn`` reads what it
    needs from state set before the call: the workers inherit it.
    :class:`WorkerDied` if a worker dies meanwhile."""
    if jobs > 1 and len(items) > 1 and "fork" in multiprocessing.get_all_start_methods():
        workers = fork_pool(min(jobs, len(items)))
        if workers is not None:
            with workers:
                return workers.gather([workers.pool.apply_async(fn, (item,)) for item in items])
    return [fn(item) for item in items]


class WorkerDied(RuntimeError):
    """A pool's worker ended while the pool had work: the task it ran, if any, is
    lost, and ``multiprocessing``'s pool waits for it forever (a worker killed by
    the kernel's out-of-memory killer hung the command, silent)."""


def started_since(known: set[multiprocessing.process.BaseProcess]) -> list[Any]:
    """This process's live children that are not in ``known``: a pool's workers,
    given the children there were before it was made."""
    return [child for child in multiprocessing.active_children() if child not in known]


def check_alive(workers: Iterable[multiprocessing.process.BaseProcess]) -> None:
    """:class:`WorkerDied` for the first of ``workers`` that has ended."""
    for worker in workers:
        code = worker.exitcode
        if code is None:
            continue
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:  # a real-time signal has no name
                how = f"was killed by signal {-code}"
        else:
            how = f"exited ({code})"
        raise WorkerDied(
            f"a worker process (pid {worker.pid}) {how} while the simulation ran "
            "(out of memory? try fewer --jobs)"
        )


def end_within(pool: _WatchedPool, seconds: float = 5.0) -> None:
    """``pool.terminate()``, for ``seconds`` at most; then its workers still alive
    are killed. A worker that died idle holding the task queue's lock, or in the
    middle of sending a result holding the result queue's, leaves
    ``terminate()`` waiting for that lock forever."""
    stopper = threading.Thread(target=pool.terminate, daemon=True)
    stopper.start()
    stopper.join(seconds)
    if stopper.is_alive():
        for worker in pool.started:
            if worker.exitcode is None:
                worker.kill()
                worker.join()


def _worker_setup() -> None:  # pragma: no cover - runs in a worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C held meanwhile: dropped
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM kills this process's workers and exits at once
    with 143 (128 + SIGTERM, the status a shell reports for it).

    At once, not through the pools' ``terminate()``: a SIGTERM sent to the whole
    process group (``timeout``, systemd, ``kill -- -PGID``) has killed the
    workers already, an idle one while it held its pool's queue lock, and
    ``terminate()`` waited for that lock forever (a review found it)."""

    def stop(signum: int, frame: FrameType | None) -> None:
        for child in multiprocessing.active_children():
            child.kill()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(128 + signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
