"""Measured activation rows: what a block of any family keeps for backward, taken from a fake-tensor forward of the
model itself instead of a hand-written formula (`activations.py` keeps its formulas where they are exact: Llama's
SwiGLU block with or without Qwen3's q/k norms, SigLIP's and Qwen2.5-VL's towers).

How a row is measured (`MeasuredRows.rows`): the model is rebuilt under `FakeTensorMode` from its components' configs
cut to a few blocks (`_depth`: every distinct block, by class, sub-layer class and `layer_types` entry, and one
repeat), the component's precision and checkpointing strategy are applied by the trainer's own code
(`apply_techniques`, LoRA included), and `techniques.accounting.count_saved` counts what a forward keeps, per block,
at five (batch, sequence) points: batch 2 and 4 at the configured instruction length, batch 2 and 4 at a longer one,
and batch 2 at a longer one still. Each quantity q is then solved exactly for the five terms it can have:

    q(B, S) = per_token x B x S + per_pair x B x S^2 + per_sample x B + shared x S + fixed

- per_token: everything a token carries; per_pair: a padding mask's B x S x S rows; per_sample: the LM head's
  input over the text targets (not S-proportional); shared: one row for the whole batch (the position ids and rotary
  tables of an unpadded batch); fixed: tensors of the model's own size (a tower's shared position ids).
The component's activation bytes are then: its blocks at the full depth (each block the bytes of the last measured
block like it: `steady`), plus `once` (what the first blocks of each kind keep beyond that: rotary tables, a
checkpoint's mask and position ids), plus `rest` (embeddings, final norm, the LM head's input).

What it does not model: tensor, sequence and context parallel shares of a measured LLM block (the planner refuses
those layouts in one line for such a model: `refuse_sharded`), and `train.compile`'s partitioner (a measured block
is planned as eager, an upper bound). fp8 keeps bf16 activations (measured as bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlaforge.errors import VlaforgeError
from vlaforge.models.blocks import is_policy

MEASURED = ("vision", "llm")
# instruction tokens added at the second and third point: sequence lengths far enough apart that the fit is exact
LONGER = (16, 48)
# the micro-batches measured: a batch of one takes other paths (views where a larger one copies: a pi0 step counted at
# 1 and 2 samples overstates 4 by 4 %)
BATCHES = (2, 4)


@dataclass(frozen=True)
class Row:
    """Bytes as a function of the micro-batch's samples B and LLM tokens S (module docstring)."""

    per_token: float = 0.0
    per_pair: float = 0.0
    per_sample: float = 0.0
    shared: float = 0.0
    fixed: float = 0.0

    def at(self, batch: int, seq: int) -> int:
        b, s = batch, seq
        return max(0, round(self.per_token * b * s + self.per_pair * b * s * s + self.per_sample * b
                            + self.shared * s + self.fixed))

    def __add__(self, o: "Row") -> "Row":
        return Row(*(getattr(self, f) + getattr(o, f) for f in _FIELDS))

    def __sub__(self, o: "Row") -> "Row":
        return Row(*(getattr(self, f) - getattr(o, f) for f in _FIELDS))

    def scaled(self, k: float) -> "Row":
        return Row(*(getattr(self, f) * k for f in _FIELDS))


_FIELDS = ("per_token", "per_pair", "per_sample", "shared", "fixed")


def fit(points: dict[tuple[int, int], int]) -> Row:
    """The `Row` through five measured (batch, seq) -> bytes points (exact: five unknowns)."""
    import numpy as np

    keys = sorted(points)
    a = np.array([[b * s, b * s * s, b, s, 1.0] for b, s in keys], dtype=np.float64)
    y = np.array([points[k] for k in keys], dtype=np.float64)
    return Row(*(float(v) for v in np.linalg.solve(a, y)))


@dataclass(frozen=True)
class Rows:
    """One component's measured rows: `block` (the average block over the component's full depth), `once` and
    `rest` (module docstring); `blocks` the full depth."""

    block: Row
    once: Row
    rest: Row
    blocks: int

    def total(self, batch: int, seq: int) -> int:
        return self.blocks * self.block.at(batch, seq) + self.once.at(batch, seq) + self.rest.at(batch, seq)


