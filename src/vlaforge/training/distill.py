"""Teacher -> student distillation (`[distill]`): an objective of the normal training loop, not a second trainer.

The teacher is a trained checkpoint (`vlaforge train` or `vlaforge quantize` output), frozen, run under
`inference_mode` in its own dtype. `Distiller` takes the place of the loss weighting: `VLA.compute_loss` calls its
`extra_terms` with the student forward's pieces, and it weighs those terms beside the data terms (whose weighting
it wraps). So precision, checkpointing, data parallel, gradient accumulation, resume and logging are the normal
ones. Its feature projections train with the student and are saved in the trainer state, never in the student's
weights: an exported student has none.

Terms, each logged as loss/distill_<term>:
- action: the student's chunk against the teacher's (MSE or Huber, normalized action units). A flow-matching
  student matches the teacher's velocity at the student's own noisy points (`flow_target = "velocity"`: a direct
  functional match - one velocity call of the teacher instead of a 10-step sample, and free of the sampling noise
  of one random draw), or trains its flow towards the teacher's sampled chunk (`"chunk"`, what a cache can hold);
- kl: KL(teacher || student) of the language logits at the text targets, both softened by T, x T^2;
- feature: MSE between mapped LLM block outputs at the action queries (the positions the action head reads: no
  padding, a fixed count per sample), the student's through a learned linear map to the teacher's width.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from torch import nn

from vlaforge.checkpoints.load import load_policy_model, weights_digest
from vlaforge.config.distill import DISTILL_TERMS, DistillConfig
from vlaforge.data.batch import Batch
from vlaforge.errors import VlaforgeError
from vlaforge.models import losses as L
from vlaforge.models.llm import llm_blocks
from vlaforge.progress import progress_bar
from vlaforge.techniques.quantized_format import place

TERM_PREFIX = "distill_"


@dataclass
class TeacherOutputs:
    """What the teacher gives for a batch (None: not needed by the active terms)."""

    actions: torch.Tensor | None = None  # (B, T, A) its chunk: a regression head's prediction or a sampled flow
    logits: torch.Tensor | None = None  # (B, Lt, V) at the text targets
    features: torch.Tensor | None = None  # (B, K, T, Dt) the mapped blocks' outputs at the action queries
    condition: torch.Tensor | None = None  # (B, T, H) its flow head's condition, for velocity matching

    def map(self, fn) -> "TeacherOutputs":
        return TeacherOutputs(**{f.name: None if (v := getattr(self, f.name)) is None else fn(v)
                                 for f in fields(self)})


def at_queries(hidden: torch.Tensor, chunk: int, n_text: int) -> torch.Tensor:
    """(B, N, D) states over the layout [frames][instruction][queries][text] -> (B, T, D) at the action queries."""
    end = hidden.shape[1] - n_text
    return hidden[:, end - chunk:end]


def layer_pairs(layers, student_layers: int, teacher_layers: int) -> list[tuple[int, int]]:
    """(student block, teacher block) output pairs, 1-based: 'uniform' pairs student block i with the teacher's
    round(i * Lt / Ls), so the last blocks meet; explicit pairs are checked against both depths."""
    if layers == "uniform":
        return [(i, max(1, round(i * teacher_layers / student_layers))) for i in range(1, student_layers + 1)]
    for s, t in layers:
        if s > student_layers or t > teacher_layers:
            raise VlaforgeError(f"distill.layers pair [{s}, {t}] is out of range: the student has {student_layers} "
                                f"LLM blocks and the teacher {teacher_layers}; pick blocks 1..{student_layers} and "
                                f"1..{teacher_layers}")
    return [tuple(p) for p in layers]


class Teacher:
    """A frozen trained VLA that gives the distillation targets, on the student's device in its own dtype."""

    def __init__(self, cfg: DistillConfig, device: torch.device):
        model, self.cfg, self.ckpt = load_policy_model(cfg.teacher, device, what="distill.teacher")
        auto = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.dtype = {"auto": auto, "fp32": torch.float32, "bf16": torch.bfloat16}[cfg.teacher_dtype]
        self.model = place(model.eval().requires_grad_(False), device, self.dtype)
        self.digest = weights_digest(self.ckpt)
        self.flow = self.cfg.model.action_head.kind == "flow_matching"

    @property
    def layers(self) -> int:
        return self.model.llm.config.num_hidden_layers

    def outputs(self, batch: Batch, *, actions: bool, condition: bool, logits: bool,
                layers: list[int]) -> TeacherOutputs:
        """The teacher's targets for `batch`: ordinary tensors (made under inference_mode, then copied out of it,
        since autograd may save them for the student's backward)."""
        with torch.inference_mode():
            out = self._outputs(batch, actions, condition, logits, layers)
        return out.map(torch.Tensor.clone)

    def _outputs(self, batch: Batch, actions: bool, condition: bool, logits: bool,
                 layers: list[int]) -> TeacherOutputs:
        m = self.model
        b = replace(batch, images=batch.images.to(self.dtype), state=batch.state.to(self.dtype))
        h = m.run_llm(b, with_text=logits, keep_hidden=bool(layers))
        out = TeacherOutputs()
        if actions:
            out.actions = m.action_head(h["action_hidden"], b.state).float()
        if condition:
            out.condition = m.action_head.condition(h["action_hidden"], b.state)
        if logits:
            out.logits = h["text_logits"].float()
        if layers:
            n_text = b.text_ids.shape[1] if logits else 0
            out.features = torch.stack([at_queries(h["hidden_states"][k], m.action_head.chunk, n_text)
                                        for k in layers], 1).float()
        return out

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        """The teacher's flow velocity (B, T, A) at the student's noisy actions and times."""
        with torch.inference_mode():
            v = self.model.action_head.velocity(x_t.detach().to(self.dtype), t, condition).float()
        return v.clone()


