"""A request's first step run in the server's callback, not in a new task.

uvicorn starts a task per request. On Python 3.11 (no eager tasks) that
costs a task object, a callback through the event loop for its first step
and another for its done-callbacks: about 10,000 instructions of the 200,000
a node spends on a proxied request. Most of a node's requests never wait for
anything (an in-memory decision, then the embedded answer or a 429), so a
node's front door (node/frontdoor.py) runs the request's coroutine at once,
in a copy of the context as a task would, from the parser's callback at the
end of the request; only if it suspends does a task take it over from where
it stopped (:func:`start_inline`).

The price is that until then there is no current task
(``asyncio.current_task()`` is None), which ``asyncio.timeout``, aiohttp,
anyio (so httpx and Starlette's streaming) need. So an app states that it
may be started inline (:data:`INLINE`, read by the front door from the app
it serves), and code that may need a task first awaits :func:`in_a_task`,
which suspends only when there is none, so that the task takes over before
it goes on: a node's control API (Starlette), an application the node
fronts that is not its own (:func:`in_task`), a decision that waits for a
handoff. A request served in a task (any other server, a pipelined request
whose turn came) pays one ``current_task()`` call there.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Coroutine, Generator, MutableSet
from typing import Any

from node.asgi import ASGIApp, Receive, Scope, Send

__all__ = ["INLINE", "in_a_task", "in_task", "inline_app", "start_inline"]

log = logging.getLogger("ringlimit.node")

#: The attribute of an ASGI app that says it may be started inline: it either
#: never needs a current task or awaits :func:`in_a_task` before it does.
INLINE = "ringlimit_starts_inline"


def inline_app(app: Any) -> Any:
    """``app`` marked as one that may be started inline (see :data:`INLINE`)."""
    setattr(app, INLINE, True)
    return app


class _InATask:
    """What :func:`in_a_task` returns: a bare ``yield`` only without a current
    task, which :func:`start_inline`'s driver takes as "go on in a task now"."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        if asyncio.current_task() is None:
            yield


_IN_A_TASK = _InATask()


def in_a_task() -> _InATask:
    """Await before code that needs a current task: under :func:`start_inline`
    it moves the request into its task first; in a task it does nothing."""
    return _IN_A_TASK


def in_task(app: ASGIApp) -> ASGIApp:
    """``app`` (one the node fronts but does not know: an ``--app``, the upstream
    proxy's aiohttp) called only from within a task."""

    async def called_in_a_task(scope: Scope, receive: Receive, send: Send) -> None:
        await _IN_A_TASK
        await app(scope, receive, send)

    return called_in_a_task


def start_inline(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, None],
    tasks: MutableSet[asyncio.Task[None]],
) -> None:
    """Run ``coro`` (a request's ``run_asgi``) until it ends or first suspends, in
    a copy of the current context; if it suspends, a task in ``tasks`` (the
    server's, as uvicorn keeps them: counted for ``limit_concurrency``, waited
    for and cancelled at shutdown) takes it over in that same context."""
    context = contextvars.copy_context()
    try:
        yielded = context.run(coro.send, None)
    except StopIteration:
        return
    except BaseException:
        # run_asgi answers an app's failure itself; this is its own, which a task
        # would have left to the loop's exception handler.
        log.exception("serving a request failed")
        return
    task = loop.create_task(_TakenOver(coro, yielded), context=context)
    task.add_done_callback(tasks.discard)
    tasks.add(task)


_STARTED = object()


class _TakenOver(Coroutine[Any, Any, None]):
    """A coroutine that :func:`start_inline` ran until it suspended with
    ``yielded``, as the coroutine of its task (what a task takes: a coroutine,
    ``send`` and ``throw``).

    Its task's first step hands ``yielded`` back to the task, which then waits
    on it as if it had started the coroutine itself; ``yielded`` None (a bare
    yield, :func:`in_a_task`'s) goes on at once. A cancellation before that
    first step reaches the coroutine where it waits, as it would in a task (a
    task cancelled before its first step throws into its coroutine; a native
    coroutine not yet begun would drop it), and the future it waited on is
    cancelled, as a task cancels what it waits on."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, None], yielded: Any) -> None:
        self._coro = coro
        self._first = yielded

    def send(self, value: Any) -> Any:
        first = self._first
        if first is not _STARTED:
            self._first = _STARTED
            if first is not None:
                return first
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        first = self._first
        if first is not _STARTED:
            self._first = _STARTED
            cancel = getattr(first, "cancel", None)
            if cancel is not None:
                cancel()
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)  # (the form deprecated since 3.12)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, None]:
        raise TypeError("run only as a task's coroutine")

    def __getattr__(self, name: str) -> Any:
        # The coroutine's own name, frame and state, so that the task's repr,
        # ``get_stack()`` and asyncio's debug mode show ``run_asgi`` (reached only
        # for what this class has not: never on a request's path).
        return getattr(self._coro, name)