def formula_llm(block) -> bool:
    """Whether `activations.py`'s Llama formula counts `block` exactly: Llama's children (Qwen3's per-head q/k norms
    allowed) and a SiLU MLP (Gemma's GELU-tanh is measured instead)."""
    from vlaforge.models.families import unlike_llama

    act = getattr(getattr(block, "mlp", None), "act_fn", None)
    return unlike_llama(block) is None and type(act).__name__ in ("SiLU", "SiLUActivation")


def measured_components(model) -> tuple[str, ...]:
    """The components of `model` whose activations are measured rather than counted by a formula.

    Raises:
        VlaforgeError: a tower that cannot run under fake tensors and has no formula (Qwen2-VL's), named.
    """
    from vlaforge.models.llm import llm_blocks
    from vlaforge.models.vision import vision_family

    if is_policy(model):  # a LeRobot policy: every part measured, its joint layers as the LLM's blocks
        return POLICY_PARTS
    out = []
    tower = vision_family(model.vision)
    if not tower.planned:
        if not tower.static_shapes:
            raise VlaforgeError(f"the planner measures a vision tower under fake tensors, and a {tower.name} tower "
                                f"({type(model.vision).__name__}) sizes its forward from its patch grid's values, "
                                "which fake tensors do not hold: plan with Qwen2.5-VL's tower (counted by formula) "
                                "or a SigLIP tower of the same width and depth")
        out.append("vision")
    if not formula_llm(llm_blocks(model.llm)[0]):
        out.append("llm")
    return tuple(out)


POLICY_PARTS = ("vision", "projector", "llm", "action_head", "other")


def policy_shapes(cfg, model):
    """`cfg` with a policy's own shapes (its `PolicySpec`): action chunk, state and action sizes, its tokenizer's
    prompt length, no text targets - what its training batches hold - and its one loss term."""
    from vlaforge.config.loading import deep_merge, validate

    spec = model.spec
    return validate(deep_merge(cfg.model_dump(), {
        "model": {"action_chunk": spec.chunk, "action_dim": spec.action_dim, "state_dim": spec.state_dim},
        "data": {"max_instruction_tokens": int(spec.extra.get("tokenizer_max_length", 48)), "max_text_tokens": 0},
        "loss": {"weights": {"action": 1.0}}}))  # its one loss term (a folder's config gets it from the schema)


def _signatures(blocks, layer_types) -> list[tuple]:
    """What makes two blocks keep different tensors: their class, their feed-forward's class (a MoE block's sparse
    or dense MLP) and their attention kind (`layer_types`: sliding or full)."""
    out = []
    for i, block in enumerate(blocks):
        ffn = next((type(c).__name__ for n, c in block.named_children() if n in ("mlp", "feed_forward")), None)
        kind = layer_types[i] if layer_types and i < len(layer_types) else None
        out.append((type(block).__name__, ffn, kind))
    return out


def _depth(signatures: list[tuple]) -> int:
    """Blocks to build: up to the second of every distinct kind (its first keeps what that kind shares, e.g. a
    sliding-window mask; its second is the steady block), or all of them."""
    seen: dict[tuple, list[int]] = {}
    for i, s in enumerate(signatures):
        seen.setdefault(s, []).append(i)
    return min(len(signatures), max(at[1] if len(at) > 1 else at[0] for at in seen.values()) + 1)


def _cut(config: dict, depth: int) -> dict:
    out = dict(config, num_hidden_layers=depth)
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][:depth]
    return out


def _config(module) -> dict:
    drop = ("out_features", "out_indices", "stage_names")  # DINOv2's backbone stages (transformers derives them)
    return {k: v for k, v in module.config.to_dict().items() if not k.startswith("_") and k not in drop}


