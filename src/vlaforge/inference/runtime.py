"""`PolicyRuntime`: the one inference path of a trained VLA - `vlaforge eval`, the policy server, quantized
checkpoints and exported packages all predict through it.

A typed `Observation` (uint8 H x W x 3 image per camera, state, instruction) is checked against the
checkpoint's `policy.json`, turned into model inputs exactly as the training dataset builds them (frame history,
resizing, normalization, tokens), and the model runs as two regions: vision tower + projector (per frame, its
output cached per session by `feature_cache`) and LLM + action head. Sessions keep their own frame history,
tokenized instruction and cache; `predict_batch` runs many sessions in one forward of each region.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from vlaforge.data.transforms import ObservationSpec, to_model_images
from vlaforge.errors import VlaforgeError
from vlaforge.inference.feature_cache import CacheConfig, SessionCache, TokenReuseEncoder
from vlaforge.inference.observation import (  # noqa: F401 - re-exported: the runtime's public types
    DTYPES,
    Observation,
    ObservationError,
    Prediction,
    Session,
    _Request,
    check_image,
    latency_summary,
    pick_device,
    pick_dtype,
)
from vlaforge.techniques.quantized_format import place

COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
BACKENDS = ("auto", "torch", "onnx", "executorch")
NO_PREFIX = "needs a flow-matching action head; this policy's does not sample"  # why a runtime takes no prefix


class PolicyRuntime:
    """A trained VLA behind one interface: `predict(obs, session)`, `predict_batch`, `reset(session)`."""

    def __init__(self, model: torch.nn.Module, spec: ObservationSpec, tokenizer, *, device: str = "auto",
                 dtype: str = "auto", compile: str = "off", cache: CacheConfig | str = "exact",
                 source: str | None = None, adapters=None):
        if compile not in COMPILE_MODES:
            raise VlaforgeError(f"compile mode {compile!r} is not one of {', '.join(COMPILE_MODES)}")
        self.cache_config = cache if isinstance(cache, CacheConfig) else CacheConfig(mode=cache)
        self.backend = getattr(model, "backend", "torch")  # onnx / executorch: an exported package's PackageRegions
        if self.backend == "torch":
            self.device = pick_device(device)
            self.dtype = pick_dtype(dtype, self.device)
            self.model = place(model.eval(), self.device, self.dtype)
            self.supports_prefix = bool(model.action_head.supports_prefix)
            self.prefix_refusal = getattr(model.action_head, "prefix_refusal", NO_PREFIX)
        else:
            self._check_package_options(model, dtype, compile)
            self.device, self.dtype, self.model = torch.device("cpu"), model.dtype, model
            self.supports_prefix, self.prefix_refusal = model.supports_prefix, NO_PREFIX
        self.spec, self.tokenizer, self.source = spec, tokenizer, source
        self.cameras = [k.removeprefix("observation.images.") for k in spec.cameras]
        self.depth = (spec.frames - 1) * spec.frame_stride + 1
        self.sessions: dict[str, Session] = {}
        self.compile_mode = compile
        self._encode, self._act = model.encode_frames, model.actions_from_tokens
        self._token_encoder = TokenReuseEncoder(model, self.cache_config) \
            if self.cache_config.mode == "token" else None
        self.adapters = adapters  # an inference.adapters.AdapterSet: several LoRA runs over this base, unmerged
        specs = {n: a.spec for n, a in adapters.adapters.items()} if adapters is not None else {None: spec}
        # (x - mean) / std on the device: a LeRobot policy's own mode (QUANTILES...) is affine too (spec.affine)
        self._norms = {n: {k: torch.tensor(v, dtype=torch.float32, device=self.device) for k, v in sp.affine().items()}
                       for n, sp in specs.items()}
        self._norm = next(iter(self._norms.values()))
        self.compile_s = 0.0
        if compile != "off":
            self._encode = torch.compile(model.encode_frames, mode=None if compile == "default" else compile)
            self._act = torch.compile(model.actions_from_tokens, mode=None if compile == "default" else compile)
            t0 = time.perf_counter()
            self.warm_up()
            self.compile_s = round(time.perf_counter() - t0, 2)

    def _check_package_options(self, regions, dtype: str, compile: str) -> None:
        pkg = regions.manifest["dtype"]
        if dtype not in ("auto", pkg):
            raise VlaforgeError(f"--dtype {dtype}: this package was exported in {pkg}; drop --dtype or export "
                                f"again with --dtype {dtype}")
        if compile != "off":
            raise VlaforgeError("--compile applies to the torch backend; a package's runtime optimizes its graphs "
                                "itself")
        if self.cache_config.mode == "token":
            raise VlaforgeError("--cache token reruns parts of the PyTorch vision tower, which a package does not "
                                "have; use --cache exact or frame with a package")

    @classmethod
    def load(cls, checkpoint: str | Path, *, device: str = "auto", dtype: str = "auto", compile: str = "off",
             cache: CacheConfig | str = "exact", backend: str = "auto",
             adapters: Mapping[str, str | Path] | None = None,
             lerobot: Mapping[str, str] | None = None) -> "PolicyRuntime":
        """Any checkpoint `vlaforge eval` takes (a run folder or a checkpoints/step_* folder; full or sharded), or an
        exported package (`vlaforge export --format onnx|executorch`). `backend`: auto (the package's runtime for
        a package, else torch), torch, onnx or executorch (which then need a package of that runtime).
        `adapters`: name -> LoRA run to serve beside `checkpoint` (a LoRA run too, named after its folder), each
        kept unmerged over the one base (inference/adapters.py); {} keeps `checkpoint`'s own adapters unmerged.
        A LeRobot policy folder (SmolVLA, pi0) loads too (inference/lerobot_policy.py); `lerobot`: its `model.lerobot`
        settings (vlm, tokenizer, sizes) where the folder needs them."""
        from vlaforge.checkpoints.layout import local_checkpoint
        from vlaforge.inference.packages import is_package, load_package

        checkpoint = local_checkpoint(checkpoint)  # a Hub id of a LeRobot policy: its cached snapshot
        if backend not in BACKENDS:
            raise VlaforgeError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if adapters is not None:
            return cls._load_adapters(checkpoint, adapters, device, dtype, compile, cache, backend)
        if backend in ("onnx", "executorch") or (backend == "auto" and is_package(checkpoint)):
            regions, spec, tokenizer = load_package(checkpoint, device, backend)
            return cls(regions, spec, tokenizer, device=device, dtype=dtype, compile=compile, cache=cache,
                       source=str(checkpoint))
        if is_package(checkpoint):
            raise VlaforgeError(f"{checkpoint} is an exported package, not a checkpoint; drop --backend torch (auto "
                                "runs it in its runtime)")
        from vlaforge.checkpoints.load import load_policy_model
        from vlaforge.data.tokenizer import load_tokenizer

        model, cfg, ckpt = load_policy_model(checkpoint, pick_device(device), lerobot=dict(lerobot or {}))
        from vlaforge.models.policies.reader import is_lerobot_folder

        if is_lerobot_folder(ckpt):  # a LeRobot folder as LeRobot wrote it: its own pipelines (a fine-tuned run of

            return LeRobotRuntime(model, *model.pipelines, str(ckpt), device=device, dtype=dtype,  # one predicts
                                  compile=compile, cache=cache)  # through policy.json, below)
        spec = ObservationSpec.load(ckpt)
        tokenizer = load_tokenizer(ckpt, cfg.model.text_folder)
        return cls(model, spec, tokenizer, device=device, dtype=dtype, compile=compile, cache=cache,
                   source=str(ckpt))

    @classmethod
    def _load_adapters(cls, checkpoint, adapters, device, dtype, compile, cache, backend) -> "PolicyRuntime":
        from vlaforge.checkpoints.layout import resolve_checkpoint
        from vlaforge.inference.adapters import load_adapter_set, run_name

        if backend not in ("auto", "torch") or compile != "off":
            raise VlaforgeError("--keep-adapters runs the PyTorch model (peft layers switch adapters): drop --backend "
                                "and --compile")
        ckpt = resolve_checkpoint(str(checkpoint), ".", what="CHECKPOINT")
        main = run_name(ckpt)
        if main in adapters:  # the served run would be replaced by the other: its requests would get that one's
            raise VlaforgeError(f"adapter {main!r} is the served run's own name; name the other adapter otherwise")
        model, _, aset = load_adapter_set({main: ckpt, **adapters}, pick_device(device))
        first = aset.adapters[aset.default]
        return cls(model, first.spec, first.tokenizer, device=device, dtype=dtype, cache=cache, source=str(ckpt),
                   adapters=aset)

    # ---- description -------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """What a client needs to build observations, and how this runtime runs."""
        s = self.spec
        return {"cameras": self.cameras, "image_size": s.image_size, "render_size": s.render_size,
                "state_dim": len(s.state_mean), "action_dim": len(s.action_mean), "action_chunk": s.chunk,
                "frames": s.frames, "frame_stride": s.frame_stride, "checkpoint": self.source,
                "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "compile": self.compile_mode, "compile_s": self.compile_s, "cache": self.cache_config.mode,
                "backend": self.backend,
                **({"adapters": self.adapters.describe()} if self.adapters is not None else {}),
                **({"quantization": layout.summary() if (layout := getattr(self.model, "quantization", None)) else None}
                   if self.backend == "torch" else {"package": self.model.describe(),
                                                    "quantization": self.model.manifest.get("quantization")})}

    # ---- sessions ----------------------------------------------------------------------------------------
    def session(self, name: str = "default") -> Session:
        if name not in self.sessions:
            self.sessions[name] = Session(name, SessionCache(self.cache_config),
                                          {c: deque(maxlen=self.depth) for c in self.cameras})
        return self.sessions[name]

    def reset(self, session: str = "default") -> None:
        """Start a new episode in `session` (or end it): its frames, cache and instruction are forgotten."""
        self.sessions.pop(session, None)

    # ---- observations ------------------------------------------------------------------------------------
    def check(self, obs: Observation) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The observation's frames (uint8 (H, W, 3) tensors per camera) and normalized state; raises
        ObservationError naming the field that does not fit the policy."""
        if not isinstance(obs.instruction, str) or not obs.instruction.strip():
            raise ObservationError("instruction: must be a non-empty string (the task, e.g. 'open the door')")
        frames = {}
        for cam in self.cameras:
            img = obs.images.get(cam, obs.images.get(f"observation.images.{cam}"))
            if img is None:
                raise ObservationError(f"images.{cam}: missing; the policy takes cameras {', '.join(self.cameras)}")
            frames[cam] = check_image(img, f"images.{cam}")
        state = np.asarray(obs.state)
        want = len(self.spec.state_mean)
        if state.dtype.kind not in "fiu" or state.ndim != 1 or state.shape[0] != want:
            raise ObservationError(f"state: {state.dtype} of shape {tuple(state.shape)}; the policy takes {want} "
                                   "numbers")
        if not np.isfinite(state).all():
            raise ObservationError("state: contains NaN or inf")
        return frames, torch.tensor(state, dtype=torch.float32)  # a copy: decoded messages are read-only

    def observe(self, obs: Observation, session: str = "default") -> Session:
        """Record an observation's frames in the session's history without predicting (a frame history needs every
        control step's frame; a prediction needs only the latest state)."""
        frames, _ = self.check(obs)
        return self._record(self._session_for(session, obs), frames, obs.instruction)

    def _session_for(self, name: str, obs: Observation) -> Session:
        """The session, on the adapter the observation names (or the one it has, or the default); another adapter
        than its own starts a new episode (features, history and tokens belong to one adapter)."""
        s = self.session(name)
        if self.adapters is None:
            if obs.adapter not in (None, ""):
                raise ObservationError(f"adapter {str(obs.adapter)[:64]!r}: this policy holds no adapters to choose "
                                       "from (serve LoRA runs with --keep-adapters)")
            return s
        want = obs.adapter or s.adapter or self.adapters.default
        if want not in self.adapters.adapters:
            raise ObservationError(f"adapter {str(want)[:64]!r}: this server holds "
                                   f"{', '.join(self.adapters.adapters)}")
        if s.adapter not in (None, want):
            self.reset(name)
            s = self.session(name)
        s.adapter = want
        return s

    def _record(self, s: Session, frames: dict[str, torch.Tensor], instruction: str,
                state: torch.Tensor | None = None) -> Session:
        tokenizer = self.tokenizer if s.adapter is None else self.adapters.adapters[s.adapter].tokenizer
        if state is not None and getattr(tokenizer, "state_prompt", False):  # pi0.5: a prompt per state, each call
            # NOTE: the spec's own arithmetic (LeRobot's, as training wrote the prompts), not the device's affine
            spec = self.spec if s.adapter is None else self.adapters.adapters[s.adapter].spec
            normed = spec.normalize_state(state.cpu())
            ids, mask = tokenizer.encode_with_states([instruction], normed[None], self.spec.instruction_tokens)
            s.tokens = (ids[0].to(self.device), mask[0].to(self.device), int(mask[0].sum()))
            s.instruction = None
        elif instruction != s.instruction:  # tokenized once per instruction, not per call
            ids, mask = tokenizer.encode([instruction], self.spec.instruction_tokens)
            s.tokens = (ids[0].to(self.device), mask[0].to(self.device), int(mask[0].sum()))
            s.instruction = instruction
        for cam, frame in frames.items():
            s.frames[cam].append((s.count, frame))
        s.count += 1
        return s

    def request(self, obs: Observation, session: str = "default", prefix: np.ndarray | None = None,
                prefix_weight: np.ndarray | None = None, noise: np.ndarray | None = None) -> _Request:
        """Record `obs` and snapshot what its prediction needs (safe to run in another thread afterwards)."""
        if noise is not None:
            raise VlaforgeError("noise= is taken by LeRobot policies (pi0, SmolVLA); a vlaforge action head draws its "
                                "noise from torch's generator: seed it instead")
        frames, state = self.check(obs)
        s = self._record(self._session_for(session, obs), frames, obs.instruction, state)
        spec = self.spec
        norm = self._norms[s.adapter]
        rows = spec.history(len(s.frames[self.cameras[0]]) - 1)  # positions in the deque, as the dataset picks
        slots = [(cam, *s.frames[cam][r]) for r in rows for cam in self.cameras]  # time-major, as training
        pre = None
        if prefix is not None:
            if not self.supports_prefix:
                raise VlaforgeError(f"a committed-action prefix (merge 'rtc') {self.prefix_refusal}")
            t, a = spec.chunk, len(spec.action_mean)
            full, w = torch.zeros(t, a), torch.zeros(t)
            k = min(t, len(prefix))
            full[:k] = torch.as_tensor(np.asarray(prefix[:k]), dtype=torch.float32)
            w[:k] = torch.as_tensor(np.asarray(prefix_weight[:k]), dtype=torch.float32)
            pre = (((full.to(self.device) - norm["action_mean"]) / norm["action_std"]), w.to(self.device))
        return _Request(s, slots, state, pre)

    # ---- prediction --------------------------------------------------------------------------------------
    def predict(self, obs: Observation, session: str = "default", prefix: np.ndarray | None = None,
                prefix_weight: np.ndarray | None = None, noise: np.ndarray | None = None) -> Prediction:
        """The denormalized action chunk (T, A) for `obs` in `session` (its frame history and cache). `noise`: a
        LeRobot policy's starting noise (chunk_size x max_action_dim), to compare with LeRobot's actions."""
        return self.run([self.request(obs, session, prefix, prefix_weight, noise=noise)])[0]

    def predict_batch(self, observations: Sequence[Observation], sessions: Sequence[str]) -> list[Prediction]:
        """One prediction per (observation, session), in one forward of each region; sessions must differ."""
        if len(set(sessions)) != len(sessions) or len(sessions) != len(observations):
            raise VlaforgeError("predict_batch takes one observation per session, each session once")
        return self.run([self.request(o, s) for o, s in zip(observations, sessions)])

    def run(self, requests: list[_Request]) -> list[Prediction]:
        """Predictions for prepared requests, in one forward of each region (per adapter, when several are held:
        the model switches to each group's adapter first and its timings say what the switch cost)."""
        if self.adapters is None:
            return self._run(requests)
        out: list[Prediction | None] = [None] * len(requests)
        for name in dict.fromkeys(r.session.adapter for r in requests):
            group = [i for i, r in enumerate(requests) if r.session.adapter == name]
            switch = self.adapters.activate(name)
            self._norm = self._norms[name]
            for i, pred in zip(group, self._run([requests[i] for i in group])):
                pred.timings["switch_ms"] = round(switch, 3)
                out[i] = pred
        return out

    @torch.inference_mode()
    def _run(self, requests: list[_Request]) -> list[Prediction]:
        t0 = time.perf_counter()
        tokens: list[list[torch.Tensor | None]] = []
        pending: list[tuple[int, int, torch.Tensor]] = []  # (request, slot, model-space pixels)
        first: dict[tuple[int, str, int], int] = {}
        repeats: list[tuple[int, int, int]] = []  # (request, slot, pending position)
        encoded_before = [r.session.cache.stats.encoded for r in requests]
        token_s = 0.0  # token mode encodes inside the lookup loop
        for i, req in enumerate(requests):
            cache = req.session.cache
            row: list[torch.Tensor | None] = []
            for j, (cam, index, frame) in enumerate(req.slots):
                pixels = self._pixels(frame) if cache.config.mode == "frame" else None
                hit = cache.lookup(cam, index, pixels)
                if hit is None and self._token_encoder is not None:
                    tv = time.perf_counter()
                    hit = cache.remember(cam, index, self._token_encoder.encode(cache, cam, self._pixels(frame)))
                    token_s += time.perf_counter() - tv
                if hit is None:
                    key = (i, cam, index)  # a frame repeated in one history (clamped at the episode start)
                    if key not in first:
                        first[key] = len(pending)
                        pending.append((i, j, pixels if pixels is not None else self._pixels(frame)))
                    repeats.append((i, j, first[key]))
                row.append(hit)
            tokens.append(row)
        t1 = time.perf_counter()
        if pending:
            out = self._encode(torch.stack([p for _, _, p in pending]).to(self.dtype))
            for (i, j, pixels), toks in zip(pending, out):
                cam, index, _ = requests[i].slots[j]
                requests[i].session.cache.store(cam, index, pixels, toks)
            for i, j, k in repeats:
                tokens[i][j] = out[k]
        for req in requests:
            req.session.cache.retain(min(index for _, index, _ in req.slots))
        t2 = time.perf_counter()
        vision = torch.stack([torch.cat(row, 0) for row in tokens])  # (B, F*V*P, D)
        # Instruction padding is only ever masked out (positions skip it): dropping the columns no row uses gives
        # the same actions, and attention runs without a mask when no row is padded.
        lengths = [r.session.tokens[2] for r in requests]
        keep = max(lengths)
        ids = torch.stack([r.session.tokens[0][:keep] for r in requests])
        mask = torch.stack([r.session.tokens[1][:keep] for r in requests]) if min(lengths) < keep else None
        state = torch.stack([r.state for r in requests]).to(self.device)
        state = ((state - self._norm["state_mean"]) / self._norm["state_std"]).to(self.dtype)
        head = {}
        if any(r.prefix is not None for r in requests):
            zero = (torch.zeros_like(self._norm["action_mean"]).expand(self.spec.chunk, -1),
                    torch.zeros(self.spec.chunk, device=self.device))
            pre = [r.prefix or zero for r in requests]
            head = {"prefix": torch.stack([p[0] for p in pre]), "prefix_weight": torch.stack([p[1] for p in pre])}
        actions = self._act(vision, ids, mask, state, **head)
        actions = (actions.float() * self._norm["action_std"] + self._norm["action_mean"]).cpu().numpy()
        t3 = time.perf_counter()
        ms = lambda a, b: round((b - a) * 1000, 3)
        out = []
        for k, req in enumerate(requests):
            total = ms(t0, t3)
            req.session.latencies_ms.append(total)
            out.append(Prediction(actions[k], {
                "total_ms": total, "prepare_ms": ms(t0 + token_s, t1), "vision_ms": ms(t1 - token_s, t2),
                "llm_ms": ms(t2, t3),
                "batch_size": len(requests),
                "frames_encoded": req.session.cache.stats.encoded - encoded_before[k]}))
        return out

    def _pixels(self, frame: torch.Tensor) -> torch.Tensor:
        """uint8 (H, W, 3) -> model-space (3, S, S) on the device, resized as training resizes."""
        return to_model_images(frame[None].to(self.device), self.spec.image_size)[0]

    def warm_up(self) -> None:
        """One prediction on blank inputs (compiles the regions); leaves no session behind."""
        blank = Observation({c: np.zeros((self.spec.render_size,) * 2 + (3,), np.uint8) for c in self.cameras},
                            np.zeros(len(self.spec.state_mean), np.float32), "warm up")
        self.predict(blank, session="__warm_up__")
        self.reset("__warm_up__")


