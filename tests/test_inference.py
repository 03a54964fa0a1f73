"""The policy runtime: what it feeds the model equals the training dataset's samples, the caches are exact where
they claim to be, batching and sessions do not mix, bad observations fail in one line, and chunk execution
aligns actions with the robot's steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlaforge.data.episodes import DemoDataset
from vlaforge.data.lerobot_v3 import LeRobotDataset
from vlaforge.data.tokenizer import train_bpe
from vlaforge.data.transforms import ObservationSpec, normalization_from_stats
from vlaforge.errors import VlaforgeError
from vlaforge.inference.chunking import ChunkExecutor
from vlaforge.inference.feature_cache import CacheConfig, SessionCache, TokenReuseEncoder
from vlaforge.inference.runtime import Observation, ObservationError, PolicyRuntime, Prediction
from vlaforge.models.build import build_vla

from conftest import tiny_config
from fake_lerobot import CAMS, SIZE, write_dataset

STATE = 4


def _model(frames=3, image=24, patch=8, chunk=4, head="regression", cams=CAMS):
    cfg = tiny_config(model={"frames": frames, "cameras": list(cams), "image_size": image, "patch_size": patch,
                             "action_chunk": chunk, "state_dim": STATE, "action_dim": 4,
                             "action_head": {"kind": head}})
    return build_vla(cfg.model, cfg.loss), cfg


def _spec(model, cfg, stride=2, render=SIZE, stats=None, cams=CAMS):
    norm = stats or {"state_mean": [0.1] * STATE, "state_std": [2.0] * STATE, "action_mean": [0.5] * 4,
                     "action_std": [3.0] * 4}
    return ObservationSpec(cameras=[f"observation.images.{c}" for c in cams], frames=cfg.model.frames,
                           frame_stride=stride, image_size=model.layout.image_size, render_size=render,
                           instruction_tokens=cfg.data.max_instruction_tokens, text_tokens=0,
                           chunk=cfg.model.action_chunk, **norm)


TOKENIZER = train_bpe(["open the door", "press the button", "close the drawer"], 300)


def _obs(g, t=0, instruction="open the door", size=SIZE, cams=CAMS):
    return Observation({c: g.integers(0, 256, (size, size, 3), dtype=np.uint8) for c in cams},
                       g.normal(size=STATE).astype(np.float32), instruction)


def test_runtime_feeds_the_model_what_training_fed_it(tmp_path):
    """Closed-loop inputs (frame history with stride, resizing, normalization, tokens) equal the dataset's samples:
    the runtime's chunk at every step equals the model's prediction on the dataset sample, denormalized."""
    root = tmp_path / "ds"
    write_dataset(root)
    d = LeRobotDataset(root)
    model, cfg = _model()
    spec = _spec(model, cfg, stats=normalization_from_stats(d.stats))
    ds = DemoDataset(d, spec, TOKENIZER, seed=0, shift=0, color=0.0, cache_mb=64, text_column=None)
    e = d.episodes[1]
    frames = {c: d.decode(f"observation.images.{c}", e) for c in CAMS}
    for mode in ("none", "exact"):
        runtime = PolicyRuntime(model, spec, TOKENIZER, device="cpu", cache=mode)
        for t in range(e.length):
            state = d.columns["observation.state"][e.start + t]
            got = runtime.predict(Observation({c: frames[c][t] for c in CAMS}, state, e.task))
            ref = ds[e.start + t]
            want = spec.denormalize_action(model.predict_actions(ref)).numpy()
            np.testing.assert_allclose(got.actions, want, rtol=1e-5, atol=1e-5)
            assert got.actions.dtype == np.float32 and got.actions.shape == (spec.chunk, 4)
        report = runtime.session().report()
        assert report["predictions"] == e.length and report["p50_ms"] > 0
    # exact: stride 2 over 3 frames -> each frame is needed at steps t, t+2, t+4 and encoded once
    assert report["cache"]["encoded"] == len(CAMS) * e.length


def test_exact_cache_gives_the_uncached_actions_and_encodes_one_frame_per_camera():
    model, cfg = _model(frames=4)
    spec = _spec(model, cfg, stride=1)
    runs = {}
    for mode in ("none", "exact"):
        runtime = PolicyRuntime(model, spec, TOKENIZER, device="cpu", cache=mode)
        g = np.random.default_rng(0)
        runs[mode] = [runtime.predict(_obs(g)) for _ in range(7)]
    for a, b in zip(runs["none"], runs["exact"]):
        assert torch.equal(torch.from_numpy(a.actions), torch.from_numpy(b.actions))
    assert [p.timings["frames_encoded"] for p in runs["exact"]] == [2] * 7  # one new frame per camera
    # none: F = 4 frames x 2 cameras once the history is full (a frame repeated at the start is encoded once)
    assert [p.timings["frames_encoded"] for p in runs["none"]] == [2, 4, 6] + [8] * 4


def test_batched_sessions_equal_single_ones_and_never_share_frames():
    model, cfg = _model(frames=2, head="regression")
    spec = _spec(model, cfg, stride=1)
    g = np.random.default_rng(1)
    instructions = ["open the door", "press the button", "close the drawer"]
    streams = {s: [_obs(g, instruction=instructions[i]) for _ in range(3)] for i, s in enumerate("abc")}
    batched = PolicyRuntime(model, spec, TOKENIZER, device="cpu")
    out = []
    for t in range(3):
        sessions = [s for s in "abc" if t < 2 or s != "b"]  # b stops early; histories then differ in length
        out.append(dict(zip(sessions, batched.predict_batch([streams[s][t] for s in sessions], sessions))))
    for s in "abc":  # each session alone, in a runtime that never saw the others
        alone = PolicyRuntime(model, spec, TOKENIZER, device="cpu")
        for t in range(3):
            if s in out[t]:
                np.testing.assert_allclose(out[t][s].actions, alone.predict(streams[s][t], s).actions, atol=2e-6)
    assert out[0]["a"].timings["batch_size"] == 3
    with pytest.raises(VlaforgeError, match="each session once"):
        batched.predict_batch([streams["a"][0]] * 2, ["a", "a"])


def test_reset_starts_a_new_episode():
    model, cfg = _model(frames=2)
    spec = _spec(model, cfg, stride=1)
    g = np.random.default_rng(2)
    first, second = _obs(g), _obs(g)
    rt = PolicyRuntime(model, spec, TOKENIZER, device="cpu")
    fresh = rt.predict(second, "s").actions
    rt.predict(first, "s")
    assert not np.allclose(rt.predict(second, "s").actions, fresh)  # the history holds `first` now
    rt.reset("s")
    np.testing.assert_array_equal(rt.predict(second, "s").actions, fresh)


@pytest.mark.parametrize("change,message", [
    (lambda o: o.images.pop("top"), "images.top: missing; the policy takes cameras front, top"),
    (lambda o: o.images.update(top=o.images["top"].astype(np.float32)), "images.top: dtype float32; send uint8"),
    (lambda o: o.images.update(top=np.zeros((0, 5, 3), np.uint8)), "images.top: empty image"),
    (lambda o: o.images.update(top=np.zeros((5, 5), np.uint8)), "images.top: shape (5, 5)"),
    (lambda o: setattr(o, "state", np.zeros(3)), "state: float64 of shape (3,); the policy takes 4 numbers"),
    (lambda o: setattr(o, "state", np.array([0, np.nan, 0, 0])), "state: contains NaN or inf"),
    (lambda o: setattr(o, "instruction", ""), "instruction: must be a non-empty string"),
])
def test_a_bad_observation_is_one_line_naming_the_field(change, message):
    model, cfg = _model(frames=1)
    rt = PolicyRuntime(model, _spec(model, cfg), TOKENIZER, device="cpu")
    obs = _obs(np.random.default_rng(0))
    change(obs)
    with pytest.raises(ObservationError) as err:
        rt.predict(obs)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not rt.session().latencies_ms  # nothing recorded


def test_any_image_size_is_resized_as_training_resizes():
    model, cfg = _model(frames=1)
    spec = _spec(model, cfg, render=48)
    rt = PolicyRuntime(model, spec, TOKENIZER, device="cpu", cache="none")
    obs = _obs(np.random.default_rng(3), size=48)
    from vlaforge.data.batch import Batch
    from vlaforge.data.transforms import to_model_images

    images = torch.cat([to_model_images(torch.from_numpy(obs.images[c])[None], spec.image_size) for c in CAMS])
    ids, mask = TOKENIZER.encode([obs.instruction], spec.instruction_tokens)
    want = model.predict_actions(Batch(images, spec.normalize_state(obs.state), ids[0], mask[0]))
    np.testing.assert_allclose(rt.predict(obs).actions, spec.denormalize_action(want).numpy(), atol=1e-5)


def test_frame_cache_reuses_a_similar_frame_and_refreshes_it():
    model, cfg = _model(frames=1)
    spec = _spec(model, cfg)
    rt = PolicyRuntime(model, spec, TOKENIZER, device="cpu",
                       cache=CacheConfig(mode="frame", frame_threshold=0.99, refresh_every=2, max_frames=3))
    g = np.random.default_rng(4)
    still = _obs(g)
    encoded = [rt.predict(still).timings["frames_encoded"] for _ in range(4)]
    assert encoded == [2, 0, 0, 2]  # reused twice, then refreshed
    stats = rt.session().cache.stats
    assert stats.similar_hits == 4 and stats.refreshes == 2
    assert rt.predict(_obs(g)).timings["frames_encoded"] == 2  # a different scene is encoded
    for _ in range(3):
        rt.predict(_obs(g))
    banks = rt.session().cache.banks
    assert {c: b.n for c, b in banks.items()} == {c: 3 for c in CAMS}  # max_frames per camera, LRU
    assert not any(torch.equal(banks["front"].vectors[i], banks["front"].vectors[0]) for i in (1, 2))


def test_token_cache_partial_pass_is_the_tower_when_every_patch_is_recomputed():
    """The per-layer recomputation with cached keys/values equals the SigLIP tower + projector when all patches
    are recomputed, and keeps the cached tokens of patches that did not change."""
    model, cfg = _model(frames=1, image=32, patch=8)
    enc = TokenReuseEncoder(model.eval(), CacheConfig(mode="token", token_refresh=0.0))
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(2, 3, 32, 32, generator=g) * 2 - 1
    with torch.inference_mode():
        ref = model.encode_frames(torch.stack([a, b]))
        cache = SessionCache(enc.config)
        torch.testing.assert_close(enc.encode(cache, "front", a), ref[0], atol=1e-5, rtol=1e-5)
        state = cache.patches["front"]
        from vlaforge.inference.feature_cache import patch_pixels

        enc._update(state, b, patch_pixels(b, 8), torch.arange(16))
        torch.testing.assert_close(state.tokens, ref[1], atol=1e-5, rtol=1e-5)
        # only the top-left patch changes: 1 of 16 recomputed, the others' tokens kept
        c = b.clone()
        c[:, :8, :8] = -c[:, :8, :8]
        before = state.tokens.clone()
        out = enc.encode(cache, "front", c)
        assert cache.stats.partial == 1 and cache.stats.reused_tokens == 15
        assert torch.equal(out[1:], before[1:]) and not torch.equal(out[0], before[0])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tmp_path_factory.mktemp("token_towers")


def _token_model(name, root):
    """A one-frame VLA on tower `name`: the flavor's SigLIP, a tiny folder's tower, a whole VLM's (its connector
    merging 2 x 2 patches), or Prismatic's fused DINOv2 + SigLIP."""
    from families import tower_folder, vlm_folder

    if name == "siglip":
        return _model(frames=1, image=32, patch=8)[0]
    if name in ("idefics3", "smolvlm", "qwen2_5_vl"):
        model = {"vlm": {"pretrained": str(vlm_folder(name, root))}}
    elif name == "fused":
        model = {"vision": {"pretrained": str(tower_folder("dinov2_with_registers", root)),
                            "fused": str(tower_folder("siglip", root))}}
    else:
        model = {"vision": {"pretrained": str(tower_folder(name, root))}}
    cfg = tiny_config(model={**model, "frames": 1, "image_size": 32})
    return build_vla(cfg.model, cfg.loss)


