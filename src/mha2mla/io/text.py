"""Text sources → token blocks.

A text source is a file or a directory of files: `.jsonl` (field `text`), `.parquet` (column
`text`), anything else UTF-8 text. The WikiExtractor shards in ../shared/data wrap articles in
`<doc …>` / `</doc>` lines; those lines are dropped. Documents are tokenized, joined with the EOS
token and cut into fixed-length blocks (the usual "packing" of pretraining text).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from ..errors import UserError

_DOC_TAG = re.compile(r"^\s*</?doc(\s[^>]*)?>\s*$")


def repo_root() -> Path | None:
    """The folder holding pyproject.toml above this file (a source checkout), else None."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").exists():
            return parent
    return None


def data_dir() -> Path | None:
    """Offline data: $MHA2MLA_DATA_DIR, else ../shared/data beside the repository; None if absent."""
    env = os.environ.get("MHA2MLA_DATA_DIR")
    if env:
        return Path(env)
    root = repo_root()
    if root is not None and (root.parent / "shared" / "data").is_dir():
        return root.parent / "shared" / "data"
    return None


def default_train_text() -> Path:
    """The Wikipedia shards used for calibration and fine-tuning by default."""
    base = data_dir()
    path = base / "text" / "wikipedia-en-2015-wikiextractor" / "AA" if base else None
    if path is None or not path.is_dir():
        raise UserError("no default text found: pass --data/--calib-data PATH, or set MHA2MLA_DATA_DIR "
                        "to a folder holding text/wikipedia-en-2015-wikiextractor")
    return path


def default_eval_text() -> Path:
    """WikiText-2 raw test, the held-out perplexity text."""
    base = data_dir()
    path = base / "text" / "wikitext-2" / "wikitext-2-raw-v1" / "wiki.test.raw" if base else None
    if path is None or not path.is_file():
        raise UserError("no default evaluation text found: pass --data FILE, or set MHA2MLA_DATA_DIR "
                        "to a folder holding text/wikitext-2/wikitext-2-raw-v1/wiki.test.raw")
    return path


def text_files(paths: Sequence[str | Path]) -> list[Path]:
    """Expand files and directories (recursively, sorted) into a list of files."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        elif p.is_file():
            files.append(p)
        else:
            raise UserError(f"text path not found: {p} (give an existing file or directory)")
    if not files:
        raise UserError(f"no text files under {', '.join(map(str, paths))} (add .txt/.jsonl/.parquet files)")
    return files


def read_documents(paths: Sequence[str | Path]) -> Iterator[str]:
    """Yield documents: one per jsonl row / parquet row / WikiExtractor article / plain file."""
    for f in text_files(paths):
        if f.suffix == ".jsonl":
            with open(f, encoding="utf-8") as fh:
                for line in fh:
                    if line.strip():
                        text = json.loads(line).get("text")
                        if text:
                            yield text
        elif f.suffix == ".parquet":
            import pyarrow.parquet as pq  # optional: only for parquet inputs

            for text in pq.read_table(f, columns=["text"]).column("text").to_pylist():
                if text:
                    yield text
        else:
            yield from _plain_documents(f)


def _plain_documents(path: Path) -> Iterator[str]:
    """A plain text file; WikiExtractor `<doc>` markup splits it into articles and is dropped."""
    doc: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if _DOC_TAG.match(line):
                if doc and "".join(doc).strip():
                    yield "".join(doc).strip()
                doc = []
            else:
                doc.append(line.replace("\r\n", "\n"))
    if doc and "".join(doc).strip():
        yield "".join(doc).strip()


def token_stream(tokenizer, documents: Iterable[str]) -> Iterator[int]:
    """Token ids of the documents, each followed by EOS."""
    eos = tokenizer.eos_token_id
    for doc in documents:
        yield from tokenizer(doc, add_special_tokens=False)["input_ids"]
        if eos is not None:
            yield eos


def pack_blocks(tokenizer, paths: Sequence[str | Path], seq_len: int, n_blocks: int | None = None,
                what: str = "text") -> torch.Tensor:
    """The first `n_blocks` (all when None) fixed-length blocks of the text: LongTensor [n, seq_len]."""
    return pack_documents(tokenizer, read_documents(paths), seq_len, n_blocks, what)


def pack_documents(tokenizer, documents: Iterator[str], seq_len: int, n_blocks: int | None = None,
                   what: str = "text") -> torch.Tensor:
    """pack_blocks on a document iterator; it is left just after the document holding the last block."""
    if seq_len < 2:
        raise UserError(f"sequence length {seq_len} is too short (use at least 2)")
    blocks: list[list[int]] = []
    buf: list[int] = []
    for tok in token_stream(tokenizer, documents):
        buf.append(tok)
        if len(buf) == seq_len:
            blocks.append(buf)
            buf = []
            if n_blocks is not None and len(blocks) >= n_blocks:
                break
    if not blocks:
        raise UserError(f"{what} is too short for one block of {seq_len} tokens "
                        f"(add more text or lower the sequence length)")
    return torch.tensor(blocks, dtype=torch.long)


def calibration_blocks(tokenizer, paths: Sequence[str | Path], seq_len: int, n_calib: int,
                       n_held_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration blocks [≤ n_calib, seq_len], held-out blocks [≤ n_held_out, seq_len]).

    The calibration blocks pack the start of the text; the held-out blocks are the first seq_len
    tokens of each of the next documents (from the one after the last calibration block's), so a
    held-out score measures how a conversion generalises to other text, not to more of the same.
    """
    documents = read_documents(paths)
    calib = pack_documents(tokenizer, documents, seq_len, n_calib, what="calibration text")
    held_out = []
    for doc in documents:
        if len(held_out) == n_held_out:
            break
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        if len(ids) >= seq_len:
            held_out.append(ids[:seq_len])
    return calib, torch.tensor(held_out, dtype=torch.long).view(-1, seq_len)
