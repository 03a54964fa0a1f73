"""Pipeline parallel for the VLA on `torch.distributed.pipelining` (GPipe and 1F1B schedules).

Stage 0 holds the vision tower, the projector, the token embeddings, the action queries and the first LLM blocks;
the last stage holds the last blocks, the final norm, the LM head and the action head; middle stages hold blocks.
The split keeps every parameter's name (`llm.model.layers.<i>` stays `<i>`), so checkpoints are the same files
whatever the layout.

The step's accumulation micro-batches are the pipeline's micro-batches (Megatron's convention): `train.grad_accum`
batches of `train.batch_size` go through the schedule as one batch, so a pipelined step computes the gradient of
`grad_accum` accumulated micro-steps in one process. Each stage receives the token mask as a keyword argument
(every rank of a pipeline has the batch); activations travel as (hidden states, [pooled vision, pooled instruction,
contrastive temperature]). The loss is computed on the last stage, in the schedule's loss function: the action
head runs there, where the micro-batch's state and actions are, and the contrastive term uses the pooled
embeddings carried from stage 0 (their gradients travel back with the hidden states').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vlaforge.data.batch import Batch
from vlaforge.models.build import tokens_per_sample
from vlaforge.models.families import decoder_of, llm_parts
from vlaforge.models.vla import VLA

SCHEDULES = ("gpipe", "1f1b")


class Removed(nn.Module):
    """Stands in for a component whose parameters live on another pipeline stage (no forward; stage 0's
    `action_head` holds the action queries only)."""

    removed = True


class StageLayers(nn.ModuleDict):
    """The LLM blocks of one stage, keyed by their index in the whole model so parameter names do not change;
    iterates and slices like the `nn.ModuleList` it replaces (transformers' Llama loops over `layers[:n]`)."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, key):
        if isinstance(key, slice):
            return list(self.values())[key]
        if isinstance(key, int):
            return list(self.values())[key]
        return super().__getitem__(key)


@dataclass(frozen=True)
class StagePlan:
    """Which LLM blocks each stage runs, and the estimated forward work of each stage (matmul FLOPs per sample)."""

    bounds: tuple[tuple[int, int], ...]  # [start, end) block indices per stage
    work: tuple[float, ...]

    @property
    def balance(self) -> float:
        """Slowest stage over the mean: 1.0 is perfect; the pipeline runs at the pace of the slowest stage."""
        return max(self.work) / (sum(self.work) / len(self.work))

    def summary(self) -> str:
        total = sum(self.work)
        parts = [f"stage {i}: blocks {a}-{b - 1} ({w / total:.0%})" for i, ((a, b), w) in
                 enumerate(zip(self.bounds, self.work))]
        return "; ".join(parts) + f"; slowest/mean {self.balance:.2f}"


def _params(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def plan_stages(model: VLA, stages: int, instruction_tokens: int, text_tokens: int) -> StagePlan:
    """Contiguous LLM-block ranges for `stages` stages (at least one block each) that minimize the slowest stage's
    work, counted as 2 x parameters x tokens: vision tokens through the vision tower and projector on stage 0,
    the whole sequence through each block, the text targets through the LM head and the action queries through the
    action head on the last stage."""
    lay = model.layout
    seq = tokens_per_sample(model, instruction_tokens, text_tokens)
    blocks = [2.0 * _params(b) * seq for b in llm_parts(model.llm).blocks]
    first = 2.0 * (_params(model.vision) + _params(model.projector)) * lay.frames * lay.patches_per_frame
    last = 2.0 * (_params(model.llm.get_output_embeddings()) * (text_tokens + 1)
                  + (_params(model.action_head) - model.action_head.queries.numel()) * model.action_head.chunk)
    n = len(blocks)

    def work(a: int, b: int, i: int) -> float:
        return sum(blocks[a:b]) + (first if i == 0 else 0.0) + (last if i == stages - 1 else 0.0)

    # best[i][j]: the smallest possible slowest-stage work putting blocks[:j] on stages 0..i-1 (small n: exact DP)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for i in range(1, stages + 1):
        for j in range(i, n - (stages - i) + 1):
            for k in range(i - 1, j):
                cost = max(best[i - 1][k], work(k, j, i - 1))
                if cost < best[i][j]:
                    best[i][j], cut[i][j] = cost, k
    bounds, j = [], n
    for i in range(stages, 0, -1):
        bounds.append((cut[i][j], j))
        j = cut[i][j]
    bounds.reverse()
    return StagePlan(tuple(bounds), tuple(work(a, b, i) for i, (a, b) in enumerate(bounds)))


def tied_names(model: nn.Module) -> list[tuple[str, ...]]:
    """The names of each parameter `model` holds under more than one name (tied token embeddings and LM head),
    sorted."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [tuple(sorted(group)) for group in names.values() if len(group) > 1]


def split_model(model: VLA, plan: StagePlan, stage: int) -> None:
    """Keep only stage `stage`'s parameters in `model`, in place (names unchanged). A weight tied across the first
    and last stage (the token embeddings and the LM head) stays on both, under the name each uses;
    `model.pipeline_tied` records the tied names (`tie_stages` sums their gradients, checkpoints keep one)."""
    model.pipeline_tied = tied_names(model)
    first, last = stage == 0, stage == len(plan.bounds) - 1
    a, b = plan.bounds[stage]
    parts = llm_parts(model.llm)
    inner = parts.decoder
    inner.layers = StageLayers({str(i): inner.layers[i] for i in range(a, b)})
    if not first:
        model.vision, model.projector = Removed(), Removed()
        setattr(inner, _child_name(inner, model.llm.get_input_embeddings()), None)
    if not last:
        setattr(inner, parts.final_norm_name, nn.Identity())  # `norm`, Phi's `final_layernorm`, ...
        setattr(model.llm, _child_name(model.llm, model.llm.get_output_embeddings()), None)
        queries = model.action_head.queries
        chunk = model.action_head.chunk
        model.action_head = Removed()
        model.action_head.queries, model.action_head.chunk = queries, chunk  # LLM input: stage 0 holds them
    elif not first:
        del model.action_head.queries


def _child_name(parent: nn.Module, child: nn.Module) -> str:
    """The attribute of `parent` that holds `child` (the token embeddings, the LM head: named per family)."""
    return next(name for name, module in parent.named_children() if module is child)


class StageModule(nn.Module):
    """One stage's forward over the VLA's own modules (children named as the VLA's, so FSDP2 units and parameter
    names are those of the single-process model).

    Stage 0: (images, instruction_ids[, text_ids]) -> (hidden[, vision_pool, text_pool, logit_scale rows]);
    later stages: (hidden[, pooled...]) -> the same, with their blocks applied (and the final norm on the last).
    """

    def __init__(self, model: VLA, first: bool, contrastive: bool):
        super().__init__()
        self.vision, self.projector, self.llm, self.action_head = (model.vision, model.projector, model.llm,
                                                                    model.action_head)
        object.__setattr__(self, "vla", model)  # not a child: its modules are registered above
        self.first, self.contrastive = first, contrastive

    def forward(self, *inputs: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        extras: tuple[torch.Tensor, ...] = ()
        if self.first:
            images, instruction_ids, *text = inputs
            hidden, vision_tokens, instruction = self.vla.input_embeddings(images, instruction_ids,
                                                                           text[0] if text else None)
            if self.contrastive:
                start = vision_tokens.shape[1]  # the instruction follows the vision tokens in the layout
                instruction_mask = attention_mask[:, start:start + instruction.shape[1]]
                pooled = self.vla.contrastive_inputs(vision_tokens, instruction, instruction_mask)
                scale = pooled["logit_scale"].expand(hidden.shape[0], 1)
                extras = (pooled["vision_pool"], pooled["text_pool"], scale)
        else:
            hidden, *rest = inputs
            extras = tuple(e.view_as(e) for e in rest)  # passed on (a node, so gradients flow back through us)
        out = decoder_of(self.llm)(inputs_embeds=hidden, attention_mask=attention_mask.long(),
                             position_ids=self.vla.llm_positions(attention_mask), use_cache=False)
        return tuple(t.contiguous() for t in (out.last_hidden_state, *extras))  # gloo receives into dense buffers


class Pipeline:
    """The stage this rank runs, its schedule, and the loss function over the step's micro-batches."""

    def __init__(self, model: VLA, stage_module: StageModule, stages: int, micro_batches: int, schedule: str, mesh,
                 device: torch.device):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = mesh["pp"].get_local_rank()
        self.model, self.stage_module = model, stage_module
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.group = mesh.get_group("pp")
        self.pipe_stage = PipelineStage(stage_module, stage, stages, device, group=self.group)
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        # scale_grads=False: the loss function already divides by the micro-batch count (the trainer's convention)
        self.schedule = kind(self.pipe_stage, micro_batches, loss_fn=self._loss, scale_grads=False)
        self._step: dict[str, Any] = {}

    def _loss(self, outputs: tuple[torch.Tensor, ...] | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        s = self._step
        if isinstance(outputs, torch.Tensor):  # the schedule unwraps a one-tensor output (no contrastive term)
            outputs = (outputs,)
        i = int(index.reshape(-1)[0])
        batch: Batch = s["micro"][i]
        model, n = self.model, len(s["micro"])
        hidden, *extras = outputs
        with_text = model.uses_text(batch)
        n_text = batch.text_ids.shape[1] if with_text else 0
        logits = model.llm.get_output_embeddings()(hidden[:, -(n_text + 1):]) if with_text else None
        h = model.split_outputs(hidden, logits, n_text)
        if extras:
            h.update(vision_pool=extras[0], text_pool=extras[1], logit_scale=extras[2][0])
        loss, metrics = model.weigh(model.loss_terms(batch, h, s["denominators"]), s["weighting"])
        s["metrics"][i] = metrics  # by index: the schedule's first step also calls us once to infer shapes
        return s["scaler"].scale_loss(loss / n)

    def run(self, micro: list[Batch], weighting, scaler, denominators) -> dict[str, torch.Tensor]:
        """Forward and backward of every micro-batch through the pipeline; returns the step's loss metrics (averaged
        over micro-batches) on every rank of the pipeline."""
        model = self.model
        with_text = model.uses_text(micro[0])
        whole = Batch.concat(micro)
        args = [whole.images, whole.instruction_ids] + ([whole.text_ids] if with_text else [])
        mask = model.token_mask(whole, with_text)
        self._step = {"micro": micro, "weighting": weighting, "scaler": scaler, "denominators": denominators,
                      "metrics": {}}
        index = torch.arange(len(micro), device=mask.device)
        self.schedule.step(*(args if self.is_first else ()), attention_mask=mask, target=index,
                           return_outputs=False)
        per_batch = self._step.pop("metrics")
        self._step = {}
        sums: dict[str, torch.Tensor] = {}
        for i in sorted(per_batch):  # empty off the last stage
            for k, v in per_batch[i].items():  # the step's mean over its micro-batches
                sums[k] = sums[k] + v / len(micro) if k in sums else v / len(micro)
        return share_metrics(sums, self.group, mask.device)


def share_metrics(sums: dict[str, torch.Tensor], group, device: torch.device) -> dict[str, torch.Tensor]:
    """Every stage's metrics merged on every rank of the pipeline (the losses exist on the last stage only)."""
    local = {k: torch.as_tensor(v).detach().float().cpu() for k, v in sums.items()}
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    return {k: v.to(device) for k, v in merged.items()}


def tie_stages(model: VLA, reducer, mesh) -> None:
    """Register with `reducer` this stage's copies of the weights tied across the first and the last stage, the
    group of the two ranks that hold them, and which copy the gradient norms skip (the last stage's: counted once,
    on stage 0). A collective: every rank calls it (the groups are created in the same order everywhere)."""
    if not model.pipeline_tied:
        return
    names = {n for group in model.pipeline_tied for n in group}
    pp_axis = mesh.mesh_dim_names.index("pp")
    ranks = mesh.mesh.movedim(pp_axis, 0).reshape(mesh.mesh.shape[pp_axis], -1)  # (stages, the other coordinates)
    me = dist.get_rank()
    if ranks.shape[0] == 2:
        group = mesh.get_group("pp")
    else:
        group = None
        for col in range(ranks.shape[1]):
            pair = [int(ranks[0, col]), int(ranks[-1, col])]
            made = dist.new_group(pair)
            if me in pair:
                group = made
    stage, last = mesh["pp"].get_local_rank(), ranks.shape[0] - 1
    reducer.pp_tied = [p for n, p in model.named_parameters() if n in names]
    reducer.pp_tied_group = group if stage in (0, last) else None
    if stage == last:
        reducer.norm_skip |= {id(p) for p in reducer.pp_tied}


def split_for_stage(model: VLA, cfg, stages: int, mesh) -> tuple[StageModule, StagePlan]:
    """Plan the stages, keep this rank's stage of `model` (in place) and return the module its schedule runs."""
    stage = mesh["pp"].get_local_rank()
    plan = plan_stages(model, stages, cfg.data.max_instruction_tokens, cfg.data.max_text_tokens)
    split_model(model, plan, stage)
    return StageModule(model, stage == 0, model.objective.active("contrastive")), plan