@pytest.mark.parametrize("name", ["siglip", "idefics3", "smolvlm", "siglip2", "clip", "dinov2_with_registers",
                                  "fused"])
def test_token_cache_recomputing_every_patch_is_the_uncached_encoding(name, folders):
    """Token mode runs the tower's own layers (embeddings and positions, masks, blocks, final norm, leading tokens,
    the connector): with refresh 1.0, and a partial pass over every patch, a frame's tokens are its uncached
    encoding; a partial pass over some patches of an unchanged frame gives that encoding too (the cached rows and
    keys / values are the ones it would compute)."""
    from vlaforge.inference.feature_cache import patch_pixels

    model = _token_model(name, folders).eval()
    enc = TokenReuseEncoder(model, CacheConfig(mode="token", token_refresh=1.0))
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(2, 3, 32, 32, generator=g) * 2 - 1
    close = lambda got, want: torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        ref = model.encode_frames(torch.stack([a, b]))
        cache = SessionCache(enc.config)
        close(enc.encode(cache, "front", a), ref[0])
        close(enc.encode(cache, "front", b), ref[1])  # refresh 1.0: every patch recomputed
        assert cache.stats.encoded == 2 and cache.stats.reused_tokens == 0
        state, patches = cache.patches["front"], patch_pixels(b, 8)
        enc._update(state, a, patch_pixels(a, 8), torch.arange(16))  # the partial pass over every patch
        close(state.tokens, ref[0])
        enc._update(state, a, patch_pixels(a, 8), torch.tensor([0, 5, 6, 15]))
        close(state.tokens, ref[0])
        assert not torch.allclose(state.tokens, ref[1], atol=1e-3) and patches.shape == (16, 3 * 8 * 8)


