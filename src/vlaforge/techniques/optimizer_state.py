"""`apply_optimizer_state`: AdamW state as a per-component choice - moments in the weights' master dtype (torch's
fused AdamW, as without this module) or torchao's blockwise 8-bit moments (`components.<c>.optim_state = "8bit"`),
and bf16 master weights updated with stochastic rounding (`components.<c>.stochastic_rounding`).

Components that choose differently get one optimizer each (`torchao.optim.AdamW8bit`, `torchao.optim._AdamW` with
`bf16_stochastic_round`, fused `torch.optim.AdamW`), joined in `ComponentOptimizer`: one `param_groups` list (the
parts' own group dicts, in the order of the groups it was given) and one `state` dict, so what reads an optimizer
- per-component gradient norms, the device learning-rate schedule, checkpoints by parameter name, staged
unfreezing - sees one optimizer. A run that sets no option never reaches this module (`training/optim.py` builds
today's fused AdamW).

torchao's rule for which moments are 8-bit (`_AdamBase._new_buffer`, torchao 0.18, following bitsandbytes): a
tensor of at least 4096 values whose count is a multiple of the block (256). Smaller or unaligned tensors (biases,
norms, scalars) keep zero-initialised moments in the parameter's dtype. An 8-bit moment holds 1 byte per value, one
fp32 scale per block of 256 and its own 256-entry fp32 code map (1 KiB per moment tensor); the `step` counter is a
0-d fp32 tensor on the CPU.

Stochastic rounding (torchao `_fp32_to_bf16_sr`) draws `torch.randint` inside torchao's compiled step: inductor
seeds its generator from torch's default generator of the parameter's device, so the trainer's checkpointed RNG
state (`seeding.rng_state`, CPU and every CUDA device) makes a resumed run draw the same bits.

torchao's step takes no `found_inf`: a step that may be skipped (loss scaling, `numerics.check_finite`) is decided
on the host for this optimizer (`training/step.py:optimizer_step`), one read per step, and a skipped step calls
nothing - weights, moments and step counters stay as they were.

Checkpoints hold an 8-bit moment as three plain tensors (`pack_moments`): its codes (uint8), scales (fp32, one per
block) and code map, rebuilt into torchao's `OptimState8bit` on load (`unpack_moments`); the class itself is never
pickled nor unpickled.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from vlaforge.errors import VlaforgeError
from vlaforge.techniques.host_optimizer import HostAdamW, host_params, restore_host_state, run_closure

BLOCK = 256  # values per 8-bit scale (torchao's AdamW8bit default)
MIN_QUANTIZED = 4096  # torchao quantizes a moment of at least this many values that blocks evenly
QMAP_SIZE = 256  # entries of an 8-bit code map (fp32)
PACKED = ("codes", "scale", "qmap")  # an 8-bit moment in a checkpoint: its plain tensors


def option(policy) -> tuple[str, bool]:
    """(optim_state, stochastic_rounding) of a component policy; defaults for objects without them."""
    return getattr(policy, "optim_state", "master"), bool(getattr(policy, "stochastic_rounding", False))


def uses_optimizer_state(components: Mapping[str, Any]) -> bool:
    """Whether any component asks for 8-bit moments, stochastic rounding or the host's AdamW (else: today's fused
    AdamW)."""
    return any(option(p) != ("master", False) for p in components.values())


def quantized(numel: int, eight_bit: bool = True) -> bool:
    """Whether torchao keeps a moment of a `numel`-value tensor in 8 bits (see the module docstring)."""
    return eight_bit and numel >= MIN_QUANTIZED and numel % BLOCK == 0


def moment_bytes(numel: int, master_size: int, eight_bit: bool) -> int:
    """Bytes of one AdamW moment of a `numel`-value parameter whose weights are `master_size` bytes each."""
    if quantized(numel, eight_bit):
        return numel + 4 * (numel // BLOCK) + 4 * QMAP_SIZE
    return numel * master_size


ADAM_STEP_BYTES = 4  # the fp32 `step` tensor AdamW keeps per parameter tensor


def adam_state_bytes(numel: int, master_size: int, optim_state: str = "master") -> int:
    """Bytes AdamW keeps for one trained `numel`-value tensor whose weights are `master_size` bytes each, by
    `optim_state`: both moments (`moment_bytes`) and the step; with "cpu" (techniques/host_optimizer.py) fp32 moments
    and an fp32 master unless the weights are fp32 already - on the host. The planner's count and the host-memory
    check's."""
    if optim_state == "cpu":
        return 2 * 4 * numel + (4 * numel if master_size != 4 else 0) + ADAM_STEP_BYTES
    return 2 * moment_bytes(numel, master_size, optim_state == "8bit") + ADAM_STEP_BYTES


