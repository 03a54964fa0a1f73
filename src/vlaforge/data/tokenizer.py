"""Text -> token ids for instructions and language targets.

With a pretrained LLM folder the LLM's own tokenizer is used (`transformers.AutoTokenizer`, local files only).
For the built-in flavors a small byte-level BPE is trained with the `tokenizers` library on the dataset's texts
and saved with the run (`tokenizer.json`), so evaluation encodes text exactly as training did.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from vlaforge.errors import VlaforgeError

TOKENIZER_FILE = "tokenizer.json"
PRETRAINED_DIR = "tokenizer"  # a pretrained LLM's tokenizer, saved into a checkpoint
SPECIALS = ("<pad>", "<unk>", "<eos>")  # <pad> is id 0


STYLE_FILE = "vlaforge_text.json"  # beside a saved pretrained tokenizer: how texts are encoded (`TextTokenizer.style`)


def state_bins(state: torch.Tensor) -> np.ndarray:
    """pi0.5's state bins (openpi's `PaligemmaTokenizer`), LeRobot's `digitize(state, linspace(-1, 1, 257)[:-1]) - 1`:
    [-1, 1) in 256 bins 1/128 wide, a value on an edge in the bin it opens, below -1 -> -1, from 1 - 1/128 up -> 255
    (NaN too). (..., D) in, (..., D) int64 out. Cast to float64 first, as numpy compares against its float64 edges."""
    edges = np.linspace(-1, 1, 256 + 1)[:-1]
    return np.digitize(state.detach().to("cpu", torch.float64).numpy(), bins=edges) - 1


def state_prompt(task: str, state: torch.Tensor) -> str:
    r"""pi0.5's prompt (LeRobot's `Pi05PrepareStateTokenizerProcessorStep`): "Task: {task}, State: {bins};\nAction: ",
    the task stripped, '_' and newlines made spaces, the normalized state row (D,) as `state_bins` joined by spaces."""
    clean = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {clean}, State: {' '.join(map(str, state_bins(state).tolist()))};\nAction: "


class TextTokenizer:
    """Encodes batches of strings to fixed-length (ids, mask); appends <eos> so targets have an end.

    `suffix` / `special`: a LeRobot policy's pipeline style - the text gets `suffix` appended (its newline step)
    and the tokenizer's own special tokens (BOS), with no <eos> (models/policies/processors.py). `state_prompt`:
    pi0.5's - an instruction is encoded with the sample's normalized state (`encode_with_states`)."""

    def __init__(self, tok, pad_id: int, eos_id: int | None, suffix: str = "", special: bool = False,
                 state_prompt: bool = False):
        self.tok, self.pad_id, self.eos_id = tok, pad_id, eos_id
        self.suffix, self.special, self.state_prompt = suffix, special, state_prompt

    @classmethod
    def styled(cls, tok, pad_id: int, eos_id: int | None, style: dict) -> "TextTokenizer":
        """A tokenizer with a saved `style` (what `style` writes; {} for vlaforge's own): no eos where it says so."""
        return cls(tok, pad_id, eos_id if style.get("eos", True) else None, suffix=style.get("suffix", ""),
                   special=style.get("special", False), state_prompt=style.get("state_prompt", False))

    @property
    def style(self) -> dict:
        return {"suffix": self.suffix, "special": self.special, "eos": self.eos_id is not None,
                "state_prompt": self.state_prompt}

    def encode_with_states(self, texts: list[str], states: torch.Tensor,
                           length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode` of each instruction as its state's prompt (`state_prompt`) when the style asks for it; states:
        (N, D) normalized as the model is fed."""
        if self.state_prompt:
            texts = [state_prompt(t, s) for t, s in zip(texts, states, strict=True)]
        return self.encode(texts, length)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size() if hasattr(self.tok, "get_vocab_size") else len(self.tok)

    def ids(self, text: str) -> list[int]:
        if hasattr(self.tok, "get_vocab_size"):  # a `tokenizers` file (a package's): its post-processor's specials
            out = self.tok.encode(text + self.suffix).ids
        else:
            out = self.tok(text + self.suffix, add_special_tokens=self.special)["input_ids"]
        return out + ([self.eos_id] if self.eos_id is not None else [])

    def encode(self, texts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, length) ids, padded with pad_id and truncated; (N, length) bool mask."""
        ids = torch.full((len(texts), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(texts), length, dtype=torch.bool)
        for i, text in enumerate(texts):
            row = self.ids(text)[:length]
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = True
        return ids, mask

    def save(self, folder: Path) -> None:
        """Into a checkpoint: training's BPE as tokenizer.json, a pretrained LLM's tokenizer as its own
        save_pretrained folder (`tokenizer/`), so the checkpoint needs no other folder to encode instructions."""
        if hasattr(self.tok, "get_vocab_size"):
            self.tok.save(str(folder / TOKENIZER_FILE))
        else:
            self.tok.save_pretrained(str(folder / PRETRAINED_DIR))
            (folder / PRETRAINED_DIR / STYLE_FILE).write_text(json.dumps(self.style))


def train_bpe(texts: list[str], vocab_size: int) -> TextTokenizer:
    """A byte-level BPE over `texts` with at most `vocab_size` entries (the LLM's embedding table size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sorted(set(texts)), trainer)
    return _wrap(tok)


def load_tokenizer(folder: Path | None, llm_pretrained: str | None) -> TextTokenizer:
    """The tokenizer saved in `folder`, else the pretrained LLM's."""
    if folder is not None and (folder / TOKENIZER_FILE).is_file():
        from tokenizers import Tokenizer

        try:
            return _wrap(Tokenizer.from_file(str(folder / TOKENIZER_FILE)))
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception on bad files
            raise VlaforgeError(f"{folder / TOKENIZER_FILE} is not a tokenizer file ({str(exc)[:120]}); use the "
                                f"{TOKENIZER_FILE} that training wrote") from None
    if folder is not None and (folder / PRETRAINED_DIR).is_dir():
        return pretrained_tokenizer(str(folder / PRETRAINED_DIR))
    if llm_pretrained:  # a checkpoint from before its tokenizer was saved with it
        return pretrained_tokenizer(llm_pretrained)
    raise VlaforgeError(f"no {TOKENIZER_FILE} in {folder}; the checkpoint was not trained on text data")


def pretrained_tokenizer(path: str) -> TextTokenizer:
    from transformers import AutoTokenizer

    from vlaforge import hub

    path = str(hub.local_folder(path, "model.llm.pretrained", hub.TOKENIZER)) if hub.looks_like_id(path) else path
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise VlaforgeError(f"model.llm.pretrained {path}: no usable tokenizer ({str(exc).splitlines()[0]}); "
                            "save the tokenizer with the model (tokenizer.save_pretrained)") from None
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    style_file = Path(path) / STYLE_FILE
    style = json.loads(style_file.read_text()) if style_file.is_file() else {}
    return TextTokenizer.styled(tok, pad, tok.eos_token_id, style)


def build_tokenizer(texts: list[str], vocab_size: int, llm_pretrained: str | None) -> TextTokenizer:
    if llm_pretrained:
        return pretrained_tokenizer(llm_pretrained)
    return train_bpe(texts, vocab_size)


def _wrap(tok) -> TextTokenizer:
    return TextTokenizer(tok, tok.token_to_id("<pad>"), tok.token_to_id("<eos>"))