class Distiller(nn.Module):
    """The distillation objective, in the loss weighting's place: `extra_terms` (called from the student's
    forward) and `forward(terms) -> (loss, weights)`, the data terms through the wrapped weighting and the
    distillation terms with their static `distill.weights`. Holds the feature projections."""

    def __init__(self, cfg: DistillConfig, student: nn.Module, teacher: Teacher, weighting: nn.Module):
        super().__init__()
        self.cfg, self.weighting = cfg, weighting
        self.teacher = teacher  # NOTE: a plain attribute, not a submodule: its weights are neither trained nor saved
        self.cache: TeacherCache | None = None
        s_cfg = student.llm.config
        self.pairs = layer_pairs(cfg.layers, s_cfg.num_hidden_layers, teacher.layers) if cfg.active("feature") else []
        self.projections = nn.ModuleList()
        t_dim = teacher.model.llm.config.hidden_size
        if self.pairs and cfg.projections:
            self.projections.extend(nn.Linear(s_cfg.hidden_size, t_dim) for _ in self.pairs)
        elif self.pairs and s_cfg.hidden_size != t_dim:
            raise VlaforgeError(f"distill.projections = false needs equal LLM widths, but the student's is "
                                f"{s_cfg.hidden_size} and the teacher's {t_dim}; set distill.projections = true")
        check_shapes(student, teacher)
        self.student_flow = student.action_head.supports_prefix  # the flow-matching head samples
        self.velocity = cfg.active("action") and self.student_flow and cfg.flow_target == "velocity"
        if self.velocity and not teacher.flow:
            raise VlaforgeError("distill.flow_target = 'velocity' matches the teacher's velocity field, but the "
                                "teacher has a regression head; set distill.flow_target = 'chunk'")
        self.terms = list(getattr(weighting, "terms", [])) + [TERM_PREFIX + t for t in DISTILL_TERMS if cfg.active(t)]

    # ---- the terms -----------------------------------------------------------------------------------------
    def needs(self) -> dict:
        """What the teacher must give for the active terms."""
        return {"actions": self.cfg.active("action") and not self.velocity, "condition": self.velocity,
                "logits": self.cfg.active("kl"), "layers": [t for _, t in self.pairs]}

    def targets(self, batch: Batch) -> TeacherOutputs:
        if self.cache is not None:
            return self.cache.outputs(batch, self.needs()["layers"])
        return self.teacher.outputs(batch, **self.needs())

    def extra_terms(self, student, batch: Batch, h: dict, head, den: dict) -> dict[str, torch.Tensor]:
        """The distillation terms of one student forward (`VLA.loss_terms` calls this with its pieces)."""
        cfg, target = self.cfg, self.targets(batch)
        out = {}
        if cfg.active("action"):
            if self.velocity:
                pred, goal = head.prediction, self.teacher.velocity(head.x_t, head.t, target.condition)
            elif self.student_flow:  # the student's flow-matching loss towards the teacher's chunk
                towards = student.action_head(h["action_hidden"], batch.state, target.actions.to(batch.actions.dtype))
                pred, goal = towards.prediction, towards.target
            else:
                pred, goal = head.actions, target.actions
            out[TERM_PREFIX + "action"] = L.action_loss(pred, goal, batch.action_mask, cfg.action, 1.0,
                                                        den.get("action"))
        if cfg.active("kl"):
            out[TERM_PREFIX + "kl"] = L.distillation_kl(h["text_logits"], target.logits, batch.text_mask.bool(),
                                                        cfg.temperature, den.get("language"))
        if self.pairs:
            n_text = batch.text_ids.shape[1] if h["text_logits"] is not None else 0
            chunk = student.action_head.chunk
            errors = []
            for k, (s, _) in enumerate(self.pairs):
                mine = at_queries(h["hidden_states"][s], chunk, n_text).float()  # (B, T, Ds)
                mine = self.projections[k](mine) if len(self.projections) else mine
                errors.append((mine - target.features[:, k]).square().mean())
            out[TERM_PREFIX + "feature"] = torch.stack(errors).mean()
        return out

    def forward(self, terms: dict[str, torch.Tensor]):
        data = {k: v for k, v in terms.items() if not k.startswith(TERM_PREFIX)}
        loss, weights = self.weighting(data)
        for k, v in terms.items():
            if k.startswith(TERM_PREFIX):
                weights[k] = self.cfg.weights[k.removeprefix(TERM_PREFIX)]
                loss = loss + weights[k] * v
        return loss, weights

    def end_step(self, reducer=None) -> None:
        self.weighting.end_step(reducer)

    # ---- the data ----------------------------------------------------------------------------------------
    def bind(self, cfg, data, main: bool, barrier) -> None:
        """Check the teacher against the student's data (same observations, normalization and vocabulary), then
        open or build the cache (`distill.cache`) on rank 0 while the other ranks wait at `barrier`."""
        check_compatible(self.teacher, data, self.cfg.active("kl"))
        if not self.cfg.cache:
            return
        key = cache_key(self.teacher, cfg, len(data.dataset))
        path = Path(self.cfg.cache)
        if main:
            TeacherCache.ensure(path, key, self.teacher, data.dataset, cfg.train.progress)
        barrier()
        self.cache = TeacherCache.open(path, key)