class ComponentOptimizer(torch.optim.Optimizer):
    """Several optimizers as one: `param_groups` are the parts' own group dicts (in the order given), `state` one
    dict the parts share. `step` steps every part; `load_state_dict` hands the loaded groups back to the parts."""

    def __init__(self, groups: list[dict], parts: list[torch.optim.Optimizer], owner: list[int]):
        super().__init__(groups, defaults={})
        self.parts, self.owner = parts, owner  # owner[i]: the part that steps param_groups[i]
        self._share()

    def _share(self) -> None:
        for i, part in enumerate(self.parts):
            part.param_groups = [g for g, o in zip(self.param_groups, self.owner) if o == i]
            part.state = self.state

    def eight_bit(self, param: torch.Tensor) -> bool:
        """Whether `param`'s moments are (or will be) 8-bit."""
        for group, o in zip(self.param_groups, self.owner):
            if any(p is param for p in group["params"]):
                part = self.parts[o]
                return getattr(part, "block_size", None) == BLOCK and quantized(_local(param).numel())
        return False

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for part in self.parts:
            part.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()  # NOTE: torch replaced the group dicts and the state dict
        restore_host_state(self, state_dict, host_params(self))  # (torch cast the host's fp32 state)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def apply_optimizer_state(groups: list[dict], components: Mapping[str, Any], betas: tuple[float, float],
                          eps: float) -> ComponentOptimizer:
    """One optimizer over `groups` (training/optim.py's per-component groups; a group whose "component" is not in
    `components` - learned loss weights, distillation projections - takes fused AdamW), each component's groups
    stepped by the optimizer its policy names.

    Raises:
        VlaforgeError: a parameter is not a floating tensor on the CPU or a CUDA device (fused AdamW's and
            torchao's devices), or a stochastically rounded component holds weights that are not bf16.
    """
    kinds: dict[tuple[str, bool], list[int]] = {}
    for i, group in enumerate(groups):
        policy = components.get(group["component"])
        kind = option(policy) if policy is not None else ("master", False)
        _check_params(group, kind)
        kinds.setdefault(kind, []).append(i)
    for group in groups:  # NOTE: before torchao turns each lr into a float32 tensor (the schedule's base, unrounded)
        group.setdefault("initial_lr", float(group["lr"]))
    owner, parts = [0] * len(groups), []
    for n, ((state, rounding), members) in enumerate(kinds.items()):
        mine = [groups[i] for i in members]
        if state == "cpu":
            parts.append(HostAdamW(mine, betas=betas, eps=eps))
        elif state == "8bit":
            from torchao.optim import AdamW8bit

            parts.append(AdamW8bit(mine, betas=betas, eps=eps, block_size=BLOCK, bf16_stochastic_round=rounding))
        elif rounding:
            from torchao.optim import _AdamW

            parts.append(_AdamW(mine, betas=betas, eps=eps, bf16_stochastic_round=True))
        else:
            parts.append(torch.optim.AdamW(mine, betas=betas, eps=eps, fused=True))
        for i in members:
            owner[i] = n
    return ComponentOptimizer(groups, parts, owner)


def _check_params(group: dict, kind: tuple[str, bool]) -> None:
    for p in group["params"]:
        if p.device.type not in ("cpu", "cuda") or not p.is_floating_point():
            raise VlaforgeError(f"components.{group['component']}: parameter of {p.dtype} on {p.device.type}; the "
                                "per-component optimizer state needs floating weights on cpu or cuda - drop "
                                "optim_state / stochastic_rounding")
        if kind[1] and p.dtype != torch.bfloat16:
            raise VlaforgeError(f"components.{group['component']}.stochastic_rounding = true needs bf16 weights and "
                                f"holds {str(p.dtype).removeprefix('torch.')} ones; set its precision to 'bf16' with "
                                "train.precision_master = 'bf16', or drop stochastic_rounding")


# ---- checkpoints: 8-bit moments as plain tensors ----------------------------------------------------------------

def _is_8bit(value: Any) -> bool:
    return type(value).__name__ == "OptimState8bit" and hasattr(value, "codes")


