"""Offline distillation targets: the teacher's top-k log-probabilities over a run's training blocks, written once.

Where the teacher does not fit beside the student, one pass runs it alone over exactly the blocks that
`mha2mla train` with the same data, sequence length, steps, batch, accumulation and process count draws
(pack_blocks, the same count), and keeps at every position the k most probable next tokens of its
distribution, log p(v) = t_v − logsumexp(t):

    OUT/targets.json    teacher, vocabulary size, k, seq_len, blocks, data, sha256 of the blocks
    OUT/indices.npy     int32   [blocks, seq_len, k]   the teacher's top-k token ids, most probable first
    OUT/logprobs.npy    float32 [blocks, seq_len, k]   their log-probabilities

Training then reads a batch's targets by block index instead of running the teacher (TopK). The KL is
taken over the top k, the teacher's part renormalised at temperature T: with p = softmax(log p[top k] / T)
and the student's log q = log_softmax(s / T) over the whole vocabulary,

    KL_k = Σ_{v in top k} p_v (log p_v − log q_v)  ≥ 0

which is the online KL(softmax(t/T) ‖ softmax(s/T)) when k is the vocabulary (apps/distill.py).

The pass writes into a hidden sibling `.OUT.partial` and renames it to OUT when complete; after a kill,
the same command continues from the last batch written (`done` in its targets.json).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import UserError
from ..io.atomic import write_file_atomically
from ..io.sources import load_model
from ..io.text import default_train_text, pack_blocks

FILES = ("indices.npy", "logprobs.npy")


@dataclass(frozen=True)
class TopK:
    """A batch's offline targets: the teacher's top-k token ids and log-probabilities, [B, T, k] each."""
    indices: torch.Tensor
    logprobs: torch.Tensor


def blocks_digest(blocks: torch.Tensor) -> str:
    """sha256 of the token blocks: what ties targets to the training run that reads them."""
    return hashlib.sha256(blocks.to(torch.int64).numpy().tobytes()).hexdigest()


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int32, log-probabilities float32) of the k most probable tokens of logits [..., V]."""
    values, indices = logits.float().log_softmax(-1).topk(k, dim=-1)
    return indices.to(torch.int32), values


def write_targets(teacher, out, data=None, steps: int = 100, *, seq_len: int = 512, batch_size: int = 4,
                  grad_accum: int = 1, processes: int = 1, top_k: int = 64, device: str = "cpu",
                  progress: bool = True) -> dict:
    """Run the teacher (path/alias or (model, tokenizer)) over the blocks of a training run with these
    settings and write their top-k targets into `out`; returns targets.json's record. Resumes a killed pass."""
    if min(steps, batch_size, grad_accum, processes) <= 0:
        raise UserError(f"--steps, --batch-size, --grad-accum and --processes must be positive "
                        f"(got {steps}, {batch_size}, {grad_accum}, {processes})")
    out = Path(out)
    if out.exists():
        raise UserError(f"{out} exists: choose a new directory for the targets")
    model, tokenizer = load_model(teacher) if isinstance(teacher, (str, Path)) else teacher
    vocab = model.config.vocab_size
    if not 0 < top_k <= vocab:
        raise UserError(f"--top-k must be in 1..{vocab}, the teacher's vocabulary (got {top_k})")
    data = [str(Path(p).resolve()) for p in (data or [default_train_text()])]
    blocks = pack_blocks(tokenizer, data, seq_len, steps * batch_size * grad_accum * processes, what="training text")
    name = teacher if isinstance(teacher, (str, Path)) else model.config._name_or_path
    record = {"teacher": str(name), "vocab_size": vocab, "top_k": top_k, "seq_len": seq_len, "blocks": len(blocks),
              "data": data, "digest": blocks_digest(blocks)}

    partial = out.with_name(f".{out.name}.partial")
    done = _resume_point(partial, record)
    shape = (len(blocks), seq_len, top_k)
    arrays = [np.lib.format.open_memmap(partial / f, mode="r+" if done else "w+", dtype=dtype, shape=shape)
              for f, dtype in zip(FILES, (np.int32, np.float32))]
    if not done:
        _write_record(partial, {**record, "done": 0})
    model = model.to(device).eval()
    bar = tqdm(total=len(blocks), initial=done, desc="teacher targets", unit="block", disable=not progress)
    with torch.no_grad():
        for start in range(done, len(blocks), batch_size):
            batch = blocks[start:start + batch_size].to(device)
            indices, logprobs = top_logprobs(model(input_ids=batch).logits, top_k)
            arrays[0][start:start + len(batch)] = indices.cpu().numpy()
            arrays[1][start:start + len(batch)] = logprobs.cpu().numpy()
            for array in arrays:
                array.flush()
            _write_record(partial, {**record, "done": start + len(batch)})
            bar.update(len(batch))
    bar.close()
    del arrays
    _write_record(partial, record)
    partial.rename(out)
    return record


def _resume_point(partial: Path, record: dict) -> int:
    """Blocks already written by a killed pass with the same settings (0 for a new pass)."""
    path = partial / "targets.json"
    if not path.is_file():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        return 0
    previous = json.loads(path.read_text())
    if {k: v for k, v in previous.items() if k != "done"} != record:
        raise UserError(f"{partial} holds an unfinished pass with other settings: run that one again to finish "
                        f"it, or remove {partial}")
    return previous["done"]


def _write_record(folder: Path, record: dict) -> None:
    write_file_atomically(folder / "targets.json", lambda f: f.write(json.dumps(record, indent=1) + "\n"))


class Targets:
    """Written targets opened for training: TopK batches by block index, checked against the run's blocks."""

    def __init__(self, folder, blocks: torch.Tensor, vocab_size: int):
        folder = Path(folder)
        path = folder / "targets.json"
        if not path.is_file():
            raise UserError(f"{folder} holds no distillation targets (write them with `mha2mla distill-targets`)")
        self.record = json.loads(path.read_text())
        if "done" in self.record:
            raise UserError(f"the targets in {folder} are unfinished: run `mha2mla distill-targets` again to finish")
        if self.record["vocab_size"] != vocab_size:
            raise UserError(f"the targets in {folder} are over a vocabulary of {self.record['vocab_size']} tokens, "
                            f"the model's has {vocab_size}: write them with the model's own source")
        if self.record["digest"] != blocks_digest(blocks):
            raise UserError(f"the targets in {folder} were written for other training blocks: write them with the "
                            f"run's --data, --seq-len, --steps, --batch-size, --grad-accum and process count")
        self.indices, self.logprobs = (np.load(folder / f, mmap_mode="r") for f in FILES)

    def batch(self, block: torch.Tensor, device) -> TopK:
        rows = block.cpu().numpy()
        return TopK(torch.from_numpy(self.indices[rows]).to(device), torch.from_numpy(self.logprobs[rows]).to(device))