def check_shapes(student: nn.Module, teacher: Teacher) -> None:
    """The teacher must take the student's samples: frames per sample, image size, chunk, action and state sizes.
    Raises VlaforgeError naming the first difference."""
    def shapes(m):
        return {"frames per sample (time steps x cameras)": m.layout.frames, "model.image_size": m.layout.image_size,
                "model.action_chunk": m.action_head.chunk, "model.action_dim": m.action_head.action_dim,
                "model.state_dim": m.action_head.state_proj.in_features}

    mine, theirs = shapes(student), shapes(teacher.model)
    for name, value in mine.items():
        if theirs[name] != value:
            raise VlaforgeError(f"the teacher {teacher.ckpt} takes {name} = {theirs[name]}, the student {value}; give "
                                "the student the teacher's shapes")


def check_compatible(teacher: Teacher, data, kl: bool) -> None:
    """The teacher must see what the student sees: cameras, history, image size, chunk, normalization, and (for
    the KL term) the same vocabulary. Raises VlaforgeError naming the first difference."""
    from vlaforge.data.tokenizer import load_tokenizer
    from vlaforge.data.transforms import ObservationSpec

    if data.spec is None:
        return  # synthetic data: the shapes are checked when the teacher first runs
    mine, theirs = data.spec, ObservationSpec.load(teacher.ckpt)
    for name in ("cameras", "frames", "frame_stride", "image_size", "chunk", "state_mean", "state_std",
                 "action_mean", "action_std"):
        a, b = getattr(mine, name), getattr(theirs, name)
        if not (a == b if not isinstance(a, list) or not a or isinstance(a[0], str)
                else torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-7)):
            raise VlaforgeError(f"the teacher {teacher.ckpt} was trained with {name} = {b}, the student's data gives "
                                f"{a}; distil on the teacher's dataset and model shapes")
    if kl and data.tokenizer is not None:
        tok = load_tokenizer(teacher.ckpt, teacher.cfg.model.text_folder)
        if tok.tok.get_vocab() != data.tokenizer.tok.get_vocab():
            raise VlaforgeError(f"the teacher {teacher.ckpt} has another vocabulary than the student's tokenizer, so "
                                "their language logits cannot be compared; train the student on the same dataset "
                                "and LLM vocabulary, or set distill.weights.kl = 0")