def test_token_cache_refuses_a_tower_whose_blocks_take_the_whole_grid(folders):
    model = _token_model("qwen2_5_vl", folders)
    with pytest.raises(VlaforgeError) as err:
        TokenReuseEncoder(model, CacheConfig(mode="token"))
    line = str(err.value)
    assert "\n" not in line and "qwen2_5_vl vision tower" in line and "whole patch grid" in line, line
    assert "--cache exact or frame" in line


def test_token_cache_runs_in_the_runtime_and_reports_reuse():
    model, cfg = _model(frames=1, image=32, patch=8)
    rt = PolicyRuntime(model, _spec(model, cfg), TOKENIZER, device="cpu", cache="token")
    g = np.random.default_rng(5)
    obs = _obs(g)
    first = rt.predict(obs).actions
    again = rt.predict(obs).actions  # same pixels: only the always-recomputed share is recomputed
    np.testing.assert_allclose(again, first, atol=1e-5)
    report = rt.session().report()["cache"]
    assert report["partial"] == 2 and 0 < report["reused_token_share"] < 1


# ---- chunk execution ------------------------------------------------------------------------------------------

class _Clock:
    """Stands in for a runtime: the chunk predicted at step s (state = [s]) holds actions s, s+1, ..."""

    def __init__(self, chunk=8, frames=1, prefix=False):
        self.spec = type("Spec", (), {"chunk": chunk, "frames": frames})()
        self.supports_prefix = prefix
        self.asked, self.prefixes = [], []

    def request(self, obs, session, prefix=None, weight=None):
        self.asked.append(int(obs.state[0]))
        self.prefixes.append((prefix, weight))
        return int(obs.state[0])

    def run(self, requests):
        s = requests[0]
        return [Prediction(np.arange(s, s + self.spec.chunk, dtype=np.float32)[:, None].repeat(2, 1),
                           {"total_ms": 5.0})]


