"""Several LoRA runs over one base served unmerged (`--keep-adapters`, inference/adapters.py): a session runs with the
adapter it names and gets what that run's merged policy predicts; one batch mixes adapters; a run over another base,
a run that is not LoRA, an unknown adapter name, `serve --adapter` naming the served run or one name twice are one
line each; the server takes the adapter per connection."""

from __future__ import annotations

import numpy as np
import pytest
from shared_runs import base_run, shared_run

from vlaforge.errors import VlaforgeError
from vlaforge.inference.runtime import Observation, ObservationError, PolicyRuntime

from conftest import run_cli
from fake_lerobot import CAMS

LORA = ['--components.vision.lora={rank=4}', '--components.llm.lora={rank=4,base="nf4"}']


def _step(run, step):
    return run / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The session's full run (tests/shared_runs.py: two checkpoints, two bases), LoRA runs `a` and `b` over its
    step 2 (other seeds, other adapters and heads: 2 steps each), `c` over its step 1 (one step: it only needs
    another base); each trained once per session. A run's folder name is the adapter name it is served under."""
    base = base_run(tmp_path_factory)
    a = shared_run(tmp_path_factory, "a", f"--train.init_from={_step(base, 2)}", *LORA, "--train.seed=1")
    b = shared_run(tmp_path_factory, "b", f"--train.init_from={_step(base, 2)}", *LORA, "--train.seed=2")
    c = shared_run(tmp_path_factory, "c", f"--train.init_from={_step(base, 1)}", *LORA, steps=1)
    return base, a, b, c


def _obs(seed: int, adapter: str | None = None) -> Observation:
    g = np.random.default_rng(seed)
    return Observation({c: g.integers(0, 256, (32, 32, 3), dtype=np.uint8) for c in CAMS},
                       g.normal(size=4).astype(np.float32), "open the door", adapter)


def test_each_session_gets_its_adapters_merged_policy(runs):
    _, a, b, _ = runs
    held = PolicyRuntime.load(a, device="cpu", adapters={"b": b})
    merged = {"a": PolicyRuntime.load(a, device="cpu"), "b": PolicyRuntime.load(b, device="cpu")}
    assert set(held.describe()["adapters"]["adapters"]) == {"a", "b"}
    for seed in range(3):
        for name in ("a", "b"):
            want = merged[name].predict(_obs(seed), f"m{seed}{name}").actions
            got = held.predict(_obs(seed, name), f"s{seed}{name}").actions
            np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)
    assert not np.allclose(merged["a"].predict(_obs(9), "x").actions, merged["b"].predict(_obs(9), "y").actions)
    # one batch with both adapters: a forward per adapter, each request its own adapter's actions
    reqs = [held.request(_obs(5, name), f"batch-{name}") for name in ("b", "a", "b")]
    preds = held.run(reqs[:2]) + held.run(reqs[2:])
    np.testing.assert_allclose(preds[0].actions, merged["b"].predict(_obs(5), "q0").actions, atol=1e-5)
    np.testing.assert_allclose(preds[1].actions, merged["a"].predict(_obs(5), "q1").actions, atol=1e-5)
    assert preds[0].timings["switch_ms"] >= 0 and held.adapters.switches >= 3
    # a session keeps its adapter; naming another starts a new episode on it
    held.predict(_obs(1, "b"), "keep")
    assert held.sessions["keep"].adapter == "b"
    held.predict(_obs(2), "keep")
    assert held.sessions["keep"].adapter == "b" and held.sessions["keep"].count == 2
    held.predict(_obs(3, "a"), "keep")
    assert held.sessions["keep"].adapter == "a" and held.sessions["keep"].count == 1
    with pytest.raises(ObservationError, match="this server holds a, b"):
        held.predict(_obs(0, "nope"), "bad")


def test_what_cannot_share_a_base_is_one_line(runs):
    base, a, _, c = runs
    with pytest.raises(VlaforgeError, match="trained over base"):
        PolicyRuntime.load(a, device="cpu", adapters={"c": c})
    with pytest.raises(VlaforgeError, match="is not a LoRA run"):
        PolicyRuntime.load(a, device="cpu", adapters={"base": base})
    with pytest.raises(VlaforgeError, match="adapter name"):
        PolicyRuntime.load(a, device="cpu", adapters={"no.dots": c})
    with pytest.raises(ObservationError, match="holds no adapters"):
        PolicyRuntime.load(a, device="cpu").predict(_obs(0, "a"), "s")
    done = run_cli("serve", str(a), "--adapter", f"b={c}")
    assert done.returncode == 2 and "add --keep-adapters" in done.stderr


def test_serve_refuses_an_adapter_name_taken_or_given_twice(runs):
    """`--adapter A=B` where A is the served run's own name would serve B to requests for A and to requests naming
    no adapter; a name given twice would drop the first run silently. Both are one line, before anything loads."""
    from test_safety import one_line

    _, a, b, c = runs
    taken = run_cli("serve", str(a), "--keep-adapters", "--adapter", f"a={b}", "--port=0", "--http-port=0",
                    timeout=60)
    one_line(taken, "--adapter a=", "'a' is the served run's own name", "name the other adapter otherwise")
    twice = run_cli("serve", str(a), "--keep-adapters", "--adapter", f"x={b}", "--adapter", f"x={c}", "--port=0",
                    "--http-port=0", timeout=60)
    one_line(twice, "--adapter x given twice", f"x={b}", f"x={c}")


def test_the_server_takes_the_adapter_per_request(runs):
    from vlaforge.serving.client import PolicyClient, wire_observation

    from test_serving import Live

    _, a, b, _ = runs
    live = Live(PolicyRuntime.load(a, device="cpu", adapters={"b": b}))
    try:
        client = PolicyClient(live.uri)
        obs = wire_observation(_obs(4))
        got = client.infer(obs | {"adapter": "b"})["actions"]
        np.testing.assert_allclose(got, PolicyRuntime.load(b, device="cpu").predict(_obs(4), "m").actions, atol=1e-5)
        with pytest.raises(Exception, match="this server holds a, b"):
            client.infer(obs | {"adapter": "zzz"})
        client.close()
    finally:
        live.close()