def cache_key(teacher: Teacher, cfg, size: int) -> dict[str, str]:
    """What the cached outputs depend on: the teacher's weights (and dtype), the dataset and the sample shapes. The
    cache holds every target any combination of terms uses, so the ablations of one teacher share it."""
    data = cfg.data.model_dump(exclude={"augment_shift", "augment_color", "num_workers", "cache_mb"})
    from vlaforge.data.hub_dataset import dataset_root

    info = dataset_root(cfg.data, fetch=False) / "meta" / "info.json" if cfg.data.path else Path("/nonexistent")
    shapes = {"samples": size, "data": data, "model": cfg.model.model_dump(include={"cameras", "frames",
                                                                                   "image_size", "action_chunk"}),
              "info": hashlib.sha256(info.read_bytes()).hexdigest() if info.is_file() else None}
    dataset = hashlib.sha256(json.dumps(shapes, sort_keys=True, default=str).encode()).hexdigest()
    targets = json.dumps({"dtype": str(teacher.dtype), "text_tokens": cfg.data.max_text_tokens}, sort_keys=True)
    return {"teacher": teacher.digest, "dataset": dataset, "targets": targets}


class TeacherCache:
    """The teacher's outputs on every dataset sample, computed once without augmentation: its action chunk (fp32;
    a flow head's sample drawn with a fixed seed), its text logits and every block's output at the action queries
    (fp16), in a safetensors file keyed by `cache_key` in its metadata."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    @staticmethod
    def stale(path: Path, key: dict[str, str]) -> str | None:
        """Why the file at `path` cannot serve `key` (None: it can)."""
        from safetensors import SafetensorError, safe_open

        if not path.is_file():
            return "missing"
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
        except (SafetensorError, OSError) as exc:
            return f"unreadable ({exc})"
        changed = [k for k in key if meta.get(k) != key[k]]
        return f"made for another {' and '.join(changed)}" if changed else None

    @classmethod
    def ensure(cls, path: Path, key: dict[str, str], teacher: Teacher, dataset, progress: bool) -> None:
        """Build the file unless it already serves `key`; written to a temporary name and renamed."""
        from safetensors.torch import save_file

        why = cls.stale(path, key)
        if why is None:
            return
        if why != "missing":
            print(f"distill.cache {path} is {why}: rebuilding it", flush=True)
        plain = dataset.without_augmentation() if hasattr(dataset, "without_augmentation") else dataset
        parts: dict[str, list[torch.Tensor]] = {}
        device = next(teacher.model.parameters()).device
        step = 64
        with progress_bar(progress, "teacher cache", -(-len(plain) // step)) as advance, torch.random.fork_rng():
            torch.manual_seed(0)  # a flow head's samples: the same file for the same teacher and data
            for start in range(0, len(plain), step):
                batch = Batch.collate([plain[i] for i in range(start, min(len(plain), start + step))]).to(device)
                text = batch.text_ids is not None
                out = teacher.outputs(batch, actions=True, condition=False, logits=text,
                                      layers=list(range(1, teacher.layers + 1)))
                for f in fields(out):
                    if (v := getattr(out, f.name)) is not None:
                        parts.setdefault(f.name, []).append(v.cpu())
                advance()
        tensors = {k: torch.cat(v).to(torch.float32 if k == "actions" else torch.float16).contiguous()
                   for k, v in parts.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp), metadata=key)
        tmp.replace(path)

    @classmethod
    def open(cls, path: Path, key: dict[str, str]) -> "TeacherCache":
        from safetensors.torch import load_file

        why = cls.stale(path, key)
        if why is not None:
            raise VlaforgeError(f"distill.cache {path} is {why}; remove it and train again")
        return cls(load_file(str(path)))

    def outputs(self, batch: Batch, layers: list[int]) -> TeacherOutputs:
        """The cached outputs of the batch's samples (by `Batch.index`) with the features of teacher blocks
        `layers` (1-based), in fp32 on the batch's device."""
        if batch.index is None:
            raise VlaforgeError("distill.cache needs each sample's dataset row (Batch.index), which this data source "
                                "does not give; drop distill.cache to run the teacher on every batch")
        rows = batch.index.cpu()
        out = {k: v[rows] for k, v in self.tensors.items()}
        if "features" in out:
            out["features"] = out["features"][:, [k - 1 for k in layers]] if layers else None
        return TeacherOutputs(**{k: None if v is None else v.to(batch.images.device, torch.float32)
                                 for k, v in out.items()})