def _drive(executor, steps):
    actions = []
    for t in range(steps):
        obs = Observation({}, np.array([t, 0.0]), "x") if executor.needs_observation() else None
        actions.append(float(executor.act(obs)[0]))
    executor.close()
    return actions


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("merge", ["replace", "ensemble"])
def test_every_executed_action_belongs_to_its_step(asynchronous, merge):
    clock = _Clock()
    ex = ChunkExecutor(clock, "s", execute=2, period_s=0.01, merge=merge, asynchronous=asynchronous,
                       latency_ms=20.0, compute_ms=5.0)
    assert _drive(ex, 40) == list(range(40))  # stale actions of a late chunk are dropped, never executed


def test_synchronous_execution_idles_where_async_hides_the_delay():
    stats = {}
    for asynchronous in (False, True):
        ex = ChunkExecutor(_Clock(), "s", execute=2, period_s=0.01, asynchronous=asynchronous, latency_ms=25.0,
                           compute_ms=5.0)
        _drive(ex, 40)
        stats[asynchronous] = ex.stats.as_dict()
    sync, asy = stats[False], stats[True]
    # sync: 20 predictions, each a 30 ms stop; the first is start-up
    assert sync["predictions"] == 20 and sync["idle_s"] == pytest.approx(19 * 0.030)
    assert sync["idle_fraction"] == pytest.approx(0.57 / (0.40 + 0.57), abs=1e-3)
    # async: a 3-step delay fits in an 8-action chunk (T >= 2 x delay): no wait after start-up
    assert asy["idle_s"] == 0 and asy["startup_s"] == pytest.approx(0.030)
    # a delay longer than half the chunk makes async wait too, but less than sync
    ex = ChunkExecutor(_Clock(), "s", execute=2, period_s=0.01, asynchronous=True, latency_ms=55.0, compute_ms=5.0)
    _drive(ex, 40)
    assert 0 < ex.stats.as_dict()["idle_fraction"] < sync["idle_fraction"]


