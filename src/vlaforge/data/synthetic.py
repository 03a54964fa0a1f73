"""A synthetic, learnable dataset of valid `Batch`es: quick starts and tests without a simulator.

Each task has a fixed instruction and a colour; a sample shows a coloured square whose position is the goal,
the state is a hand position, and the actions move the hand towards the goal (so images and instruction
carry all the information the policy needs). Every sample is a pure function of (seed, index).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from vlaforge.data.batch import Batch


class SyntheticDataset(Dataset):
    def __init__(self, *, num_samples: int, num_tasks: int, frames: int, image_size: int, state_dim: int,
                 action_dim: int, chunk: int, vocab_size: int, instruction_tokens: int, text_tokens: int,
                 seed: int = 0):
        self.n, self.frames, self.size = num_samples, frames, image_size
        self.state_dim, self.action_dim, self.chunk = state_dim, action_dim, chunk
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        # Per task: instruction tokens (varied lengths), colour, phase-text tokens.
        self.instructions = torch.randint(1, vocab_size, (num_tasks, instruction_tokens), generator=g)
        lengths = torch.randint(max(1, instruction_tokens // 2), instruction_tokens + 1, (num_tasks,), generator=g)
        self.instruction_mask = torch.arange(instruction_tokens)[None, :] < lengths[:, None]
        self.instructions = self.instructions * self.instruction_mask
        self.colours = torch.rand(num_tasks, 3, generator=g) * 1.6 - 0.8
        self.texts = torch.randint(1, vocab_size, (num_tasks, text_tokens), generator=g)
        self.num_tasks, self.text_tokens = num_tasks, text_tokens

    def __len__(self) -> int:
        return self.n

    def without_augmentation(self) -> "SyntheticDataset":
        return self  # no augmentation: every sample is a pure function of (seed, index)

    def __getitem__(self, index: int) -> Batch:
        index %= self.n  # the same sample every epoch
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        task = index % self.num_tasks
        goal = torch.rand(2, generator=g) * 1.6 - 0.8  # (x, y) in [-0.8, 0.8]
        hand = torch.rand(self.state_dim, generator=g) * 2 - 1
        images = self._render(goal, task, g)
        # Proportional controller towards the goal over the chunk; unused action dims stay 0.
        steps = torch.arange(1, self.chunk + 1, dtype=torch.float32)[:, None]  # (T, 1)
        delta = (goal - hand[:2]).clamp(-1, 1)
        actions = torch.zeros(self.chunk, self.action_dim)
        actions[:, :2] = delta[None, :] * (0.9 ** steps)
        valid = torch.randint(self.chunk // 2, self.chunk + 1, (), generator=g)  # episode ends inside the chunk
        action_mask = torch.arange(self.chunk) < valid
        text = None if self.text_tokens == 0 else self.texts[task]
        text_mask = None if text is None else torch.ones(self.text_tokens, dtype=torch.bool)
        return Batch(images=images, state=hand, instruction_ids=self.instructions[task],
                     instruction_mask=self.instruction_mask[task], actions=actions * action_mask[:, None],
                     action_mask=action_mask, text_ids=text, text_mask=text_mask, index=torch.tensor(index))

    def _render(self, goal: torch.Tensor, task: int, g: torch.Generator) -> torch.Tensor:
        """(F, 3, H, W) in [-1, 1]: noise background with a square of the task colour at the goal."""
        s = self.size
        images = torch.rand(self.frames, 3, s, s, generator=g) * 0.2 - 0.6
        half = max(1, s // 10)
        cx, cy = ((goal + 1) / 2 * (s - 1)).round().long().tolist()
        images[:, :, max(0, cy - half):cy + half, max(0, cx - half):cx + half] = self.colours[task][None, :, None, None]
        return images