class MeasuredRows:
    """Measured rows of `model`'s `components` (built from `cfg`, its micro-batches `padded` or not), cached by
    (component, strategy, compute bytes, master dtype)."""

    def __init__(self, cfg, model, components: tuple[str, ...], padded: bool):
        from vlaforge.models.blocks import blocks_of

        self.cfg, self.components, self.padded = cfg, components, padded
        self.modules = tuple(c for c in components if c != "other")  # the parts that are the model's own modules
        self.policy = is_policy(model)
        self._cache: dict[tuple, Rows] = {}
        if self.policy:  # measured whole (its joint layers are built from one config): each block its own kind
            self._full = {c: [(c, i) for i in range(len(blocks_of(model, c) or ()) if c in self.modules else 0)]
                          for c in components}  # component -> its blocks' signatures at full depth
            self._cut_sigs, self._backbones = dict(self._full), None
            return
        llm_types = getattr(model.llm.config, "layer_types", None)
        towers = list(model.vision.towers) if hasattr(model.vision, "towers") else [model.vision]
        self._full = {"llm": _signatures(blocks_of(model, "llm"), llm_types),
                      "vision": [(t, *s) for t, tower in enumerate(towers)
                                 for s in _signatures(_tower_blocks(tower), None)]}
        llm_depth = _depth(self._full["llm"])
        vision_depths = [min(2, len(_tower_blocks(t))) for t in towers]
        self._backbones = self._cut_backbones(model, llm_depth, vision_depths)
        self._cut_sigs = {"llm": self._full["llm"][:llm_depth],
                          "vision": [s for t, n in enumerate(vision_depths)
                                     for s in [x for x in self._full["vision"] if x[0] == t][:n]]}

    @staticmethod
    def _cut_backbones(model, llm_depth: int, vision_depth: list[int]) -> dict:
        from vlaforge.models.vision import FUSED

        if hasattr(model.vision, "towers"):
            vision = {"model_type": FUSED, "towers": [_cut(c, n) for c, n in
                                                      zip(_config(model.vision)["towers"], vision_depth)]}
        else:
            vision = _cut(_config(model.vision), vision_depth[0])
        return {"vision": vision, "llm": _cut(_config(model.llm), llm_depth),
                "projector": dict(model.projector.spec)}

    def rows(self, comp: str, strategy: str, precision: str, master: str) -> Rows:
        """The measured rows of `comp` computing in `precision` under checkpointing `strategy` (`every_nth`: its
        checkpointed blocks' and plain blocks' rows mixed by count)."""
        from vlaforge.planner.activations import compute_bytes

        if strategy == "every_nth" and not self._full.get(comp):  # no blocks of its own to alternate
            strategy = "none"
        if strategy == "every_nth":
            every = getattr(getattr(self.cfg.components, comp), "checkpoint_every_n", 2)
            n = len(self._full[comp])
            done = len(range(0, n, every))
            full, none = (self.rows(comp, s, precision, master) for s in ("full", "none"))
            block = full.block.scaled(done / n) + none.block.scaled((n - done) / n)
            return Rows(block, full.once, full.rest, n)
        # the master dtype changes what is kept only through LoRA's adapters (`activations.py`): measured with fp32
        # masters otherwise (a bf16 cast of a fake model's tied weights does not run)
        lora = any(getattr(self.cfg.components, c).lora is not None for c in self.modules)
        key = (comp, strategy, compute_bytes(precision), master if lora and precision != "fp32" else "fp32")
        if key not in self._cache:
            self._measure(strategy, "fp32" if key[2] == 4 else "bf16", key[3])
        return self._cache[key]

    def _measure(self, strategy: str, precision: str, master: str) -> None:
        from vlaforge.config.loading import deep_merge, validate
        from vlaforge.distributed.apply import apply_techniques
        from vlaforge.models.build import build_vla, synthetic_batch
        from vlaforge.models.fake import fake_build
        from vlaforge.planner.activations import sequence_of
        from vlaforge.techniques import accounting as memory
        from vlaforge.techniques.freezing import apply_freezing

        comps = {c: {"precision": precision, "checkpointing": self._allowed(c, strategy), "offload": "none"}
                 for c in self.modules}
        base = self.cfg.model_dump()
        instr = self.cfg.data.max_instruction_tokens
        override = {"components": comps, "train": {"compile": False, "precision_master": master}}
        cfg = validate(deep_merge(base, override))
        points: dict[str, dict[tuple[int, int], list[int]]] = {}
        with fake_build():
            try:
                model = build_vla(cfg.model, cfg.loss, fake=True, backbones=self._backbones)  # a policy: None
                apply_techniques(model, cfg, torch.device("cpu"))
                apply_freezing(model, dict(cfg.components.items()), 0)
                for n in (instr, instr + LONGER[0], instr + LONGER[1]):
                    at = validate(deep_merge(base, {**override, "data": {"max_instruction_tokens": n}}))
                    for b in (BATCHES if n != instr + LONGER[1] else BATCHES[:1]):
                        batch = synthetic_batch(at, model, b, padded=self.padded)
                        with memory.count_saved(model) as acc:
                            model.compute_loss(batch)
                        seq = sequence_of(model, batch).llm_tokens  # the S the planner evaluates rows at
                        for comp in self.components:
                            by = acc.per_block(comp) if comp != "other" else {"rest": acc.per_component().get(
                                "other", 0)}
                            n_blocks = len(self._cut_sigs[comp])
                            points.setdefault(comp, {})[(b, seq)] = [by.get(str(i), 0) for i in range(n_blocks)] \
                                + [by.get("rest", 0)]
            except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
                raise VlaforgeError(self._refusal(model if "model" in locals() else None, e)) from None
        for comp in self.components:
            pts = points[comp]  # (a component without blocks: its bytes as `rest`)
            n_blocks = len(self._cut_sigs[comp])
            fitted = [fit({k: v[i] for k, v in pts.items()}) for i in range(n_blocks + 1)]
            self._cache[(comp, strategy, 4 if precision == "fp32" else 2, master)] = self._combine(comp, fitted)

    def _allowed(self, comp: str, strategy: str) -> str:
        """`strategy` where `comp` takes it when measured beside the others: a connector is checkpointed whole or not
        at all; a policy's action head has no unit of its own (its expert blocks are in the joint layers), nor its
        LLM a selective one (docs/lerobot_policies.md)."""
        if comp == "projector":
            return strategy if strategy in ("none", "full") else "none"
        if self.policy and (comp == "action_head" or (comp == "llm" and strategy.startswith("selective"))):
            return "none"
        return strategy

    def _combine(self, comp: str, fitted: list[Row]) -> Rows:
        cut, full = self._cut_sigs[comp], self._full[comp]
        steady = {s: fitted[i] for i, s in enumerate(cut)}  # the last measured block of each kind
        once = Row()
        for i, s in enumerate(cut):
            once = once + (fitted[i] - steady[s])
        total = Row()
        for s in full:
            total = total + steady[s]
        return Rows(block=total.scaled(1 / max(1, len(full))), once=once, rest=fitted[-1], blocks=len(full))

    def parts(self, batch: int, seq: int, policies, master: str) -> dict[str, int]:
        """A policy's `activation_parts`: every part from its measured rows (the LLM's: its joint layers; 'other':
        the embeddings, the expert's projections and the loss, keyed by the LLM's strategy)."""
        out = {}
        for comp in self.components:
            pol = policies["llm" if comp == "other" else comp]
            r = self.rows(comp, pol.checkpointing, pol.precision, master)
            if comp == "llm":
                out["llm_block"], out["llm_once"], out["llm_tail"] = (r.block.at(batch, seq), r.once.at(batch, seq),
                                                                      r.rest.at(batch, seq))
            else:
                out[comp] = r.total(batch, seq)
        return out

    def _refusal(self, model, error: Exception) -> str:
        from vlaforge.models.blocks import blocks_of

        kinds = []
        for comp in self.modules:
            blocks = blocks_of(model, comp) if model is not None else None
            kinds.append(type(blocks[0]).__name__ if blocks else comp)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return (f"the planner could not measure the {' and '.join(kinds)} blocks under fake tensors ({first}); "
                "plan with a model of a family docs/families.md lists as planned")


def _tower_blocks(tower):
    from vlaforge.models.vision import vision_blocks

    return vision_blocks(tower)


def refuse_sharded(measured: tuple[str, ...], tp: int, cp: int, pp: int = 1, backend: str = "fsdp2") -> str | None:
    """Why a layout that shards a measured LLM block (or a layout a LeRobot policy does not train with: pipeline
    stages) is not planned (None when none is asked)."""
    if measured == POLICY_PARTS and pp > 1:
        return ("a LeRobot policy trains with FSDP2 / DDP / DeepSpeed, not pipeline parallel "
                "(docs/lerobot_policies.md): plan it with those")
    if "llm" not in measured or (tp == 1 and cp == 1):
        return None
    what = "tensor parallel" if tp > 1 else "context parallel"
    return (f"the planner measures this LLM's blocks whole and does not divide them for {what} "
            f"(parallel.{'tp' if tp > 1 else 'cp'}); plan it with FSDP2 / HSDP / DDP and pipeline parallel")