def test_rtc_commits_the_actions_executed_during_the_delay():
    clock = _Clock(prefix=True)
    ex = ChunkExecutor(clock, "s", execute=2, period_s=0.01, merge="rtc", asynchronous=True, latency_ms=25.0,
                       compute_ms=5.0)
    _drive(ex, 12)
    prefix, weight = clock.prefixes[2]
    asked = clock.asked[2]
    assert prefix[:, 0].tolist() == list(range(asked, asked + len(prefix)))  # the plan from the asking step on
    assert weight[:3].tolist() == [1.0, 1.0, 1.0] and all(np.diff(weight[3:]) < 0) and weight[-1] > 0
    with pytest.raises(VlaforgeError, match="flow-matching action head"):
        ChunkExecutor(_Clock(), "s", execute=1, period_s=0.01, merge="rtc")


def test_flow_matching_sampling_follows_a_committed_prefix():
    model, cfg = _model(frames=1, head="flow_matching")
    head = model.action_head.eval()
    cond = torch.randn(2, 4, 128)
    state = torch.randn(2, STATE)
    committed = torch.randn(2, 4, 4)
    weight = torch.tensor([[1.0, 1.0, 0.5, 0.0]] * 2)
    with torch.no_grad():
        torch.manual_seed(0)
        free = head(cond, state)
        torch.manual_seed(0)
        guided = head(cond, state, prefix=committed, prefix_weight=weight)
        torch.manual_seed(0)
        unguided = head(cond, state, prefix=committed, prefix_weight=torch.zeros(2, 4))
    torch.testing.assert_close(guided[:, :2], committed[:, :2])
    assert not torch.allclose(guided[:, 2:], free[:, 2:])
    torch.testing.assert_close(unguided, free)


def test_a_simulator_renders_only_when_a_chunk_is_requested():
    for frames, want in ((1, [True, False, False] * 3), (2, [True] * 9)):
        ex = ChunkExecutor(_Clock(frames=frames), "s", execute=3, period_s=0.01)
        ex.runtime.observe = lambda obs, session: None
        wants = []
        for t in range(9):
            wants.append(ex.needs_observation())
            ex.act(Observation({}, np.array([t, 0.0]), "x") if wants[-1] else None)
        assert wants == want
