"""Dynamic batching: requests of all sessions gathered up to `max_batch` or `max_wait_ms`, run as one
`PolicyRuntime` forward, off the event loop.

Every runtime call (recording a session's frames, predicting, resetting a session) runs in one worker thread, in
the order it was asked for, so sessions are never touched by two threads. A request whose observation does not fit
the policy fails alone; the others of its batch are answered. So does a request whose predicted chunk holds a NaN
or inf: every transport answers through here, so this is the one place that withholds such a chunk.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from vlaforge.inference.runtime import Observation, PolicyRuntime, Prediction
from vlaforge.serving.common import NonFiniteActions


@dataclass
class _Item:
    session: str
    obs: Observation | None
    future: asyncio.Future
    queued: float = field(default_factory=time.perf_counter)
    observe_only: bool = False


class Batcher:
    """`await batcher.predict(session, obs)` -> (actions (T, A), server_timing dict)."""

    def __init__(self, runtime: PolicyRuntime, max_batch: int = 8, max_wait_ms: float = 5.0,
                 on_batch: Callable[[int, float], None] | None = None, clients: Callable[[], int] | None = None,
                 on_nonfinite: Callable[[], None] | None = None):
        self.runtime, self.max_batch, self.max_wait = runtime, max_batch, max_wait_ms / 1000
        self.clients = clients  # open sessions: a batch holding one request of each starts without waiting
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="vlaforge-infer")
        self.on_batch = on_batch
        self.on_nonfinite = on_nonfinite  # called once per withheld chunk (in the worker thread)
        self.in_flight = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def predict(self, session: str, obs: Observation) -> tuple[Any, dict[str, float]]:
        return await self._submit(_Item(session, obs, asyncio.get_running_loop().create_future()))

    async def observe(self, session: str, obs: Observation) -> None:
        """Record a frame in the session's history without predicting (a frame history needs every step's)."""
        await self._submit(_Item(session, obs, asyncio.get_running_loop().create_future(), observe_only=True))

    async def reset(self, session: str) -> None:
        """Forget a session (episode start or end, a closed connection), after its queued requests."""
        await self._submit(_Item(session, None, asyncio.get_running_loop().create_future()))

    async def _submit(self, item: _Item):
        self.in_flight += 1
        try:
            await self.queue.put(item)
            return await item.future
        finally:
            self.in_flight -= 1

    async def drain(self) -> None:
        """Wait until every accepted request is answered."""
        while self.in_flight:
            await asyncio.sleep(0.01)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.max_wait
            while len(batch) < self.max_batch:
                if self.clients is not None and len(batch) >= self.clients():
                    break
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), timeout))
                except asyncio.TimeoutError:
                    break
            results = await loop.run_in_executor(self.pool, self._run, batch)
            for item, (value, error) in zip(batch, results):
                if item.future.done():  # the client went away
                    continue
                if error is not None:
                    item.future.set_exception(error)
                else:
                    item.future.set_result(value)

    def _run(self, batch: list[_Item]) -> list[tuple[Any, BaseException | None]]:
        """In the worker thread: resets and frame records in order, then one forward for the predictions. A
        session's second prediction in one batch runs in a forward of its own, after the first."""
        out: list[tuple[Any, BaseException | None]] = [(None, None)] * len(batch)
        groups: list[list[tuple[int, Any]]] = [[]]
        start = time.perf_counter()
        for i, item in enumerate(batch):
            try:
                if item.obs is None:
                    self.runtime.reset(item.session)
                elif item.observe_only:
                    self.runtime.observe(item.obs, item.session)
                else:
                    group = next((g for g in groups if all(batch[j].session != item.session for j, _ in g)), None)
                    if group is None:
                        groups.append(group := [])
                    group.append((i, self.runtime.request(item.obs, item.session)))
            except Exception as exc:  # noqa: BLE001 - one bad request fails alone
                out[i] = (None, exc)
        for group in groups:
            if not group:
                continue
            try:
                preds = self.runtime.run([r for _, r in group])
            except Exception as exc:  # noqa: BLE001 - each request of the group is answered with the failure
                for i, _ in group:
                    out[i] = (None, exc)
                continue
            size = len(group)
            if self.on_batch is not None:
                self.on_batch(size, preds[0].timings["total_ms"])
            for (i, _), pred in zip(group, preds):
                out[i] = self._reply(batch[i], pred, start, size)
        return out

    def _reply(self, item: _Item, pred: Prediction, start: float, size: int) -> tuple[Any, BaseException | None]:
        """One request's (actions, timing), or its refusal when any action of the chunk is NaN or inf."""
        # NOTE: one check of the (T, A) numpy chunk the runtime already copied to the host: no device sync
        if not np.isfinite(pred.actions).all():
            if self.on_nonfinite is not None:
                self.on_nonfinite()
            return None, NonFiniteActions()
        timing = {"infer_ms": pred.timings["total_ms"], "queue_ms": round((start - item.queued) * 1000, 3),
                  "batch_size": size}
        return (pred.actions, timing), None

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.pool.shutdown(wait=True)
