"""From a request's blocking token stream to the event loop, and Server-Sent Events out of it.

A request's tokens come from a blocking iterator (the scheduler hands them over a thread-safe queue). Each
request gets a thread of its own that drains it into an :class:`asyncio.Queue`, so the event loop never
blocks and a request waiting in the scheduler holds no thread of the loop's pool. When the consumer stops
early (the client went away, the handler was cancelled), the request is cancelled, which ends its
iterator and so its thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from .backend import RunningRequest
from .protocol import Answer


@dataclass(frozen=True)
class _Failure:
    error: BaseException


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


async def relay(running: RunningRequest) -> AsyncIterator[str | Answer]:
    """Yield the request's text pieces, then its :class:`Answer`; raises what the request failed with.
    Cancels the request if the caller stops before the answer."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str | Answer | _Failure] = asyncio.Queue()

    def put(item: str | Answer | _Failure) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            running.cancel()

    def pump() -> None:
        try:
            for piece in running.events():
                put(piece)
            put(running.result())
        except BaseException as exc:  # handed to the consumer, which raises it
            put(_Failure(exc))

    threading.Thread(target=pump, name="serve-relay", daemon=True).start()
    finished = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, _Failure):
                finished = True
                raise item.error
            if isinstance(item, Answer):
                finished = True
                yield item
                return
            yield item
    finally:
        if not finished:
            running.cancel()


async def collect(running: RunningRequest, request: Request) -> Answer:
    """The request's :class:`Answer`; if the client disconnects first, the request is cancelled and
    :class:`ClientGone` raised."""

    async def answer() -> Answer:
        async for item in relay(running):
            if isinstance(item, Answer):
                return item
        raise AssertionError("relay ended without an answer")

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    answering = asyncio.ensure_future(answer())
    watching = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({answering, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not answering.done():
            answering.cancel()  # relay's cleanup cancels the request
            await asyncio.gather(answering, return_exceptions=True)
    if answering.cancelled():
        raise ClientGone()
    return answering.result()


def sse(data: dict[str, Any] | str) -> str:
    """One Server-Sent Event carrying ``data`` (a JSON object, or a literal such as ``[DONE]``)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n"