def init_from_teacher(student: nn.Module, teacher: nn.Module) -> list[str]:
    """Copy the teacher's weights into the student where shapes allow; returns what was copied.

    Whole components whose every tensor matches by name and shape (the vision tower, projector, action head); in
    the LLM, each tensor outside the blocks that matches (embeddings, final norm, LM head), and student block i from
    teacher block (i + 1) * k - 1 with k = teacher blocks // student blocks (every k-th block, the last blocks
    meeting, as the uniform layer map pairs them) when all the blocks' shapes match."""
    copied = []
    with torch.no_grad():
        for name in ("vision", "projector", "action_head"):
            if _copy_matching(getattr(student, name), getattr(teacher, name)):
                copied.append(name)
        s_blocks, t_blocks = llm_blocks(student.llm), llm_blocks(teacher.llm)
        # the blocks by identity: the decoder's, wherever its family keeps them (models/families.py)
        in_blocks = {id(p) for p in s_blocks.parameters()}
        s_params, t_params = dict(student.llm.named_parameters()), dict(teacher.llm.named_parameters())
        outside = [n for n, p in s_params.items() if id(p) not in in_blocks
                   and n in t_params and t_params[n].shape == p.shape]
        for n in outside:
            s_params[n].copy_(t_params[n])
        copied += [f"llm.{n}" for n in outside]
        k = max(1, len(t_blocks) // len(s_blocks))
        pairs = [(i, min(len(t_blocks) - 1, (i + 1) * k - 1)) for i in range(len(s_blocks))]
        if all(_copy_matching(s_blocks[i], t_blocks[j], dry=True) for i, j in pairs):
            for i, j in pairs:
                _copy_matching(s_blocks[i], t_blocks[j])
                copied.append(f"llm block {i} <- teacher block {j}")
    return copied


def _copy_matching(dst: nn.Module, src: nn.Module, dry: bool = False) -> bool:
    """Copy `src`'s tensors into `dst` when every one matches by name and shape (`dry`: only check); else False."""
    mine, theirs = dst.state_dict(), src.state_dict()
    if mine.keys() != theirs.keys() or any(mine[k].shape != theirs[k].shape for k in mine):
        return False
    if not dry:
        dst.load_state_dict(theirs)
    return True


def build_teacher(cfg, student: nn.Module, device: torch.device, fresh: bool, verbose: bool) -> Teacher | None:
    """The run's distillation teacher (None without `distill.teacher`); a fresh run with `distill.init = "teacher"`
    (and no train.init_from) starts the student from it."""
    if cfg.distill.teacher is None:
        return None
    teacher = Teacher(cfg.distill, device)
    if fresh and cfg.distill.init == "teacher" and not cfg.train.init_from:
        copied = init_from_teacher(student, teacher.model)
        if verbose:
            print(f"student initialized from the teacher: {', '.join(copied) or 'nothing (no shape matches)'}",
                  flush=True)
    return teacher


def split_parameters(weighting: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(learned loss weights, distillation projections) of the run's loss weighting, for their optimizer groups."""
    if isinstance(weighting, Distiller):
        return list(weighting.weighting.parameters()), list(weighting.projections.parameters())
    return list(weighting.parameters()), []
