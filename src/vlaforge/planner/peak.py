"""When a step holds its gradients: the peak of one GPU over the step's phases, activations and gradients together.

`train_step` sets the gradients to None before the forward (`optimizer.zero_grad(set_to_none=True)`), so the forward
holds no gradient. Backward then walks the model in reverse - the loss and the heads, the LLM's blocks from the last,
its embeddings, the projector, the vision tower's blocks from the last - and each part, as its backward runs,
allocates its parameters' gradients while its saved activations are still held, then frees them. What the GPU holds
besides parameters, optimizer state and buffers at part k is therefore

    activations not yet freed (all of part k's included) + gradients of parts 1 .. k + part k's working set,

and the step's peak is the largest of these and of the optimizer step's (every gradient, no activation; fused AdamW
holds no temporary). With activations larger than the gradients they make (small models, long sequences) the peak is
at the start of backward; with the gradients larger (large models, short sequences) it moves towards its end. Where
gradients outlive a backward - gradient accumulation (the first micro-batch's gradients are held through the next
ones' forwards) or a pipeline stage with several micro-batches in flight - every gradient is held under the
activations, and each part's new gradients are a transient until they are added in.

With the optimizer step inside backward (`train.step_in_backward`) and one micro-batch per step, each parameter
steps and frees its gradient as soon as it is complete: a part holds one gradient at a time (at most its largest
parameter's, `Part.largest`; under FSDP2 one unit's sharded gradients, which share the reduce-scatter's output), no
gradient outlives its part, and there is no optimizer step holding them all - the
whole gradient (4 of fp32 masters' 16 bytes per parameter) leaves the peak. With accumulation the earlier
micro-batches' gradients are held as before (`grads_held`).

Working sets (transient, not saved for backward): the LM head's weight gradient in the compute dtype before autocast
casts it to the master dtype (c x head parameters, when the LLM computes below its master precision); in a block, its
input and output gradients in fp32 (2 x 4D per token) and the gradients of its widest intermediates (Llama: the
SwiGLU product's, gate's and up's, 3cF; SigLIP: fc1's and GELU's, 2cF) - the tensors that coexist at the block's
MLP backward; a tied embedding's dense gradient from the embedding backward (it is added into the head's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Part:
    """One stretch of backward: `count` identical pieces, each freeing `acts` and making `grads` bytes, with
    `work` transient bytes while it runs."""

    acts: float
    grads: float
    work: float = 0.0
    count: int = 1
    largest: float = 0.0  # bytes of the largest single gradient one piece makes


def backward_peak(parts: list[Part], activations: float, held: float = 0.0, in_backward: bool = False) -> float:
    """The most the GPU holds during backward beyond its state and buffers: `activations` (all kept for backward,
    the parts' included) at its start, `parts` in backward order, `held` gradient bytes from earlier micro-batches
    (their new gradients are then a transient until added in, not an addition). `in_backward`: the optimizer step
    runs inside backward and nothing is held, so each part's gradients are a transient of its largest one."""
    peak, kept, made = 0.0, activations, 0.0
    consumed = in_backward and not held
    for p in parts:
        if p.count <= 0:
            continue
        fresh = p.grads if not held and not consumed else 0.0  # gradients that stay
        transient = p.largest if consumed else p.grads if held else 0.0
        for j in (0, p.count - 1):  # within identical pieces the sum moves linearly: its ends bound it
            value = kept - j * p.acts + made + (j + 1) * fresh + transient + p.work + held
            peak = max(peak, value)
        kept -= p.count * p.acts
        made += p.count * fresh
    return max(peak, activations + held)


def grads_held(parts: list[Part], total: float, held: float = 0.0, in_backward: bool = False) -> float:
    """The most gradient bytes the step holds at once: every gradient (`total`, at the optimizer step or across
    micro-batches), or with the step inside backward and nothing held across micro-batches, the largest single
    gradient backward makes."""
    if in_backward and not held:
        return max((p.largest for p in parts if p.count > 0), default=0.0)
    return total


def stage_parts(pm, case, stage: int, comp_mem: dict, other: float, in_flight: int) -> list[Part]:
    """The backward of one micro-batch on a GPU of pipeline stage `stage`, in order (module docstring): `comp_mem`
    its bytes by component (`estimate._component_memory`: activations on the device, casts included, and gradient
    shares), `other` the loss terms' activations, `in_flight` the micro-batches whose activations the stage holds."""
    from vlaforge.planner.activations import compute_bytes, vision_shape

    first, last = stage == 0, stage == case.pp - 1
    a, b = case.bounds[stage]
    blocks = b - a
    pol = case.policies["llm"]
    c = compute_bytes(pol.precision)
    master = 4 if pol.precision == "fp32" else compute_bytes(case.cfg.train.precision_master)
    n = pm.llm_numel
    tied = n["tied_head"] > 0
    if case.pp == 1:  # the LLM's own parameters: a tied head is its embeddings, counted once
        own = n["embed"] + n["tail"] + blocks * n["block"]
        head_numel, embed_numel = n["tail"] + (n["embed"] if tied else 0), 0 if tied else n["embed"]
    else:
        own = blocks * n["block"] + n["embed"] * first + (n["tail"] + n["tied_head"]) * last
        head_numel, embed_numel = (n["tail"] + n["tied_head"]) * last, n["embed"] * first
    llm = comp_mem["llm"]
    per_param = llm.grads / own if own else 0.0
    big = pm.largest_numel
    state = case.state.by_component
    per = {c: comp_mem[c].grads / state[c].numel if state[c].numel else 0.0 for c in comp_mem}  # bytes per element
    # activations outside the blocks: the final norm and head input (last stage), rotary and checkpoint keywords,
    # the LM head's weight cast (the share of the casts outside the blocks)
    tail = case.parts["llm_tail"] * in_flight * last
    once = case.parts["llm_once"] * in_flight
    cast_all = pm.cast_numel("llm", pol.checkpointing, blocks, case.tp)
    head_cast = llm.weight_casts * pm.cast_numel("llm", pol.checkpointing, 0, case.tp) / cast_all if cast_all else 0
    through = case.backward_through
    tokens = case.micro * -(-case.seq.llm_tokens // case.cp)
    dims = pm.llm_dims
    wide = 3 * c * dims.ffn // case.tp
    llm_work = (8 * dims.hidden + wide) * tokens if through["llm"] else 0.0
    head_work = c * n["tied_head" if tied else "tail"] if last and c < master and llm.grads else 0.0
    head_largest = max(per["action_head"] * big["action_head"] * last,
                       per_param * (big["embed"] if tied else big["llm_tail"]) * bool(head_numel))
    parts = [Part(acts=other + comp_mem["action_head"].activations + tail + head_cast,
                  grads=comp_mem["action_head"].grads + per_param * head_numel, work=head_work, largest=head_largest),
             Part(acts=max(0.0, llm.activations - tail - once - head_cast) / blocks if blocks else 0.0,
                  grads=per_param * n["block"], work=llm_work, count=blocks, largest=per_param * big["llm_block"]),
             Part(acts=once, grads=per_param * embed_numel,
                  work=per_param * n["embed"] if tied and first and case.pp == 1 else 0.0,
                  largest=per_param * big["embed"] * bool(embed_numel))]
    if first:
        layers = pm.model.vision.config.num_hidden_layers
        vision, vs = comp_mem["vision"], vision_shape(pm.model.vision)
        patches = case.micro * case.seq.frames * case.seq.tower_patches
        vis_work = (8 * vs.hidden + 2 * compute_bytes(case.policies["vision"].precision) * vs.ffn) * patches \
            if through["vision"] else 0.0
        parts += [Part(acts=comp_mem["projector"].activations, grads=comp_mem["projector"].grads,
                       largest=per["projector"] * big["projector"]),
                  Part(acts=vision.activations / layers, grads=vision.grads / layers, work=vis_work, count=layers,
                       largest=per["vision"] * big["vision"])]
    if case.fsdp:  # FSDP2 reduce-scatters a unit's gradients into one buffer, freed once all its shards stepped
        parts = [replace(p, largest=p.grads) for p in parts]
    return parts

