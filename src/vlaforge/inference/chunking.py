"""Chunk execution: action chunks from a `PolicyRuntime` -> one action per control step of a robot.

The robot runs on a clock of its own: a control step takes `period_s`, and a prediction takes its measured compute
time (or a fixed `compute_ms`) plus `latency_ms` of simulated delay (network, a slower device). The clock is
virtual, so a simulator slower than real time still measures what a real-time robot would see.

- synchronous (default): every `execute` steps the robot stops, the policy predicts from the current observation,
  and the robot waits for the chunk (the world waits too in the simulator); the wait is idle time.
- asynchronous: every `execute` steps the next chunk is requested from the current observation and computed in a
  background thread while the robot keeps executing the chunk it has. The result is usable `compute + latency`
  after the request; its actions for steps that passed meanwhile are dropped (they are aligned by the step of the
  observation, as LeRobot's asynchronous inference aligns them). The robot idles only when it runs out of actions.

Merge modes decide the action of a step that several chunks cover:
- `replace`: the newest chunk's.
- `ensemble`: ACT's temporal ensembling, the weighted mean of every chunk's action for the step, weights
  exp(-m * i) with i = 0 for the oldest chunk (m = `ensemble_decay`).
- `rtc`: Real-Time Chunking for flow-matching heads: the new chunk is sampled guided to agree with the actions
  the robot has committed to - the ones it executes before the chunk can arrive (weight 1) and, with linearly
  falling weight, the rest of the current chunk - then replaces it.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vlaforge.errors import VlaforgeError
from vlaforge.inference.runtime import NO_PREFIX, Observation, PolicyRuntime, latency_summary

MERGES = ("replace", "ensemble", "rtc")


@dataclass
class ExecutionStats:
    """What the robot did: steps, predictions, time it waited for actions (robot clock)."""

    period_s: float
    steps: int = 0
    predictions: int = 0
    idle_steps: int = 0  # steps that waited for an action (after the first)
    idle_s: float = 0.0
    startup_s: float = 0.0  # the wait for the very first chunk
    compute_ms: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        moving = self.steps * self.period_s
        return {"steps": self.steps, "predictions": self.predictions, "idle_steps": self.idle_steps,
                "idle_s": round(self.idle_s, 4), "startup_s": round(self.startup_s, 4),
                "idle_fraction": round(self.idle_s / (moving + self.idle_s), 4) if moving else 0.0,
                **latency_summary(self.compute_ms)}


@dataclass
class _Chunk:
    start: int  # the control step of the observation it was predicted from
    actions: np.ndarray  # (T, A)


@dataclass
class _Pending:
    start: int
    asked_at: float  # robot clock
    future: Future
    arrival: float | None = None


class ChunkExecutor:
    """One episode's control loop helper: `act(obs)` once per control step returns the action to execute."""

    def __init__(self, runtime: PolicyRuntime, session: str, *, execute: int, period_s: float,
                 merge: str = "replace", asynchronous: bool = False, latency_ms: float = 0.0,
                 compute_ms: float | None = None, ensemble_decay: float = 0.01):
        chunk = runtime.spec.chunk
        if not 1 <= execute <= chunk:
            raise VlaforgeError(f"execute = {execute} must be between 1 and the action chunk ({chunk})")
        if merge not in MERGES:
            raise VlaforgeError(f"merge {merge!r} is not one of {', '.join(MERGES)}")
        if merge == "rtc" and not runtime.supports_prefix:
            why = getattr(runtime, "prefix_refusal", NO_PREFIX)  # (a stand-in runtime may not say)
            raise VlaforgeError(f"merge 'rtc' {why}; use --merge replace or ensemble")
        if latency_ms < 0 or period_s <= 0:
            raise VlaforgeError("latency_ms must be >= 0 and the control period > 0")
        self.runtime, self.session, self.execute, self.merge = runtime, session, execute, merge
        self.asynchronous, self.latency_s, self.period_s = asynchronous, latency_ms / 1000, period_s
        self.compute_ms, self.decay = compute_ms, ensemble_decay
        self.stats = ExecutionStats(period_s)
        self.chunks: list[_Chunk] = []
        self.pending: _Pending | None = None
        self.last_ask: int | None = None
        self.step, self.now = 0, 0.0
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="vlaforge-chunk") if asynchronous else None
        self._delay_steps = 0  # expected steps between a request and its chunk (from the last one measured)

    # ---- the control loop ----------------------------------------------------------------------------------
    def needs_observation(self) -> bool:
        """Whether this step's `act` reads the observation: always with a frame history, else only when a chunk
        is requested now (so a simulator renders only then)."""
        self._collect()
        return self.runtime.spec.frames > 1 or self._asks_now()

    def act(self, obs: Observation | None) -> np.ndarray:
        """The action for this control step; advances the robot clock by one period (plus any wait)."""
        self._collect()
        if self._asks_now():
            if obs is None:
                raise VlaforgeError("this step requests a chunk: pass the observation (see needs_observation)")
            self._ask(obs)
        elif obs is not None and self.runtime.spec.frames > 1:
            self.runtime.observe(obs, self.session)
        action = self._action()
        while action is None:  # out of actions: the robot waits for the pending chunk
            self._wait()
            action = self._action()
        self.step += 1
        self.now += self.period_s
        self.stats.steps += 1
        return action

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    # ---- internals ---------------------------------------------------------------------------------------
    def _asks_now(self) -> bool:
        return self.pending is None and (self.last_ask is None or self.step - self.last_ask >= self.execute)

    def _ask(self, obs: Observation) -> None:
        prefix = weight = None
        if self.merge == "rtc" and self.chunks:
            prefix, weight = self._committed()
        request = self.runtime.request(obs, self.session, prefix, weight)
        self.last_ask = self.step
        self.stats.predictions += 1
        if self.pool is None:
            future = _done(self.runtime.run([request])[0])
        else:
            future = self.pool.submit(lambda: self.runtime.run([request])[0])
        self.pending = _Pending(self.step, self.now, future)
        if self.pool is None:
            self._wait()  # synchronous: the robot stops until the chunk is there

    def _committed(self) -> tuple[np.ndarray, np.ndarray]:
        """RTC's guide for a chunk requested now: the planned actions of the coming steps, weight 1 for those
        executed before the chunk can arrive, then falling linearly to 0 over the rest of the current plan."""
        planned = []
        for k in range(self.runtime.spec.chunk):
            a = self._planned(self.step + k)
            if a is None:
                break
            planned.append(a)
        n = len(planned)
        if n == 0:
            return np.zeros((0, 1), np.float32), np.zeros(0, np.float32)
        d = min(n, self._delay_steps if self.asynchronous else 0)
        soft = n - d
        weights = [1.0] * d + [1.0 - (i + 1) / (soft + 1) for i in range(soft)]
        return np.stack(planned).astype(np.float32), np.asarray(weights, np.float32)

    def _collect(self) -> None:
        """Merge the pending chunk once the robot clock has reached its arrival."""
        p = self.pending
        if p is None or self.now < p.asked_at + self.latency_s:
            return
        if p.arrival is None:  # its arrival depends on its compute time: wait (wall clock) to learn it
            self._resolve(p)
        if self.now + 1e-12 >= p.arrival:
            self._merge(p)

    def _resolve(self, p: _Pending) -> None:
        pred = p.future.result()
        compute = self.compute_ms if self.compute_ms is not None else pred.timings["total_ms"]
        self.stats.compute_ms.append(compute)
        p.arrival = p.asked_at + compute / 1000 + self.latency_s
        self._delay_steps = math.ceil((compute / 1000 + self.latency_s) / self.period_s - 1e-9)

    def _merge(self, p: _Pending) -> None:
        chunk = _Chunk(p.start, p.future.result().actions)
        self.chunks = [chunk] if self.merge != "ensemble" else self.chunks + [chunk]
        self.chunks = [c for c in self.chunks if c.start + len(c.actions) > self.step]
        self.pending = None

    def _wait(self) -> None:
        """Block until the pending chunk is usable; the robot clock moves to its arrival."""
        p = self.pending
        if p is None:
            raise VlaforgeError("no action and no chunk on the way")  # cannot happen: a step asks when idle
        if p.arrival is None:
            self._resolve(p)
        wait = max(0.0, p.arrival - self.now)
        if self.stats.steps == 0:
            self.stats.startup_s += wait
        elif wait > 0:
            self.stats.idle_s += wait
            self.stats.idle_steps += 1
        self.now = max(self.now, p.arrival)
        self._merge(p)

    def _planned(self, step: int) -> np.ndarray | None:
        covering = [c for c in self.chunks if c.start <= step < c.start + len(c.actions)]
        if not covering:
            return None
        if self.merge != "ensemble" or len(covering) == 1:
            return covering[-1].actions[step - covering[-1].start]
        w = np.exp(-self.decay * np.arange(len(covering)))  # oldest first, as ACT
        acts = np.stack([c.actions[step - c.start] for c in covering])
        return (w[:, None] * acts).sum(0) / w.sum()

    def _action(self) -> np.ndarray | None:
        a = self._planned(self.step)
        return None if a is None else a.astype(np.float32)


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f
