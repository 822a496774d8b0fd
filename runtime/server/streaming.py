"""From the engine thread to HTTP: a job's events as an asyncio stream, and Server-Sent Events.

`JobStream` is the sink handed to the service: the service thread calls it, it hops onto the event
loop with `call_soon_threadsafe`, and the route awaits the events in order. If the route stops early
— the client went away and Starlette cancelled the response, or the route raised — `close()` cancels
the job, so its sequence leaves the engine before the next step.
"""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from runtime.server.errors import SERVICE_CODE_KINDS, APIError
from runtime.service import (ContextTooLong, Failed, Finished, GenerateJob, NoModel, Overloaded, Piece,
                             Service, ServiceError, StillLoading)

DISCONNECT_POLL_S = 0.25        # how often a non-streaming request checks that its client is still there
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict | str, event: str | None = None) -> str:
    """One SSE frame: optional `event:` line, one `data:` line (JSON has no raw newlines), blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


class JobStream:
    def __init__(self, service: Service):
        self.service = service
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.job: GenerateJob | None = None
        self.finished: Finished | None = None

    def sink(self, event) -> None:   # called on the service thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def start(self, *, prompt_ids: list[int], prompt_text: str, sampling, parse: bool = True,
              tools: list | None = None) -> "JobStream":
        """Admit the job or raise APIError in the caller's shape (429/529, 503, 400)."""
        job = GenerateJob(prompt_ids=prompt_ids, prompt_text=prompt_text, sampling=sampling, sink=self.sink,
                          parse=parse, tools=tools)
        try:
            self.job = self.service.submit(job)
        except ContextTooLong as exc:
            raise APIError("context_length", str(exc), param="messages") from exc
        except (Overloaded, NoModel, StillLoading) as exc:
            raise APIError(SERVICE_CODE_KINDS[exc.code], str(exc)) from exc
        except ServiceError as exc:
            raise APIError("invalid_request", str(exc)) from exc
        return self

    async def events(self, request: Request | None = None) -> AsyncIterator:
        """Every event up to and including Finished; a Failed raises APIError. With `request`, a client
        that disconnects cancels the job (for non-streaming routes, which Starlette does not cancel)."""
        next_check = self.loop.time() + DISCONNECT_POLL_S
        while True:
            if request is None:
                event = await self.queue.get()
            else:
                # check on a clock, not only when idle: tokens may arrive faster than the poll interval
                try:
                    event = await asyncio.wait_for(self.queue.get(), max(0.0, next_check - self.loop.time()))
                except asyncio.TimeoutError:
                    event = None
                if self.loop.time() >= next_check:
                    next_check = self.loop.time() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        self.close()
                        return
                if event is None:
                    continue
            if isinstance(event, Failed):
                raise APIError(SERVICE_CODE_KINDS.get(event.code, "server"), event.message)
            yield event
            if isinstance(event, Finished):
                self.finished = event
                return

    async def collect(self, request: Request, add) -> bool:
        """Non-streaming routes: hand every text/reasoning/tool piece to `add` until the job finishes.
        False when the client went away first (the job is then cancelled)."""
        try:
            async for event in self.events(request):
                if isinstance(event, Piece):
                    add(event)
        finally:
            self.close()
        return self.finished is not None

    def close(self) -> None:
        """Cancel the job unless it already finished (idempotent)."""
        if self.job is not None and not self.job.done:
            self.service.cancel(self.job)


def sse_response(frames: AsyncIterator[str], stream: JobStream) -> StreamingResponse:
    """Stream `frames`; whatever ends the response (done, disconnect, error) cancels the job."""
    async def body():
        try:
            async for frame in frames:
                yield frame
        finally:
            stream.close()

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)