def pack_moments(state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state dict (keyed by name, as `get_optimizer_state_dict` gives it) with every 8-bit moment
    replaced by {"codes", "scale", "qmap"} plain tensors; other values as they are (a rank that receives no full
    state has {})."""
    if "state" not in state:
        return state
    out = {k: v for k, v in state.items() if k != "state"}
    out["state"] = {name: {k: _pack(v) if _is_8bit(v) else v for k, v in entry.items()}
                    for name, entry in state["state"].items()}
    return out


def _pack(value) -> dict[str, torch.Tensor]:
    return {"codes": value.codes, "scale": value.scale, "qmap": value.qmap}


def unpack_moments(state: dict[str, Any]) -> dict[str, Any]:
    """The reverse of `pack_moments`: each packed record rebuilt into torchao's `OptimState8bit` (its dtype is the
    parameter's once the optimizer loads it)."""
    out = {k: v for k, v in state.items() if k != "state"}
    out["state"] = {name: {k: _unpack(v) if isinstance(v, dict) else v for k, v in entry.items()}
                    for name, entry in state["state"].items()}
    return out


def _unpack(record: dict[str, torch.Tensor]):
    from torchao.optim.subclass_8bit import OptimState8bit

    signed = bool(record["qmap"][0] < 0)  # the signed map (first moment) spans [-1, 1], the unsigned [0, 1]
    return OptimState8bit(record["codes"], record["scale"], record["qmap"], signed)


def packed_problem(record: Any) -> str:
    """What is wrong with a packed 8-bit moment read from a checkpoint, or ''."""
    if not isinstance(record, dict) or set(record) != set(PACKED):
        return f"a moment is a {type(record).__name__} with keys {sorted(record) if isinstance(record, dict) else []}"
    codes, scale, qmap = (record[k] for k in PACKED)
    if not all(isinstance(t, torch.Tensor) and type(t) is torch.Tensor for t in (codes, scale, qmap)):
        return "an 8-bit moment holds something other than plain tensors"
    if codes.dtype != torch.uint8 or scale.dtype != torch.float32 or qmap.dtype != torch.float32:
        return "an 8-bit moment's codes are not uint8 or its scales / code map not float32"
    if scale.ndim != 1 or qmap.shape != (QMAP_SIZE,) or codes.numel() != BLOCK * scale.numel():
        return (f"an 8-bit moment of {codes.numel()} codes has {scale.numel()} scales and a code map of "
                f"{tuple(qmap.shape)} (blocks of {BLOCK}, {QMAP_SIZE} codes)")
    return ""


def flat_pack(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened optimizer state dict (DCP: 'state.<fqn>.exp_avg') with each 8-bit moment as three plain tensors
    '<key>.codes', '<key>.scale', '<key>.qmap' (views of the moment's own: a load into them fills the moment)."""
    out = {}
    for k, v in flat.items():
        if _is_8bit(v):
            out.update({f"{k}.{part}": t for part, t in _pack(v).items()})
        else:
            out[k] = v
    return out


def flat_unpack(flat: dict[str, Any]) -> dict[str, Any]:
    """The reverse of `flat_pack`."""
    out = {k: v for k, v in flat.items() if not any(k.endswith(f".{p}") and k[:-len(p) - 1] + ".codes" in flat
                                                      for p in PACKED)}
    for k in [k[:-len(".codes")] for k in flat if k.endswith(".codes")]:
        out[k] = _unpack({p: flat[f"{k}.{p}"] for p in PACKED})
    return out


def check_flat_kinds(mine: Mapping[str, Any], saved_keys) -> None:
    """`check_moment_kinds` for a sharded checkpoint: `mine`, this run's flattened packed optimizer state; `saved_keys`,
    the checkpoint's keys under the same prefix.

    Raises:
        VlaforgeError: naming the first moment whose kind differs and the fix.
    """
    saved = set(saved_keys)
    for k in mine:
        if k.endswith(".codes") and k not in saved and k[:-len(".codes")] in saved:
            raise VlaforgeError(_kind_message(k[:-len(".codes")], False))
        if not k.endswith(tuple(f".{p}" for p in PACKED)) and k not in saved and f"{k}.codes" in saved:
            raise VlaforgeError(_kind_message(k, True))


def check_moment_kinds(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor],
                       state: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose AdamW moments are 8-bit where this run's are plain, or the reverse (`state`: the
    packed, by-name optimizer state; `params`: this run's parameters by the same names).

    Raises:
        VlaforgeError: naming the first parameter and the fix.
    """
    mine = getattr(optimizer, "eight_bit", lambda p: False)
    for name, entry in state.items():
        if name not in params or not isinstance(entry, Mapping):
            continue
        saved = any(isinstance(entry.get(k), Mapping) for k in ("exp_avg", "exp_avg_sq"))
        if saved != mine(params[name]):
            raise VlaforgeError(_kind_message(name, saved))


def _kind_message(name: str, saved_8bit: bool) -> str:
    there, here = ("8-bit", "in the master dtype") if saved_8bit else ("in the master dtype", "8-bit")
    return (f"the checkpoint's AdamW moments of {name} are {there} and this run keeps them {here}; resume with the "
            "components' optim_state of the checkpoint's config.toml, or start from its weights with "
            "--train.init_from")
