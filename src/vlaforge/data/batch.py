"""`Batch`: the typed, shape-checked data contract between data loading and the model."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from vlaforge.errors import VlaforgeError


@dataclass
class Batch:
    """One (micro-)batch. Frames of all cameras and time steps are stacked along F.

    images (B, F, C, H, W) float, already normalized; state (B, S); instruction_ids/mask (B, L);
    actions (B, T, A) and action_mask (B, T) (None at inference); text_ids/mask (B, Lt): optional targets of
    the language loss (e.g. a description of the expert's current phase); index (B,): each sample's row in its
    dataset (what a teacher-output cache is keyed by; None where the samples have no rows, as at inference);
    env_state (B, E): the normalized privileged scene state (`observation.environment_state`, e.g. the goal position),
    a training target of the auxiliary `env_state` term only, never a policy input (None unless that term is on).
    full: a host-side fact, known where the batch is made on the CPU (`collate`): True when no instruction or text
    position is padding, so the model can attend causally without a mask and without reading the mask on the
    device to find that out (a blocking read on a GPU); None where unknown.
    """

    images: torch.Tensor
    state: torch.Tensor
    instruction_ids: torch.Tensor
    instruction_mask: torch.Tensor
    actions: torch.Tensor | None = None
    action_mask: torch.Tensor | None = None
    text_ids: torch.Tensor | None = None
    text_mask: torch.Tensor | None = None
    index: torch.Tensor | None = None
    env_state: torch.Tensor | None = None
    full: bool | None = None

    @property
    def size(self) -> int:
        return self.images.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        moved = {f.name: (v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v)
                 for f in fields(self) for v in [getattr(self, f.name)]}
        return replace(self, **moved)

    def validate(self) -> "Batch":
        """Check ranks, dtypes and that all batch dimensions agree; raise VlaforgeError naming the field."""
        b = self.size
        _expect(self.images, "images", 5, b, floating=True)
        _expect(self.state, "state", 2, b, floating=True)
        _expect(self.instruction_ids, "instruction_ids", 2, b)
        _expect(self.instruction_mask, "instruction_mask", 2, b, shape=self.instruction_ids.shape)
        if self.actions is not None:
            _expect(self.actions, "actions", 3, b, floating=True)
            _expect(self.action_mask, "action_mask", 2, b, shape=self.actions.shape[:2])
        if self.text_ids is not None:
            _expect(self.text_ids, "text_ids", 2, b)
            _expect(self.text_mask, "text_mask", 2, b, shape=self.text_ids.shape)
        if self.index is not None:
            _expect(self.index, "index", 1, b)
        if self.env_state is not None:
            _expect(self.env_state, "env_state", 2, b, floating=True)
        return self

    @classmethod
    def collate(cls, samples: list["Batch"]) -> "Batch":
        """Stack unbatched samples (fields without the B dimension) into one Batch."""
        return cls._join(samples, torch.stack)

    @classmethod
    def concat(cls, batches: list["Batch"]) -> "Batch":
        """Join batches along B (micro-batches -> the pipeline's whole batch)."""
        return cls._join(batches, torch.cat)

    @classmethod
    def _join(cls, parts: list["Batch"], join) -> "Batch":
        """Each field joined across `parts` with `join` (torch.stack / torch.cat); optional fields stay None; `full`
        from the parts' own, else read once from the joined masks where they are on the host (where the batch is
        made: no device sync)."""
        out = {f.name: None if getattr(parts[0], f.name) is None else join([getattr(b, f.name) for b in parts])
               for f in fields(cls) if f.name != "full"}
        joined = cls(**out)
        if all(b.full is not None for b in parts):
            joined.full = all(b.full for b in parts)
        elif joined.instruction_mask.device.type == "cpu":
            joined.full = bool(joined.instruction_mask.all()) and (joined.text_mask is None
                                                                  or bool(joined.text_mask.all()))
        return joined



def _expect(t: torch.Tensor | None, name: str, rank: int, batch: int, floating: bool = False,
            shape: tuple | torch.Size | None = None) -> None:
    if t is None:
        raise VlaforgeError(f"Batch.{name} is missing")
    if t.dim() != rank or t.shape[0] != batch:
        raise VlaforgeError(f"Batch.{name} has shape {tuple(t.shape)}; expected rank {rank} with batch {batch}")
    if floating != t.is_floating_point():
        raise VlaforgeError(f"Batch.{name} has dtype {t.dtype}; expected a {'float' if floating else 'integer/bool'}"
                            " tensor")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise VlaforgeError(f"Batch.{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