def resolve_policy(path: str | Path) -> Path:
    """A policy folder: an exported package as it is, else the checkpoint folder of a run (`resolve_checkpoint`)."""
    from vlaforge.checkpoints.layout import local_checkpoint, resolve_checkpoint
    from vlaforge.inference.packages import is_package

    path = local_checkpoint(path)
    return Path(path) if is_package(path) else resolve_checkpoint(str(path), ".", what="CHECKPOINT")


class LeRobotRuntime(PolicyRuntime):
    """A LeRobot policy folder behind `PolicyRuntime`'s interface: its own pipelines and noise (`predict(obs,
    noise=...)`), one frame per camera, no frame cache or compile (inference/lerobot_policy.py)."""

    def __init__(self, model, pre, post, source: str, *, device: str = "auto", dtype: str = "auto",
                 compile: str = "off", cache: CacheConfig | str = "exact"):
        from vlaforge.inference.lerobot_policy import observation_spec

        mode = cache.mode if isinstance(cache, CacheConfig) else cache
        if compile != "off" or mode != "exact":
            raise VlaforgeError("a LeRobot policy runs with --compile off and --cache exact (it caches the prefix's "
                                "keys and values itself, once per prediction); drop those options")
        self.cache_config, self.backend = CacheConfig("exact"), "torch"
        self.adapters, self.supports_prefix = None, False
        self.prefix_refusal = model.action_head.prefix_refusal
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.model, self.pre, self.post = model.eval().to(self.device, self.dtype), pre, post
        self.spec, self.tokenizer, self.source = observation_spec(model, pre), pre.tokenizer, source
        self.cameras = [k.removeprefix("observation.images.") for k in model.spec.cameras]
        self.depth, self.sessions, self.compile_mode, self.compile_s = 1, {}, "off", 0.0

    def request(self, obs: Observation, session: str = "default", prefix: np.ndarray | None = None,
                prefix_weight: np.ndarray | None = None, noise: np.ndarray | None = None) -> _Request:
        from vlaforge.inference.lerobot_policy import check_noise

        if prefix is not None:
            raise VlaforgeError(f"a committed-action prefix (merge 'rtc') {self.prefix_refusal}; use another merge")
        frames, state = self.check(obs)
        s = self._session_for(session, obs)
        s.instruction = obs.instruction
        return _Request(s, [(cam, 0, frames[cam]) for cam in self.cameras], state, None, check_noise(self.model, noise))

    def _run(self, requests: list[_Request]) -> list[Prediction]:
        from vlaforge.inference.lerobot_policy import predict_requests

        return predict_requests(self.model, self.pre, self.post, self.cameras, requests, self.device)

    def warm_up(self) -> None:
        """Nothing is compiled: a first prediction pays only its own cost."""
